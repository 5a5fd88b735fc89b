"""The one builder of the tests' random Qwen3 models.

Every test model is a ``transformers`` Qwen3 with random weights, built here so the config
keys, the seed handling and the weight tweaks are written once:

  qwen3_config(...)   a ``Qwen3Config``: the real vocabulary (151,669) unless ``vocab`` is given,
                      Qwen3's rope_theta 1e6, eager attention; shape arguments by name
  random_qwen3(...)   ``Qwen3ForCausalLM`` on that config, seeded inside ``fork_rng`` (the caller's
                      random stream is untouched), optionally with
                        perturb_norms   norm weights moved off 1 (random init leaves them at 1,
                                        which would hide a norm applied twice or not at all)
                        spread_yes_no   the "yes"/"no" output rows scaled by this factor: random
                                        init gives logit_yes − logit_no ≈ ±0.05 (scores 0.49–0.51);
                                        scaling spreads the scores over (0, 1), so a tolerance
                                        of 1e-5 on scores is sharp
  tiny_causal / tiny_seq_cls   the 1-layer model of the input-safety tests and its
                      sequence-classification conversion (vLLM's / sentence-transformers' form)
"""
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3ForSequenceClassification

from acarerank.tokenizer import QWEN3_VOCAB, TOKEN_NO, TOKEN_YES


def qwen3_config(*, vocab=QWEN3_VOCAB, hidden=32, intermediate=48, layers=1, heads=2, kv_heads=1, head_dim=16,
                 tie=False, attn="eager", **kw) -> Qwen3Config:
    return Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                       num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                       head_dim=head_dim, rope_theta=1000000.0, tie_word_embeddings=tie,
                       attn_implementation=attn, **kw)


def random_qwen3(*, seed=0, dtype=torch.float32, perturb_norms=False, spread_yes_no=None, **config) -> Qwen3ForCausalLM:
    """A random ``Qwen3ForCausalLM`` (eval mode, ``dtype``) on ``qwen3_config(**config)``."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        m = Qwen3ForCausalLM(qwen3_config(**config)).eval()
        with torch.no_grad():
            if perturb_norms:
                for name, p in m.named_parameters():
                    if "norm" in name:
                        p.add_(torch.rand_like(p) * 0.5 - 0.25)
            if spread_yes_no is not None:
                m.lm_head.weight[[TOKEN_YES, TOKEN_NO]] *= spread_yes_no
    return m.to(dtype)


def tiny_config(tie=False, **kw):
    """The input-safety tests' 1-layer shape (2 query heads, 1 kv head, head_dim 16)."""
    return qwen3_config(tie=tie, **kw)


def tiny_causal(seed=0, tie=False):
    return random_qwen3(seed=seed, tie=tie, spread_yes_no=40)


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
