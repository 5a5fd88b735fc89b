"""What the subcommands share: the model flags, checking them, reading files, loading a model.

Imports only the standard library at module level: a subcommand's ``--help`` needs no torch.
"""
from __future__ import annotations

import codecs
import io
import json
import os
import sys

from ..malloc_tuning import CHOICES as MALLOC_CHOICES  # stdlib only, as the next
from ..server.config import (BACKEND_NAMES, DEFAULT_MAX_BODY_BYTES,  # stdlib-only module: --help stays light
                             DEFAULT_MAX_DOCUMENTS)

#: bytes one input file (--docs, --trace-file, stdin) may hold: what one server request may carry
#: (docs/input-safety.md, "What is guaranteed"); only this + 1 bytes are ever read
MAX_INPUT_BYTES = DEFAULT_MAX_BODY_BYTES
#: default of ``score --max-documents``: what one server request may carry (``serve --max-documents``;
#: docs/input-safety.md); MAX_INPUT_BYTES alone admits ~2.8 M empty documents, each a prompt to score
MAX_DOCUMENTS = DEFAULT_MAX_DOCUMENTS
DTYPES = ("auto", "float32", "bfloat16", "float16")
BACKEND_HELP = (f"backend preference: {BACKEND_NAMES}, used by every op that has it, "
                "or per op: attention=triton,yes_no=cuda (default: ACARERANK_BACKEND, else by device)")


def add_model_flags(p, *, model_help: str) -> None:
    """``--model``, ``--dtype``, ``--device``, ``--backend``, ``--malloc``: the flags every
    model-loading subcommand takes, with one meaning everywhere (checked by ``check_common``, used
    by ``load_reranker``)."""
    p.add_argument("--model", default=None, help=model_help)
    p.add_argument("--dtype", default="auto", choices=DTYPES,
                   help="auto (default): bfloat16 on a CPU with native bf16 (AVX512_BF16/AMX), else float32")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda[:N]")
    p.add_argument("--backend", default=None, help=BACKEND_HELP)
    p.add_argument("--malloc", choices=MALLOC_CHOICES, default="tuned",
                   help="glibc's malloc in this process, as acarerank serve's --malloc (default tuned: freed blocks "
                        "kept for the next layer, 4,096-token CPU passes; default: glibc as it is, 2,048)")


def positive(name: str, value) -> None:
    if value is not None and value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")


def check_default_buildable(model) -> None:
    """ValueError when ``model`` (``--model``) is None and the embedded default cannot be built
    (``python -OO``: ``docstrings_kept``): the command line asks for what cannot be built, a usage
    error (exit 2) before loading."""
    if model is None:
        from ..model.default import NO_DOCSTRINGS, docstrings_kept

        if not docstrings_kept():
            raise ValueError(f"no --model: {NO_DOCSTRINGS}; run under python or python -O, or give --model CHECKPOINT")


def check_common(args) -> None:
    """Flags every model-loading subcommand has, checked before anything loads."""
    from ..hardware import resolve_dtype
    from ..model.placement import check_dtype_device
    from ..ops import parse_preference, per_op_backends

    positive("--max-length", args.max_length)
    check_dtype_device(resolve_dtype(args.dtype, args.device)[0], args.device)
    per_op_backends(parse_preference(args.backend, "--backend"))  # unknown name or op: BackendError, before loading
    if not args.backend:   # then ACARERANK_BACKEND chooses: its junk refused before loading too, not after
        per_op_backends(parse_preference(os.environ.get("ACARERANK_BACKEND"), "ACARERANK_BACKEND"))
    check_default_buildable(args.model)
    if args.model is not None:
        if not os.path.isdir(args.model):
            raise FileNotFoundError(f"--model {args.model!r} is not a folder")
        if not os.path.isfile(os.path.join(args.model, "config.json")):
            raise FileNotFoundError(f"--model {args.model!r} has no config.json")


def check_text_flags(args, *flags: str) -> None:
    """ValueError naming the first of ``flags`` (e.g. "--query") whose text is not Unicode: bytes in
    the command line that are not UTF-8 reach Python as lone surrogates (U+DC80-U+DCFF for bytes
    0x80-0xFF), which the reranker refused only after the model had loaded. Under an ASCII locale
    (LANG=C, PYTHONUTF8=0) valid UTF-8 reaches Python so too: such a flag is decoded from its bytes
    as UTF-8 (it was called "not UTF-8")."""
    for flag in flags:
        attr = flag.lstrip("-").replace("-", "_")
        value = getattr(args, attr)
        try:
            value is None or value.encode("utf-8")
        except UnicodeEncodeError as e:
            try:
                setattr(args, attr, os.fsencode(value).decode("utf-8"))
                continue
            except (UnicodeError, ValueError):
                pass
            c = ord(value[e.start])
            what = f"byte 0x{c - 0xDC00:02x}" if 0xDC80 <= c <= 0xDCFF else f"U+{c:04X}"
            raise ValueError(f"{flag} is not UTF-8 text ({what} at character {e.start})") from None


