"""Every CLI failure is one line on stderr with exit status 2 (usage/input) or 1 (runtime),
checked before the model loads where possible."""
import json

import pytest
import torch

from _tiny import tiny_causal
from acarerank.cli import main


class ModelLoaded(BaseException):
    """Raised if a check that belongs before loading ran after it (not an Exception: main cannot swallow it)."""


@pytest.fixture()
def no_load(monkeypatch):
    import acarerank.model.default as default
    from acarerank.pointwise import PointwiseReranker
    from acarerank.setwise import SetwiseReranker

    def boom(*a, **kw):
        raise ModelLoaded()

    monkeypatch.setattr(default, "build_default_model", boom)
    for cls in (PointwiseReranker, SetwiseReranker):
        monkeypatch.setattr(cls, "from_pretrained", classmethod(boom))


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli")
    (d / "docs.jsonl").write_text('"plain string doc"\n{"text": "object doc", "id": 7}\n')
    (d / "latin1.jsonl").write_bytes(b'"ok"\n"caf\xe9"\n')
    (d / "surrogate.jsonl").write_text('"fine"\n"bad \\ud800"\n')
    ckpt = d / "ckpt"
    tiny_causal(seed=4, tie=True).save_pretrained(ckpt)
    return d


def run(capsys, argv):
    rc = main(argv)
    cap = capsys.readouterr()
    # informational lines (the random-default NOTE, the chosen dtype) are not failure lines
    lines = [x for x in cap.err.splitlines() if x.strip() and not x.startswith(("NOTE:", "dtype:"))]
    return rc, lines, cap.out


@pytest.mark.parametrize("extra, code, needle", [
    (["--backend", "bogus"], 2, "bogus"),
    (["--device", "garbage"], 2, "garbage"),
    (["--top-n", "0"], 2, "--top-n"),
    (["--max-length", "0"], 2, "--max-length"),
    (["--min-doc-tokens", "0"], 2, "--min-doc-tokens"),
    (["--max-length", "300", "--min-doc-tokens", "300"], 2, "leaves no room"),  # once after the model loaded
    (["--trace-file", "DIR"], 2, "--trace-file"),
    (["--docs", "DIR"], 2, "--docs"),
    (["--docs", "DIR/missing.jsonl"], 2, "--docs"),
    (["--trace-file", "DIR/missing.txt"], 2, "--trace-file"),
    (["--docs", "DIR/latin1.jsonl"], 2, "latin1.jsonl:2"),
    (["--docs", "DIR/surrogate.jsonl"], 2, "surrogate.jsonl:2"),
    (["--model", "DIR/nope"], 2, "nope"),
    (["--top-n", "x"], 2, "--top-n"),
    (["--device", "mps"], 2, "cpu or cuda"),  # once loaded the checkpoint, then exit 1 from inside torch
    (["--device", "meta"], 2, "cpu or cuda"),
    (["--device", "cuda:99"], 2, "cuda:99"),
] + ([(["--device", "cuda"], 2, "CUDA")] if not torch.cuda.is_available() else []))
def test_score_input_errors_before_loading(capsys, files, no_load, extra, code, needle):
    argv = ["score", "--query", "q", "--docs", str(files / "docs.jsonl")] + [x.replace("DIR", str(files)) for x in extra]
    rc, err, _ = run(capsys, argv)
    assert rc == code and len(err) == 1 and needle in err[0], (rc, err)


def test_docs_and_trace_cannot_both_read_stdin(capsys, no_load, monkeypatch):
    """--docs read all of stdin and --trace-file then read nothing: an empty trace, so M0 scores
    where M1 was asked for, exit 0."""
    import io
    import types

    monkeypatch.setattr("sys.stdin", types.SimpleNamespace(buffer=io.BytesIO(b'"doc"\n')))
    rc, err, _ = run(capsys, ["score", "--query", "q", "--docs", "-", "--trace-file", "-"])
    assert rc == 2 and err == ["acarerank score: error: --docs - and --trace-file - cannot both read stdin: give one "
                               "of them a file"], (rc, err)


@pytest.mark.parametrize("data, line", [(b"", "stdin: no documents"),
                                        (b'"a"\n{bad\n', "stdin:2: not valid JSON"),
                                        (b'"a"\n"\xff"\n', "stdin:2: not UTF-8 text")])
def test_errors_in_documents_from_stdin_say_stdin(capsys, no_load, monkeypatch, data, line):
    """They read '-: no documents' and '-:2: not valid JSON (...)'."""
    import io
    import types

    monkeypatch.setattr("sys.stdin", types.SimpleNamespace(buffer=io.BytesIO(data)))
    rc, err, _ = run(capsys, ["score", "--query", "q", "--docs", "-"])
    assert rc == 2 and len(err) == 1 and err[0].startswith(f"acarerank score: error: {line}"), (rc, err)


@pytest.mark.parametrize("line, reason", [('{"text": "a", "id": NaN}', "NaN is not a JSON number"),
                                          ('{"text": "a", "w": -Infinity}', "-Infinity is not a JSON number"),
                                          ('{"text": "a", "w": 1e999}', "the number 1e999 is past a double's range")])
def test_documents_with_numbers_json_has_not_are_refused(capsys, no_load, tmp_path, line, reason):
    """Python's json reads NaN, Infinity and 1e999 (as inf); a passed-through field then came out
    as NaN / Infinity, which no strict JSON reader (jq, JSON.parse) accepts."""
    (tmp_path / "d.jsonl").write_text('"ok"\n' + line + "\n")
    rc, err, _ = run(capsys, ["score", "--query", "q", "--docs", str(tmp_path / "d.jsonl")])
    assert rc == 2 and err == [f"acarerank score: error: {tmp_path / 'd.jsonl'}:2: not valid JSON ({reason})"], (rc, err)


