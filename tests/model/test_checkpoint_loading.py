"""The loader reads exactly the checkpoint's files and never reads a missing head as the embedding.

Oracles: transformers' own forward (Qwen3ForCausalLM through the model card's scoring path;
Qwen3ForSequenceClassification's logits) on the same weights.
"""
import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from _tiny import random_qwen3, tiny_seq_cls
from acarerank import PointwiseReranker
from acarerank.prompts import joint_input_ids, official_scores
from acarerank.setwise import SetwiseReranker
from acarerank.tokenizer import load_qwen3_tokenizer

DOCS = ["alpha beta", "gamma delta epsilon", "the answer is 42", ""]


@pytest.fixture(scope="module")
def causal():
    # card scores 0.40-0.52 (seed 1 gave ~1e-4, where 1e-5 tests nothing); norms off 1, so a norm
    # weight the loader dropped would show
    return random_qwen3(seed=5, spread_yes_no=40, perturb_norms=True)


@pytest.fixture(scope="module")
def card_scores(causal):
    tok = load_qwen3_tokenizer()
    scores = official_scores(causal, tok, [joint_input_ids(tok, "q", d) for d in DOCS], batch_size=1)
    assert max(scores) - min(scores) > 0.05, scores  # else a 1e-5 tolerance tests nothing
    return scores


@pytest.fixture(scope="module")
def saved(causal, tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt") / "single"
    causal.save_pretrained(path)
    return path


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def close(a, b, tol=1e-5):
    return max(abs(x - y) for x, y in zip(a, b)) <= tol


def load(path, **kw):
    """from_pretrained in fp32, as the oracles run: the default is bf16 on a CPU with native bf16,
    ~7e-3 off transformers' fp32 scores, which no 1e-5 comparison could hold."""
    return PointwiseReranker.from_pretrained(str(path), dtype=torch.float32, **kw)


def test_stray_safetensors_file_is_ignored_with_a_warning(saved, card_scores, tmp_path):
    ckpt = _copy(saved, tmp_path / "c")
    sd = load_file(ckpt / "model.safetensors")
    sd["model.embed_tokens.weight"] = torch.zeros_like(sd["model.embed_tokens.weight"])
    save_file(sd, ckpt / "zz-second-export.safetensors")  # sorts after model.safetensors: main let it win
    with pytest.warns(UserWarning, match="zz-second-export.safetensors"):
        rr = load(ckpt)
    got = rr.score("q", DOCS)
    assert close(got, card_scores), (got, card_scores)


def test_sharded_checkpoint_reads_exactly_the_index(causal, card_scores, tmp_path):
    ckpt = tmp_path / "sharded"
    causal.save_pretrained(ckpt, max_shard_size="10MB")
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1, shards
    shutil.copy(ckpt / shards[0], ckpt / "model-partial-download.safetensors")
    with pytest.warns(UserWarning, match="model-partial-download.safetensors"):
        got = load(ckpt).score("q", DOCS)
    assert close(got, card_scores), (got, card_scores)
    # an index that does not cover a tensor of its shards is refused, naming the tensor
    name = next(k for k, v in index["weight_map"].items() if v == shards[-1])
    del index["weight_map"][name]
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=f"does not list tensor '{name}'"), pytest.warns(UserWarning):
        PointwiseReranker.from_pretrained(str(ckpt))


def test_model_safetensors_beside_an_index_is_read_as_transformers_reads_it(causal, card_scores, tmp_path):
    """save_pretrained removes old shards, not an old index: both files in one folder. The index
    was read first (transformers reads model.safetensors first): a stale index naming deleted
    shards refused a good checkpoint, and an old model.safetensors beside a newer sharded save
    gave scores off transformers' by up to 2.7 in logit, with a warning calling the file stray."""
    from transformers import AutoModelForCausalLM

    # a sharded save, then a plain one: the index names shards that are gone
    ckpt = tmp_path / "stale-index"
    causal.save_pretrained(ckpt, max_shard_size="10MB")
    causal.save_pretrained(ckpt)
    assert (ckpt / "model.safetensors.index.json").exists() and (ckpt / "model.safetensors").exists()
    with pytest.warns(UserWarning, match="ignoring model.safetensors.index.json"):
        got = load(ckpt).score("q", DOCS)
    assert close(got, card_scores), (got, card_scores)
    # a plain save of other weights, then a sharded save: transformers reads the old single file
    ckpt = tmp_path / "old-single"
    other = random_qwen3(seed=6, spread_yes_no=40, perturb_norms=True)
    other.save_pretrained(ckpt)
    causal.save_pretrained(ckpt, max_shard_size="10MB")
    assert (ckpt / "model.safetensors.index.json").exists() and (ckpt / "model.safetensors").exists()
    tok = load_qwen3_tokenizer()
    theirs = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    want = official_scores(theirs, tok, [joint_input_ids(tok, "q", d) for d in DOCS], batch_size=1)
    assert not close(want, card_scores, tol=1e-3), "transformers read the shards: this case tests nothing"
    with pytest.warns(UserWarning, match="ignoring model.safetensors.index.json"):
        got = load(ckpt).score("q", DOCS)
    assert close(got, want), (got, want)


