"""Qwen3Runner against transformers' own forward on the same random weights."""
import numpy as np
import pytest
import torch

from _tiny import random_qwen3
from acarerank.model import Qwen3Runner, SourceModelChangedError


def tiny_qwen3(layers=2, heads=4, kv_heads=2, head_dim=32, hidden=64, vocab=503, seed=0, dtype=torch.float32, **kw):
    """A small-vocabulary random Qwen3 with its norms perturbed (tests/_tiny.py)."""
    return random_qwen3(seed=seed, dtype=dtype, perturb_norms=True, vocab=vocab, hidden=hidden,
                        intermediate=2 * hidden + 6, layers=layers, heads=heads, kv_heads=kv_heads,
                        head_dim=head_dim, **kw)


SHAPES = [
    dict(layers=1, heads=4, kv_heads=4, head_dim=64),   # GQA ratio 1
    dict(layers=3, heads=4, kv_heads=2, head_dim=128),  # ratio 2
    dict(layers=4, heads=8, kv_heads=2, head_dim=16),   # ratio 4
]


def hf_hidden(model, ids):
    with torch.no_grad():
        return model.model(torch.as_tensor(ids)[None]).last_hidden_state[0]


@pytest.mark.parametrize("shape", SHAPES)
def test_segments_over_shared_prefix_match_full_sequences(shape):
    m = tiny_qwen3(**shape)
    r = Qwen3Runner.from_hf(m)
    g = torch.Generator().manual_seed(1)
    prefixes = [torch.randint(0, 503, (n,), generator=g) for n in (37, 1, 80)]
    segs = [torch.randint(0, 503, (n,), generator=g) for n in (5, 1, 12, 3, 9)]
    groups = [0, 0, 1, 2, 2]
    cache = r.prefill(prefixes, chunk_tokens=16)  # chunked prefill: 37 and 80 need several passes
    last = r.forward(cache, segs, groups, output="last")
    every = r.forward(cache, segs, groups, output="all")
    off = 0
    for s, g_ in zip(segs, groups):
        ref = hf_hidden(m, torch.cat([prefixes[g_], s]))[-len(s):]
        mine_all = r.final_norm(every[off:off + len(s)])
        err = (mine_all - ref).abs().max().item()
        assert err <= 1e-5, f"segment of group {g_}: max |diff| {err:.2e}"
        off += len(s)
    for i, (s, g_) in enumerate(zip(segs, groups)):
        ref = hf_hidden(m, torch.cat([prefixes[g_], s]))[-1]
        err = (r.final_norm(last[i]) - ref).abs().max().item()
        assert err <= 1e-5, f"last token of segment {i}: max |diff| {err:.2e}"


def test_logits_and_greedy_decode_with_append_match_transformers():
    m = tiny_qwen3(layers=2)
    r = Qwen3Runner.from_hf(m)
    prompts = [torch.randint(0, 503, (n,)) for n in (21, 8)]
    cache = r.prefill([p[:-1] for p in prompts])
    seqs = [p.tolist() for p in prompts]
    step_in = [[p[-1].item()] for p in prompts]
    for _ in range(6):  # greedy decode both sequences in the same steps
        h = r.forward(cache, step_in, [0, 1], output="last", append=True)
        nxt = r.logits(h).argmax(-1).tolist()
        for b in range(2):
            with torch.no_grad():
                ref = m(torch.tensor(seqs[b])[None]).logits[0, -1]
            assert (r.logits(h[b:b + 1])[0] - ref).abs().max() <= 1e-4
            seqs[b].append(nxt[b])
        step_in = [[t] for t in nxt]
    assert cache.lengths == [len(s) - 1 for s in seqs]


def test_checkpoint_folder_roundtrip(tmp_path):
    m = tiny_qwen3(layers=2, tie=False)
    m.save_pretrained(tmp_path)  # config.json + model.safetensors
    r = Qwen3Runner.from_pretrained(str(tmp_path), dtype=torch.float32)
    ids = torch.randint(0, 503, (19,))
    cache = r.prefill([ids[:11]])
    h = r.forward(cache, [ids[11:]], [0], output="last")
    with torch.no_grad():
        ref = m(ids[None]).logits[0, -1]
    assert (r.logits(h)[0] - ref).abs().max() <= 1e-4
    rb = Qwen3Runner.from_pretrained(str(tmp_path), dtype=torch.bfloat16)
    assert rb.dtype == torch.bfloat16 and rb.lm_head.dtype == torch.bfloat16


def test_bfloat16_matches_transformers_bfloat16_within_its_own_error():
    """bf16 rule: our error vs an fp32 reference stays within 2x transformers-bf16's error (+ a floor)."""
    m32 = tiny_qwen3(layers=2, head_dim=64)
    mbf = tiny_qwen3(layers=2, head_dim=64).to(torch.bfloat16)
    r = Qwen3Runner.from_hf(mbf)
    ids = torch.randint(0, 503, (40,))
    cache = r.prefill([ids[:30]])
    mine = r.final_norm(r.forward(cache, [ids[30:]], [0], output="all")).float()
    ref32 = hf_hidden(m32, ids)[30:]
    refbf = hf_hidden(mbf, ids)[30:].float()
    ours, theirs = (mine - ref32).abs().max().item(), (refbf - ref32).abs().max().item()
    assert ours <= 2 * theirs + 1e-2, f"bf16 error {ours:.3e} vs transformers-bf16 {theirs:.3e}"