def test_select_max_select_names_max_new_tokens(capsys, files, no_load):
    (files / "many.jsonl").write_text("\n".join(json.dumps(f"doc {i}") for i in range(20)))
    rc, err, _ = run(capsys, ["select", "--query", "q", "--docs", str(files / "many.jsonl"), "--max-select", "16"])
    assert rc == 2 and len(err) == 1 and "--max-new-tokens" in err[0], err


@pytest.mark.parametrize("unconstrained", [[], ["--unconstrained"]])
def test_select_max_new_tokens_is_capped_at_the_longest_selection(capsys, files, no_load, unconstrained):
    """--unconstrained decodes until the model stops or --max-new-tokens: with 10**22 (a random model
    never stops) it ran for ever, its KV cache growing. The cap is the longest selection of 1,000
    documents (max_output_tokens(1000, 1000) = 6,001 tokens), or of all --docs when there are more."""
    from acarerank.setwise.grammar import max_output_tokens

    cap = max_output_tokens(1000, 1000)
    assert cap == 6001
    for value in (str(cap + 1), "99999999999999999999999"):
        rc, err, _ = run(capsys, ["select", "--query", "q", "--docs", str(files / "docs.jsonl"), "--max-new-tokens",
                                  value] + unconstrained)
        assert rc == 2 and err == [f"acarerank select: error: --max-new-tokens must be at most {cap:,}, the longest "
                                   f"selection of 1,000 documents, got {int(value):,}"], (rc, err)
    # the cap itself passes the check (the model is next: no_load stops there)
    with pytest.raises(ModelLoaded):
        main(["select", "--query", "q", "--docs", str(files / "docs.jsonl"), "--max-new-tokens", str(cap)]
             + unconstrained)
    (files / "pool.jsonl").write_text("\n".join(json.dumps(f"doc {i}") for i in range(1001)))
    with pytest.raises(ModelLoaded):  # a pool past 1,000 documents: its own longest selection
        main(["select", "--query", "q", "--docs", str(files / "pool.jsonl"), "--max-documents", "1001",
              "--max-select", "1001", "--max-new-tokens", str(max_output_tokens(1001, 1001))] + unconstrained)


def test_runtime_failures_after_loading(capsys, files, monkeypatch):
    ckpt = files / "ckpt"
    base = ["score", "--model", str(ckpt), "--query", "q", "--docs", str(files / "docs.jsonl")]
    # a backend that cannot run here: one line, exit 2 (the user asked for it)
    rc, err, _ = run(capsys, base + ["--backend", "flash_attn_cascade"])
    assert rc == 2 and len(err) == 1 and "flash_attn_cascade" in err[0], err
    # a failure while running: one line, exit 1
    from acarerank.pointwise import PointwiseReranker

    def fail(*a, **kw):
        raise RuntimeError("out of memory\nsecond line")

    monkeypatch.setattr(PointwiseReranker, "rerank", fail)
    rc, err, _ = run(capsys, base)
    assert rc == 1 and len(err) == 1 and "out of memory second line" in err[0], err


def test_truncated_checkpoint_is_one_line_naming_the_file(capsys, files, tmp_path):
    import shutil

    ckpt = shutil.copytree(files / "ckpt", tmp_path / "ckpt")
    data = (ckpt / "model.safetensors").read_bytes()
    (ckpt / "model.safetensors").write_bytes(data[:1000])
    rc, err, _ = run(capsys, ["score", "--model", str(ckpt), "--query", "q", "--docs", str(files / "docs.jsonl")])
    assert rc == 2 and len(err) == 1 and "model.safetensors" in err[0], err


def test_score_output_has_text_and_short_max_length_works(capsys, files):
    argv = ["score", "--model", str(files / "ckpt"), "--query", "q", "--docs", str(files / "docs.jsonl")]
    rc, err, out = run(capsys, argv + ["--max-length", "300", "--min-doc-tokens", "50"])
    rows = [json.loads(x) for x in out.splitlines()]
    assert rc == 0 and [r["text"] for r in rows] == ["plain string doc", "object doc"] and rows[1]["id"] == 7, (err, rows)


@pytest.mark.parametrize("encoding", ["ascii", "latin-1"])
@pytest.mark.parametrize("command", ["score", "select"])
def test_output_is_json_in_any_stdout_encoding(files, tmp_path, monkeypatch, capsys, command, encoding):
    """Under PYTHONIOENCODING=ascii (or a Latin-1 locale) the first document with a character
    stdout cannot encode failed its line after the whole run: a UnicodeEncodeError, exit 2. Now
    such characters are JSON escapes there, the same text once parsed."""
    import io

    texts = ["caf\u00e9 \u4e2d\u6587", "plain"]
    (tmp_path / "uni.jsonl").write_text("\n".join(json.dumps({"text": t}) for t in texts), encoding="utf-8")
    out = io.TextIOWrapper(io.BytesIO(), encoding=encoding, errors="strict")
    monkeypatch.setattr("sys.stdout", out)
    rc = main([command, "--model", str(files / "ckpt"), "--query", "q", "--docs", str(tmp_path / "uni.jsonl")])
    err = capsys.readouterr().err
    out.flush()
    rows = [json.loads(x) for x in out.buffer.getvalue().decode(encoding).splitlines()]
    assert rc == 0 and rows, (rc, err)
    assert all(r["text"] == texts[r["index"]] for r in rows) and (command == "select" or len(rows) == 2), rows


@pytest.mark.parametrize("argv, needle", [(["bench", "--device", "garbage", "--quick"], "garbage"),
                                          (["bench", "--device", "xpu", "--quick"], "cpu or cuda"),
                                          (["bench", "--depths", "x"], "--depths")])
def test_bench_usage_errors_are_one_line(capsys, argv, needle):
    rc, err, _ = run(capsys, argv)
    assert rc == 2 and len(err) == 1 and needle in err[0], (rc, err)


@pytest.fixture()
def no_bench(monkeypatch):
    """A bench run that got past its checks stops here, before loading or measuring anything."""
    import acarerank.benchmark.harness as harness

    def boom(*a, **kw):
        raise ModelLoaded()

    monkeypatch.setattr(harness, "run_bench", boom)
    monkeypatch.setattr(harness, "load_model", boom)


