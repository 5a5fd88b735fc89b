"""The JSON error shapes: ``{"error": {"message", "type", "code"}}``, and TEI's on its route.

``code`` is the HTTP status (as vLLM and Infinity send it), ``type`` a stable machine word. It is
vLLM's ``ErrorResponse`` less its optional ``param``, so an OpenAI-style client reads
``error.message`` on every route. Input never causes a 500: bad input is 400/413/422, load is 429,
shutdown 503.

Text Embeddings Inference answers ``{"error": "<message>", "error_type": "<ErrorType>"}``
(router/src/lib.rs ``ErrorResponse``), and its clients read ``error`` as the message: our object
there is no message. So ``/rerank``, TEI's one route, answers errors in TEI's shape unless the
body was read and is not TEI's (``documents`` and no ``texts``: the Cohere, Jina and vLLM clients
that also call ``/rerank`` keep ours); before its body is parsed (drain, key, size, uploads, admission) or
when it does not parse (or its parse was cut short), a ``/rerank`` request is taken for TEI's; a
431 too, whether the gate or the protocol measures the head (docs/serving.md, "Errors").
The status is ours on every route; ``error_type`` is TEI's word for it (``TEI_ERROR_TYPES``).
"""
from __future__ import annotations

import json
from typing import Optional

#: nginx's status for "client closed request": counted in the metrics, never sent (nobody is there)
CLIENT_CLOSED = 499
#: scope key: the status of the error the connection's protocol wrote itself before it closed the
#: connection under a request being read (``protocol.py``), so that request is counted as that,
#: not as a client that left
ANSWERED_BY_PROTOCOL = "acarerank.answered_by_protocol"


def log_safe(value, limit: int = 200) -> str:
    """``value`` (a client's path, an error naming its text) as one log line's part: characters that
    are not printable escaped as Python writes them (a %0A in a path wrote a forged log line, an
    %1B a terminal escape) and cut to ``limit`` characters."""
    text = str(value)
    if len(text) > limit:
        text = text[:limit] + "..."
    return text if text.isprintable() else "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)

#: status -> error type
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "method_not_allowed",
    408: "request_timeout",
    413: "request_too_large",
    415: "unsupported_media_type",
    422: "validation_error",
    431: "request_header_fields_too_large",
    429: "rate_limit_error",
    500: "internal_error",
    503: "service_unavailable",
    504: "timeout",
}


class APIError(Exception):
    """An HTTP error with its message; ``headers`` go on the response (e.g. Retry-After)."""

    def __init__(self, status: int, message: str, headers: Optional[dict] = None, type: Optional[str] = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = headers or {}
        self.type = type or ERROR_TYPES.get(status, "error")


def error_body(status: int, message: str, type: Optional[str] = None) -> dict:
    return {"error": {"message": message, "type": type or ERROR_TYPES.get(status, "error"), "code": status}}


def error_bytes(status: int, message: str) -> bytes:
    return json.dumps(error_body(status, message)).encode()


#: TEI's route: its errors are TEI's shape (module docstring)
TEI_PATH = "/rerank"
#: status -> TEI's ErrorType (router/src/lib.rs): TEI answers Overloaded 429, Unhealthy 503, Backend
#: 424 and Validation 422 (a batch too large included); a 504 here is the wait or the run outlasting
#: --request-timeout, a load problem; every other 4xx is the request's (Validation), 5xx the model's
TEI_ERROR_TYPES = {429: "Overloaded", 503: "Unhealthy", 504: "Overloaded"}


def tei_error_type(status: int) -> str:
    return TEI_ERROR_TYPES.get(status, "Validation" if status < 500 else "Backend")


def route_path(scope: dict) -> str:
    """The request's path as the app routes it: ``scope["path"]`` without the ``root_path`` it
    starts with (Ray Serve's ``route_prefix``: "/acare/v1/rerank" under "/acare" is "/v1/rerank";
    compared whole, no API path matched there and the gate admitted nothing as an API request)."""
    path, root = scope.get("path", ""), scope.get("root_path", "")
    if root and path.startswith(root) and (len(path) == len(root) or path[len(root)] == "/"):
        return path[len(root):] or "/"
    return path


def speaks_tei(path: str, state: Optional[dict]) -> bool:
    """Whether an error on ``path`` goes in TEI's shape: on ``TEI_PATH`` unless the request's body
    was read and names ``documents`` and no ``texts`` (``state["body_fields"]``: the top-level
    fields the body had, null ones left out as validation leaves them, set by the app once it is
    read; absent before)."""
    if path != TEI_PATH:
        return False
    fields = (state or {}).get("body_fields")
    return fields is None or "texts" in fields or "documents" not in fields


def error_for(scope: dict, status: int, message: str, type: Optional[str] = None) -> dict:
    """The error body for a request (its ASGI ``scope``): TEI's on TEI's route, else ours."""
    if speaks_tei(route_path(scope), scope.get("state")):
        return {"error": message, "error_type": tei_error_type(status)}
    return error_body(status, message, type)
