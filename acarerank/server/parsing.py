"""Request bodies from bytes: msgspec decodes, pydantic validates; both off the event loop.

``msgspec`` decodes the body into a struct holding only the schema's own fields (typed ``Any``):
an unknown field is skipped without building a Python object for it (a 30 MB array of ``[]``
in an ignored field decodes in ~0.06 s and ~70 MB here, where ``json.loads`` took 2.9 s and
800 MB, orjson 3.6 s and 940 MB, pydantic's ``model_validate_json`` 2.2 s and 600 MB). Then the
pydantic model (``schemas.py``) validates the known fields exactly as before: strict types,
the same messages.

``documents`` is read the same way, element by element (``_documents``): a string is decoded,
an object only for its ``text``; the object's other keys are never built: it is kept as its raw
JSON (``msgspec.Raw``, a view of the body, no copy), which ``return_documents`` sends back as sent.
Built, they cost ~45 times their size and seconds of CPU (a 30 MB body of ``[]`` in one
document's other key: 1.4 GB and 2.6 s to decode, 2.9 s more on the event loop to answer).

Every malformed body is a 422 naming what is wrong: invalid JSON or UTF-8 (a lone surrogate
escape included), nesting deeper than Python's recursion limit, an integer or float out of
range in a known field, a top level that is not an object.
"""
from __future__ import annotations

import functools
from typing import Any, Optional

import msgspec
import pydantic

from .errors import APIError

UTF8_BOM = b"\xef\xbb\xbf"


@functools.lru_cache(maxsize=None)
def _wire(model_cls):
    """A msgspec struct with ``model_cls``'s field names, every one ``Any`` and optional
    (``documents``: its raw JSON, read by ``_documents``)."""
    return msgspec.defstruct(f"{model_cls.__name__}Wire",
                             [(name, msgspec.Raw if name == "documents" else Any, msgspec.UNSET)
                              for name in model_cls.model_fields])


class _TextWire(msgspec.Struct):
    """An object document's ``text`` (raw); its other keys are skipped unread."""
    text: msgspec.Raw = msgspec.UNSET


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


def _documents(raw):
    """``(documents for pydantic, raw JSON of each object document or None)`` from the raw
    ``documents`` value (module docstring): objects are read for their ``text`` only."""
    if _first(raw) != b"[":
        return _stand_in(raw, "documents"), None
    items = msgspec.json.decode(raw, type=list[msgspec.Raw])
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


def parse_body(body: bytes, model_cls, fields: Optional[set] = None):
    """``model_cls`` (a pydantic model) from a JSON body, or ``APIError(422)``. Blocking: run it in a worker.

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
        raise APIError(422, f"malformed JSON body: {e}") from None
    data = {name: v for name in model_cls.model_fields if (v := getattr(wire, name)) is not msgspec.UNSET}
    if fields is not None:   # null is the field left out, as validation reads it (docs/serving.md, "Endpoints")
        fields.update(name for name, v in data.items()
                      if v is not None and not (isinstance(v, msgspec.Raw) and _first(v) == b"n"))
    raws = None
    if "documents" in data:
        data["documents"], raws = _documents(data["documents"])
    try:
        req = model_cls.model_validate(data)
    except pydantic.ValidationError as e:
        raise APIError(422, validation_message(e.errors())) from None
    except RecursionError:
        raise APIError(422, "invalid request: nested too deeply") from None
    if raws is not None and "_as_sent" in model_cls.__private_attributes__:
        req._as_sent = raws   # RerankRequest.response_document answers these
    return req