@pytest.mark.parametrize("flag", ["--providers", "--modes"])
def test_bench_an_empty_name_list_is_a_usage_error(capsys, no_bench, flag):
    """``--providers ''`` ran every provider (an empty list read as the default); ``--modes ''``
    said 'unknown context mode(s) []'."""
    rc, err, _ = run(capsys, ["bench", "--quick", flag, " , "])
    assert rc == 2 and err == [f"acarerank bench: error: argument {flag}: expected comma-separated names, "
                               f"got ' , ' (see --help)"], (rc, err)


@pytest.mark.parametrize("workload", ["depth", "agent"])
def test_bench_output_that_is_a_file_names_the_flag(capsys, no_bench, tmp_path, workload):
    """It was '[Errno 17] File exists: ...' (the agent workload's after loading the model)."""
    (tmp_path / "f").write_text("")
    rc, err, _ = run(capsys, ["bench", "--quick", "--workload", workload, "--output", str(tmp_path / "f")])
    assert rc == 2 and err == [f"acarerank bench: error: --output {str(tmp_path / 'f')!r} is a file, not a folder"], \
        (rc, err)


@pytest.mark.parametrize("workload", ["depth", "agent"])
def test_bench_output_that_refuses_files_names_the_flag_before_measuring(capsys, no_bench, tmp_path, workload):
    """A folder that exists but takes no files (a read-only mount; /sys refuses a new file to root
    too) passed the check, every measurement ran (~9 min by default), then the first write failed:
    '[Errno 30] Read-only file system: .../bench.csv', exit 2, nothing saved. Now refused before."""
    rc, err, _ = run(capsys, ["bench", "--quick", "--workload", workload, "--output", "/sys"])
    assert rc == 2 and err == ["acarerank bench: error: --output '/sys' cannot be written: Permission denied"], \
        (rc, err)
    with pytest.raises(ModelLoaded):  # a folder that takes files reaches the model, the probe file removed
        main(["bench", "--quick", "--workload", workload, "--output", str(tmp_path)])
    assert list(tmp_path.iterdir()) == [], list(tmp_path.iterdir())


# -- input files are read with a byte cap ---------------------------------------------------------
@pytest.mark.parametrize("flag", ["--docs", "--trace-file"])
def test_input_file_over_the_cap_names_flag_file_and_cap(capsys, files, no_load, tmp_path, flag):
    from acarerank.cli.common import MAX_INPUT_BYTES

    big = tmp_path / "big.txt"
    big.write_bytes(b"x" * (MAX_INPUT_BYTES + 1))
    argv = ["score", "--query", "q", "--docs", str(files / "docs.jsonl"), flag, str(big)]
    rc, err, _ = run(capsys, argv)
    assert rc == 2 and len(err) == 1, (rc, err)
    assert flag in err[0] and "big.txt" in err[0] and f"{MAX_INPUT_BYTES:,} bytes" in err[0], err


@pytest.mark.parametrize("command", ["score", "select"])
def test_document_count_is_capped_before_loading(capsys, files, no_load, tmp_path, command):
    """More documents than --max-documents (default: the server's 1,000) is one line naming the
    file, the line and the cap, before loading; the cap itself loads, and the flag raises it."""
    from acarerank.cli.common import MAX_DOCUMENTS

    many = tmp_path / "many.jsonl"
    many.write_text("\n".join(['""'] * MAX_DOCUMENTS + ["", '""']))  # a blank line is no document
    argv = [command, "--query", "q", "--docs", str(many)]
    rc, err, _ = run(capsys, argv)
    assert rc == 2 and len(err) == 1, (rc, err)
    assert "many.jsonl" in err[0] and f"more than {MAX_DOCUMENTS:,} documents (line {MAX_DOCUMENTS + 2})" in err[0] \
        and "--max-documents" in err[0], err
    for flags in (["--max-documents", str(MAX_DOCUMENTS + 1)], ["--docs", str(files / "docs.jsonl"), "--max-documents", "2"]):
        with pytest.raises(ModelLoaded):
            main(argv + flags)
    rc, err, _ = run(capsys, [command, "--query", "q", "--docs", str(files / "docs.jsonl"), "--max-documents", "1"])
    assert rc == 2 and len(err) == 1 and "more than 1 document (line 2)" in err[0], err
    rc, err, _ = run(capsys, argv + ["--max-documents", "0"])
    assert rc == 2 and len(err) == 1 and "--max-documents must be >= 1, got 0" in err[0], err


def test_read_input_bytes_takes_the_cap_and_refuses_one_more(tmp_path):
    from acarerank.cli.common import read_input_bytes

    f = tmp_path / "f"
    f.write_bytes(b"0123456789")
    assert read_input_bytes(str(f), "--docs", cap=10) == b"0123456789"
    with pytest.raises(ValueError, match="--docs .* more than 9 bytes"):
        read_input_bytes(str(f), "--docs", cap=9)


def test_a_leading_utf8_byte_order_mark_is_dropped(tmp_path, monkeypatch):
    """A file saved by a Windows editor starts with EF BB BF: --docs refused its line 1 as invalid
    JSON ('Unexpected UTF-8 BOM'), --trace-file gave the model a trace starting with U+FEFF. The mark
    is dropped, as the server drops it from a body; one later in the file is still an error."""
    import io
    import types

    from acarerank.cli.common import read_documents, read_text_file

    bom = b"\xef\xbb\xbf"
    (tmp_path / "docs.jsonl").write_bytes(bom + b'"a"\r\n{"text": "b"}\r\n')
    (tmp_path / "trace.txt").write_bytes(bom + b"step 1\r\nstep 2")
    assert read_documents(str(tmp_path / "docs.jsonl")) == ["a", {"text": "b"}]
    assert read_text_file(str(tmp_path / "trace.txt"), "--trace-file") == "step 1\nstep 2"
    monkeypatch.setattr("sys.stdin", types.SimpleNamespace(buffer=io.BytesIO(bom + b'"from stdin"\n')))
    assert read_documents("-") == ["from stdin"]
    (tmp_path / "two.jsonl").write_bytes(bom + b'"a"\n' + bom + b'"b"\n')
    with pytest.raises(ValueError, match="two.jsonl:2: not valid JSON"):
        read_documents(str(tmp_path / "two.jsonl"))


