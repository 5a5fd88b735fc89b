"""The native CPU attention kernel's direct path (csrc/cpu/attn_direct_avx512.h): row blocks of a
few rows — decode-like, one-token segments — computed straight from the K/V rows, no packed tile.

It runs where the CPU has AVX512_BF16 (fp32 and bf16 blocks of up to 16 rows by default);
ACARERANK_CPU_DIRECT_ROWS=0..16 sets one limit for both, read once per process. So
each limit runs in a fresh process: with 0 the tile path takes every block (what a CPU without
AVX-512 runs), with 16 the direct path takes every block of up to 16 rows in both dtypes. Both
are held to the suite's rules on the same cases: fp32 within 1e-5 of the fp32 oracle, bf16 within
flash-attn's rule (2x plain bf16 PyTorch's error + twice fp32's rounding step); and the switch
must change the path (outputs not bitwise equal), so a limit that is ignored fails here.
"""
import json
import os
import platform
import subprocess
import sys

import pytest
import torch

from _ext import cpu_flags, needs_native
from _repo import ROOT

pytestmark = needs_native

_AVX512_BF16 = {"avx512_bf16", "avx512f", "avx512bw", "avx512vl", "avx512dq"}

_CHILD = r"""
import json, math, sys
edges = sys.argv[1] == "edges"   # the tile-edge cases too (the split runs read only the decode batches)
sys.path[:0] = sys.argv[2:]
import torch
from acarerank.ops import prefix_shared_attention, prefix_shared_attention_paged
from test_op_cpu_attention_bf16_paths import EDGE_CASES, _rule
from test_op_cpu_attention_native import make, plain, ref32

THREADS = torch.get_num_threads()


def native_paged(*args):
    # the kernel at the process's thread count (its tasks split over the threads the suite runs
    # with); the inputs and the plain-PyTorch oracles around it on one thread: small ops on a
    # loaded 2-core machine lose most of their time to OpenMP spin-waiting
    torch.set_num_threads(THREADS)
    try:
        return prefix_shared_attention_paged(*args, backend="native")
    finally:
        torch.set_num_threads(1)


rows, fp32 = [], []
if edges:
    rows = [list(_rule(tuple(c.values))) for c in EDGE_CASES]
    for c in EDGE_CASES:
        paged, packed = make(*c.values)
        ref = ref32(packed)
        fp32.append(max((prefix_shared_attention_paged(*paged, backend="native") - ref).abs().max().item(),
                        (prefix_shared_attention(*packed, backend="native") - ref).abs().max().item()))
torch.set_num_threads(1)
# a decode-like batch: 6 groups of one one-token segment (2 query rows per kv head)
decode = {}
for dtype in (torch.float32, torch.bfloat16):
    paged, _ = make([1] * 6, [300, 17, 1, 64, 129, 2], list(range(6)), 16, 8, 128, 16, dtype=dtype, seed=5)
    decode[str(dtype)] = native_paged(*paged).float().flatten().tolist()


def strided(x):  # x's values in a view whose kv heads lie 2·d apart (NaN rows between them)
    wide = torch.stack([x, torch.full_like(x, float("nan"))], -2)      # [..., Hkv, 2, d]
    return wide.select(-2, 0)


# decode-like batches against the fp32 oracle: tasks of several kv heads (ranges that do not divide
# Hkv), 2-token segments, an empty prefix and an empty segment, one kv head, d 72 (masked tails),
# and K/V (inputs and pages) whose heads are not d apart, K's stride not V's
DECODE = [
    ("0.6b-heads-6-groups", [1] * 6, [300, 17, 1, 64, 129, 2], list(range(6)), 16, 8, 128),
    ("4b-heads-3-groups-empty-prefix", [1, 1, 1], [40, 0, 95], [0, 1, 2], 32, 8, 128),
    ("two-token-and-empty-segments", [2, 1, 0, 2, 1, 2], [70, 3, 31], [0, 0, 1, 1, 2, 2], 16, 8, 128),
    ("one-kv-head-16-groups", [1] * 16, [33 + 7 * i for i in range(16)], list(range(16)), 4, 1, 64),
    ("d72-9-groups", [1] * 9, [5 * i + 1 for i in range(9)], list(range(9)), 6, 3, 72),
    # long prefixes: one group (a setwise decode step over its whole prompt), lengths at and either
    # side of powers of two, two-token segments, d 64 with r 4
    ("long-prefix-one-group", [1], [2100], [0], 16, 8, 128),
    ("long-prefixes-at-edges", [1, 2, 1, 1], [512, 513, 1024, 1537], [0, 1, 2, 3], 32, 8, 128),
    ("long-prefix-d64-two-tokens", [2], [1300], [0], 8, 2, 64),
    # K/V rows are fetched one 64-key step ahead: prefixes either side of the step edges and of one
    # page, prime lengths, GQA 1 / 2 / 4 / 8 at d 64 and 128 (the next step's rows exist only up to
    # the prefix's end)
    ("gqa1-d64-step-edges", [1] * 7, [16, 63, 64, 65, 127, 128, 129], list(range(7)), 8, 8, 64),
    ("gqa2-d64-primes", [1] * 4, [61, 191, 67, 1021], list(range(4)), 4, 2, 64),
    ("gqa4-d128-primes", [1] * 5, [16, 61, 131, 257, 1031], list(range(5)), 32, 8, 128),
    ("gqa8-d64-one-page-and-long", [1, 1, 2], [16, 1, 1601], [0, 1, 2], 64, 8, 64),
]
decode_rule = []
for name, *case in DECODE:
    for dtype in (torch.float32, torch.bfloat16):
        paged, packed = make(*case, 16, dtype=dtype, seed=11)
        q, k, v, cu, kc, vc, bt, pl, sg = paged
        ref = ref32(packed)
        bound = 1e-5
        if dtype == torch.bfloat16:
            bound = (2 * (plain(packed, 1.0 / math.sqrt(q.shape[2])).float() - ref).abs().max().item()
                     + 2 * (ref + 0.3 - 0.3 - ref).abs().max().item())
        for layout, args in (("contiguous", paged),
                             ("strided", (q, strided(k), v, cu, kc, strided(vc), bt, pl, sg))):
            out = native_paged(*args)
            err = (out.float() - ref).abs().nan_to_num(float("inf")).max().item()
            decode_rule.append([f"{name} {dtype} {layout}", err, bound])
print(json.dumps({"rows": rows, "fp32": fp32, "decode": decode, "decode_rule": decode_rule}))
"""




