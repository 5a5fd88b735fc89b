"""The runner's fused page write: on the native qk_norm_rope kernel the new K/V rows go into their
pages inside that op's pass (``OpsLayers.writes_pages``), instead of ``PagedKVCache.write`` after it.
The values written are the same k, v either way, so prefill, extend and scoring must give the same
bits as the unfused path (fp32 and bf16), pages included; ``PagedKVCache.write`` must not run."""
import pytest
import torch
from _ext import needs_native
from _tiny import random_qwen3

from acarerank import PointwiseReranker
from acarerank.model import layer_ops
from acarerank.model.paged_cache import PagedKVCache
from acarerank.model.runner import Qwen3Runner

pytestmark = [needs_native, pytest.mark.usefixtures("one_thread")]

PREFIXES = [list(range(1000, 1037)), list(range(2000, 2003)), []]   # 37 (mid-block end), 3, empty
SEGMENTS = [list(range(3000, 3011)), list(range(4000, 4005)), list(range(5000, 5017))]


def _model(dtype=torch.float32):
    return random_qwen3(layers=3, hidden=64, intermediate=96, heads=4, kv_heads=2, head_dim=16, dtype=dtype,
                        perturb_norms=True, spread_yes_no=20)


@pytest.fixture
def count_writes(monkeypatch):
    calls = []
    write = PagedKVCache.write

    def counted(self, layer, slots, k, v):
        calls.append(layer)
        return write(self, layer, slots, k, v)

    monkeypatch.setattr(PagedKVCache, "write", counted)
    return calls


def _owned_rows(cache, layer):
    """k, v [rows, Hkv, d] of every row the groups' prefixes own, group by group in token order
    (a block's tail past a prefix's end was never written and is not compared)."""
    bs = cache.block_size
    slots = torch.tensor([t[c // bs] * bs + c % bs for t, n in zip(cache.block_tables, cache.lengths)
                          for c in range(n)], dtype=torch.long)
    k, v = cache.pages(layer)
    return k.view(-1, *k.shape[2:])[slots], v.view(-1, *v.shape[2:])[slots]


def _run(runner):
    """prefill (chunked: the second chunk appends after a mid-block end), one extend, one pass over
    all segments; the hidden states and every layer's owned page rows."""
    cache = runner.prefill(PREFIXES, chunk_tokens=16)
    runner.extend(cache, [0, 1], [list(range(6000, 6009)), list(range(6100, 6102))])
    hidden = runner.forward(cache, SEGMENTS, [0, 1, 2], output="all")
    rows = [_owned_rows(cache, i) for i in range(runner.arch.num_layers)]
    cache.free()
    return hidden, rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_page_write_gives_the_bits_of_the_unfused_path(dtype, monkeypatch, count_writes):
    runner = Qwen3Runner.from_hf(_model(dtype))
    assert runner._layer_backends["qk_norm_rope"] == "native"
    fused_hidden, fused_rows = _run(runner)
    assert count_writes == [], f"PagedKVCache.write ran on the fused path (layers {count_writes})"

    monkeypatch.setattr(layer_ops.OpsLayers, "writes_pages", False)  # the old path: cache.write per layer
    old_hidden, old_rows = _run(runner)
    assert count_writes, "the unfused path never called PagedKVCache.write"
    assert torch.equal(fused_hidden, old_hidden), \
        f"hidden states differ: max {(fused_hidden.float() - old_hidden.float()).abs().max():.3e}"
    for i, (fused, old) in enumerate(zip(fused_rows, old_rows)):
        for name, f, o in zip("kv", fused, old):
            assert f.shape == o.shape and f.shape[0] == sum(len(p) for p in PREFIXES) + 11
            bad = (f != o).flatten(1).any(-1).nonzero().flatten()[:5].tolist()
            assert not bad, f"layer {i}: {name} pages differ at owned rows {bad}"


def test_scores_with_the_fused_write_equal_the_unfused_path(monkeypatch, count_writes):
    docs = ["bread rises", "rivers flow to the sea", "the agent searched twice", ""]
    trace = "the agent read the hint and searched twice. " * 4
    model = _model()
    fused = PointwiseReranker(model=model).score("which helps?", docs, trace=trace)
    assert count_writes == []
    monkeypatch.setattr(layer_ops.OpsLayers, "writes_pages", False)
    old = PointwiseReranker(model=model).score("which helps?", docs, trace=trace)
    assert count_writes
    assert fused == old, f"scores differ: {fused} vs {old}"


def test_reserve_never_hands_out_a_slot_in_a_shared_block():
    """A group added over shared blocks with one more block than its length needs: the rows
    reserved after it land in the partly filled block and the spare one, both shared, so both
    are copied first and the other holder's rows stay as they were (only the table's last
    block was checked before: rows 6 and 7 went into the shared block 1)."""
    from acarerank.model import BlockPool

    pool = BlockPool(1, 8, 4, 1, 2, torch.float32, "cpu")
    shared = pool.allocate(3)                      # held by the caller: refcount 1 each
    pool.k[0].view(-1, 1, 2)[:] = torch.arange(32.0).view(32, 1, 1)
    before = pool.k[0][shared].clone()
    cache = PagedKVCache(pool)
    g = cache.add_group(shared, 6)                 # 6 tokens: 1.5 blocks used, one spare block
    slots = cache.reserve([g], [4])                # rows 6..9
    cache.write(0, slots, torch.full((4, 1, 2), -1.0), torch.full((4, 1, 2), -1.0))
    assert not set((slots // 4).tolist()) & set(shared), f"slots {slots.tolist()} in shared blocks {shared}"
    assert torch.equal(pool.k[0][shared], before), "a shared block was written"
    table = cache.block_tables[g]
    assert table[0] == shared[0] and torch.equal(pool.k[0][table[1], :2], before[1, :2])  # rows 4, 5 copied
    cache.free()
