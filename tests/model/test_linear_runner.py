"""The runner's linear layers on oneDNN-packed weights (model/linear_weights.py, ops/linear.py).

fp32: scores with the "onednn" linear equal the "torch" ones to 1e-5 and hidden states equal
transformers' to 1e-5 (the runner's existing rule, tests/model/test_runner.py); memory is counted
in bytes of live tensors: a packed matrix replaces its dense one, never sits beside it.
"""
import gc
import warnings
import weakref

import pytest
import torch

from _tiny import random_qwen3
from acarerank import PointwiseReranker
from acarerank.model import Qwen3Runner
from acarerank.model import linear_weights as lw
from acarerank.model import runner as runner_mod
from acarerank.model.linear_weights import LINEAR_FIELDS
from acarerank.model.runner import INVARIANT_ROWS, _linear_fixed_tiles
from acarerank.ops import PackedLinearWeight, prepare_linear_weight
from acarerank.ops.linear import onednn_why_unavailable

# K (hidden 72, heads·d 80, intermediate 150) and N not multiples of 16
SHAPE = dict(layers=2, heads=4, kv_heads=2, head_dim=20, hidden=72, intermediate=75 * 2, vocab=503)


def _model(dtype=torch.float32, **kw):
    return random_qwen3(seed=0, dtype=dtype, perturb_norms=True, **{**SHAPE, **kw})


def _hidden(runner, seed=1):
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(0, 503, (41,), generator=g)
    segs = [torch.randint(0, 503, (n,), generator=g) for n in (13, 1, 30)]
    cache = runner.prefill([prefix])
    h = runner.forward(cache, segs, [0, 0, 0], output="all")
    return prefix, segs, runner.final_norm(h)


def _forms(runner):
    return {type(getattr(L, f)).__name__ for L in runner.weights.layers for f in LINEAR_FIELDS}


def test_fp32_default_packs_the_layer_matrices_and_matches_transformers():
    m = _model()
    r = Qwen3Runner.from_hf(m)
    assert r.linear_backend == "onednn" and r.linear_fallback == "", r.linear_fallback
    assert _forms(r) == {"PackedLinearWeight"}
    prefix, segs, h = _hidden(r)
    off = 0
    for s in segs:
        with torch.no_grad():
            ref = m.model(torch.cat([prefix, s])[None]).last_hidden_state[0, -len(s):]
        err = (h[off:off + len(s)] - ref).abs().max().item()
        assert err <= 1e-5, f"onednn runner vs transformers, segment of {len(s)}: {err:.2e}"
        off += len(s)


def test_onednn_and_torch_linear_scores_agree(qwen3_tokenizer):
    m = random_qwen3(seed=0, perturb_norms=True, spread_yes_no=40, layers=2, hidden=72, intermediate=150, heads=4,
                     kv_heads=2, head_dim=20)
    docs = ["a cat", "", "the stock market fell 3% on Tuesday", "x" * 300, "猫が好き"]
    scores = {}
    for lin in ("onednn", "torch"):
        rr = PointwiseReranker(model=m, tokenizer=qwen3_tokenizer, backend={"linear": lin}, prefix_cache=False)
        assert rr.runner.linear_backend == lin
        scores[lin] = rr.score("which animal purrs?", docs)
    diff = max(abs(a - b) for a, b in zip(scores["onednn"], scores["torch"]))
    assert diff <= 1e-5, f"scores onednn {scores['onednn']} vs torch {scores['torch']}"
    assert max(scores["torch"]) - min(scores["torch"]) > 1e-2, "scores too close together to tell anything"


def test_a_linear_preference_of_torch_keeps_dense_weights_and_f_linear():
    m = _model()
    for pref in ("torch", {"linear": "torch"}):
        r = Qwen3Runner.from_hf(m, backend=pref)
        assert r.linear_backend == "torch" and _forms(r) == {"Tensor"}, pref
    # the other ops keep theirs: only the linear layers change
    r = Qwen3Runner.from_hf(m, backend={"linear": "torch"})
    assert r._layer_backends == Qwen3Runner.from_hf(m)._layer_backends