def test_truncated_file_is_named(saved, tmp_path):
    ckpt = _copy(saved, tmp_path / "t")
    f = ckpt / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=r"model\.safetensors.*truncated"):
        PointwiseReranker.from_pretrained(str(ckpt))


def test_missing_tensor_is_named(saved, tmp_path):
    ckpt = _copy(saved, tmp_path / "m")
    sd = load_file(ckpt / "model.safetensors")
    del sd["model.layers.0.mlp.down_proj.weight"]
    save_file(sd, ckpt / "model.safetensors")
    with pytest.raises(ValueError, match="model.layers.0.mlp.down_proj.weight"):
        PointwiseReranker.from_pretrained(str(ckpt))


def test_untied_model_without_output_layer_is_refused(saved, causal, tmp_path):
    ckpt = _copy(saved, tmp_path / "u")
    sd = load_file(ckpt / "model.safetensors")
    del sd["lm_head.weight"]
    save_file(sd, ckpt / "model.safetensors")
    with pytest.raises(ValueError, match="lm_head.weight"):
        PointwiseReranker.from_pretrained(str(ckpt))
    # the same in memory: a bare decoder (no head) with untied embeddings
    with pytest.raises(ValueError, match="lm_head.weight"):
        PointwiseReranker(model=causal.model)


def test_bad_config_names_the_file(saved, tmp_path):
    ckpt = _copy(saved, tmp_path / "cfg")
    (ckpt / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="config.json"):
        PointwiseReranker.from_pretrained(str(ckpt))
    (ckpt / "config.json").write_bytes(b"\xff\xfe{}")
    with pytest.raises(ValueError, match="config.json"):
        PointwiseReranker.from_pretrained(str(ckpt))
    # nested past Python's stack in 200 kB: a RecursionError out of json that named no file
    from acarerank.model import CheckpointError

    (ckpt / "config.json").write_text('{"a": ' + "[" * 100_000 + "]" * 100_000 + "}")
    with pytest.raises(CheckpointError, match="config.json: not a valid JSON config"):
        PointwiseReranker.from_pretrained(str(ckpt))
    (ckpt / "config.json").write_text((saved / "config.json").read_text())
    (ckpt / "model.safetensors").unlink()  # else model.safetensors is read and the index ignored
    (ckpt / "model.safetensors.index.json").write_text('{"weight_map": ' + "[" * 100_000 + "]" * 100_000 + "}")
    with pytest.raises(CheckpointError, match="index.json: not a safetensors index"):
        PointwiseReranker.from_pretrained(str(ckpt))


@pytest.mark.parametrize("rows", [1, 2])
def test_sequence_classification_reranker(causal, card_scores, rows, tmp_path):
    """vLLM / sentence-transformers convert Qwen3-Reranker to Qwen3ForSequenceClassification: the
    score head is used as the yes−no direction (never the embedding), in memory and from disk."""
    tok = load_qwen3_tokenizer()
    seq = tiny_seq_cls(causal, rows)
    with torch.no_grad():
        logits = [seq(input_ids=torch.tensor([joint_input_ids(tok, "q", d)])).logits[0].float() for d in DOCS]
    ref = [float(torch.sigmoid(z[0])) if rows == 1 else float(z.softmax(-1)[1]) for z in logits]
    assert close(ref, card_scores, 1e-5)  # the conversion is the model card's score
    assert close(PointwiseReranker(model=seq).score("q", DOCS), ref)
    seq.save_pretrained(tmp_path / "seq")
    assert close(load(tmp_path / "seq").score("q", DOCS), ref)
    with pytest.raises(ValueError, match="sequence-classification"):
        SetwiseReranker(model=seq)