def test_trace_file_is_read_without_its_last_line_end(tmp_path):
    """A text file ends its last line with a newline (every editor writes one): kept, the trace's
    prompt had a blank line before "<Query>:" the template does not have — other ids, other scores
    than the same trace sent to the API or the server. The line ends at its end are dropped, as
    $(cat file) drops them; the others are the text's."""
    from acarerank.cli.common import read_text_file

    for raw, want in ((b"step 1\nstep 2\n", "step 1\nstep 2"), (b"step 1\r\nstep 2\r\n", "step 1\nstep 2"),
                      (b"step 1\n\n", "step 1"), (b"step 1\n\nstep 2\n", "step 1\n\nstep 2"), (b"step 1", "step 1"), (b"\n", "")):
        (tmp_path / "trace.txt").write_bytes(raw)
        assert read_text_file(str(tmp_path / "trace.txt"), "--trace-file") == want, raw


# the child measures the memory the read adds: torch and the ops are imported before it
_CHILD = """
import resource, sys
import acarerank.cli.score, acarerank.hardware, acarerank.model.placement, acarerank.ops
from acarerank.cli import main
with open("/proc/self/statm") as f:
    vm = int(f.read().split()[0]) * resource.getpagesize()
resource.setrlimit(resource.RLIMIT_AS, (vm + (1 << 30), resource.RLIM_INFINITY))  # a reader without a cap fails
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
rc = main(sys.argv[1:])
print(rc, (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024)
"""


_DEV_ZERO = [(["--docs", "/dev/zero"], None), (["--docs", "-"], "/dev/zero"),
             (["--docs", "DOCS", "--trace-file", "/dev/zero"], None)]


def _side_by_side(start, keys, timeout):
    """``get(key)``: (returncode, stdout, stderr) of the child ``start(key)``. The first get starts
    the children of every key at once: each is a CLI process's imports and its run, one core's
    work (~2.7-3 s on a Xeon), so on 2 cores they take about half as long side by side as one
    after another. A generator for a module fixture: the children a -k run never read are killed."""
    procs, done = {}, {}

    def get(key):
        if not procs:
            for k in keys:
                procs[k] = start(k)
        if key not in done:
            out, err = procs[key].communicate(timeout=timeout)
            done[key] = (procs[key].returncode, out, err)
        return done[key]

    yield get
    for proc in procs.values():
        if proc.poll() is None:
            proc.kill()
        proc.communicate()


@pytest.fixture(scope="module")
def dev_zero_runs(files):
    import subprocess
    import sys

    def start(i):
        flags, stdin = _DEV_ZERO[i]
        argv = ["score", "--query", "q"] + [x.replace("DOCS", str(files / "docs.jsonl")) for x in flags]
        with open(stdin or "/dev/null", "rb") as inp:
            return subprocess.Popen([sys.executable, "-c", _CHILD] + argv, stdin=inp, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True)

    yield from _side_by_side(start, range(len(_DEV_ZERO)), timeout=120)


@pytest.mark.parametrize("flags, stdin", _DEV_ZERO)
def test_dev_zero_is_refused_at_once_in_bounded_memory(dev_zero_runs, flags, stdin):
    from acarerank.cli.common import MAX_INPUT_BYTES

    returncode, stdout, stderr = dev_zero_runs(_DEV_ZERO.index((flags, stdin)))
    rc, grew = map(int, stdout.split())
    assert rc == 2 and "more than" in stderr and flags[-2] in stderr, (rc, stderr[-2000:])
    assert grew < 3 * MAX_INPUT_BYTES, f"the read grew the process by {grew / 2**20:.0f} MiB"


def test_select_over_the_token_cap_fails_before_loading_with_the_late_message(capsys, files, no_load):
    """100 documents cannot fit --max-length 300: the check needs the tokenizer only, and its line is
    the one the selection itself raises (build_prompt) once the model has loaded."""
    from acarerank.setwise.prompts import build_prompt
    from acarerank.tokenizer import TextEncoder

    texts = [f"doc {i}" for i in range(100)]
    (files / "hundred.jsonl").write_text("\n".join(json.dumps(t) for t in texts))
    with pytest.raises(ValueError) as late:
        build_prompt(TextEncoder.of(None, "escape"), "q", texts, None, 2, 300)
    rc, err, _ = run(capsys, ["select", "--query", "q", "--docs", str(files / "hundred.jsonl"), "--max-select", "2",
                              "--max-length", "300"])
    assert rc == 2 and err == [f"acarerank select: error: {late.value}"], (rc, err)


def _raise_in_run(monkeypatch, error):
    import acarerank.cli.score as score

    def run(args):
        raise error

    monkeypatch.setattr(score, "run", run)


def test_ctrl_c_rewrapped_by_an_import_is_still_an_interrupt(capsys, monkeypatch):
    """transformers' lazy modules turn a Ctrl-C during their import into ModuleNotFoundError
    ("Could not import module 'Qwen3ForCausalLM'"): exit 130, not a runtime error."""
    try:
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt as e:
            raise ModuleNotFoundError("Could not import module 'Qwen3ForCausalLM'") from e
    except ModuleNotFoundError as e:
        _raise_in_run(monkeypatch, e)
    rc, err, _ = run(capsys, ["score", "--query", "q", "--docs", "x"])
    assert rc == 130 and err == ["acarerank score: interrupted"], (rc, err)