def test_bf16_packs_where_onednn_reorders_it_and_falls_back_to_f_linear_where_it_refuses():
    """Either branch, by the CPU: AVX512_BF16 / AMX (oneDNN reorders bf16) or an AVX2-only CPU."""
    r = Qwen3Runner.from_hf(_model(torch.bfloat16))
    why = onednn_why_unavailable(torch.bfloat16)
    if why:
        assert r.linear_backend == "torch" and _forms(r) == {"Tensor"}
        assert r.linear_fallback == why and "bfloat16" in r.linear_fallback
    else:
        assert r.linear_backend == "onednn" and _forms(r) == {"PackedLinearWeight"} and not r.linear_fallback


def test_the_runner_never_holds_dense_and_packed_copies_and_leaves_its_input_alone():
    m = _model()
    hf_o = m.model.layers[0].self_attn.o_proj.weight
    hf_o_before = hf_o.detach().clone()
    weights = runner_mod.weights_from_hf(m)
    dense = weights.layers[0].w_qkv
    r = Qwen3Runner(weights)  # not owned: the caller's object keeps its dense matrices
    assert isinstance(r.weights.layers[0].w_qkv, PackedLinearWeight)
    assert weights.layers[0].w_qkv is dense and r.weights is not weights
    del weights, dense
    r2 = Qwen3Runner.from_hf(m)  # owned: packed in place
    assert _forms(r2) == {"PackedLinearWeight"}
    assert torch.equal(hf_o, hf_o_before) and hf_o.layout == torch.strided, "the transformers tensor was touched"
    assert torch.equal(r2.weights.layers[0].w_o.unpack(), hf_o_before)


def test_from_pretrained_peak_is_the_model_plus_one_matrix(tmp_path, monkeypatch):
    """Counted in bytes of live layer matrices at every packing step: the dense matrices die one by
    one as their packed forms appear, so the peak is the model's matrices + one matrix (not two models)."""
    _model().save_pretrained(tmp_path)
    dense_refs, packed = [], []
    load, prepare = runner_mod.load_checkpoint, lw.prepare_linear_weight

    def recording_load(*a, **kw):
        w = load(*a, **kw)
        dense_refs.extend((weakref.ref(getattr(L, f)), getattr(L, f).nbytes) for L in w.layers for f in LINEAR_FIELDS)
        return w

    peaks = []

    def recording_prepare(w, backend):
        out = prepare(w, backend)
        packed.append(out.nbytes)
        peaks.append(sum(n for ref, n in dense_refs if ref() is not None) + sum(packed))
        return out

    monkeypatch.setattr(runner_mod, "load_checkpoint", recording_load)
    monkeypatch.setattr(lw, "prepare_linear_weight", recording_prepare)
    r = Qwen3Runner.from_pretrained(str(tmp_path))
    gc.collect()
    total = sum(n for _, n in dense_refs)
    largest = max(n for _, n in dense_refs)
    assert len(packed) == len(dense_refs) and _forms(r) == {"PackedLinearWeight"}
    assert max(peaks) <= total + largest, f"peak {max(peaks)} B > model {total} B + one matrix {largest} B"
    alive = [n for ref, n in dense_refs if ref() is not None]
    assert not alive, f"{len(alive)} dense layer matrices ({sum(alive)} B) outlive their packing"


def test_a_reranker_copy_with_another_linear_backend_leaves_the_callers_runner_alone(qwen3_tokenizer):
    runner = Qwen3Runner.from_hf(random_qwen3(seed=0, layers=1))  # the real vocabulary: the head needs yes/no
    rr = PointwiseReranker(runner=runner, tokenizer=qwen3_tokenizer, backend="torch", prefix_cache=False)
    assert rr.runner is not runner and rr.runner.linear_backend == "torch" and _forms(rr.runner) == {"Tensor"}
    assert runner.linear_backend == "onednn" and _forms(runner) == {"PackedLinearWeight"}
    assert rr.runner._layer_backends["rms_norm"] == "torch", "the copy's layer ops follow its backend"
    same = PointwiseReranker(runner=runner, tokenizer=qwen3_tokenizer, batch_invariant=True, prefix_cache=False)
    assert same.runner.weights is runner.weights, "same linear form: the weights are shared, not copied"


