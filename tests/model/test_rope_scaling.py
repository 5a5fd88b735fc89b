"""Scaled RoPE (YaRN, linear, llama3) against transformers' Qwen3 forward with the same config.

Oracle: transformers 5.x's ``Qwen3ForCausalLM`` (its ``Qwen3RotaryEmbedding`` over
``modeling_rope_utils``) on the same random weights and config; the inputs run past
``original_max_position_embeddings`` (64 here, 32,768 in Qwen3's card) so the scaled frequencies
and YaRN's attention factor are what is compared.
"""
import json

import pytest
import torch
from transformers import Qwen3ForCausalLM

from _tiny import random_qwen3
from acarerank import PointwiseReranker
from acarerank.model import CheckpointError, Qwen3Runner
from acarerank.prompts import joint_input_ids, official_scores
from acarerank.tokenizer import load_qwen3_tokenizer

# Qwen3's card recipe for contexts past 32k, with the original length cut to 64 so that ~200 tokens cross it
CARD_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
KINDS = {
    "yarn-card": (CARD_YARN, {}),
    # every YaRN option off its default: a ramp not truncated, other betas, attention factor from mscale ratio
    "yarn-options": ({"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64, "truncate": False,
                      "beta_fast": 8, "beta_slow": 2, "mscale": 1.0, "mscale_all_dim": 0.5}, {}),
    # factor null: max_position_embeddings / original (256 / 64); an explicit attention factor
    "yarn-null-factor": ({"rope_type": "yarn", "factor": None, "original_max_position_embeddings": 64,
                          "attention_factor": 1.3}, {"max_position_embeddings": 256}),
    # a top-level original_max_position_embeddings wins over the object's (transformers 5.x)
    "yarn-top-level-original": (CARD_YARN, {"original_max_position_embeddings": 16}),
    "linear": ({"type": "linear", "factor": 2.5}, {}),
    "llama3": ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64}, {}),
}


def scaled(kind, *, dtype=torch.float32, seed=0, **shape):
    rope, top = KINDS[kind]
    shape = {**dict(vocab=503, hidden=64, intermediate=134, layers=2, heads=4, kv_heads=2, head_dim=32), **shape}
    return random_qwen3(seed=seed, dtype=dtype, perturb_norms=True, rope_scaling=dict(rope), **top, **shape)


def hf_hidden(model, ids):
    with torch.no_grad():
        return model.model(torch.as_tensor(ids)[None]).last_hidden_state[0]


def default_rope_twin(model):
    """The same weights under plain RoPE: what a runner that ignored the scaling would compute."""
    cfg = model.config.to_dict()
    cfg.pop("rope_scaling", None)
    cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": model.config.rope_parameters["rope_theta"]}
    twin = Qwen3ForCausalLM(type(model.config).from_dict(cfg)).eval().to(model.dtype)
    twin.load_state_dict(model.state_dict())
    return twin


@pytest.mark.parametrize("kind", list(KINDS))
def test_scaled_rope_matches_transformers_past_the_original_length(kind):
    """A prefix of 150 tokens prefilled in chunks, then segments at positions 150..199 over it: the
    hidden rows and last-token logits are transformers' (fp32: 1e-5 / 1e-4). Any scaled RoPE was
    refused ('is not supported'); the default-RoPE twin is far off, so the comparison is sharp."""
    m = scaled(kind)
    r = Qwen3Runner.from_hf(m)
    g = torch.Generator().manual_seed(1)
    prefix = torch.randint(0, 503, (150,), generator=g)
    segs = [torch.randint(0, 503, (n,), generator=g) for n in (50, 7)]
    cache = r.prefill([prefix], chunk_tokens=64)
    every = r.forward(cache, segs, [0, 0], output="all")
    off = 0
    for s in segs:
        full = torch.cat([prefix, s])
        ref = hf_hidden(m, full)[-len(s):]
        mine = r.final_norm(every[off:off + len(s)])
        err = (mine - ref).abs().max().item()
        assert err <= 1e-5, f"{kind}: max |diff| {err:.2e}"
        with torch.no_grad():
            ref_logits = m(full[None]).logits[0, -1]
        assert (r.logits(every[off + len(s) - 1:off + len(s)])[0] - ref_logits).abs().max() <= 1e-4
        plain = hf_hidden(default_rope_twin(m), full)[-len(s):]
        assert (plain - ref).abs().max().item() > 1e-2, "the scaling changes nothing here: the test is not sharp"
        off += len(s)