def test_sequence_classification_pad_token_on_the_prompts_last_token_is_refused(causal, tmp_path):
    """transformers' Qwen3ForSequenceClassification scores the last token that is not
    pad_token_id: with the pad id on the token every prompt ends with ("\\n\\n", 271) it scores
    the one before, so our scores were 0.48 off its in logit with no error. Now refused, in
    memory and from disk; the usual pad id (151643) still loads."""
    tok = load_qwen3_tokenizer()
    seq = tiny_seq_cls(causal, 1)
    last = joint_input_ids(tok, "q", DOCS[0])[-1]
    seq.config.pad_token_id = last
    with torch.no_grad():  # the case is real: transformers scores another token than the last
        theirs = float(seq(input_ids=torch.tensor([joint_input_ids(tok, "q", DOCS[0])])).logits[0, 0])
    assert abs(theirs - float(torch.logit(torch.tensor(PointwiseReranker(model=tiny_seq_cls(causal, 1))
                                                       .score("q", DOCS[:1])[0], dtype=torch.float64)))) > 1e-3
    with pytest.raises(ValueError, match=f"pad_token_id {last} is the token every prompt ends with"):
        PointwiseReranker(model=seq)
    seq.save_pretrained(tmp_path / "pad")
    with pytest.raises(ValueError, match=f"pad_token_id {last} is the token every prompt ends with"):
        load(tmp_path / "pad")
    seq.config.pad_token_id = 151643
    assert len(PointwiseReranker(model=seq).score("q", DOCS)) == len(DOCS)


def test_only_safetensors_named_model_are_read(saved, tmp_path):
    ckpt = _copy(saved, tmp_path / "n")
    os.rename(ckpt / "model.safetensors", ckpt / "weights.safetensors")
    with pytest.raises(FileNotFoundError, match="weights.safetensors"):
        PointwiseReranker.from_pretrained(str(ckpt))


LONG_DOCS = ["retrieval " * 60 + "tail", "short"]  # past a 32-token window


@pytest.mark.parametrize("config, match", [
    (dict(use_sliding_window=True, sliding_window=32, max_window_layers=0), "sliding-window"),
    (dict(hidden_act="gelu"), "hidden_act"),
])
def test_config_the_runner_cannot_follow_is_refused(config, match, tmp_path):
    """A Qwen3 config that makes transformers run another computation (sliding-window attention,
    another MLP activation) is an error naming the field, in memory and from disk — the runner
    once ignored both and returned scores that differ from transformers' forward, with no error."""
    model = random_qwen3(seed=5, spread_yes_no=40, tie=False, **config)
    with pytest.raises(ValueError, match=match):
        PointwiseReranker(model=model)
    model.save_pretrained(tmp_path / "ckpt")
    with pytest.raises(ValueError, match=match):
        PointwiseReranker.from_pretrained(str(tmp_path / "ckpt"))


def test_sliding_layers_of_a_huge_layer_count_are_found_in_bounded_memory(saved):
    """num_hidden_layers is bounded by no tensor yet when the sliding-window rule is checked: its
    list of sliding layers took 4.5 GB for 10**8 layers (40 GB for 10**9) before the refusal."""
    import tracemalloc

    from acarerank.model.arch import Qwen3Arch

    cfg = json.loads((saved / "config.json").read_text())
    cfg.update(num_hidden_layers=10**7, use_sliding_window=True, sliding_window=4096)   # a list: ~400 MB
    cfg.pop("layer_types", None)
    tracemalloc.start()
    try:
        with pytest.raises(ValueError, match=r"sliding-window attention .* in layers \[28, 29, .*\]\.\.\."):
            Qwen3Arch.from_config(cfg)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 10 * 2**20, f"{peak / 2**20:.0f} MB to refuse it"
    with pytest.raises(ValueError, match="'max_window_layers' must be an int"):
        Qwen3Arch.from_config({**cfg, "max_window_layers": "28"})