def test_ctrl_c_while_the_subcommand_imports_is_an_interrupt(capsys, monkeypatch):
    """Ctrl-C while ``build_parser`` imports the chosen subcommand's module (torch-free, but a few
    hundred ms of imports) escaped main: a traceback, and the process killed by SIGINT."""
    import acarerank.cli as cli

    def interrupted_import(command=None):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "build_parser", interrupted_import)
    try:
        rc, err, _ = run(capsys, ["score", "--query", "q", "--docs", "x"])
    except KeyboardInterrupt:  # not raised on: pytest would stop the whole session
        pytest.fail("KeyboardInterrupt escaped main")
    assert rc == 130 and err == ["acarerank score: interrupted"], (rc, err)


def test_ctrl_c_swallowed_by_a_callback_still_exits_130(capsys, monkeypatch):
    """A KeyboardInterrupt raised inside a weakref callback (importlib's module-lock cleanup is
    one) is 'Exception ignored' to Python: it printed a traceback and the command ran on to exit 0."""
    import weakref

    import acarerank.cli.score as score

    def throw(_ref):
        raise KeyboardInterrupt

    def run_with_a_lost_interrupt(args):
        class Obj:
            pass

        obj = Obj()
        ref = weakref.ref(obj, throw)
        del obj  # the callback runs here; its KeyboardInterrupt goes to sys.unraisablehook
        assert ref() is None
        return 0

    monkeypatch.setattr(score, "run", run_with_a_lost_interrupt)
    rc, err, _ = run(capsys, ["score", "--query", "q", "--docs", "x"])
    assert rc == 130 and err == ["acarerank score: interrupted"], (rc, err)


# the child runs ``score`` with a run() that imports a slow module; the parent sends SIGINT during it
_SLOW_IMPORT_CHILD = """
import sys
import acarerank.cli.score as score
sys.path.insert(0, sys.argv[1])

def run(args):
    import slow_module
    return 0

score.run = run
from acarerank.cli import main
sys.exit(main(["score", "--query", "q", "--docs", "x"]))
"""


@pytest.mark.parametrize("presses", [1, 2])
def test_ctrl_c_during_an_import_waits_for_the_import_then_exits_130(tmp_path, presses):
    """SIGINT inside an import raised KeyboardInterrupt in the middle of it (inside torch's, a
    SIGABRT from pybind11; after it, 'cannot load module more than once', exit 1). It is raised
    once the import has finished: the module is whole, the exit is 130 with one line. A second
    Ctrl-C raises at once (an import that hangs cannot hold the interrupt for ever)."""
    import signal
    import subprocess
    import sys
    import time

    sleep_s = 1.5 if presses == 1 else 8
    (tmp_path / "slow_module.py").write_text(
        f"import sys, time\nsys.stderr.write('importing\\n'); sys.stderr.flush()\ntime.sleep({sleep_s})\n"
        "sys.stderr.write('imported\\n')\n")
    child = subprocess.Popen([sys.executable, "-c", _SLOW_IMPORT_CHILD, str(tmp_path)], stderr=subprocess.PIPE,
                             text=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        assert child.stderr.readline() == "importing\n"
        for _ in range(presses):
            child.send_signal(signal.SIGINT)
            time.sleep(0.3)
        err = child.stderr.read().splitlines()
        rc = child.wait(timeout=30)
    finally:
        child.kill()
    expected = ["imported"] if presses == 1 else []
    assert rc == 130 and err == expected + ["acarerank score: interrupted"], (rc, err)


def test_a_second_ctrl_c_stops_the_watcher_of_the_first(monkeypatch):
    """The first Ctrl-C inside an import is held by a watcher thread, which posts it once the main
    thread is out of the import; a second one raises at once. The watcher then posted a third as
    soon as the unwinding left the import (a KeyboardInterrupt the user never pressed, raised in
    the command's cleanup or in main's own except clause: a traceback instead of exit 130)."""
    import threading
    import types

    import acarerank.cli as cli

    posted = []
    monkeypatch.setattr(cli._thread, "interrupt_main", lambda *a: posted.append(a))
    in_import = types.SimpleNamespace(f_code=types.SimpleNamespace(co_filename="<frozen importlib._bootstrap>"),
                                      f_back=None)
    interrupts = cli._Interrupts()
    interrupts._on_sigint(2, in_import)  # the first press: held, a watcher started
    watchers = [t for t in threading.enumerate() if t.name == "acarerank-ctrl-c"]
    assert interrupts.seen and watchers, "the first Ctrl-C inside an import starts no watcher"
    with pytest.raises(KeyboardInterrupt):
        interrupts._on_sigint(2, in_import)  # the second press: raised at once
    for t in watchers:  # this test's main thread is in no import: a watcher still running posts at once
        t.join(5 * cli._Interrupts.RETRY_S + 1)
    interrupts._stop.set()
    assert posted == [], "the watcher posted a Ctrl-C after the second one had raised"


def test_a_held_ctrl_c_posted_as_the_command_ends_is_dropped(monkeypatch):
    """The watcher may decide to post the held Ctrl-C just as the command ends. __exit__ waits
    for it, so the post lands in our handler (signal.signal runs a pending one before the swap),
    which drops it: the press counted already (exit 130), and Python's own handler would have
    raised it after main's ``with`` (a traceback)."""
    import acarerank.cli as cli

    interrupts = cli._Interrupts()
    interrupts.seen = True
    interrupts._posting = True      # the watcher's post, delivered ...
    interrupts._stop.set()          # ... after __exit__ stopped it
    try:  # a KeyboardInterrupt escaping here would stop the whole pytest run, not fail this test
        interrupts._on_sigint(2, None)
    except KeyboardInterrupt:
        pytest.fail("a held Ctrl-C posted after the command ended was raised (a traceback after main's with)")
    assert not interrupts._posting
    interrupts._posting = True      # a post while the command still runs is raised, as before
    interrupts._stop.clear()
    with pytest.raises(KeyboardInterrupt):
        interrupts._on_sigint(2, None)


def test_stdout_reader_gone_is_a_quiet_141(capsys, monkeypatch):
    _raise_in_run(monkeypatch, BrokenPipeError(32, "Broken pipe"))
    rc, err, _ = run(capsys, ["score", "--query", "q", "--docs", "x"])
    assert rc == 141 and err == [], (rc, err)


@pytest.fixture(scope="module")
def failed_write_runs(files):
    import os
    import subprocess
    import sys

    import acarerank

    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    env["PYTHONPATH"] = os.path.dirname(os.path.dirname(acarerank.__file__))

    def start(key):
        command, sink = key
        argv = [sys.executable, "-m", "acarerank.cli", command, "--model", str(files / "ckpt"), "--query", "q",
                "--docs", str(files / "docs.jsonl")]
        if sink == "reader gone":
            read_end, write_end = os.pipe()
            os.close(read_end)
            with os.fdopen(write_end, "wb") as out:
                return subprocess.Popen(argv, stdout=out, stderr=subprocess.PIPE, text=True, env=env)
        with open("/dev/full", "wb") as out:
            return subprocess.Popen(argv, stdout=out, stderr=subprocess.PIPE, text=True, env=env)

    yield from _side_by_side(start, [(c, s) for c in ("score", "select") for s in ("reader gone", "disk full")],
                             timeout=60)


@pytest.mark.parametrize("sink", ["reader gone", "disk full"])
@pytest.mark.parametrize("command", ["score", "select"])
def test_a_failed_write_of_buffered_results_is_one_line_and_its_own_status(failed_write_runs, command, sink):
    """stdout to a pipe or a file is block-buffered (no PYTHONUNBUFFERED): the results were
    written at the interpreter's exit flush, where a reader that had left (``| true``) or a full
    disk printed "Exception ignored in: <_io.TextIOWrapper name='<stdout>'...>" and exited 120.
    Now a gone reader is the quiet 141, another write error one line and exit 1."""
    returncode, _, stderr = failed_write_runs((command, sink))
    if sink == "reader gone":
        expected = (141, [])
    else:
        expected = (1, [f"acarerank {command}: runtime error: RuntimeError: cannot write the results to stdout: "
                        "No space left on device"])
    err = [x for x in stderr.splitlines() if not x.startswith(("NOTE:", "dtype:", "output "))]
    assert (returncode, err) == expected, (returncode, stderr[-2000:])


@pytest.fixture(scope="module")
def broken_stderr_runs(files):
    import os
    import subprocess
    import sys

    import acarerank

    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(acarerank.__file__)), OMP_NUM_THREADS="1")

    def start(key):
        docs, sink = key
        argv = [sys.executable, "-m", "acarerank.cli", "score", "--model", str(files / "ckpt"), "--query", "q",
                "--docs", str(files / docs)]
        if sink == "reader gone":
            read_end, write_end = os.pipe()
            os.close(read_end)
            with os.fdopen(write_end, "wb") as err:
                return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=err, text=True, env=env)
        with open("/dev/full" if sink == "disk full" else os.devnull, "wb") as err:
            return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=err, text=True, env=env)

    keys = [("docs.jsonl", s) for s in ("devnull", "reader gone", "disk full")] + [("missing.jsonl", "disk full")]
    yield from _side_by_side(start, keys, timeout=60)


