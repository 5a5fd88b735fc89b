"""PointwiseReranker end to end with backend="triton" (both Triton kernels) vs backend="torch".

A tiny random Qwen3 with the real vocabulary (the real tokenizer drives it); on CPU the
kernels run under TRITON_INTERPRET=1 (conftest.py). Oracles: the torch backend (<= 1e-5,
fp32) and the model card's scoring on transformers' own forward of each joint sequence.
"""
import pytest
import torch
from transformers import Qwen3ForCausalLM

from _tiny import qwen3_config, random_qwen3
from acarerank import PointwiseReranker, ScoreRequest
from acarerank.prompts import encode_pointwise
from acarerank.tokenizer import TOKEN_NO as NO_ID, TOKEN_YES as YES_ID

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = [pytest.mark.cuda] if DEVICE == "cuda" else []  # with a GPU the whole path runs there
QUERY = "what limits the context length of a reranker?"
QUESTION = "How do I serve a 4B reranker at depth 100 on one GPU?"
TRACE = "The agent searched for KV-cache sharing.\nIt found cascade attention; now it needs limits."
DOCS = [
    "Rotary position embeddings extend to 32k tokens with YaRN scaling.",
    "",
    "  leading spaces, digits 12345 and CJK 上下文长度",
    "Prefix caching stores the shared prompt's keys and values once.",
    "x",
]


@pytest.fixture(scope="module")
def tiny_model():
    # 4 query / 2 kv heads (GQA 2), head_dim 32, 2 layers: small enough for the interpreter
    # norms perturbed so the fused head's norm is tested; yes/no rows spread so 1e-5 is sharp
    return random_qwen3(perturb_norms=True, spread_yes_no=40, hidden=64, intermediate=134, layers=2, heads=4,
                        kv_heads=2, head_dim=32, tie=True).to(DEVICE)


def test_triton_scores_equal_torch_scores_and_transformers(tiny_model, qwen3_tokenizer):
    torch_rr = PointwiseReranker(model=tiny_model, tokenizer=qwen3_tokenizer, backend="torch")
    triton_rr = PointwiseReranker(model=tiny_model, tokenizer=qwen3_tokenizer, backend="triton")
    ref = torch_rr.score(QUERY, DOCS, question=QUESTION, trace=TRACE)
    got = triton_rr.score(QUERY, DOCS, question=QUESTION, trace=TRACE)
    err = [abs(a - b) for a, b in zip(got, ref)]
    assert max(err) <= 1e-5, f"triton vs torch scores: {got} vs {ref} (errors {err})"

    # the model card's way: full logits of transformers' forward on each joint sequence
    enc = encode_pointwise(qwen3_tokenizer, QUERY, DOCS, question=QUESTION, trace=TRACE)
    yes, no = qwen3_tokenizer.convert_tokens_to_ids("yes"), qwen3_tokenizer.convert_tokens_to_ids("no")
    assert (yes, no) == (YES_ID, NO_ID)
    for i, seg in enumerate(enc.segment_ids):
        ids = torch.as_tensor(list(enc.shared_ids) + list(seg), device=DEVICE)[None]
        with torch.no_grad():
            logits = tiny_model(ids).logits[0, -1].float()
        card = torch.softmax(torch.stack([logits[no], logits[yes]]), 0)[1].item()
        assert abs(got[i] - card) <= 1e-5, f"document {i}: triton {got[i]} vs transformers {card}"


# the bf16 model: on a GPU Qwen3-0.6B's 16/8 heads at d 128 (the serving shapes); on CPU, where the
# interpreter runs the kernels, the small model's 4/2 heads at d 32 (~2 s), its yes/no rows spread
# by 4 only: by 40 its scores are all 1.0 to 4 decimals and an attention output 30 % off, or a
# doubled softmax scale, stays inside the rule (by 4: scores 0.70-0.76, both 10x past it)
BF16_SHAPE, BF16_SPREAD = ((dict(hidden=512, intermediate=1024, layers=2, heads=16, kv_heads=8, head_dim=128), 40)
                           if DEVICE == "cuda" else
                           (dict(hidden=64, intermediate=134, layers=2, heads=4, kv_heads=2, head_dim=32), 4))