def test_scaled_rope_bfloat16_within_transformers_bfloat16_error():
    """bf16 rule: our error against the fp32 reference stays within 2x transformers-bf16's (+ a floor)."""
    m32 = scaled("yarn-card")
    mbf = scaled("yarn-card", dtype=torch.bfloat16)
    r = Qwen3Runner.from_hf(mbf)
    ids = torch.randint(0, 503, (200,), generator=torch.Generator().manual_seed(2))
    cache = r.prefill([ids[:150]])
    mine = r.final_norm(r.forward(cache, [ids[150:]], [0], output="all")).float()
    ref32 = hf_hidden(m32, ids)[150:]
    refbf = hf_hidden(mbf, ids)[150:].float()
    ours, theirs = (mine - ref32).abs().max().item(), (refbf - ref32).abs().max().item()
    assert ours <= 2 * theirs + 1e-2, f"bf16 error {ours:.3e} vs transformers-bf16 {theirs:.3e}"


LONG_DOCS = ["retrieval " * 60 + "tail", "short", "the answer is 42 " * 12]  # prompts of ~90-170 tokens


@pytest.mark.parametrize("kind", ["yarn-card", "yarn-top-level-original", "llama3"])
def test_scaled_rope_checkpoint_scores_as_transformers(kind, tmp_path):
    """config.json in the card's form (a top-level rope_theta, the scaling under the legacy
    rope_scaling key; a top-level original_max_position_embeddings, which transformers 5.x puts
    over the object's when it builds the model): from_pretrained and model= score as the card's
    code on transformers' from_pretrained of the same folder (fp32: 1e-5)."""
    m = random_qwen3(seed=5, spread_yes_no=40, perturb_norms=True, rope_scaling=dict(KINDS[kind][0]))
    m.save_pretrained(tmp_path / "c")
    cfg = json.loads((tmp_path / "c" / "config.json").read_text())
    cfg.pop("rope_parameters")
    (tmp_path / "c" / "config.json").write_text(json.dumps({**cfg, **KINDS[kind][1], "rope_theta": 1e6,
                                                                   "rope_scaling": KINDS[kind][0]}))
    hf = Qwen3ForCausalLM.from_pretrained(str(tmp_path / "c"), attn_implementation="eager",
                                          dtype=torch.float32).eval()
    assert hf.config.rope_parameters["rope_type"] == KINDS[kind][0]["rope_type"]
    tok = load_qwen3_tokenizer()
    want = official_scores(hf, tok, [joint_input_ids(tok, "q", d) for d in LONG_DOCS], batch_size=1)
    plain = official_scores(default_rope_twin(hf), tok, [joint_input_ids(tok, "q", d) for d in LONG_DOCS],
                            batch_size=1)
    assert max(abs(a - b) for a, b in zip(want, plain)) > 1e-3, (want, plain)  # else 1e-5 tests nothing
    for rr in (PointwiseReranker.from_pretrained(str(tmp_path / "c"), dtype=torch.float32),
               PointwiseReranker(model=hf)):
        got = rr.score("q", LONG_DOCS)
        assert max(abs(a - b) for a, b in zip(got, want)) <= 1e-5, (got, want)