@pytest.mark.parametrize("sink", ["reader gone", "disk full"])
def test_a_stderr_that_cannot_be_written_costs_no_results(broken_stderr_runs, sink):
    """stderr a pipe whose reader has gone (a log collector that exited) or on a full disk: the
    dtype line's print raised before anything was scored, the error line failed again (exit 1), and
    stderr's BrokenPipeError was read as stdout's reader leaving (exit 141), stdout empty. Now the
    diagnostics go to /dev/null: the results and exit status of a run with a working stderr."""
    reference = broken_stderr_runs(("docs.jsonl", "devnull"))
    returncode, stdout, _ = broken_stderr_runs(("docs.jsonl", sink))
    assert reference[0] == 0 and len(reference[1].splitlines()) == 2, reference
    assert (returncode, stdout) == reference[:2], (returncode, stdout, reference[:2])


def test_a_stderr_that_cannot_be_written_keeps_an_input_errors_status(broken_stderr_runs):
    """A missing --docs file is exit 2 (bad input); its line failing to print made it exit 1."""
    returncode, stdout, _ = broken_stderr_runs(("missing.jsonl", "disk full"))
    assert (returncode, stdout) == (2, ""), (returncode, stdout)


_OO_LINE = ("python -OO strips docstrings, and transformers' model classes (Qwen3ForCausalLM, which builds the "
            "embedded default model) read theirs when they are defined")


def test_python_OO_without_a_checkpoint_is_one_line_naming_the_cause(files):
    """Under python -OO the embedded default could not be built: transformers' auto_docstring needs
    the docstrings -OO strips, and score/select/serve said "No `Args` or `Parameters` section is found
    in the docstring of `BaseModelOutputWithPast`" (exit 2). Now the line says why and what works,
    before loading. A real -OO child (it compiles every module it imports: no cached -OO bytecode)."""
    import os
    import subprocess
    import sys

    import acarerank

    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(acarerank.__file__)), OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-OO", "-m", "acarerank.cli", "score", "--query", "q", "--docs",
                           str(files / "docs.jsonl")], capture_output=True, text=True, env=env, timeout=120)
    err = [x for x in done.stderr.splitlines() if not x.startswith(("NOTE:", "dtype:"))]
    assert (done.returncode, done.stdout, err) == (2, "", [f"acarerank score: error: no --model: {_OO_LINE}; run under "
                                                           "python or python -O, or give --model CHECKPOINT"]), \
        (done.returncode, done.stderr[-2000:])


