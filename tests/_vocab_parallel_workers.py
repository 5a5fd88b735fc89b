"""Spawned gloo process groups for tests/ops/test_op_vocab_parallel.py.

One group of W ranks (torch.multiprocessing, forkserver) serves many cases: each rank loops on its
job queue, runs ``CASES[name](ctx, **job)`` and puts (rank, "ok", result) or
(rank, "error", (exception type, message)) on the shared result queue. Jobs carry the full
inputs (shared memory); each rank cuts its own shard. Kept free of pytest so the children
import little.
"""
from __future__ import annotations

import os
import queue
import tempfile
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

COLLECTIVE_TIMEOUT_S = 60  # a hang becomes a gloo timeout error, never a stuck test run


class Ctx:
    def __init__(self, rank, world, group):
        self.rank, self.world, self.group = rank, world, group


def _worker(rank, world, init_file, jobs, results):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    ctx = Ctx(rank, world, dist.group.WORLD)
    while True:
        job = jobs.get()
        if job is None:
            break
        name, kw = job
        try:
            results.put((rank, "ok", CASES[name](ctx, **kw)))
        except Exception as e:  # reported, the loop goes on: the next case proves the group still works
            results.put((rank, "error", (type(e).__name__, str(e), traceback.format_exc(limit=4))))
    dist.destroy_process_group()


class Group:
    """W spawned gloo ranks; ``run(name, **job)`` → list of per-rank (status, payload)."""

    def __init__(self, world: int):
        self.world = world
        # forkserver: one fresh server process imports torch and the ops once, every rank is
        # forked from it (spawn would import torch once per rank: seconds each)
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo", "acarerank.ops", "acarerank.ato",
                                    "_vocab_parallel_workers"])
        self._dir = tempfile.TemporaryDirectory(prefix="vp_pg_")
        init_file = os.path.join(self._dir.name, "store")
        self.jobs = [ctx.Queue() for _ in range(world)]
        self.results = ctx.Queue()
        self.procs = [ctx.Process(target=_worker, args=(r, world, init_file, self.jobs[r], self.results), daemon=True)
                      for r in range(world)]
        for p in self.procs:
            p.start()

    def run(self, name, per_rank=None, timeout=COLLECTIVE_TIMEOUT_S + 30, **job):
        """Send case ``name`` to every rank (``per_rank[r]`` overrides job keys on rank r)."""
        for r in range(self.world):
            kw = dict(job)
            kw.update((per_rank or {}).get(r, {}))
            self.jobs[r].put((name, kw))
        out = [None] * self.world
        for _ in range(self.world):
            try:
                r, status, payload = self.results.get(timeout=timeout)
            except queue.Empty:
                dead = [r for r, p in enumerate(self.procs) if not p.is_alive()]
                raise TimeoutError(f"case {name!r}: no answer from every rank within {timeout} s "
                                   f"(hang; dead ranks {dead})") from None
            out[r] = (status, payload)
        return out

    def close(self):
        for q in self.jobs:
            q.put(None)
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
        self._dir.cleanup()