@pytest.mark.parametrize("rope, top, match", [
    ({"rope_type": "dynamic", "factor": 2.0}, {}, r"rope_type 'dynamic' \(its frequencies change"),
    ({"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8,
      "original_max_position_embeddings": 64}, {}, r"rope_type 'longrope'"),
    ({"rope_type": "proportional", "rope_theta": 1e6}, {}, r"rope_type 'proportional' \(it is not a Qwen3 RoPE"),
    ({**CARD_YARN, "partial_rotary_factor": 0.5}, {}, "partial_rotary_factor 0.5"),
    (CARD_YARN, {"partial_rotary_factor": 0.5}, "partial_rotary_factor 0.5"),
    ({"rope_type": "yarn", "original_max_position_embeddings": 64}, {}, "no 'factor'"),
    ({"type": "linear", "factor": None}, {}, "factor must be a finite number, got None"),
    ({"type": "linear", "factor": 0.5}, {}, "factor must be >= 1"),
    ({**CARD_YARN, "beta_fast": 1, "beta_slow": 4}, {}, "beta_fast 1 must be >= beta_slow 4"),
    ({**CARD_YARN, "truncate": "no"}, {}, "truncate must be true or false"),
    ({**CARD_YARN, "attention_factor": 0}, {}, "attention_factor must be > 0"),
    ({**CARD_YARN, "original_max_position_embeddings": "64"}, {}, "original_max_position_embeddings must be"),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "original_max_position_embeddings": 64}, {},
     r"no \['high_freq_factor'\]"),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 64}, {}, "high_freq_factor must be > 4"),
])
def test_rope_the_runner_does_not_compute_is_refused_by_name(rope, top, match, tmp_path):
    """A kind whose frequencies depend on the call's length, a partial rotation (transformers'
    Qwen3 raises on it), or a parameter transformers would refuse or warn about: a CheckpointError
    naming config.json and the field, never a silently different RoPE."""
    m = random_qwen3(seed=0, vocab=503)
    m.save_pretrained(tmp_path / "c")
    cfg = json.loads((tmp_path / "c" / "config.json").read_text())
    cfg.pop("rope_parameters")
    (tmp_path / "c" / "config.json").write_text(json.dumps({**cfg, **top, "rope_scaling": rope}))
    with pytest.raises(CheckpointError, match=rf"config\.json.*{match}"):
        Qwen3Runner.from_pretrained(str(tmp_path / "c"))


def test_a_scaled_rope_parameters_that_rope_scaling_replaces_is_refused(tmp_path):
    """transformers 5 takes a non-empty rope_scaling whole, so a YaRN in rope_parameters beside it
    would be dropped with no sign: refused, naming both."""
    m = random_qwen3(seed=0, vocab=503)
    m.save_pretrained(tmp_path / "c")
    cfg = json.loads((tmp_path / "c" / "config.json").read_text())
    cfg["rope_parameters"] = {**CARD_YARN, "rope_theta": 1e6}
    cfg["rope_scaling"] = {"rope_type": "default", "rope_theta": 1e6}
    (tmp_path / "c" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="rope_scaling .* replaces rope_parameters .* 'yarn' would be ignored"):
        Qwen3Runner.from_pretrained(str(tmp_path / "c"))


def test_a_misspelt_rope_key_is_named(tmp_path):
    """A key transformers' RoPE validation does not know (a misspelt "beta_fats") left its
    parameter at the default with no word; now a warning names it and the known ones. The
    model card's keys load silently."""
    import warnings

    m = random_qwen3(seed=0, vocab=503)
    m.save_pretrained(tmp_path / "c")
    cfg = json.loads((tmp_path / "c" / "config.json").read_text())
    cfg.pop("rope_parameters")
    for rope, match in (({**CARD_YARN, "rope_theta": 1e6}, None),
                        ({**CARD_YARN, "beta_fats": 8}, r"unrecognised key\(s\) \['beta_fats'\] for rope_type 'yarn'"),
                        ({"rope_type": "linear", "factor": 2.0, "original_max_position_embeddings": 64},
                         r"\['original_max_position_embeddings'\] for rope_type 'linear'")):
        (tmp_path / "c" / "config.json").write_text(json.dumps({**cfg, "rope_scaling": rope}))
        if match is None:
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                Qwen3Runner.from_pretrained(str(tmp_path / "c"))
        else:
            with pytest.warns(UserWarning, match=match):
                Qwen3Runner.from_pretrained(str(tmp_path / "c"))
