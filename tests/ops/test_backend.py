"""Backend rules (acarerank/ops/_backend.py): explicit backend= > ACARERANK_BACKEND (a preference)
> device default; a preference maps per op; never a silent fallback from an explicit request."""
import sys

import pytest
import torch

import acarerank.ops as ops
from acarerank.ops import BackendError, backend_for, per_op_backends, prefix_shared_attention, yes_no_score
from acarerank.ops._backend import ENV_VAR, OpDecl, op_decl
from _ext import NATIVE_MISSING

# the attention ops' CPU default: the native kernel where acarerank._cpu is built, else torch
ATTN_CPU = "torch" if NATIVE_MISSING else "native"

# triton runs on CUDA tensors, or on CPU tensors under TRITON_INTERPRET=1 (conftest.py sets it without a GPU)
TRITON_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _attn_inputs(device="cpu"):
    q, k, v = torch.randn(5, 2, 16), torch.randn(5, 1, 16), torch.randn(5, 1, 16)
    pk, pv = torch.randn(3, 1, 16), torch.randn(3, 1, 16)
    return tuple(t.to(device) for t in (q, k, v, torch.tensor([0, 2, 5], dtype=torch.int32), pk, pv,
                                        torch.tensor([0, 3], dtype=torch.int32), torch.tensor([0, 0], dtype=torch.int32)))


def _head_inputs(device="cpu"):
    return tuple(t.to(device) for t in (torch.randn(3, 32), torch.rand(32) + 0.5, torch.randn(32), torch.randn(32)))


@pytest.fixture
def ran(monkeypatch):
    """Record (op, backend) of every implementation that runs."""
    log = []
    real = OpDecl.impl

    def impl(self, name):
        fn = real(self, name)

        def recorded(*args, **kw):
            log.append((self.name, name))
            return fn(*args, **kw)
        return recorded
    monkeypatch.setattr(OpDecl, "impl", impl)
    monkeypatch.delenv(ENV_VAR, raising=False)
    return log


def test_cpu_defaults(ran):
    prefix_shared_attention(*_attn_inputs())
    yes_no_score(*_head_inputs())
    assert ran == [("prefix_shared_attention", ATTN_CPU), ("yes_no_score", "torch")]


def test_declared_device_defaults():
    assert op_decl("attention").defaults["cuda"][0] == "triton"
    assert op_decl("yes_no").defaults["cuda"][0] == "triton"
    assert op_decl("topk").defaults["cuda"][0] == "cuda"  # cuBLAS GEMM + CUDA merge until measured
    assert op_decl("yes_no").defaults["cpu"][0] in ("torch", "cpp")
    # topk: its bf16 chunk GEMM in acarerank._cpu where built (csrc/cpu/logits_gemm.cpp), torch where not
    assert op_decl("topk").defaults["cpu"] == ("native", "torch")
    # attention: the native kernel first, torch where acarerank._cpu does not load
    assert op_decl("attention").defaults["cpu"] == op_decl("paged_attention").defaults["cpu"] == ("native", "torch")


def test_available_backends_lists_what_runs_here():
    assert ops.available_backends("attention", "cpu")[0] == ATTN_CPU
    assert "triton" in ops.available_backends("yes_no_score", TRITON_DEVICE)
    assert "flash_attn_cascade" not in ops.available_backends("attention", "cpu")
    assert "cuda" not in ops.available_backends("yes_no", "cpu")
    with pytest.raises(BackendError, match="unknown op 'softmax'"):
        ops.available_backends("softmax", "cpu")


def test_environment_preference_overrides_device_default(ran, monkeypatch):
    monkeypatch.setenv(ENV_VAR, "triton")
    args = _attn_inputs(TRITON_DEVICE)
    out = prefix_shared_attention(*args)
    yes_no_score(*_head_inputs(TRITON_DEVICE))
    ref = ops.prefix_shared_attention_ref(*args)
    assert ran == [("prefix_shared_attention", "triton"), ("yes_no_score", "triton")]
    assert (out - ref).abs().max() <= 1e-5


def test_environment_name_applies_only_to_ops_that_have_it(ran, monkeypatch):
    """ACARERANK_BACKEND=cpp: the head runs its C++ twin, attention (no cpp backend) its default."""
    pytest.importorskip("acarerank._C")
    monkeypatch.setenv(ENV_VAR, "cpp")
    prefix_shared_attention(*_attn_inputs())
    yes_no_score(*_head_inputs())
    assert ran == [("prefix_shared_attention", ATTN_CPU), ("yes_no_score", "cpp")]