def test_python_OO_leaves_a_checkpoint_alone_and_the_api_says_why(capsys, files, no_load, monkeypatch):
    """The same check as python -OO's (sys.flags.optimize 2, seen by acarerank.model.default only):
    --model loads (it needs no transformers model class), and build_default_model raises the line."""
    from types import SimpleNamespace

    import acarerank.model.default as default

    monkeypatch.setattr(default, "sys", SimpleNamespace(flags=SimpleNamespace(optimize=2)))
    with pytest.raises(ModelLoaded):
        main(["score", "--model", str(files / "ckpt"), "--query", "q", "--docs", str(files / "docs.jsonl")])
    monkeypatch.undo()  # no_load's stand-in off: the real build_default_model
    monkeypatch.setattr(default, "sys", SimpleNamespace(flags=SimpleNamespace(optimize=2)))
    with pytest.raises(RuntimeError) as e:
        default.build_default_model()
    assert str(e.value) == f"{_OO_LINE}: run it under python or python -O, or load a checkpoint", e.value


@pytest.mark.parametrize("workload", ["depth", "agent"])
def test_bench_under_python_OO_without_a_checkpoint_is_a_usage_error(capsys, no_bench, monkeypatch, workload):
    """bench did not run score/select/serve's check (check_common): under python -OO without --model
    it failed ~9 s in, "runtime error: RuntimeError: python -OO ...", exit 1. Now the same line as
    theirs, exit 2, before loading; with --model it is left alone (the same sys.flags stand-in as above)."""
    from types import SimpleNamespace

    import acarerank.model.default as default

    monkeypatch.setattr(default, "sys", SimpleNamespace(flags=SimpleNamespace(optimize=2)))
    rc, err, _ = run(capsys, ["bench", "--quick", "--workload", workload])
    assert (rc, err) == (2, [f"acarerank bench: error: no --model: {_OO_LINE}; run under python or python -O, "
                             "or give --model CHECKPOINT"]), (rc, err)


@pytest.mark.parametrize("command", ["score", "select"])
def test_closed_stdout_is_refused_before_loading(capsys, files, no_load, monkeypatch, command):
    """Started with stdout closed (``>&-``), Python has no sys.stdout and print() writes nothing:
    the results were lost with exit 0. Now exit 2, one line, before the model loads."""
    monkeypatch.setattr("sys.stdout", None)
    rc, err, _ = run(capsys, [command, "--query", "q", "--docs", str(files / "docs.jsonl")])
    assert rc == 2 and err == [f"acarerank {command}: error: stdout is closed: the results would be lost"], (rc, err)


def test_closed_stderr_keeps_diagnostics_out_of_the_results(capsys, files, monkeypatch):
    """Started with stderr closed (``2>&-``), Python has no sys.stderr and print(file=None) writes
    to stdout: the dtype and NOTE lines, and an error's line, came out among the JSON results."""
    monkeypatch.setattr("sys.stderr", None)
    rc = main(["score", "--query", "q", "--docs", str(files / "missing.jsonl")])
    assert rc == 2 and capsys.readouterr().out == ""
    monkeypatch.setattr("sys.stderr", None)
    rc = main(["score", "--query", "q", "--docs", str(files / "docs.jsonl")])  # the embedded default: a NOTE
    rows = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert rc == 0 and [r["index"] for r in rows] == [0, 1], rows


def test_nonfinite_weights_are_one_line_and_never_a_nan_score(capsys, files, tmp_path, monkeypatch):
    """A NaN in the "yes" row once printed {"score": NaN} (not even JSON) with exit 0. At load it is
    bad input (exit 2) naming file and tensor; weights that turn non-finite after loading are a
    runtime failure (exit 1): one line, no score printed."""
    import acarerank.model.runner as runner_module
    from acarerank.tokenizer import TOKEN_YES

    m = tiny_causal(seed=4, tie=False)
    with torch.no_grad():
        m.lm_head.weight[TOKEN_YES, 0] = float("nan")  # untied: every hidden state stays finite
    m.save_pretrained(tmp_path / "nan")
    capsys.readouterr()  # transformers' progress bar
    base = ["--query", "q", "--docs", str(files / "docs.jsonl")]
    for cmd in ("score", "select"):
        rc, err, out = run(capsys, [cmd, "--model", str(tmp_path / "nan")] + base)
        assert rc == 2 and len(err) == 1 and out == "", (rc, err, out)
        assert "model.safetensors" in err[0] and "holds NaN" in err[0], err

    load = runner_module.load_checkpoint

    def load_then_break(*a, **kw):  # weights finite at load, the final norm inf afterwards
        w = load(*a, **kw)
        w.final_norm[0] = float("inf")
        return w

    monkeypatch.setattr(runner_module, "load_checkpoint", load_then_break)
    for cmd in ("score", "select"):
        rc, err, out = run(capsys, [cmd, "--model", str(files / "ckpt")] + base)
        assert rc == 1 and len(err) == 1 and out == "" and "NonFiniteOutputError" in err[0], (rc, err, out)


@pytest.mark.parametrize("command", ["score", "select", "serve"])
def test_backend_help_names_every_backend(command):
    """``--backend``'s help lists every name the preference takes (``acarerank.ops._backend.KNOWN_BACKENDS``;
    docs/install.md, ``ACARERANK_BACKEND``): it named torch | triton | cpp | cuda only, not the CPU
    defaults ``native`` and ``onednn``."""
    import argparse
    import re

    from acarerank.cli import build_parser
    from acarerank.ops._backend import KNOWN_BACKENDS

    sub = next(a for a in build_parser(command)._actions if isinstance(a, argparse._SubParsersAction)).choices[command]
    help_text = sub._option_string_actions["--backend"].help
    listed = re.search(r"backend preference: ([\w |]+?),", help_text).group(1).split(" | ")
    assert sorted(listed) == sorted(KNOWN_BACKENDS), help_text


