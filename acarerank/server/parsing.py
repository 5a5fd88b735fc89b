"""Request bodies from bytes: msgspec decodes, pydantic validates; both off the event loop.

``msgspec`` decodes the body into a struct holding only the schema's own fields, each as its raw
JSON (``msgspec.Raw``, a view of the body): an unknown field is skipped without building a Python
object for it (a 30 MB array of ``[]`` in an ignored field decodes in ~0.06 s and ~70 MB here,
where ``json.loads`` took 2.9 s and 800 MB, orjson 3.6 s and 940 MB, pydantic's
``model_validate_json`` 2.2 s and 600 MB). Then the pydantic model (``schemas.py``) validates the
known fields: strict types, the same messages.

A known field is built only as deep as the schema reads it (``_field``): a string or number
decoded; an array's items (at most ``max_items``: more is a 413 before any is built), each item
a string or number decoded and an array or object stood in for by ``[]`` or ``{}``, whose type
is all pydantic's message names. Every list field of the schemas holds strings (``documents``:
strings or objects, read for their ``text``, ``_documents``), and the one object
(``chat_template_kwargs``) is read for its ``instruction`` up to its first other key, which is
refused (``_kwargs``): read whole, 33 MB of distinct keys took 5 s holding the GIL before its
413 (2026-12-07). Built in
full, 6 MB of ``[[], [], ...]`` in ``documents`` took 28 s and 3.6 GB, most of it pydantic's
two million errors turned into dicts by one call that holds the GIL, and ``/health`` waited
20 s on the event loop meanwhile (2026-12-07).

``documents`` is read the same way, element by element (``_documents``): a string is decoded,
an object only for its ``text``; the object's other keys are never built: it is kept as its raw
JSON (``msgspec.Raw``, a view of the body, no copy), which ``return_documents`` sends back as sent.
Built, they cost ~45 times their size and seconds of CPU (a 30 MB body of ``[]`` in one
document's other key: 1.4 GB and 2.6 s to decode, 2.9 s more on the event loop to answer).

Every malformed body is a 422 naming what is wrong: invalid JSON or UTF-8 (a lone surrogate
escape included), nesting deeper than Python's recursion limit, an integer or float out of
range in a known field, a top level that is not an object — where the schema reads it: inside an
array or object stood in for by ``[]`` / ``{}`` nothing is decoded (the type is the error; in a
``chat_template_kwargs`` value, the 400 naming its key).
"""
from __future__ import annotations

import functools
import re
from typing import Optional

import msgspec
import pydantic

from .errors import APIError

UTF8_BOM = b"\xef\xbb\xbf"
#: a high-surrogate escape (``\\uD800``-``\\uDBFF``, after an even run of backslashes) with no
#: low-surrogate escape after it: msgspec calls that "Input data was truncated"
_LONE_HIGH_SURROGATE = re.compile(rb"(?<!\\)(?:\\\\)*\\u[dD][89abAB][0-9a-fA-F]{2}(?!\\u[dD][c-fC-F][0-9a-fA-F]{2})")


def _decode_error(body, e: msgspec.DecodeError) -> str:
    """msgspec's message for a body it cannot decode, but naming a lone high surrogate escape where
    msgspec stopped at one (it reports one followed by other text as an "unexpected end of hex
    escape" a few bytes on, or at the body's end as truncated input)."""
    said = str(e)
    at = re.search(r"\(byte (\d+)\)$", said)
    if at is None and "truncated" not in said:
        return said
    m = _LONE_HIGH_SURROGATE.search(body, 0, len(body) if at is None else int(at.group(1)) + 1)
    if m is None:
        return said
    return (f"invalid utf-16 surrogate pair: {m.group()[-6:].decode()} at byte {m.end() - 6} is not "
            f"followed by a low surrogate escape")


@functools.lru_cache(maxsize=None)
def _wire(model_cls):
    """A msgspec struct with ``model_cls``'s field names, every one optional and kept as its raw
    JSON (read by ``_field``; ``documents`` by ``_documents``)."""
    return msgspec.defstruct(f"{model_cls.__name__}Wire",
                             [(name, msgspec.Raw, msgspec.UNSET) for name in model_cls.model_fields])


class _TextWire(msgspec.Struct):
    """An object document's ``text`` (raw); its other keys are skipped unread."""
    text: msgspec.Raw = msgspec.UNSET


#: the lists of documents (the rerank routes' and a score request's document side): their 413 is
#: request_checks.check_documents' own
DOCUMENT_LISTS = ("documents", "texts", "items", "data_2", "text_2")
#: an array over the bound is counted for the 413's message when its JSON is at most this long
#: (~20 ms); a longer one is "more than"
COUNTED_BYTES_MAX = 1 << 20