def test_bf16_within_transformers_own_bf16_error(qwen3_tokenizer):
    """The bf16 serving path (Triton attention over the paged prefix, the fused head; on CPU under
    the interpreter) against the model card's scoring: our bf16 scores are within 2x transformers'
    own bf16 error + 1e-3, both measured against transformers in fp32."""
    shape = dict(tie=True, attn="sdpa", **BF16_SHAPE)
    m32 = random_qwen3(seed=1, spread_yes_no=BF16_SPREAD, **shape).to(DEVICE)
    m16 = Qwen3ForCausalLM(qwen3_config(**shape)).eval().to(torch.bfloat16).to(DEVICE)
    m16.load_state_dict(m32.state_dict())
    rr = PointwiseReranker(model=m16, tokenizer=qwen3_tokenizer, backend="triton")
    got = rr.score(QUERY, DOCS, question=QUESTION, trace=TRACE)
    enc = encode_pointwise(qwen3_tokenizer, QUERY, DOCS, question=QUESTION, trace=TRACE)

    def card(model, seg):
        ids = torch.as_tensor(list(enc.shared_ids) + list(seg), device=DEVICE)[None]
        with torch.no_grad():
            logits = model(ids).logits[0, -1].float()
        return torch.softmax(torch.stack([logits[NO_ID], logits[YES_ID]]), 0)[1].item()

    want = [card(m32, seg) for seg in enc.segment_ids]
    theirs = [card(m16, seg) for seg in enc.segment_ids]
    err_ours = max(abs(a - b) for a, b in zip(got, want))
    err_theirs = max(abs(a - b) for a, b in zip(theirs, want))
    assert err_ours <= 2 * err_theirs + 1e-3, (f"bf16 scores err {err_ours:.3e} vs transformers' own bf16 err "
                                               f"{err_theirs:.3e}: ours {got}, fp32 card {want}")


def test_triton_scores_bitwise_independent_of_batch(tiny_model, qwen3_tokenizer):
    """A document's score is bitwise the same alone, in a batch, and in another order.

    The kernels guarantee their part (tests/ops/test_op_attention.py, test_op_yes_no.py).
    The runner's dense layers are GEMMs whose rows change in the last bits with the number of
    rows M on CPU (MKL: M=1 GEMV vs M=5) and GPU (cuBLAS heuristics); ``batch_invariant=True``
    runs them on fixed 64-row tiles, which this test relies on.
    """
    rr = PointwiseReranker(model=tiny_model, tokenizer=qwen3_tokenizer, backend="triton", batch_invariant=True)
    full = rr.score(QUERY, DOCS)
    alone = [rr.score(QUERY, [doc])[0] for doc in (DOCS[0], DOCS[3])]
    reversed_ = rr.score(QUERY, DOCS[::-1])
    assert alone == [full[0], full[3]], f"alone {alone!r} vs in batch {[full[0], full[3]]!r}"
    assert reversed_[::-1] == full, f"reversed order {reversed_[::-1]} vs {full}"


# attention backends that claim batch_invariant=True on this device (PointwiseReranker's docstring)
INVARIANT_BACKENDS = ["triton"] + (["native"] if DEVICE == "cpu" else [])
# the native kernel's key tile is 512 tokens (cpu_attention.TILE_KEYS), so its shared parts pass 512
# (a hit of fewer is cut to none): a question of 522 shared tokens with the system prompt, a shared
# part of 2·512 + 7 (a whole-part hit of 1,024 would leave 7 tokens, a pass on the kernel's direct path)
LONG_QUESTION = QUESTION + "".join(f" Page {i} of the runbook says more." for i in range(41))
LONG_TRACE = TRACE + "".join(f"\nStep {i}: it read another trace." for i in range(48)) + " It stopped."