@pytest.mark.parametrize("config", [dict(use_sliding_window=False, sliding_window=32, max_window_layers=0),
                                    dict(use_sliding_window=True, sliding_window=32, max_window_layers=1),
                                    dict(hidden_act="swish")])
def test_config_that_changes_nothing_is_accepted(config):
    """No sliding layer (the window off, or every layer below max_window_layers) and SiLU under its
    other name run as transformers does."""
    model = random_qwen3(seed=5, spread_yes_no=40, tie=False, perturb_norms=True, **config)
    tok = load_qwen3_tokenizer()
    want = official_scores(model, tok, [joint_input_ids(tok, "q", d) for d in LONG_DOCS], batch_size=1)
    assert close(PointwiseReranker(model=model).score("q", LONG_DOCS), want)


def test_attention_bias_checkpoint_scores_as_transformers(tmp_path):
    """A Qwen3 config with ``attention_bias: true`` gives q/k/v *and* o_proj a bias in
    transformers; the runner once read only the q/k/v ones and returned scores off by up to 0.99
    with no error. In memory and from disk, against transformers' forward."""
    model = random_qwen3(seed=5, spread_yes_no=40, tie=False, perturb_norms=True, attention_bias=True)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    tok = load_qwen3_tokenizer()
    want = official_scores(model, tok, [joint_input_ids(tok, "q", d) for d in DOCS], batch_size=1)
    assert close(PointwiseReranker(model=model).score("q", DOCS), want)
    model.save_pretrained(tmp_path / "bias")
    assert close(load(tmp_path / "bias").score("q", DOCS), want)


@pytest.mark.parametrize("rope", [
    {},
    {"rope_theta": 5000.0, "rope_parameters": {"rope_type": "default", "rope_theta": 70.0}},
    {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}, "rope_scaling": {"rope_type": "default",
                                                                                      "rope_theta": 70.0}},
    {"rope_parameters": {"rope_type": "default", "rope_theta": 70.0}, "rope_scaling": {"type": "default"}},
], ids=["absent", "both", "scaling-theta", "scaling-without-theta"])
def test_rope_theta_is_read_as_transformers_reads_it(saved, rope, tmp_path):
    """config.json without any RoPE field runs at Qwen3Config's default theta (10,000; the loader
    once took 1,000,000), rope_parameters wins over a top-level rope_theta, and a non-empty
    rope_scaling replaces rope_parameters whole, its theta or else the default with it
    (transformers 5) — each once gave scores unlike transformers' forward with no error."""
    from transformers import Qwen3ForCausalLM

    ckpt = _copy(saved, tmp_path / "rope")
    cfg = json.loads((ckpt / "config.json").read_text())
    for key in ("rope_theta", "rope_parameters", "rope_scaling"):
        cfg.pop(key, None)
    (ckpt / "config.json").write_text(json.dumps({**cfg, **rope}))
    hf = Qwen3ForCausalLM.from_pretrained(str(ckpt), attn_implementation="eager", dtype=torch.float32).eval()
    tok = load_qwen3_tokenizer()
    want = official_scores(hf, tok, [joint_input_ids(tok, "q", d) for d in LONG_DOCS], batch_size=1)
    assert close(load(ckpt).score("q", LONG_DOCS), want)


@pytest.mark.parametrize("rope, match", [
    ({"rope_scaling": "yarn"}, "rope_scaling"),
    # a kind whose frequencies follow the call's length beside a top-level rope_theta (the scaled
    # kinds computed are tests/model/test_rope_scaling.py's)
    ({"rope_theta": 5000.0, "rope_parameters": {"rope_type": "dynamic", "factor": 2.0}},
     "rope_parameters .*'dynamic'"),
    ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e6}}, "rope_parameters .*'dynamic'"),
    ({"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 70.0}}},
     r"rope_parameters .* gives RoPE per layer type \(\['full_attention'\]\)"),
    ({"rope_theta": 0}, "rope_theta"),
    ({"rope_theta": "1e6"}, "rope_theta"),
])
def test_rope_the_runner_cannot_follow_is_refused(saved, rope, match, tmp_path):
    """A scaled RoPE beside a top-level rope_theta was once run as plain RoPE; a malformed field
    is a CheckpointError naming config.json, not an AttributeError or a NaN score."""
    ckpt = _copy(saved, tmp_path / "rope")
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg.pop("rope_parameters", None)
    (ckpt / "config.json").write_text(json.dumps({**cfg, **rope}))
    with pytest.raises(ValueError, match=rf"config\.json.*{match}"):
        PointwiseReranker.from_pretrained(str(ckpt))