def test_environment_mapping(ran, monkeypatch):
    monkeypatch.setenv(ENV_VAR, "attention=triton, yes_no=torch")
    prefix_shared_attention(*_attn_inputs(TRITON_DEVICE))
    yes_no_score(*_head_inputs(TRITON_DEVICE))
    assert ran == [("prefix_shared_attention", "triton"), ("yes_no_score", "torch")]
    monkeypatch.setenv(ENV_VAR, "attention")
    with pytest.raises(BackendError, match="unknown backend 'attention'"):
        yes_no_score(*_head_inputs())


def test_explicit_argument_overrides_environment(ran, monkeypatch):
    monkeypatch.setenv(ENV_VAR, "triton")
    prefix_shared_attention(*_attn_inputs(), backend="torch")
    yes_no_score(*_head_inputs(), backend={"yes_no": "torch"})
    assert ran == [("prefix_shared_attention", "torch"), ("yes_no_score", "torch")]


def test_a_preference_given_to_a_reranker_is_the_whole_choice(monkeypatch):
    """A name or mapping given to a reranker leaves the ops it does not cover on their device
    default, never on ACARERANK_BACKEND's choice (backend_choice): ACARERANK_BACKEND=torch put
    ``backend="native"``'s linear layers on F.linear, and a junk value refused a --backend native run."""
    from acarerank import PointwiseReranker
    from acarerank.ops import backend_choice
    from acarerank.ops.linear import resolve_linear_backend
    from _tiny import random_qwen3

    assert backend_choice("yes_no", None) is None and backend_choice("yes_no", "cpp") == "cpp"
    assert backend_choice("yes_no", "native") == {} and backend_choice("yes_no", {"attention": "torch"}) == {}
    default_linear = resolve_linear_backend(None, "cpu", torch.float32)[0]
    model = random_qwen3(layers=1)
    for env in ("torch", "bogus"):
        monkeypatch.setenv(ENV_VAR, env)
        for pref in ("torch", {"attention": "torch"}) + (() if NATIVE_MISSING else ("native",)):
            runner = PointwiseReranker(model=model, backend=pref).runner
            want_linear = "torch" if pref == "torch" else default_linear
            assert runner.linear_backend == want_linear, (env, pref, runner.linear_backend)
            want_layer = "torch" if pref == "torch" or NATIVE_MISSING else "native"
            assert set(runner._layer_backends.values()) == {want_layer}, (env, pref, runner._layer_backends)
            assert runner._attention_backend() == ("torch" if pref != "native" else "native"), (env, pref)
    # with no preference given the environment's is the runner's, its attention entry included (it
    # reached the packed op's name only: the runner's paged attention stayed on its default)
    monkeypatch.setenv(ENV_VAR, "attention=torch")
    assert PointwiseReranker(model=model).runner._attention_backend() == "torch"
    # the bench's probe of a --backends entry reads no environment either (it dropped "native")
    from acarerank.benchmark.harness import backend_runs
    monkeypatch.setenv(ENV_VAR, "cuda")
    assert backend_runs("torch", torch.device("cpu"), torch.float32) is None


def test_unknown_backend_argument_is_an_error(ran):
    with pytest.raises(BackendError, match=r"unknown backend 'tritn'.*backend="):
        prefix_shared_attention(*_attn_inputs(), backend="tritn")
    with pytest.raises(BackendError, match="unknown backend 'numpy'"):
        yes_no_score(*_head_inputs(), backend="numpy")
    assert ran == []


def test_unknown_backend_in_environment_is_an_error(ran, monkeypatch):
    monkeypatch.setenv(ENV_VAR, "fast")
    with pytest.raises(BackendError, match=f"unknown backend 'fast'.*{ENV_VAR}"):
        prefix_shared_attention(*_attn_inputs())
    assert ran == []


def test_backend_the_op_lacks_is_an_error(ran):
    with pytest.raises(BackendError, match="prefix_shared_attention has no 'cpp' backend"):
        prefix_shared_attention(*_attn_inputs(), backend="cpp")
    with pytest.raises(BackendError, match="yes_no_score has no 'flash_attn_cascade' backend"):
        yes_no_score(*_head_inputs(), backend="flash_attn_cascade")
    with pytest.raises(BackendError, match="prefix_shared_attention has no 'cuda' backend"):
        yes_no_score(*_head_inputs(), backend={"attention": "cuda"})