def _start(limit: str, chunk: str | None = None) -> subprocess.Popen:
    env = dict(os.environ, ACARERANK_CPU_DIRECT_ROWS=limit)
    if chunk is not None:
        env["ACARERANK_CPU_DIRECT_CHUNK"] = chunk
    for name in ("ACARERANK_CPU_BASELINE", "ACARERANK_CPU_BF16_PATH") + (() if chunk else ("ACARERANK_CPU_DIRECT_CHUNK",)):
        env.pop(name, None)
    tests = os.path.join(ROOT, "tests")
    part = "decode" if chunk is not None else "edges"
    return subprocess.Popen([sys.executable, "-c", _CHILD, part, tests, os.path.join(tests, "ops")], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _outputs(children: dict, variable: str) -> dict:
    """{setting: the child's JSON} of children started side by side (each is mostly its imports and
    its one-thread oracles: one core's work), read in turn; the rest killed if one failed."""
    out = {}
    try:
        for value, proc in children.items():
            stdout, stderr = proc.communicate(timeout=600)
            assert proc.returncode == 0, f"{variable}={value}: " + stderr[-3000:]
            out[value] = json.loads(stdout.strip().splitlines()[-1])
    finally:
        for proc in children.values():
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    return out


@pytest.fixture(scope="module")
def runs():
    """{limit: the child's JSON} for the tile path (0) and the direct path (16): one after the other,
    as their tile-edge cases run the oracles at the process's thread count (side by side, two
    children of 2 threads on 2 cores took longer than in turn)."""
    return {limit: _outputs({limit: _start(limit)}, "ACARERANK_CPU_DIRECT_ROWS")[limit] for limit in ("0", "16")}


@pytest.mark.parametrize("limit", ["0", "16"])
def test_both_paths_within_the_rules(runs, limit):
    got = runs[limit]
    for case, (name, err, bound) in enumerate(got["rows"]):
        assert err <= bound, f"ACARERANK_CPU_DIRECT_ROWS={limit} case {case} {name}: bf16 error {err:.3e} > {bound:.3e}"
    worst = max(got["fp32"])
    case = got["fp32"].index(worst)
    assert worst <= 1e-5, f"ACARERANK_CPU_DIRECT_ROWS={limit}: fp32 error {worst:.3e} > 1e-5 (case {case})"


@pytest.mark.parametrize("limit", ["0", "16"])
def test_decode_batches_within_the_rules(runs, limit):
    """Decode-like batches (one or two tokens per group, many groups: the direct path's tasks of
    several kv heads), K/V contiguous and with heads 2·d apart, against the fp32 oracle: fp32
    within 1e-5, bf16 within flash-attn's rule."""
    bad = [f"{name}: {err:.3e} > {bound:.3e}" for name, err, bound in runs[limit]["decode_rule"] if not err <= bound]
    assert not bad, f"ACARERANK_CPU_DIRECT_ROWS={limit}: " + "; ".join(bad)


def test_the_limit_switches_the_path(runs):
    """Where the direct path can run (AVX512_BF16), a decode batch's outputs differ in their last
    bits between the two limits (fp32: another exp; bf16: P not rounded to bf16) — the variable
    is read and obeyed. Without AVX512_BF16 both limits take the tile path: the outputs are equal."""
    for dtype in ("torch.float32", "torch.bfloat16"):
        a, b = torch.tensor(runs["0"]["decode"][dtype]), torch.tensor(runs["16"]["decode"][dtype])
        if _AVX512_BF16 <= cpu_flags():
            assert not torch.equal(a, b), f"{dtype}: ACARERANK_CPU_DIRECT_ROWS=0 and 16 gave the same bits"
            assert (a - b).abs().max().item() <= (1e-5 if dtype == "torch.float32" else 2e-2)
        else:
            assert torch.equal(a, b), f"{dtype}: the direct path ran on a CPU without AVX512_BF16"


def test_random_decode_like_batches_within_the_rules():
    """40 seeded random decode-like calls — 1-20 groups of 0-3-token segments (one or two per
    group) over prefixes of 0-600 keys, Hkv 1-8, r 1-8, d 32-128, pages of 16-64 tokens — fp32
    and bf16, paged and packed, at this process's default limit (the direct path where the CPU has
    AVX512_BF16, else the tiles): fp32 within 1e-5 of the fp32 oracle, bf16 within flash-attn's
    rule. Shapes no hand-written case picked (a 600-case run of the same draw found nothing)."""
    import math
    import random

    from test_op_cpu_attention_native import make, plain, ref32

    from acarerank.ops import prefix_shared_attention, prefix_shared_attention_paged

    rng = random.Random(26)
    bad = []
    for case in range(40):
        Hkv, r, d = rng.choice([1, 2, 4, 8]), rng.choice([1, 2, 3, 4, 8]), rng.choice([32, 64, 72, 96, 128])
        G = rng.randint(1, 20)
        P = [rng.choice([0, 1, 15, 16, 17, rng.randint(0, 600)]) for _ in range(G)]
        segs, groups = [], []
        for g in range(G):
            for _ in range(rng.choice([1, 1, 1, 2])):
                segs.append(rng.choice([0, 1, 1, 1, 2, 3]))
                groups.append(g)
        segs[0] = max(segs[0], 1)
        block = rng.choice([16, 32, 64])
        for dtype in (torch.float32, torch.bfloat16):
            paged, packed = make(segs, P, groups, Hkv * r, Hkv, d, block, dtype=dtype, seed=case)
            ref = ref32(packed)
            bound = 1e-5 if dtype == torch.float32 else (
                2 * (plain(packed, 1.0 / math.sqrt(d)).float() - ref).abs().max().item()
                + 2 * (ref + 0.3 - 0.3 - ref).abs().max().item())
            for name, out in (("paged", prefix_shared_attention_paged(*paged, backend="native")),
                              ("packed", prefix_shared_attention(*packed, backend="native"))):
                err = (out.float() - ref).abs().nan_to_num(float("inf")).max().item()
                if not err <= bound:
                    bad.append(f"case {case} {dtype} {name} (Hkv {Hkv}, r {r}, d {d}, prefixes {P}, segments {segs} "
                               f"of groups {groups}, pages of {block}): {err:.3e} > {bound:.3e}")
    assert not bad, "; ".join(bad[:5])


def test_fp32_weights_to_fp32_precision():
    """fp32 decode-like rows: each softmax weight to about fp32's precision on whichever path this
    CPU takes (the direct one where it has AVX512_BF16). Exact scores (q, k of entries -1, 0, 1,
    mostly 0, d 64: small integer dot products; scale 1/8) leave only the exponent's rounding and
    the exp; a V of one-hot rows reads each weight out. With exp2_avx512's degree-5 polynomial
    (3.3e-6) on the direct path the worst weight here was 9.7e-7 off; 9.4e-8 with the degree-7 one
    (7.1e-9), the exponent's roundings the rest."""
    from acarerank.ops import prefix_shared_attention

    g = torch.Generator().manual_seed(5)
    P, Hkv, r, d = 60, 2, 2, 64

    def sparse_signs(*shape):
        return (torch.randint(-1, 2, shape, generator=g) * (torch.rand(shape, generator=g) < 0.15)).float()

    q, k, pk = sparse_signs(1, Hkv * r, d), sparse_signs(1, Hkv, d), sparse_signs(P, Hkv, d)
    eye = torch.eye(d)[:P + 1]                       # key j's value: e_j, so out[..., j] is its weight
    pv, v = eye[:P, None].expand(P, Hkv, d).contiguous(), eye[P:, None].expand(1, Hkv, d).contiguous()
    i32 = lambda xs: torch.tensor(xs, dtype=torch.int32)  # noqa: E731
    args = (q, k, v, i32([0, 1]), pk, pv, i32([0, P]), i32([0]))
    out = prefix_shared_attention(*args, softmax_scale=0.125)[..., :P + 1].double()
    keys = torch.cat([pk, k]).double().repeat_interleave(r, 1)       # [P + 1, Hq, d]
    want = torch.softmax(torch.einsum("hd,khd->hk", q[0].double(), keys) * 0.125, -1)
    rel = ((out[0] - want) / want).abs().max().item()
    assert rel <= 3e-7, f"a weight {rel:.2e} off relative to fp64 (exact scores)"


_BAD_ROWS = ["17", "-1", "two", "1.5"]
_BAD_CHUNKS = ["-1", "two", "1.5"]


@pytest.mark.parametrize("value", _BAD_ROWS)
def test_a_bad_limit_is_an_error_naming_the_variable(refusals, value):
    """Read (and checked) on every x86-64 CPU at the first fp32/bf16 call, whether or not it can
    take the direct path: a setting that is wrong here is wrong on the next machine too."""
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("the direct path and its limit exist on x86-64 only")
    _assert_one_call_refuses(refusals, "ACARERANK_CPU_DIRECT_ROWS", value, "must be an integer in [0, 16]")


_ONE_CALL = ("import torch\nfrom acarerank.ops import prefix_shared_attention\n"
             "q = torch.randn(1, 2, 8); k = torch.randn(1, 1, 8)\n"
             "try:\n    prefix_shared_attention(q, k, k, torch.tensor([0, 1], dtype=torch.int32), k, k,"
             " torch.tensor([0, 1], dtype=torch.int32), torch.tensor([0], dtype=torch.int32), backend='native')\n"
             "except RuntimeError as e:\n    print('ERR', e)")


# The children of the bad settings, forked from one process that has imported torch (torch._dynamo
# too: importing acarerank.ops pulls it in, ~1 s) and nothing of acarerank, having run no op: those
# imports were ~2.2 s of each child's 2.6 s, and seven children side by side took 11 s on CI's 2
# cores. Each fork sets its variable before it imports the package and makes its one call, so the
# setting is read as in a process of its own; argv: [[variable, value, stdout path, stderr path], ...]
_FORK_EACH = r"""
import json, os, sys, traceback
import torch, torch._dynamo
children = []
for variable, value, out, err in json.loads(sys.argv[1]):
    sys.stdout.flush(); sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.environ[variable] = value
            os.dup2(os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), 1)
            os.dup2(os.open(err, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), 2)
            exec(compile(sys.argv[2], "<one call>", "exec"), {"__name__": "__main__"})
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush(); sys.stderr.flush()
            os._exit(code)
    children.append(pid)
for pid in children:
    os.waitpid(pid, 0)
"""


@pytest.fixture(scope="module")
def refusals(tmp_path_factory):
    """``get(variable, value)``: (stdout, stderr) of one tiny native attention call in a child
    process with ``variable=value`` set (the settings are read once per process). The first get
    makes the children of every bad setting below at once, forked from one that has imported
    torch (``_FORK_EACH``): what is left of each is the package's import and the call."""
    folder = tmp_path_factory.mktemp("refusals")
    cases = [(var, val, str(folder / f"{i}.out"), str(folder / f"{i}.err"))
             for i, (var, val) in enumerate([("ACARERANK_CPU_DIRECT_ROWS", v) for v in _BAD_ROWS]
                                            + [("ACARERANK_CPU_DIRECT_CHUNK", v) for v in _BAD_CHUNKS])]
    done = {}

    def get(variable, value):
        if not done:
            p = subprocess.run([sys.executable, "-c", _FORK_EACH, json.dumps(cases), _ONE_CALL], capture_output=True,
                               text=True, timeout=300)
            assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
            for var, val, out, err in cases:
                with open(out) as o, open(err) as e:
                    done[var, val] = (o.read(), e.read())
        return done[variable, value]

    return get


def _assert_one_call_refuses(refusals, variable: str, value: str, says: str) -> None:
    """One tiny native attention call in a child process with ``variable=value`` set: the kernel
    refuses it with a RuntimeError naming the variable, ``says`` and the value."""
    stdout, stderr = refusals(variable, value)
    want = f"ERR {variable} {says}"
    assert want in stdout and f"'{value}'" in stdout, stdout + stderr[-2000:]


def _long_prefix_batch(dtype, seed=3):
    """A decode batch of long prefixes (one- and two-token segments) and a prefill group."""
    from test_op_cpu_attention_native import make

    return make([1, 2, 1, 40], [1500, 1030, 600, 700], [0, 1, 2, 3], 16, 8, 128, 16, dtype=dtype, seed=seed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_output_bits_do_not_depend_on_the_thread_count(dtype):
    """The kernel deals its tasks to however many threads run it (and groups kv heads into direct
    tasks by the thread count), but no choice that changes the order of a sum may depend on it: the
    same call gives the same bits on 1, 2 and 3 threads, so a score does not depend on the machine's
    core count (a split of the keys by thread count would fail here)."""
    from acarerank.ops import prefix_shared_attention_paged

    paged, _ = _long_prefix_batch(dtype)
    before = torch.get_num_threads()
    outs = {}
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            outs[n] = prefix_shared_attention_paged(*paged, backend="native")
    finally:
        torch.set_num_threads(before)
    for n in (2, 3):
        diff = (outs[n].float() - outs[1].float()).abs().max().item()
        assert torch.equal(outs[n], outs[1]), f"{dtype}: {n} threads differ from 1 by up to {diff:.3e}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nan_in_a_long_prefix_group_reaches_only_its_rows(dtype):
    """A NaN in one row's q, and a NaN in one prefix value 700 keys in: exactly the rows that read
    them come out NaN (the q row wholly; the value only in its dim, for the query heads of its kv
    head), every other row matches the NaN-free oracle."""
    from test_op_cpu_attention_native import ref32

    from acarerank.ops import prefix_shared_attention_paged

    paged, packed = _long_prefix_batch(dtype)
    ref = ref32(packed)
    q, k, v, cu, kc, vc, bt, pl, sg = paged
    q[0, 3, 5] = float("nan")                                  # group 0's token, query head 3
    blk, slot = int(bt[1, 700 // 16]), 700 % 16                # group 1's prefix key 700
    vc[blk, slot, 6, 9] = float("nan")                         # kv head 6 = query heads 12, 13 (r 2)
    out = prefix_shared_attention_paged(*paged, backend="native").float()
    want = torch.zeros(out.shape, dtype=torch.bool)
    want[0, 3, :] = True
    want[1:3, 12:14, 9] = True                                 # both tokens of group 1's segment
    got = torch.isnan(out)
    assert torch.equal(got, want), f"{dtype}: NaN at {torch.nonzero(got != want)[:6].tolist()} differs"
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    err = (out[~want] - ref[~want]).abs().max().item()
    assert err <= tol, f"{dtype}: rows without a NaN off by {err:.3e} > {tol}"


@pytest.fixture(scope="module")
def split_runs():
    """{chunk: the child's JSON} on the direct path with ACARERANK_CPU_DIRECT_CHUNK = 0 (one chunk
    per group: unsplit), 7 (prefixes of 8+ keys split into chunks of 7 or fewer: chunk edges off
    the 64-key steps and the pages) and 100 (chunks of whole 64-key steps, the last one shorter)."""
    return _outputs({chunk: _start("16", chunk) for chunk in ("0", "7", "100")}, "ACARERANK_CPU_DIRECT_CHUNK")


@pytest.mark.parametrize("chunk", ["0", "7", "100"])
def test_split_prefixes_within_the_rules(split_runs, chunk):
    """Every decode batch (1-2,100-key prefixes, a 1-key one, GQA 1/2/4/8, d 64/72/128, page edges)
    with its prefixes split into chunks merged after (flash-decoding's split-K) against the fp32
    oracle: fp32 within 1e-5, bf16 within flash-attn's rule."""
    bad = [f"{name}: {err:.3e} > {bound:.3e}" for name, err, bound in split_runs[chunk]["decode_rule"]
           if not err <= bound]
    assert not bad, f"ACARERANK_CPU_DIRECT_CHUNK={chunk}: " + "; ".join(bad)


def test_a_split_changes_the_order_only(split_runs):
    """Split (7 keys a chunk) and unsplit outputs of the same decode batch are within the direct
    path's rounding of each other (fp32 1e-5, bf16 2e-2), and not bitwise equal where the direct
    path runs: the variable is read and the chunks merged."""
    for dtype, tol in (("torch.float32", 1e-5), ("torch.bfloat16", 2e-2)):
        a, b = torch.tensor(split_runs["0"]["decode"][dtype]), torch.tensor(split_runs["7"]["decode"][dtype])
        assert (a - b).abs().max().item() <= tol, f"{dtype}: split differs from unsplit by more than {tol}"
        if _AVX512_BF16 <= cpu_flags():
            assert not torch.equal(a, b), f"{dtype}: ACARERANK_CPU_DIRECT_CHUNK=7 gave the unsplit bits"


@pytest.mark.parametrize("value", _BAD_CHUNKS)
def test_a_bad_chunk_is_an_error_naming_the_variable(refusals, value):
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("the direct path and its chunks exist on x86-64 only")
    _assert_one_call_refuses(refusals, "ACARERANK_CPU_DIRECT_CHUNK", value, "must be an integer >= 0")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_chunk_of_only_minus_inf_scores_adds_nothing(dtype):
    """One group over 2,100 keys (three chunks at the default 1,024: 704 + 704 + 692) whose middle
    chunk's keys all score −inf for every row: that chunk's weight is 0 in the merge — the output
    is the tile path's over the same keys (which gives them weight 0 too), finite, no NaN from
    exp(−inf − m)."""
    from test_op_cpu_attention_native import make

    from acarerank.ops import prefix_shared_attention_paged

    paged, _ = make([1], [2100], [0], 16, 8, 128, 16, dtype=dtype, seed=4)
    q, k, v, cu, kc, vc, bt, pl, sg = paged
    q[..., 0] = q[..., 0].abs() + 0.5                         # every row's q[0] > 0 ...
    for key in range(704, 1408):                              # ... and k[0] = −inf: score −inf
        kc[int(bt[0, key // 16]), key % 16, :, 0] = float("-inf")
    out = prefix_shared_attention_paged(*paged, backend="native").float()
    tiles = prefix_shared_attention_paged(*paged, backend="native", tiles_only=True).float()
    assert not torch.isnan(out).any(), f"{dtype}: NaN in {torch.isnan(out).sum().item()} outputs"
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    err = (out - tiles).abs().max().item()
    assert err <= tol, f"{dtype}: off the tile path's output by {err:.3e} > {tol}"