@pytest.mark.parametrize("make, match", [
    (lambda t: (t * 100).to(torch.int8), "int8"),
    (lambda t: t > 0, "bool"),
    (lambda t: t.to(torch.float8_e4m3fn), "float8_e4m3fn"),
])
def test_quantized_tensor_is_refused(saved, make, match, tmp_path):
    """An integer, boolean or fp8 weight was once cast to the model's dtype as it stood (scores
    of 0.999 instead of 0.0002, no error); it is a CheckpointError naming the file and tensor."""
    ckpt = _copy(saved, tmp_path / "q")
    sd = load_file(ckpt / "model.safetensors")
    name = "model.layers.0.mlp.down_proj.weight"
    sd[name] = make(sd[name])
    save_file(sd, ckpt / "model.safetensors")
    with pytest.raises(ValueError, match=rf"model\.safetensors: tensor '{name}' is {match}"):
        PointwiseReranker.from_pretrained(str(ckpt))


def test_quantization_config_is_refused(saved, tmp_path):
    """Qwen's FP8 releases keep block scales beside the fp8 weights (``weight_scale_inv``) and say
    so in quantization_config; the runner applies no scales, so the config is refused up front."""
    ckpt = _copy(saved, tmp_path / "fp8")
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"config\.json.*quantized.*'fp8'"):
        PointwiseReranker.from_pretrained(str(ckpt))


def test_tied_config_with_its_own_output_layer_scores_as_transformers(saved, tmp_path):
    """tie_word_embeddings true beside a stored lm_head.weight that differs from the embedding:
    transformers keeps the stored head (and warns); the loader once scored with the embedding
    instead (0.54 against 0.0002), with no word."""
    from transformers import Qwen3ForCausalLM

    ckpt = _copy(saved, tmp_path / "tied")
    cfg = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**cfg, "tie_word_embeddings": True}))
    hf = Qwen3ForCausalLM.from_pretrained(str(ckpt), attn_implementation="eager", dtype=torch.float32).eval()
    tok = load_qwen3_tokenizer()
    want = official_scores(hf, tok, [joint_input_ids(tok, "q", d) for d in DOCS], batch_size=1)
    with pytest.warns(UserWarning, match="lm_head.weight"):
        rr = load(ckpt)
    assert close(rr.score("q", DOCS), want)
    with pytest.warns(UserWarning, match="lm_head.weight"):  # the transformers model itself, in memory
        assert close(PointwiseReranker(model=hf).score("q", DOCS), want)


def test_unreadable_weights_files_are_named(saved, causal, tmp_path):
    """A pytorch_model.bin-only folder says that only safetensors are read; a model.safetensors
    symlink that loops once got "found ['model.safetensors']; rename the weights file to
    model.safetensors"."""
    ckpt = tmp_path / "bin"
    ckpt.mkdir()
    shutil.copy(saved / "config.json", ckpt)
    torch.save({"x": torch.zeros(1)}, ckpt / "pytorch_model.bin")
    with pytest.raises(FileNotFoundError, match=r"pytorch_model\.bin.*only safetensors"):
        PointwiseReranker.from_pretrained(str(ckpt))
    loop = tmp_path / "loop"
    loop.mkdir()
    shutil.copy(saved / "config.json", loop)
    os.symlink(loop / "model.safetensors", loop / "model.safetensors")
    with pytest.raises(FileNotFoundError, match="symlink"):
        PointwiseReranker.from_pretrained(str(loop))