def test_preference_maps_per_op():
    pytest.importorskip("acarerank._C")
    assert backend_for("yes_no", "cpp") == "cpp" and backend_for("attention", "cpp") is None
    assert backend_for("attention", "flash_attn_cascade") == "flash_attn_cascade"
    assert backend_for("yes_no", "flash_attn_cascade") is None
    m = {"attention": "triton", "yes_no": "cuda"}
    assert backend_for("prefix_shared_attention", m) == "triton" and backend_for("yes_no_score", m) == "cuda"
    assert backend_for("topk_logprobs", m) is None and backend_for("attention", None) is None
    assert per_op_backends("cpp")["topk_logprobs"] == "cpp"
    with pytest.raises(BackendError, match="unknown op 'mlp'"):
        per_op_backends({"mlp": "triton"})
    with pytest.raises(BackendError, match="unknown backend 'fast'"):
        per_op_backends("fast")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks CPU tensors refusing GPU-only backends")
def test_backend_that_cannot_run_here_is_an_error(ran, monkeypatch):
    with pytest.raises(BackendError, match="flash_attn_cascade"):
        prefix_shared_attention(*_attn_inputs(), backend="flash_attn_cascade")
    with pytest.raises(BackendError, match="needs CUDA tensors"):
        yes_no_score(*_head_inputs(), backend="cuda")
    monkeypatch.setenv(ENV_VAR, "cuda")  # a preference the head has: explicit, so still an error
    with pytest.raises(BackendError, match=f"needs CUDA tensors.*{ENV_VAR}"):
        yes_no_score(*_head_inputs())
    assert ran == []


def test_triton_on_cpu_without_interpreter_is_an_error(ran, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(BackendError, match="TRITON_INTERPRET=1"):
        prefix_shared_attention(*_attn_inputs(), backend="triton")
    with pytest.raises(BackendError, match="TRITON_INTERPRET=1"):
        yes_no_score(*_head_inputs(), backend="triton")
    assert ran == []


def test_unimportable_triton_is_an_error_not_a_fallback(ran, monkeypatch):
    # a None entry in sys.modules makes the import raise ImportError, as a missing package would
    monkeypatch.setitem(sys.modules, "acarerank.kernels.prefix_shared_attention", None)
    monkeypatch.setitem(sys.modules, "acarerank.kernels.yes_no_head", None)
    for decl in (op_decl("attention"), op_decl("yes_no")):
        monkeypatch.setattr(decl, "_loaded", {})  # forget the cached import
    with pytest.raises(BackendError, match="triton backend unavailable"):
        prefix_shared_attention(*_attn_inputs(), backend="triton")
    with pytest.raises(BackendError, match="triton backend unavailable"):
        yes_no_score(*_head_inputs(), backend="triton")
    assert ran == []


def test_one_triton_interpreted_check():
    """The kernels and the ops ask acarerank._triton_env, nothing else reads TRITON_INTERPRET."""
    import pathlib
    from _repo import ROOT as root
    readers = [p.relative_to(root).as_posix() for d in ("acarerank",) for p in (root / d).rglob("*.py")
               if "TRITON_INTERPRET\"" in p.read_text() or "InterpretedFunction" in p.read_text()]
    assert readers == ["acarerank/_triton_env.py"], readers


def test_parse_preference_as_the_cli_and_environment_read_it():
    from acarerank.ops import parse_preference
    assert parse_preference("attention=triton, yes_no=cuda") == {"attention": "triton", "yes_no": "cuda"}
    assert parse_preference("cpp") == "cpp" and parse_preference("") is None and parse_preference(None) is None
    with pytest.raises(BackendError, match="expected a backend name or 'op=backend"):
        parse_preference("=triton", "--backend")
    with pytest.raises(BackendError, match=r"unknown backend 'fast' \(from --backend\)"):
        parse_preference("fast", "--backend")
    # one op given twice, by one key or by its name and an alias: the last entry won, silently
    with pytest.raises(BackendError, match="'attention' is given twice"):
        parse_preference("attention=torch,attention=native", "--backend")
    with pytest.raises(BackendError, match="names prefix_shared_attention twice"):
        backend_for("yes_no", parse_preference("attention=torch,prefix_shared_attention=native"))