# ----------------------------------------------------------------------------- shards
def shard_bounds(rows_total, world, rule="megatron", sizes=None):
    """[(start, stop)] per rank: "megatron"/"ceil" = rank · ceil(rows/W) (the op's default),
    "sizes" = consecutive shards of the given sizes."""
    if rule == "sizes":
        starts = [sum(sizes[:r]) for r in range(world)]
        return [(s, s + n) for s, n in zip(starts, sizes)]
    step = -(-rows_total // world)
    return [(min(r * step, rows_total), min((r + 1) * step, rows_total)) for r in range(world)]


# ----------------------------------------------------------------------------- cases
def _topk(ctx, hidden, weight, targets, bounds, k, pass_start=False, vocab_size=None, vmap=False, **kw):
    """``vmap``: the call under torch.func.vmap over a batch of one hidden [1, T, H]."""
    from acarerank.ops import topk_logprobs

    s, e = bounds[ctx.rank]

    def call(h):
        return tuple(topk_logprobs(h, weight[s:e], targets, k=k, process_group=ctx.group,
                                   vocab_start=s if pass_start else None, vocab_size=vocab_size, **kw))
    return tuple(o[0] for o in torch.func.vmap(call)(hidden[None])) if vmap else call(hidden)


def _topk_subgroups(ctx, hidden, weight, targets, k):
    """Ranks {0, 1} and {2, 3} as two tensor-parallel groups (Megatron's TP groups are
    subgroups): group-local ranks pick the shards, the second pair works on flipped targets."""
    if not hasattr(ctx, "pairs"):
        ctx.pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates both, in order
    from acarerank.ops import topk_logprobs

    pair, local = divmod(ctx.rank, 2)
    s, e = shard_bounds(weight.shape[0], 2)[local]
    tg = targets.flip(0) if pair else targets
    return tuple(topk_logprobs(hidden, weight[s:e], tg, k=k, process_group=ctx.pairs[pair]))


def _linear(ctx, hidden, weight, targets, bounds, pass_start=False, vocab_size=None, temperature=1.0,
            return_entropy=False, chunk=None, grad_seed=0, inference_targets=False, inference=None, vmap=False):
    """Forward, then backward of Σ g·logprob (+ Σ e·entropy) with the same g, e on every rank;
    ``inference_targets``: the targets an inference tensor (sampled under torch.inference_mode());
    ``inference``: "hidden" or "weight" made there instead (without grad; the other one has it);
    ``vmap``: the forward under torch.func.vmap over a batch of one hidden [1, T, H]."""
    from acarerank.ops import linear_logprob

    if inference_targets:
        with torch.inference_mode():
            targets = targets.clone()
    s, e = bounds[ctx.rank]
    h = hidden.clone().requires_grad_(True)
    w = weight[s:e].clone().requires_grad_(True)
    if inference is not None:
        with torch.inference_mode():
            made = {"hidden": hidden.clone(), "weight": weight[s:e].clone()}[inference]
        h, w = (made, w) if inference == "hidden" else (h, made)
    def call(hh):
        return linear_logprob(hh, w, targets, temperature=temperature, return_entropy=return_entropy, chunk=chunk,
                              process_group=ctx.group, vocab_start=s if pass_start else None, vocab_size=vocab_size)
    out = torch.func.vmap(call)(h[None]) if vmap else call(h)
    if vmap:
        out = tuple(o[0] for o in out) if return_entropy else out[0]
    lp, ent = (out if return_entropy else (out, None))
    g = torch.Generator().manual_seed(grad_seed)
    loss = (torch.randn(lp.shape, generator=g, dtype=lp.dtype) * lp).sum()
    if ent is not None:
        loss = loss + (torch.randn(ent.shape, generator=g, dtype=ent.dtype) * ent).sum()
    loss.backward()
    return lp.detach(), (ent.detach() if ent is not None else None), h.grad, w.grad


def _compiled(ctx, hidden, weight, targets, bounds, k, temperatures):
    """Both ops with process_group= inside torch.compile (aot_eager; Dynamo traces as for inductor),
    in one process, a Dynamo cache reset first: the teacher's topk_logprobs, then a policy
    loss Σ g·logprob + Σ e·entropy (g, e seeded as in ``_linear``) and its backward, each at every
    temperature (a new float makes Dynamo recompile, the temperature symbolic). Returns
    {temperature: (topk result tuple, logprob, entropy, hidden.grad, shard.grad)} and, for each
    op under fullgraph=True, its error (type, message) or None."""
    from acarerank.ops import linear_logprob, topk_logprobs

    torch._dynamo.reset()  # the group's other cases must not leave compiled frames behind
    s, e = bounds[ctx.rank]
    ws = weight[s:e].clone()

    def teacher(h, w, t):
        return tuple(topk_logprobs(h, w, targets, k=k, temperature=t, process_group=ctx.group))

    def policy(h, w, t):
        return linear_logprob(h, w, targets, temperature=t, return_entropy=True, process_group=ctx.group)

    compiled_teacher, compiled_policy = (torch.compile(f, backend="aot_eager") for f in (teacher, policy))
    out = {}
    for t in temperatures:
        top = compiled_teacher(hidden, ws, t)
        h, w = hidden.clone().requires_grad_(True), ws.clone().requires_grad_(True)
        lp, ent = compiled_policy(h, w, t)
        g = torch.Generator().manual_seed(0)
        ((torch.randn(lp.shape, generator=g) * lp).sum() + (torch.randn(ent.shape, generator=g) * ent).sum()).backward()
        out[t] = (top, lp.detach(), ent.detach(), h.grad, w.grad)
    errors = {}
    for name, f in (("topk_logprobs", teacher), ("linear_logprob", policy)):
        torch._dynamo.reset()  # else the graph-broken frames cached above run without a new trace
        try:
            torch.compile(f, backend="aot_eager", fullgraph=True)(hidden, ws, temperatures[0])
            errors[name] = None
        except Exception as err:
            errors[name] = (type(err).__name__, str(err))
    return out, errors


def _double_backward(ctx, hidden, weight, targets, bounds, return_entropy=False):
    """Gradients with create_graph=True (returned), then a backward through them: its error
    (type, message) for each of the three second losses, or None where none was raised."""
    from acarerank.ops import linear_logprob

    s, e = bounds[ctx.rank]
    h = hidden.clone().requires_grad_(True)
    w = weight[s:e].clone().requires_grad_(True)
    out = linear_logprob(h, w, targets, return_entropy=return_entropy, chunk=7, process_group=ctx.group,
                         vocab_start=s)
    loss = out[0].sum() + out[1].sum() if return_entropy else out.sum()
    gh, gw = torch.autograd.grad(loss, (h, w), create_graph=True)
    errors = []
    for second in ((gh ** 2).sum() + h.sum(), gw.sum(), (gh.sum() + gw.sum()) * 0 + w.sum()):
        try:
            torch.autograd.grad(second, (h, w), allow_unused=True)
            errors.append(None)
        except RuntimeError as err:
            errors.append((type(err).__name__, str(err)))
    return gh.detach(), gw.detach(), errors


class _ShardOf(torch.autograd.Function):
    """Rows [s, e) of a weight replicated on every rank; backward all-gathers every rank's rows
    of the gradient, so each rank holds the full weight gradient: the function of the
    replicated (hidden, weight) is then the same on every rank, which gradcheck needs (it
    perturbs the same element on every rank at once)."""

    @staticmethod
    def forward(ctx, w_full, bounds, rank, group):
        ctx.bounds, ctx.shape, ctx.group = bounds, w_full.shape, group
        s, e = bounds[rank]
        return w_full[s:e].clone()

    @staticmethod
    def backward(ctx, g):
        rows = max(e - s for s, e in ctx.bounds)
        buf = torch.cat([g, g.new_zeros(rows - g.shape[0], g.shape[1])])
        out = [torch.empty_like(buf) for _ in ctx.bounds]
        dist.all_gather(out, buf, group=ctx.group)
        full = g.new_zeros(ctx.shape)
        for (s, e), part in zip(ctx.bounds, out):
            full[s:e] = part[:e - s]
        return full, None, None, None


def _gradcheck(ctx, hidden, weight, targets, bounds, vocab_size=None, temperature=1.0, return_entropy=True):
    from acarerank.ops import linear_logprob

    def f(h, w_full):
        w = _ShardOf.apply(w_full, bounds, ctx.rank, ctx.group)
        return linear_logprob(h, w, targets, temperature=temperature, return_entropy=return_entropy, chunk=3,
                              process_group=ctx.group, vocab_start=bounds[ctx.rank][0], vocab_size=vocab_size)

    h = hidden.clone().requires_grad_(True)
    w = weight.clone().requires_grad_(True)
    return torch.autograd.gradcheck(f, (h, w), eps=1e-6, atol=1e-7, rtol=1e-5)


def _bad(ctx, case, good):
    """Run the bad case (expected to raise on every rank), then a good one on the same group."""
    err = None
    try:
        CASES[case["name"]](ctx, **case["kw"])
    except Exception as e:
        err = (type(e).__name__, str(e))
    return err, CASES[good["name"]](ctx, **good["kw"])


def tiny_runner(seed, vocab=997, hidden=32, layers=1):
    """A random Qwen3Runner built without transformers (H=32, 1 layer, 4/2 heads of 8)."""
    from acarerank.model import Qwen3Runner
    from acarerank.model.arch import Qwen3Arch
    from acarerank.model.weights import LayerWeights, Qwen3Weights

    arch = Qwen3Arch(vocab_size=vocab, hidden_size=hidden, intermediate_size=64, num_layers=layers, num_heads=4,
                     num_kv_heads=2, head_dim=8, rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=False)
    g = torch.Generator().manual_seed(seed)

    def r(*shape, scale=0.2):
        return torch.randn(*shape, generator=g) * scale

    d = arch.head_dim
    layer = [LayerWeights(input_norm=1 + r(hidden, scale=0.1), w_qkv=r((4 + 2 * 2) * d, hidden), b_qkv=None,
                          q_norm=1 + r(d, scale=0.1), k_norm=1 + r(d, scale=0.1), w_o=r(hidden, 4 * d),
                          post_norm=1 + r(hidden, scale=0.1), w_gate_up=r(128, hidden), w_down=r(hidden, 64))
             for _ in range(layers)]
    w = Qwen3Weights(arch=arch, embed=r(vocab, hidden, scale=1.0), layers=layer, final_norm=1 + r(hidden, scale=0.1),
                     lm_head=r(vocab, hidden, scale=1.0))
    return Qwen3Runner(w)


def rescore_queries():
    from acarerank.ato import RescoreQuery

    return [RescoreQuery([5, 17, 900, 33], [42, 7], [[1, 2, 3, 4], [996, 0, 512]], [[], [88, 89]]),
            RescoreQuery([61, 62, 63], [9], [[100, 200], [300], [400, 401, 402]], [[77], [], [5]])]


def _rescore(ctx, bounds, vocab_size, k, outside, temperature, pad_rows):
    """rescore with both output layers sharded (padded with ``pad_rows`` random rows)."""
    from acarerank.ato import rescore
    from acarerank.ops.vocab_parallel import VocabShard

    snap, teach = tiny_runner(1), tiny_runner(2)
    heads = []
    for i, m in enumerate((snap, teach)):
        w = torch.cat([m.lm_head, torch.randn(pad_rows, m.lm_head.shape[1], generator=torch.Generator().manual_seed(i))])
        s, e = bounds[ctx.rank]
        heads.append(VocabShard(w[s:e], ctx.group))
    res = rescore(snap, teach, rescore_queries(), k=k, outside=outside, temperature=temperature,
                  snapshot_head=heads[0], teacher_head=heads[1])
    return res.logp_old, res.logp_teacher, res.teacher_in_topk, res.atd


CASES = {"topk": _topk, "topk_subgroups": _topk_subgroups, "linear": _linear, "gradcheck": _gradcheck, "bad": _bad,
         "rescore": _rescore, "double_backward": _double_backward,
         "compiled": _compiled}

__all__ = ["Group", "shard_bounds", "tiny_runner", "rescore_queries", "CASES"]