def read_input_bytes(path: str, flag: str, cap: int = MAX_INPUT_BYTES) -> bytes:
    """The bytes of ``path`` ('-': stdin) without a leading UTF-8 byte order mark; ValueError naming
    the flag, the file and the cap when it holds more than ``cap`` bytes (at most ``cap`` + 1 are
    read: /dev/zero is refused at once).

    The mark (EF BB BF, which Windows editors write) is dropped as the server drops it from a body
    (RFC 8259 8.1 lets a parser ignore it): ``--docs`` refused its first line as invalid JSON, and
    ``--trace-file`` put an invisible U+FEFF at the start of the trace the model read."""
    if path == "-":
        if sys.stdin is None:  # started with stdin closed (<&-)
            raise ValueError(f"{flag} -: stdin is closed")
        data = sys.stdin.buffer.read(cap + 1)
    else:
        if os.path.isdir(path):
            raise ValueError(f"{flag} {path!r} is a folder, not a file")
        try:
            with open(path, "rb") as f:
                data = f.read(cap + 1)
        except OSError as e:  # missing, unreadable: the line names the flag, not only the file
            raise OSError(f"{flag} {path!r}: {e.strerror or e}") from None
    if len(data) > cap:
        raise ValueError(f"{flag} {'stdin' if path == '-' else repr(path)} holds more than {cap:,} bytes, "
                         f"the cap on one input file (the server's request body cap)")
    return data[len(codecs.BOM_UTF8):] if data.startswith(codecs.BOM_UTF8) else data


def read_text_file(path: str, flag: str) -> str:
    """A whole UTF-8 text file (newlines read as \\n, as ``open`` in text mode reads them) less the
    line ends at its end, as ``$(cat file)`` reads it; errors name the flag and the file.

    The last line end is the file format's, not the text's: kept, the README's own --trace-file
    example gave the prompt "...name.\\n\\n<Query>:", a blank line the template does not have
    and other ids (other scores) than the same trace sent to the API or the server."""
    data = read_input_bytes(path, flag)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{flag} {path!r} is not UTF-8 text (byte {e.start}: {e.reason})") from None
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    return text.rstrip("\n")


def _not_json(constant: str):
    """``json.loads``' ``parse_constant``: NaN, Infinity and -Infinity are not JSON (RFC 8259 6).
    Python reads them, and a passed-through field then came out as the same invalid JSON."""
    raise ValueError(f"{constant} is not a JSON number")


def _finite_float(text: str) -> float:
    """``json.loads``' ``parse_float``: a number past a double's range (1e999) read as inf and came
    out as ``Infinity``, which is not JSON."""
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise ValueError(f"the number {text[:40]} is past a double's range")
    return value


def _not_unicode(item) -> str:
    """Where a parsed JSON value holds a string that is not Unicode (a lone surrogate, which
    ``json.loads`` makes of a \\ud800 escape): 'the field "meta"', 'a field name', ... or ""."""
    stack = [(item, None)]  # iterative: json.loads takes nesting deeper than a recursion would
    while stack:
        value, field = stack.pop()
        pairs = ()
        if isinstance(value, dict):
            pairs = value.items()
        elif isinstance(value, list):
            pairs = ((None, v) for v in value)
        elif isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                return f"the field {field!r}" if field is not None else "the text"
        for key, v in pairs:
            if key is not None:
                try:
                    key.encode("utf-8")
                except UnicodeEncodeError:
                    return "a field name"
            stack.append((v, field if field is not None else key))
    return ""


#: the deepest nesting a --docs line may have: its pass-through fields are written back out by
#: json.dumps, which recurses; json.loads read up to ~1,000 levels, and a line of 990 was scored
#: whole, then failed to print (RecursionError, exit 1). Real metadata nests a few levels.
MAX_JSON_DEPTH = 256


def _too_deep(item) -> bool:
    """Whether ``item`` nests lists and objects more than ``MAX_JSON_DEPTH`` levels (iterative)."""
    stack = [(item, 1)]
    while stack:
        value, depth = stack.pop()
        children = value.values() if isinstance(value, dict) else value if isinstance(value, list) else None
        if children is None:
            continue
        if depth > MAX_JSON_DEPTH:
            return True
        stack.extend((v, depth + 1) for v in children)
    return False