@pytest.mark.parametrize("name", ["tokenizer.json", "vocab.json"])
@pytest.mark.parametrize("what", ["broken symlink", "device"])
def test_a_tokenizer_file_that_is_no_regular_file_is_refused(saved, tmp_path, name, what):
    """A checkpoint's tokenizer.json (or vocab.json) that is a broken symlink (a Hugging Face cache
    snapshot whose blob is gone) or a device: it was passed over and the Qwen3 tokenizer scored in
    its place, with no word (a model.safetensors in that state was refused already)."""
    from acarerank.reranker_base import checkpoint_tokenizer

    ckpt = _copy(saved, tmp_path / "tok")
    os.symlink(tmp_path / "gone" if what == "broken symlink" else "/dev/zero", ckpt / name)
    with pytest.raises(FileNotFoundError, match=rf"{name}' is not a readable file"):
        checkpoint_tokenizer(str(ckpt))
    with pytest.raises(FileNotFoundError, match=rf"{name}' is not a readable file"):
        load(ckpt)


# -- files a parser reads whole are size-capped -----------------------------------------------------
def _sparse(path, size):
    """A file of ``size`` zero bytes that takes no disk (and no read: the caps stat it first)."""
    with open(path, "wb") as f:
        f.truncate(size)


def test_config_json_over_the_cap_is_refused_before_reading(saved, card_scores, tmp_path):
    """config.json (and a safetensors index) went whole into json.load, whatever its size; now a
    CheckpointError naming the file, its size and the cap. The cap itself loads: the padding is
    JSON whitespace."""
    from acarerank.model import CheckpointError
    from acarerank.model.weights import MAX_CONFIG_BYTES

    ckpt = _copy(saved, tmp_path / "cfg")
    text = (saved / "config.json").read_text()
    (ckpt / "config.json").write_text(text + " " * (MAX_CONFIG_BYTES - len(text)))
    assert close(load(ckpt).score("q", DOCS), card_scores)
    (ckpt / "config.json").write_text(text + " " * (MAX_CONFIG_BYTES + 1 - len(text)))
    with pytest.raises(CheckpointError, match=rf"config\.json: {MAX_CONFIG_BYTES + 1:,} bytes, more than the "
                                              rf"{MAX_CONFIG_BYTES:,}-byte cap on config\.json"):
        load(ckpt)
    ckpt = _copy(saved, tmp_path / "index")
    (ckpt / "model.safetensors").unlink()  # else model.safetensors is read and the index ignored
    _sparse(ckpt / "model.safetensors.index.json", MAX_CONFIG_BYTES + 1)
    with pytest.raises(CheckpointError, match=rf"index\.json: {MAX_CONFIG_BYTES + 1:,} bytes, more than the "
                                              rf"{MAX_CONFIG_BYTES:,}-byte cap on a safetensors index"):
        load(ckpt)


@pytest.mark.parametrize("name", ["tokenizer.json", "vocab.json"])
def test_tokenizer_file_over_the_cap_is_refused_before_reading(saved, name, tmp_path):
    """A checkpoint's tokenizer.json went whole to the tokenizers library (vocab.json to
    transformers); now a ValueError naming the file, its size and the cap, checked with a stat."""
    from acarerank.reranker_base import checkpoint_tokenizer
    from acarerank.tokenizer import MAX_TOKENIZER_BYTES, TextEncoder

    ckpt = _copy(saved, tmp_path / "tok")
    _sparse(ckpt / name, MAX_TOKENIZER_BYTES + 1)
    if name == "vocab.json":
        (ckpt / "merges.txt").write_text("#version: 0.2\n")
    match = rf"{name}: {MAX_TOKENIZER_BYTES + 1:,} bytes, more than the {MAX_TOKENIZER_BYTES:,}-byte cap on {name}"
    with pytest.raises(ValueError, match=match):
        TextEncoder.of(checkpoint_tokenizer(str(ckpt)))  # what from_pretrained and `select`'s early check run
    with pytest.raises(ValueError, match=match):
        load(ckpt)


def test_a_vocabulary_smaller_than_the_tokenizers_is_refused_at_construction(tmp_path):
    """vocab_size 10,000 under the Qwen3 tokenizer: "yes" (9693) and "no" (2152) fit, so it loaded,
    and then every call failed on "token id out of range" (the chat template's <|im_start|> is
    151,644). The setwise reranker refused it at construction; the pointwise one does too now."""
    model = random_qwen3(seed=1, vocab=10_000, spread_yes_no=40)
    for load in (lambda: PointwiseReranker(model=model), lambda: SetwiseReranker(model=model)):
        with pytest.raises(ValueError, match="outside the model's vocabulary of 10000|not all inside the model's "
                                             "vocabulary of 10000"):
            load()