@pytest.mark.parametrize("backend", INVARIANT_BACKENDS)
def test_batch_invariant_scores_bitwise_whatever_the_window_and_the_cache(tiny_model, qwen3_tokenizer, backend):
    """batch_invariant=True: a document's score is bitwise the same alone with no cache and in every
    other composition score_encodings and the step API make — other groups in its packed pass,
    windows of a small cache budget (evictions), a hit of the whole shared part, a hit of the
    system prompt's pages only, a prefill asked for in chunks of 37 tokens.

    The attention tiles a token's keys from the start of its pass's prefix and of its own rows, and
    its rows into blocks from its first: a hit of 3 pages (48 tokens) or a chunk of 37 moved the
    tile boundaries (and, under the interpreter's GEMM, a row's place in its block), up to 3e-7
    apart in fp32. Hits and chunks are now cut to Qwen3Runner.prefix_align tokens in this mode.
    Native (then 256-key tiles): the same, up to 8e-7; and a pass of at most 8 tokens (16 rows at GQA
    2: a whole-part hit cut to 512 of 519 tokens, the last chunk) took the kernel's direct path,
    other bits than one prefill's tiles: the runner now passes tiles_only in this mode.
    """
    from acarerank import ScoreRequest

    def make(**kw):
        return PointwiseReranker(model=tiny_model, tokenizer=qwen3_tokenizer, backend=backend, batch_invariant=True,
                                 **kw)

    question, trace, other_question = QUESTION, TRACE, "Something else entirely?"
    if backend == "native":
        question, trace, other_question = LONG_QUESTION, LONG_TRACE, LONG_QUESTION
    target = ScoreRequest(QUERY, DOCS[:3], question=question, trace=trace)
    same_context = ScoreRequest("another sub-query on the same context", DOCS[3:], question=question, trace=trace)
    other_context = ScoreRequest("unrelated", DOCS[3:], question=other_question)
    rr = make(prefix_cache=False)
    enc, same, other = (rr.encode(r) for r in (target, same_context, other_context))
    if backend == "native":  # a whole-part hit cut to 1,024 leaves a pass of 7 tokens (the direct path's 8 or fewer)
        assert len(enc.shared_ids) == 2 * rr.runner.prefix_align + 7
    want = torch.tensor(rr.score_encodings([enc])[0][0], dtype=torch.float64)

    got = {}
    cached = make()
    scores, hits = cached.score_encodings([same, enc, other])  # one pass of three groups; a partial hit
    got[f"in a batch (hit {hits[1]})"] = scores[1]
    scores, hits = cached.score_encodings([enc])
    got[f"whole shared part cached (hit {hits[0]})"] = scores[0]
    small = make(cache_budget_tokens=2 * len(enc.shared_ids))  # windows of one or two requests, evictions
    scores, hits = small.score_encodings([other, enc, same, enc])
    got[f"small budget, windows (hits {hits[1]}, {hits[3]})"] = scores[1]
    got["small budget, second time"] = scores[3]
    sys_only = make()
    sys_only.score_encodings([other])
    scores, hits = sys_only.score_encodings([enc])
    assert 0 < hits[0] < len(enc.shared_ids) // 2, hits  # the system prompt's pages only (native: and question's)
    got[f"system prefix cached (hit {hits[0]})"] = scores[0]
    step = make(prefix_cache=False)
    h, h2 = step.acquire_prefix(enc, chunk_tokens=37), step.acquire_prefix(same, chunk_tokens=51)
    try:
        flat = step.score_segments([(h2, ids) for ids in same.segment_ids] + [(h, ids) for ids in enc.segment_ids])
    finally:
        step.release_prefix(h)
        step.release_prefix(h2)
    got["prefill in chunks of 37"] = flat[len(same.segment_ids):]

    bad = {name: [f"{a - b:.2e}" for a, b in zip(v, want.tolist())] for name, v in got.items()
           if not torch.equal(torch.tensor(v, dtype=torch.float64), want)}
    assert not bad, f"scores differ from alone, no cache ({want.tolist()}): {bad}"