@pytest.mark.parametrize("backend", [None, "torch"])
def test_a_pass_of_only_empty_segments(backend):
    """output='all'/'none' allow empty segments, so a pass may have no token at all: it returns
    [0, H] / None on every backend (on the native layer kernels it raised "residual and input must
    not share memory": two empty tensors share the null data pointer)."""
    r = Qwen3Runner.from_hf(tiny_qwen3(layers=2), backend=backend)
    cache = r.prefill([[1, 2, 3], []])
    assert r.forward(cache, [[], []], [0, 1], output="all").shape == (0, 64)
    assert r.forward(cache, [[]], [1], output="none") is None
    r.extend(cache, [0], [[]])  # nothing to append: no pass at all

def test_runner_rejects_bad_input():
    r = Qwen3Runner.from_hf(tiny_qwen3(layers=1))
    cache = r.prefill([[1, 2, 3]])
    with pytest.raises(ValueError, match="out of range"):
        r.forward(cache, [[5, 503]], [0])
    with pytest.raises(ValueError, match="empty"):
        r.forward(cache, [[]], [0])
    with pytest.raises(ValueError, match="outside the cache"):
        r.forward(cache, [[1]], [1])
    with pytest.raises(ValueError, match="one segment per group"):
        r.forward(cache, [[1], [2]], [0, 0], append=True)
    with pytest.raises(TypeError, match="1-D integer"):
        r.forward(cache, [torch.tensor([1.0])], [0])
    # a list of floats or bools is not token ids either (never truncated 1.7 -> 1, True -> 1)
    for bad in ([1.7], [4, 2.0], [True], ["7"]):
        with pytest.raises(TypeError, match="segment 0: token ids must be a 1-D integer"):
            r.forward(cache, [bad], [0])
    with pytest.raises(TypeError, match="prefix 0: token ids must be a 1-D integer"):
        r.prefill([[1, 2.5]])
    # integers of any width are ids: numpy scalars, a uint16 token array as data pipelines store them
    want = r.forward(cache, [[4, 5]], [0])
    for ok in ([np.int64(4), 5], list(np.array([4, 5], dtype=np.uint16)), torch.tensor([4, 5], dtype=torch.int16)):
        torch.testing.assert_close(r.forward(cache, [ok], [0]), want, rtol=0, atol=0)


def _last_hidden(r, ids):
    cache = r.prefill([ids[:30]])
    return r.forward(cache, [ids[30:]], [0], output="last")


@pytest.mark.parametrize("backend", [None, "torch"])
def test_the_source_watch_compares_what_the_runner_shares(backend):
    """from_hf shares norms, embedding, lm_head (and, on the torch linear backend, o_proj / down_proj)
    with the model. After model.to(bfloat16) the model's Parameters hold new storage and the runner
    its own references (its output unchanged): an in-place edit then changes nothing it reads, yet
    was a SourceModelChangedError (the Parameter and its version counter are the same objects). Now
    it runs and still gives the model-as-built's output bit for bit; an edit of a tensor it does
    share is still refused, and an edit of a matrix it holds its own copy of changes nothing it reads."""
    ids = torch.randint(0, 503, (40,), generator=torch.Generator().manual_seed(3))
    m = tiny_qwen3(layers=2)
    r = Qwen3Runner.from_hf(m, backend=backend)
    before = _last_hidden(r, ids)
    m.to(torch.bfloat16)
    assert torch.equal(_last_hidden(r, ids), before)
    with torch.no_grad():
        for p in m.parameters():
            p.mul_(2)
    assert torch.equal(_last_hidden(r, ids), before)

    m = tiny_qwen3(layers=2)
    r = Qwen3Runner.from_hf(m, backend=backend)
    with torch.no_grad():
        m.model.layers[1].self_attn.q_proj.weight.mul_(2)  # packed with k, v into the runner's own matrix
    assert torch.equal(_last_hidden(r, ids), before)
    with torch.no_grad():
        m.model.layers[1].post_attention_layernorm.weight.mul_(2)  # shared
    with pytest.raises(SourceModelChangedError, match="'model.layers.1.post_attention_layernorm.weight'"):
        _last_hidden(r, ids)