@pytest.mark.parametrize("T", [1, 5, 64, 65, 130])
def test_fixed_tiles_on_the_packed_weight_are_row_invariant(T):
    """batch_invariant=True: a row's result is bitwise the same whatever its batch and its place in a
    tile of INVARIANT_ROWS rows (the promise of _linear_fixed_tiles, now on the oneDNN weight)."""
    g = torch.Generator().manual_seed(T)
    w = torch.randn(75, 72, generator=g) * 0.1
    b = torch.randn(75, generator=g)
    pw = prepare_linear_weight(w, "onednn")
    row = torch.randn(1, 72, generator=g)
    alone = _linear_fixed_tiles(row, pw, b)
    for pos in sorted({0, T // 2, T - 1}):
        x = torch.randn(T, 72, generator=g)
        x[pos] = row[0]
        got = _linear_fixed_tiles(x, pw, b)[pos]
        assert torch.equal(got, alone[0]), (f"row at {pos} of {T} (tile {INVARIANT_ROWS}) differs by "
                                            f"{(got - alone[0]).abs().max():.3e}")


def test_batch_invariant_runner_uses_the_packed_weights():
    m = _model()
    r_inv = Qwen3Runner.from_hf(m, batch_invariant=True)
    assert r_inv.linear_backend == "onednn" and _forms(r_inv) == {"PackedLinearWeight"}
    _, _, h = _hidden(r_inv)
    _, _, h_ref = _hidden(Qwen3Runner.from_hf(m, backend={"linear": "torch"}))
    assert (h - h_ref).abs().max().item() <= 1e-5


def test_batch_invariant_names_an_attention_that_claims_no_invariance():
    """batch_invariant=True with the "torch" attention, where only the GEMMs are fixed-tile: a cache
    hit or another prefill chunking moves a score's last bits (docs/ARCHITECTURE.md, "Linear
    layers": Modes). It warns, naming the backend; "triton" and "native" (the CPU default), which
    hold the whole promise with their prefill passes aligned, do not."""
    m = _model()
    with pytest.warns(UserWarning, match=r"batch_invariant=True with the 'torch' attention backend"):
        Qwen3Runner.from_hf(m, batch_invariant=True, backend={"prefix_shared_attention_paged": "torch"})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Qwen3Runner.from_hf(m, batch_invariant=True, backend={"prefix_shared_attention_paged": "triton"})
        Qwen3Runner.from_hf(m, batch_invariant=True, backend={"prefix_shared_attention_paged": "native"})
        Qwen3Runner.from_hf(m)


@pytest.mark.parametrize("invariant", [False, True])
def test_the_runner_asks_for_the_attention_tiles_only_in_batch_invariant_mode(monkeypatch, invariant):
    """The native attention's direct path (a group of at most 16 rows: every decode step's) is its
    fast one and rounds otherwise than its tiles; the runner turns it off (tiles_only=True) in
    every pass of batch_invariant=True and only then, so default prefill and decoding keep it
    (tests/ops/test_op_cpu_attention_native.py: tiles_only=False takes it)."""
    seen = []
    real = runner_mod.prefix_shared_attention_paged

    def spy(*args, **kw):
        seen.append(kw.get("tiles_only"))
        return real(*args, **kw)

    monkeypatch.setattr(runner_mod, "prefix_shared_attention_paged", spy)
    r = Qwen3Runner.from_hf(_model(), batch_invariant=invariant)
    cache = r.prefill([list(range(40))])
    r.forward(cache, [[5]], [0], output="last", append=True)  # a decode step: 2 rows, direct-path size
    assert seen and set(seen) == {invariant}, seen


@pytest.mark.slow
def test_compiled_layers_run_the_packed_weights():
    """compile_layers=True traces the packed weights through the opaque acarerank::linear_onednn op."""
    m = _model()
    rc = Qwen3Runner.from_hf(m, compile_layers=True)
    assert rc.linear_backend == "onednn"
    _, _, h = _hidden(rc)
    _, _, h_ref = _hidden(Qwen3Runner.from_hf(m, backend={"linear": "torch"}))
    err = (h - h_ref).abs().max().item()
    assert err <= 1e-5, f"compiled onednn vs eager torch linear: {err:.3e}"
