"""Triton kernels called from several threads while Triton interprets them (CPU tensors,
TRITON_INTERPRET=1): Triton's interpreter keeps the running program's grid position in module
state, so concurrent launches raised its InterpreterError ("x >= grid_dim[0]", "'tensor' object
cannot be interpreted as an integer"); interpreted launches now hold one lock
(``acarerank._triton_env.interpreter_lock``, docs/api.md "Threads"). Each thread's result equals
the op's plain-PyTorch reference."""
import threading

import pytest
import torch

from acarerank.ops import prefix_shared_attention, topk_logprobs, yes_no_score
from acarerank.ops.attention import prefix_shared_attention_ref
from acarerank.ops.topk_logprobs import topk_logprobs_ref
from acarerank.ops.yes_no import yes_no_score_ref
from acarerank.ops import triton_interpreted

pytestmark = pytest.mark.skipif(not triton_interpreted(), reason="needs the Triton interpreter (TRITON_INTERPRET=1)")


def _cases():
    g = torch.Generator().manual_seed(0)
    T, Hq, Hkv, d = 24, 4, 2, 16
    q, k, v = (torch.randn(T, h, d, generator=g) for h in (Hq, Hkv, Hkv))
    pk, pv = torch.randn(20, Hkv, d, generator=g), torch.randn(20, Hkv, d, generator=g)
    meta = (torch.tensor([0, 7, 15, 24], dtype=torch.int32), torch.tensor([0, 12, 20], dtype=torch.int32),
            torch.tensor([0, 1, 1], dtype=torch.int32))
    h, nw = torch.randn(40, 32, generator=g), torch.rand(32, generator=g) + 0.5
    wy, wn = torch.randn(32, generator=g), torch.randn(32, generator=g)
    hid, w, tgt = torch.randn(6, 32, generator=g), torch.randn(300, 32, generator=g), torch.randint(0, 300, (6,))
    return {
        "attention": (lambda b: prefix_shared_attention(q, k, v, *meta[:1], pk, pv, *meta[1:], backend=b),
                      lambda: prefix_shared_attention_ref(q, k, v, *meta[:1], pk, pv, *meta[1:]), 2e-5),
        "yes_no": (lambda b: yes_no_score(h, nw, wy, wn, eps=1e-6, backend=b)[0],
                   lambda: yes_no_score_ref(h, nw, wy, wn, eps=1e-6)[0], 1e-6),
        "topk": (lambda b: topk_logprobs(hid, w, tgt, k=8, backend=b).topk_logprobs,
                 lambda: topk_logprobs_ref(hid, w, tgt, k=8).topk_logprobs, 1e-5),
    }


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the interpreter's numpy NaN
def test_interpreted_kernels_from_several_threads_match_the_reference():
    cases = _cases()
    want = {name: ref() for name, (_, ref, _) in cases.items()}
    errors, wrong, barrier = [], [], threading.Barrier(4)

    def work(i):
        barrier.wait()
        for name in list(cases)[i % 3:] + list(cases)[:i % 3]:
            op, _, tol = cases[name]
            try:
                got = op("triton")
            except Exception as e:  # reported below with the op's name, not lost in the thread
                errors.append(f"{name}: {type(e).__name__}: {e}"[:200])
                continue
            if not torch.allclose(got, want[name], rtol=0, atol=tol):
                wrong.append((name, (got - want[name]).abs().max().item()))

    threads = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a thread did not finish in 120 s (deadlock)"
    assert errors == [] and wrong == [], (errors, wrong)