@pytest.mark.parametrize("edit", ["norm mul_", "embedding copy_", "layer norm add_"])
def test_a_write_through_data_to_a_shared_tensor_is_refused(edit):
    """``p.data.mul_()`` / ``p.data.copy_()`` (an EMA, an RL weight sync) write the storage the runner
    shares without bumping the Parameter's version counter: the next pass mixed old and new weights
    (scores matching neither model, no error). The runner compares a few elements' bits too."""
    ids = torch.randint(0, 503, (40,), generator=torch.Generator().manual_seed(4))
    m = tiny_qwen3(layers=2)
    r = Qwen3Runner.from_hf(m)
    _last_hidden(r, ids)
    name, p = {"norm mul_": ("model.norm.weight", m.model.norm.weight),
               "embedding copy_": ("model.embed_tokens.weight", m.model.embed_tokens.weight),
               "layer norm add_": ("model.layers.0.input_layernorm.weight",
                                   m.model.layers[0].input_layernorm.weight)}[edit]
    version = p._version
    if edit == "norm mul_":
        p.data.mul_(1.5)
    elif edit == "embedding copy_":
        p.data.copy_(torch.randn_like(p))
    else:
        p.data.add_(0.25)
    assert p._version == version   # what the version check alone missed
    with pytest.raises(SourceModelChangedError, match=f"'{name}'.*through .data"):
        _last_hidden(r, ids)


def test_a_prefill_of_many_groups_passes_at_most_one_chunk_of_rows(monkeypatch):
    """``prefill_chunk`` bounds a prefill pass's rows, not a group's share of them: 8 pool-50
    setwise prompts (11.7k tokens each) went in passes of 8 × 4,096 rows, whose activations made
    select_batch slower a selection than select and +700 MB. Short prefixes still share a pass;
    a group's chunks start where they did, and its K/V is the one transformers computes."""
    m = tiny_qwen3(layers=2)
    r = Qwen3Runner.from_hf(m)
    rows = []
    real = Qwen3Runner._pass
    monkeypatch.setattr(Qwen3Runner, "_pass", lambda self, cache, ids, *a: (rows.append([t.numel() for t in ids]),
                                                                             real(self, cache, ids, *a))[1])
    g = torch.Generator().manual_seed(3)
    prefixes = [torch.randint(0, 503, (n,), generator=g) for n in (70, 70, 5, 6, 40)]
    cache = r.prefill(prefixes, chunk_tokens=32)
    assert all(sum(p) <= 32 for p in rows), rows
    assert rows[0] == [32] and [5, 6] in [sorted(p)[:2] for p in rows], rows  # short ones packed together
    assert sum(map(sum, rows)) == sum(len(p) for p in prefixes)  # every token once
    segs = [torch.randint(0, 503, (3,), generator=g) for _ in prefixes]
    rows.clear()
    last = r.forward(cache, segs, list(range(len(prefixes))), output="last")
    for i, (p, s) in enumerate(zip(prefixes, segs)):
        err = (r.final_norm(last[i]) - hf_hidden(m, torch.cat([p, s]))[-1]).abs().max().item()
        assert err <= 1e-5, f"group {i}: max |diff| {err:.2e}"


def test_prefill_chunk_defaults_by_device_and_is_checked(monkeypatch):
    """Left out, a CPU runner's prefill passes hold 2,048 rows (bf16 outputs under glibc's 32 MB mmap
    ceiling: docs/cpu.md, "Memory between passes"), CUDA's 4,096; a prefill of more rows goes in
    passes of at most that many. A count that is not a positive int is a ValueError naming it (0
    ran one-token passes, a float failed deep in a slice)."""
    from acarerank.model.runner import DEFAULT_PREFILL_CHUNK

    assert DEFAULT_PREFILL_CHUNK == {"cpu": 2048, "cuda": 4096}
    m = tiny_qwen3(layers=1, vocab=503)
    r = Qwen3Runner.from_hf(m)
    assert r.prefill_chunk == 2048
    rows = []
    real = Qwen3Runner._pass
    monkeypatch.setattr(Qwen3Runner, "_pass", lambda self, cache, ids, *a: (rows.append(sum(t.numel() for t in ids)),
                                                                             real(self, cache, ids, *a))[1])
    r.prefill([torch.randint(0, 503, (2048 + 37,))])
    assert rows == [2048, 37], rows
    assert Qwen3Runner.from_hf(m, prefill_chunk=100).prefill_chunk == 100
    for bad in (0, -1, 2.5, True, "64"):
        with pytest.raises(ValueError, match="prefill_chunk"):
            Qwen3Runner.from_hf(m, prefill_chunk=bad)


@pytest.mark.parametrize("size", [7, 8, 512, True])
def test_a_block_size_the_pages_cannot_take_is_refused_when_set(size):
    """block_size is a power of two from 16 to 256 (the paged attention's pages): a runner (or
    with_settings) took another and refused it only at its first pass, inside the attention op."""
    r = Qwen3Runner.from_hf(tiny_qwen3(layers=1))
    with pytest.raises(ValueError, match="block_size must be a power of two from 16 to 256"):
        r.with_settings(block_size=size)
    with pytest.raises(ValueError, match="block_size must be a power of two from 16 to 256"):
        Qwen3Runner(r.weights, block_size=size)
    assert r.with_settings(block_size=32).block_size == 32