def _too_many(raw, where: str, max_items: int) -> APIError:
    """The 413 for an array ``raw`` of more than ``max_items`` items."""
    what = "documents" if where in DOCUMENT_LISTS else f"items in {where}"
    if len(memoryview(raw)) > COUNTED_BYTES_MAX:
        return APIError(413, f"more {what} than the limit of {max_items} per request (--max-documents)")
    n = len(msgspec.json.decode(raw, type=list[msgspec.Raw]))
    return APIError(413, f"{n} {what} exceed the limit of {max_items} per request (--max-documents)")


#: the largest ``max_items`` read through ``_bounded_array`` (a struct of 65,536 fields: ~0.1 s to
#: define once, ~0.2 ms a decode); past it an array is read whole, then counted
BOUNDED_ARRAY_MAX = 65_536


@functools.lru_cache(maxsize=4)
def _bounded_array(max_items: int):
    """A msgspec type for an array of at most ``max_items`` items, each kept raw: a struct read as an
    array (``array_like``) with one optional field per item and no extra item allowed, so msgspec
    stops at item ``max_items + 1`` (1 ms into ten million ``""``; a list of them read whole and
    then counted took 0.6 s and 570 MB, holding the GIL)."""
    return msgspec.defstruct("BoundedArray", [(f"i{k}", msgspec.Raw, msgspec.UNSET) for k in range(max_items)],
                             array_like=True, forbid_unknown_fields=True)


def _items(raw, where: str, max_items: Optional[int]) -> list:
    """The raw JSON of each item of the array ``raw`` (one ``msgspec.Raw`` each, a view of the
    body); APIError 413 when there are more than ``max_items``, found before the rest are read."""
    if max_items is None or max_items > BOUNDED_ARRAY_MAX:
        items = msgspec.json.decode(raw, type=list[msgspec.Raw])
        if max_items is not None and len(items) > max_items:
            raise _too_many(raw, where, max_items)
        return items
    try:   # raw is valid JSON (the body decoded): the only error left is an item past the bound
        slots = msgspec.structs.astuple(msgspec.json.decode(raw, type=_bounded_array(max_items)))
    except msgspec.ValidationError:
        raise _too_many(raw, where, max_items) from None
    lo, hi = 0, len(slots)   # the items fill the first slots: the first one left UNSET ends them
    while lo < hi:
        mid = (lo + hi) // 2
        if slots[mid] is msgspec.UNSET:
            hi = mid
        else:
            lo = mid + 1
    return list(slots[:lo])


def _field(raw, where: str, max_items: Optional[int]):
    """A known field's value for pydantic from its raw JSON, built as deep as the schemas read one
    (module docstring): an array's items and an object's values each ``_stand_in``."""
    first = _first(raw)
    if first == b"[":
        return [_stand_in(item, f"{where}[{i}]") for i, item in enumerate(_items(raw, where, max_items))]
    if first == b"{":
        return _kwargs(raw, where)
    return decode_raw(raw, where)


class _KwargsWire(msgspec.Struct, forbid_unknown_fields=True):
    """vLLM's ``chat_template_kwargs`` as served: its ``instruction`` (raw); msgspec stops at any
    other key, unread past it."""
    instruction: msgspec.Raw = msgspec.UNSET


_UNKNOWN_KEY = re.compile(r"Object contains unknown field `(.*)`$", re.S)


def _kwargs(raw, where: str) -> dict:
    """The object field ``raw`` (``chat_template_kwargs``, the schemas' one) for pydantic: its
    ``instruction`` stood in for (``_stand_in``), or, at its first other key, ``{key: {}}`` alone:
    ``request_checks.check_vllm_options`` refuses any other key with a 400 naming it
    (docs/serving.md, "Endpoints"), so the keys after it, any number of them, are never read."""
    try:
        wire = msgspec.json.decode(raw, type=_KwargsWire)
    except msgspec.ValidationError as e:   # raw is valid JSON: the error is the first other key
        return {_UNKNOWN_KEY.match(str(e)).group(1): {}}
    if wire.instruction is msgspec.UNSET:
        return {}
    return {"instruction": _stand_in(wire.instruction, f"{where}.instruction")}


def decode_raw(raw, where: str):
    """``raw`` (JSON bytes or ``msgspec.Raw``) built; APIError 422 naming ``$.where`` if msgspec cannot."""
    try:
        return msgspec.json.decode(raw)
    except (msgspec.ValidationError, msgspec.DecodeError) as e:   # a number out of range
        raise APIError(422, f"malformed JSON body: {e} - at `$.{where}`") from None