@pytest.mark.skipif(DEVICE != "cpu", reason="the native attention runs CPU tensors")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batch_invariant_short_segments_score_the_same_alone_and_beside_longer_ones(tiny_model, qwen3_tokenizer,
                                                                                    dtype):
    """batch_invariant=True, native attention: segments of at most 8 tokens (16 rows at GQA 2, the
    kernel's direct-path size) handed to score_segments alone in their group, and the same segments
    beside a longer one of the same handle (one group of more rows: the tile path), score bitwise
    the same. The runner passes tiles_only to the kernel in this mode; without it the short ones
    alone took the direct path (64-key steps, base-2 exp, unrounded P) and moved in their last bits."""
    from acarerank.ops.cpu_attention import direct_path_tokens

    model = tiny_model if dtype == torch.float32 else random_qwen3(
        perturb_norms=True, spread_yes_no=40, hidden=64, intermediate=134, layers=2, heads=4, kv_heads=2,
        head_dim=32, tie=True, dtype=dtype)
    rr = PointwiseReranker(model=model, tokenizer=qwen3_tokenizer, backend="native", batch_invariant=True,
                           prefix_cache=False)
    enc = rr.encode(ScoreRequest(QUERY, DOCS[:1], question=QUESTION, trace=TRACE))
    short = direct_path_tokens(rr.runner.arch.num_heads // rr.runner.arch.num_kv_heads)
    assert short == 8, short
    pieces = [[9906, 374], [13, 279, 1060, 315, 264, 11], list(range(2000, 2000 + short))]
    longer = list(enc.segment_ids[0]) + list(range(3000, 3020))
    h = rr.acquire_prefix(enc)
    try:
        alone = [rr.score_segments([(h, p)])[0] for p in pieces]
        beside = rr.score_segments([(h, longer)] + [(h, p) for p in pieces])[1:]
    finally:
        rr.release_prefix(h)
    assert torch.equal(torch.tensor(alone, dtype=torch.float64), torch.tensor(beside, dtype=torch.float64)), \
        f"{dtype}: alone {alone} vs beside a longer segment {beside}"


@pytest.mark.parametrize("backend", INVARIANT_BACKENDS)
def test_batch_invariant_chunked_prefill_writes_the_pages_of_one_prefill(tiny_model, qwen3_tokenizer, backend):
    """ChunkedPrefill (a scheduler's prefill, setwise's) in batch-invariant mode: steps of 7 tokens
    over a prefix whose first prefix_align + 16 tokens are cached write every page bitwise as one
    prefill of the whole prefix does — the hit is cut to Qwen3Runner.prefix_align tokens and every
    step that does not finish computes a multiple of it. Without that, each step's pass started
    where the last ended and the pages came out in other bits. Native: the prefix ends 5 tokens past
    a multiple of it, and a last step of 5 (the kernel's direct path) wrote other bits; in this mode
    the runner passes tiles_only, so that step runs on the tile path."""
    from acarerank.model.cached_prefill import CacheSlot, ChunkedPrefill

    rr = PointwiseReranker(model=tiny_model, tokenizer=qwen3_tokenizer, backend=backend, batch_invariant=True)
    runner, bs = rr.runner, rr.runner.block_size
    align, tail = runner.prefix_align, 5 if backend == "native" else 19
    assert align % bs == 0 and align > bs, align  # a hit of align + one page is not aligned
    prefix = list(range(1000, 1000 + 2 * align + tail))
    slot = CacheSlot(runner, True, 4 * len(prefix))
    first = ChunkedPrefill(runner, slot, prefix[:align + bs] + [7] * bs)  # caches align + 1 page
    first.step(len(prefix))
    first.cache.free()

    def rows(cache, n):  # every layer's K and V of the group's first n tokens
        out = []
        for layer in range(runner.arch.num_layers):
            for pages in cache.pages(layer):
                out.append(torch.cat([pages[b] for b in cache.block_tables[0]])[:n])
        return out

    whole = runner.prefill([prefix])
    chunked = ChunkedPrefill(runner, slot, prefix)
    steps = []
    while not chunked.done:
        steps.append(chunked.step(7))
    try:
        bad = [i for i, (a, b) in enumerate(zip(rows(chunked.cache, len(prefix)), rows(whole, len(prefix))))
               if not torch.equal(a, b)]
        assert not bad, f"layer K/V {bad} differ from one prefill's (steps {steps}, hit {chunked.hit})"
        assert chunked.hit == align and all(n % align == 0 for n in steps[:-1]) and steps[-1] == tail, \
            (chunked.hit, steps)
    finally:
        chunked.cache.free()
        whole.free()


# ---------------------------------------------------------------- backend preference end to end
def test_one_preference_name_or_a_mapping_per_op(tiny_model, qwen3_tokenizer):
    """backend="cpp" (on a GPU: "cuda"): the head runs its csrc kernel, attention (no such backend)
    keeps its default; the same as the mapping {"yes_no": "cpp"}; both equal backend="torch"
    within 1e-6 (cuda: 1e-5, fp32 warp sums)."""
    pytest.importorskip("acarerank._C")
    from acarerank.ops import available_backends
    name, tol = ("cpp", 1e-6) if DEVICE == "cpu" else ("cuda", 1e-5)
    if name not in available_backends("yes_no", DEVICE):
        pytest.skip(f"acarerank._C has no {name} yes/no head in this build")
    ref = PointwiseReranker(model=tiny_model, tokenizer=qwen3_tokenizer, backend="torch").score(QUERY, DOCS)
    for pref in (name, {"yes_no": name}, {"attention": "torch", "yes_no_score": name}):
        got = PointwiseReranker(model=tiny_model, tokenizer=qwen3_tokenizer, backend=pref).score(QUERY, DOCS)
        err = max(abs(a - b) for a, b in zip(got, ref))
        assert err <= tol, f"backend={pref!r}: {got} vs torch {ref}"


def test_explicit_backend_that_cannot_run_is_an_error(tiny_model, qwen3_tokenizer):
    from acarerank.ops import BackendError
    with pytest.raises(BackendError, match="unknown backend"):
        PointwiseReranker(model=tiny_model, tokenizer=qwen3_tokenizer, backend="fast")
    with pytest.raises(BackendError, match="prefix_shared_attention has no 'cpp' backend"):
        PointwiseReranker(model=tiny_model, tokenizer=qwen3_tokenizer, backend={"attention": "cpp"})
    if DEVICE == "cpu":
        rr = PointwiseReranker(model=tiny_model, tokenizer=qwen3_tokenizer, backend={"yes_no": "cuda"})
        with pytest.raises(BackendError, match="needs CUDA tensors"):
            rr.score(QUERY, DOCS[:1])


def test_environment_triton_runs_every_public_path(tiny_model, qwen3_tokenizer, monkeypatch):
    """ACARERANK_BACKEND=triton (the interpreter on CPU): pointwise scoring and topk_logprobs run,
    each op on triton where it has it, and agree with torch (setwise: the next test)."""
    from acarerank.ops import topk_logprobs
    from acarerank.ops._backend import OpDecl

    ref = PointwiseReranker(model=tiny_model, tokenizer=qwen3_tokenizer, backend="torch").score(QUERY, DOCS[:3])
    ran, real = set(), OpDecl.impl
    monkeypatch.setattr(OpDecl, "impl", lambda self, name: (ran.add((self.name, name)), real(self, name))[1])
    monkeypatch.setenv("ACARERANK_BACKEND", "triton")
    got = PointwiseReranker(model=tiny_model, tokenizer=qwen3_tokenizer).score(QUERY, DOCS[:3])
    assert max(abs(a - b) for a, b in zip(got, ref)) <= 1e-5, (got, ref)
    h = torch.randn(5, 64, device=DEVICE)
    w = tiny_model.lm_head.weight[:1024].detach().float()
    t = torch.randint(0, 1024, (5,), device=DEVICE)
    res = topk_logprobs(h, w, t, k=8)
    want = topk_logprobs(h, w, t, k=8, backend="torch")
    assert torch.equal(res.topk_ids, want.topk_ids)
    torch.testing.assert_close(res.topk_logprobs, want.topk_logprobs, atol=1e-5, rtol=0)
    # the runner keeps KV in pages: attention runs as the paged op
    assert {("prefix_shared_attention_paged", "triton"), ("yes_no_score", "triton"), ("topk_logprobs", "triton")} <= ran, ran


def test_environment_triton_runs_setwise_selection(qwen3_tokenizer, monkeypatch):
    """Setwise selection under ACARERANK_BACKEND=triton equals the torch run. A 1-layer, 1-head
    model: the ~700-token Appendix F prompt is what the interpreter pays for, per head and layer."""
    from acarerank.setwise import SetwiseReranker

    model = random_qwen3(seed=1, hidden=32, intermediate=48, layers=1, heads=1, kv_heads=1, head_dim=32,
                         tie=True).to(DEVICE)
    want = SetwiseReranker(model=model, tokenizer=qwen3_tokenizer, max_new_tokens=8,
                           backend="torch").select(QUERY, DOCS[3:5], max_select=1)
    from acarerank.ops._backend import OpDecl
    ran, real = set(), OpDecl.impl
    monkeypatch.setattr(OpDecl, "impl", lambda self, name: (ran.add((self.name, name)), real(self, name))[1])
    monkeypatch.setenv("ACARERANK_BACKEND", "triton")
    got = SetwiseReranker(model=model, tokenizer=qwen3_tokenizer, max_new_tokens=8).select(QUERY, DOCS[3:5],
                                                                                          max_select=1)
    assert (got.text, got.ids) == (want.text, want.ids)
    # the runner keeps KV in pages: attention runs as the paged op
    assert ("prefix_shared_attention_paged", "triton") in ran, ran
    assert ("prefix_shared_attention_paged", "torch") not in ran, ran