def read_documents(path: str, max_docs: int | None = None) -> list:
    """Documents from JSONL ('-' = stdin): objects with a string "text" (kept whole, for pass-through) or strings.
    ValueError naming the file and the cap (``--max-documents``) at the first document past ``max_docs``."""
    data = read_input_bytes(path, "--docs")  # bytes: a decode error names its line
    name = "stdin" if path == "-" else path  # the file:line prefix of each error ('-:2:' named nothing)
    docs = []
    for n, raw in enumerate(io.BytesIO(data), 1):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"{name}:{n}: not UTF-8 text (byte {e.start} of the line: {e.reason})") from None
        if not line.strip():
            continue
        try:
            item = json.loads(line, parse_constant=_not_json, parse_float=_finite_float)
        except ValueError as e:  # JSONDecodeError, an over-long integer literal, NaN / Infinity / 1e999
            raise ValueError(f"{name}:{n}: not valid JSON ({getattr(e, 'msg', e)})") from None
        except RecursionError:
            raise ValueError(f"{name}:{n}: JSON nested too deeply") from None
        if isinstance(item, dict) and _too_deep(item):
            raise ValueError(f"{name}:{n}: JSON nested more than {MAX_JSON_DEPTH} levels (it is written back out)")
        if isinstance(item, dict):
            if not isinstance(item.get("text"), str):
                raise ValueError(f"{name}:{n}: a JSON object needs a string field 'text'")
        elif not isinstance(item, str):
            raise ValueError(f"{name}:{n}: expected a JSON object with 'text' or a JSON string")
        text = item["text"] if isinstance(item, dict) else item
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(f"{name}:{n}: the text is not valid Unicode ({e.reason} at character "
                             f"{e.start}, e.g. a lone \\ud800 escape)") from None
        if "\\u" in line:  # a \ud800 escape: the one way valid UTF-8 JSON holds text that is not Unicode
            where = _not_unicode(item)
            if where:  # passed through to the output, whose UTF-8 print failed after the whole run
                raise ValueError(f"{name}:{n}: {where} is not valid Unicode (a lone surrogate escape such as "
                                 f"\\ud800): it could not be written to the output")
        if max_docs is not None and len(docs) == max_docs:  # stop at the first one past the cap, parse no more
            raise ValueError(f"--docs {'stdin' if path == '-' else repr(path)} holds more than {max_docs:,} "
                             f"document{'s' if max_docs != 1 else ''} (line {n}), the cap --max-documents; raise --max-documents to read more")
        docs.append(item)
    if not docs:
        raise ValueError(f"{name}: no documents")
    return docs


def json_line(obj) -> str:
    """``obj`` as one JSON line for stdout. Non-ASCII characters are written as they are where
    stdout's encoding is UTF-8, else as ``\\uXXXX`` escapes (the same JSON once parsed): under
    ``PYTHONIOENCODING=ascii`` or a Latin-1 locale the raw characters made the first such line fail
    to encode after the whole run (a UnicodeEncodeError, exit 2, the lines before it printed)."""
    encoding = getattr(sys.stdout, "encoding", None) or "ascii"
    try:
        utf8 = codecs.lookup(encoding).name == "utf-8"
    except LookupError:
        utf8 = False
    return json.dumps(obj, ensure_ascii=not utf8)


def note_replaced_fields(docs: list, fields: tuple) -> None:
    """One NOTE on stderr per output field (``fields``: the command's own, e.g. "index", "score")
    that some documents also carry: the output's value replaces theirs, and a pipeline that joins on
    its own ``"index"`` (a corpus position, or a previous ``score``'s) would otherwise join on the
    line number with no sign. Called before loading, with the documents as read."""
    for field in fields:
        at = [i for i, d in enumerate(docs) if isinstance(d, dict) and field in d]
        if at:
            many = len(at) != 1
            where = ", ".join(map(str, at[:3])) + (", ..." if len(at) > 3 else "")
            print(f"NOTE: {len(at):,} document{'s' if many else ''} (index {where}) "
                  f"{'carry their' if many else 'carries its'} own \"{field}\": the output's \"{field}\" replaces "
                  f"{'theirs' if many else 'it'}; rename the field to keep it", file=sys.stderr)


def print_results(rows) -> None:
    """Each row (a dict) as a JSON line on stdout (``json_line``), flushed before returning.

    stdout to a file or a pipe is block-buffered: unflushed, a reader that left (``| true``) or a
    full disk surfaced at the interpreter's exit flush as "Exception ignored ... BrokenPipeError"
    with exit 120. Flushed here, a gone reader is ``main``'s quiet 141, and another write error
    a RuntimeError naming stdout (exit 1), stdout then pointed at /dev/null so the exit flush
    cannot fail again."""
    try:
        for row in rows:
            print(json_line(row))
        sys.stdout.flush()
    except BrokenPipeError:
        raise
    except OSError as e:
        from . import _stdout_to_devnull

        _stdout_to_devnull()
        raise RuntimeError(f"cannot write the results to stdout: {e.strerror or e}") from None


def load_reranker(cls, args, **kw):
    """``cls`` (PointwiseReranker or SetwiseReranker) as the flags ask (``acarerank.loading``)."""
    from .. import malloc_tuning
    from ..loading import load_reranker as load
    from ..model import ContextLengthError

    malloc_tuning.apply(args.malloc)  # before the model's first allocation, as acarerank serve
    try:
        rr = load(cls, model=args.model, dtype=args.dtype, device=args.device, backend=args.backend,
                  max_length="auto" if args.max_length is None else args.max_length, **kw)
    except ContextLengthError as e:  # the constructor names its argument; the user gave a flag
        flags = "--max-length / --max-new-tokens" if "max_new_tokens" in kw else "--max-length"
        raise ContextLengthError(f"{flags}: {e}") from None
    note = rr.default_cap_line("--max-length", "--max-new-tokens" if "max_new_tokens" in kw else "")
    if note:  # a short model's cap is below the documented default: said where the run is watched
        print(note, file=sys.stderr)
    return rr