def _first(raw) -> bytes:
    """The first byte of a raw JSON value (its type: msgspec gives it with no whitespace before)."""
    return bytes(memoryview(raw)[:1])


def _stand_in(raw, where: str):
    """A value of ``raw``'s JSON type for pydantic, built only where the schema reads it: a string
    (or number, bool, null) decoded; an array or object where a string is due is ``[]`` or ``{}``
    (pydantic's message names the type, never the content)."""
    first = _first(raw)
    if first == b"[":
        return []
    if first == b"{":
        return {}
    return decode_raw(raw, where)


def _documents(raw, max_items: Optional[int]):
    """``(documents for pydantic, raw JSON of each object document or None)`` from the raw
    ``documents`` value (module docstring): objects are read for their ``text`` only; 413 past
    ``max_items`` documents, before any is read."""
    if _first(raw) != b"[":
        return _stand_in(raw, "documents"), None
    items = _items(raw, "documents", max_items)
    docs, raws = [], []
    for i, item in enumerate(items):
        if _first(item) == b"{":
            try:   # it goes back as sent: its skipped strings must be UTF-8 too (a transient copy)
                str(memoryview(item), "utf-8")
            except UnicodeDecodeError as e:
                raise APIError(422, f"malformed JSON body: invalid UTF-8 in documents[{i}] ({e.reason})") from None
            text = msgspec.json.decode(item, type=_TextWire).text
            docs.append({} if text is msgspec.UNSET else {"text": _stand_in(text, f"documents[{i}].text")})
            raws.append(item)
        else:
            docs.append(_stand_in(item, f"documents[{i}]"))
            raws.append(None)
    return docs, raws


def validation_message(errors) -> str:
    """pydantic's errors as one line: ``field: message; ...`` (at most five)."""
    problems = []
    for err in list(errors)[:5]:
        where = ".".join(str(p) for p in err.get("loc", ()) if p != "body") or "body"
        problems.append(f"{where}: {err.get('msg')}")
    return "invalid request: " + "; ".join(problems)


def parse_body(body: bytes, model_cls, fields: Optional[set] = None, max_items: Optional[int] = None):
    """``model_cls`` (a pydantic model) from a JSON body, or ``APIError(422)``. Blocking: run it in a worker.

    max_items: the most items a known array field may hold, else
    ``APIError(413)`` before they are read: the server's ``--max-documents``, which every list of a
    request is held to (documents, texts, a score request's either side) or far below (None: no bound).

    fields: if given, gets the body's top-level fields of ``model_cls`` that are not null once the
    JSON is decoded, also when validation then fails (the app picks an error's shape by them:
    errors.speaks_tei; ``"texts": null`` beside ``documents`` is a documents body, as it is validated).

    A leading UTF-8 byte order mark is skipped (RFC 8259 section 8.1 lets a parser ignore it, and
    ``json.loads`` of bytes does, so FastAPI servers such as vLLM accept it; some Windows clients
    send it); msgspec called it malformed JSON at byte 0."""
    if body[:3] == UTF8_BOM:
        body = memoryview(body)[3:]   # no copy of a body of up to --max-body-bytes
    try:
        wire = msgspec.json.decode(body, type=_wire(model_cls))
    except RecursionError:
        raise APIError(422, "malformed JSON body: nested too deeply") from None
    except msgspec.ValidationError as e:   # a top level that is not an object; a number out of range
        raise APIError(422, f"malformed JSON body: {e}") from None
    except msgspec.DecodeError as e:       # not JSON, invalid UTF-8, truncated
        raise APIError(422, f"malformed JSON body: {_decode_error(body, e)}") from None
    data = {name: v for name in model_cls.model_fields if (v := getattr(wire, name)) is not msgspec.UNSET}
    if fields is not None:   # null is the field left out, as validation reads it (docs/serving.md, "Endpoints")
        fields.update(name for name, v in data.items() if _first(v) != b"n")
    raws = None
    for name, raw in data.items():
        if name == "documents":
            data[name], raws = _documents(raw, max_items)
        else:
            data[name] = _field(raw, name, max_items)
    try:
        req = model_cls.model_validate(data)
    except pydantic.ValidationError as e:
        raise APIError(422, validation_message(e.errors())) from None
    except RecursionError:
        raise APIError(422, "invalid request: nested too deeply") from None
    if raws is not None and "_as_sent" in model_cls.__private_attributes__:
        req._as_sent = raws   # RerankRequest.response_document answers these
    return req