def test_serve_help_states_each_default_once():
    """``serve --help`` adds argparse's "(default: X)" only where the flag's own help does not
    already state its default, and never "(default: None)" (it read "(default: 2,048 on CPU,
    16,384 on GPU) (default: None)")."""
    import argparse

    from acarerank.cli import build_parser

    sub = next(a for a in build_parser("serve")._actions if isinstance(a, argparse._SubParsersAction)).choices["serve"]
    text = " ".join(sub.format_help().split())
    assert "(default: None)" not in text, text
    assert "16,384 on GPU) (default" not in text, text
    assert "(default: 8000)" in text, "a plain default lost its '(default: X)'"


@pytest.mark.parametrize("command", ["score", "select"])
@pytest.mark.parametrize("line, where", [('{"text": "a", "meta": "x \\ud800"}', "the field 'meta'"),
                                         ('{"text": "a", "tags": [1, {"k": "\\udfff"}]}', "the field 'tags'"),
                                         ('{"text": "a", "\\ud83d": 1}', "a field name")])
def test_a_passed_through_field_that_is_not_unicode_is_refused_before_loading(capsys, no_load, tmp_path, command,
                                                                              line, where):
    """A lone surrogate escape anywhere in a document (not only its text) is refused with the
    file's line: such a field is written to the output as it is, and the UTF-8 print failed
    after the model had loaded and scored every document — one line printed, then exit 2
    naming nothing ("'utf-8' codec can't encode character '\\ud800' in position 56")."""
    (tmp_path / "d.jsonl").write_text('{"text": "ok", "meta": "caf\\u00e9 \\ud83d\\ude00"}\n' + line + "\n")
    rc, err, out = run(capsys, [command, "--query", "q", "--docs", str(tmp_path / "d.jsonl")])
    assert rc == 2 and out == "" and err == [
        f"acarerank {command}: error: {tmp_path / 'd.jsonl'}:2: {where} is not valid Unicode (a lone surrogate "
        f"escape such as \\ud800): it could not be written to the output"], (rc, err)


@pytest.mark.parametrize("command", ["score", "select"])
def test_a_passed_through_field_nested_past_the_cap_is_refused_before_loading(capsys, no_load, tmp_path, command):
    """A pass-through field nested 990 deep parsed (json.loads takes ~1,000), the model loaded and
    scored, then the output's json.dumps ran out of stack: RecursionError, exit 1, after the
    whole run. Now refused with its line before loading; the cap itself is written back out."""
    from acarerank.cli.common import MAX_JSON_DEPTH, json_line, read_documents

    at_cap = '{"text": "a", "m": ' + "[" * (MAX_JSON_DEPTH - 1) + "]" * (MAX_JSON_DEPTH - 1) + "}"
    (tmp_path / "ok.jsonl").write_text(at_cap + "\n")
    assert json_line(read_documents(str(tmp_path / "ok.jsonl"))[0])
    # 600: json.loads reads it here too (pytest's frames are on the stack); past the cap either way
    (tmp_path / "d.jsonl").write_text('"ok"\n{"text": "a", "m": ' + "[" * 600 + "]" * 600 + "}\n")
    rc, err, out = run(capsys, [command, "--query", "q", "--docs", str(tmp_path / "d.jsonl")])
    assert rc == 2 and out == "" and err == [
        f"acarerank {command}: error: {tmp_path / 'd.jsonl'}:2: JSON nested more than {MAX_JSON_DEPTH} levels "
        f"(it is written back out)"], (rc, err)


@pytest.mark.parametrize("command, flag", [("score", "--query"), ("score", "--question"), ("score", "--instruction"),
                                           ("select", "--query"), ("select", "--intent")])
def test_a_text_flag_that_is_not_utf8_is_refused_before_loading(capsys, files, no_load, command, flag):
    """Bytes that are not UTF-8 in the command line (a Latin-1 shell: 'caf\\xe9') reach Python as
    lone surrogates; the reranker refused them (clearly) only once the model had loaded."""
    argv = [command, "--query", "q", "--docs", str(files / "docs.jsonl")]
    argv += [flag, "caf\udce9 au lait"] if flag != "--query" else []
    if flag == "--query":
        argv[2] = "caf\udce9 au lait"
    rc, err, _ = run(capsys, argv)
    assert rc == 2 and err == [f"acarerank {command}: error: {flag} is not UTF-8 text (byte 0xe9 at character 3)"], \
        (rc, err)


@pytest.mark.parametrize("command", ["score", "select"])
def test_a_junk_acarerank_backend_is_refused_before_loading_unless_a_backend_is_given(capsys, files, no_load,
                                                                                      monkeypatch, command):
    """ACARERANK_BACKEND chooses only where --backend is not given: junk in it is exit 2 before the
    model loads (it was a runtime error after the load), and beside --backend it is not read (it
    refused a --backend native run)."""
    monkeypatch.setenv("ACARERANK_BACKEND", "bogus")
    argv = [command, "--query", "q", "--docs", str(files / "docs.jsonl")]
    rc, err, _ = run(capsys, argv)
    assert rc == 2 and len(err) == 1 and "unknown backend 'bogus' (from ACARERANK_BACKEND)" in err[0], (rc, err)
    with pytest.raises(ModelLoaded):
        main(argv + ["--backend", "torch"])


def test_utf8_text_read_under_an_ascii_locale_is_decoded():
    """Under LANG=C with PYTHONUTF8=0 the command line's UTF-8 reaches Python as surrogate escapes
    ('café' as 'caf\\udcc3\\udca9'): it was called "not UTF-8"; it is decoded from its bytes. Bytes
    that are not UTF-8 are still refused, naming the first."""
    import argparse

    from acarerank.cli.common import check_text_flags

    args = argparse.Namespace(query="caf\udcc3\udca9 au lait", intent=None)
    check_text_flags(args, "--query", "--intent")
    assert args.query == "café au lait"
    args = argparse.Namespace(query="caf\udce9", intent=None)
    with pytest.raises(ValueError, match=r"--query is not UTF-8 text \(byte 0xe9 at character 3\)"):
        check_text_flags(args, "--query", "--intent")
