"""Tiny random Qwen3 models with the real vocabulary, shared by the input-safety tests."""
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3ForSequenceClassification

from acarerank.tokenizer import QWEN3_VOCAB, TOKEN_NO, TOKEN_YES


def tiny_config(tie=False, **kw):
    return Qwen3Config(vocab_size=QWEN3_VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                       num_attention_heads=2, num_key_value_heads=1, head_dim=16, rope_theta=1000000.0,
                       tie_word_embeddings=tie, attn_implementation="eager", **kw)


def tiny_causal(seed=0, tie=False):
    torch.manual_seed(seed)
    m = Qwen3ForCausalLM(tiny_config(tie)).eval()
    with torch.no_grad():  # spread the yes/no rows so scores are not all ~0.5
        m.lm_head.weight[[TOKEN_YES, TOKEN_NO]] *= 40
    return m


def tiny_seq_cls(causal, rows: int):
    """A Qwen3ForSequenceClassification conversion of ``causal``, as vLLM / sentence-transformers do:
    1 row = lm_head[yes] − lm_head[no]; 2 rows = [lm_head[no], lm_head[yes]]."""
    cfg = tiny_config(tie=False, num_labels=rows, pad_token_id=0)
    m = Qwen3ForSequenceClassification(cfg).eval()
    m.model.load_state_dict(causal.model.state_dict())
    W = causal.lm_head.weight.detach()
    with torch.no_grad():
        m.score.weight.copy_((W[TOKEN_YES] - W[TOKEN_NO])[None] if rows == 1 else W[[TOKEN_NO, TOKEN_YES]])
    return m
