"""One JSON error shape for every failure: ``{"error": {"message", "type", "code"}}``.

``code`` is the HTTP status (as vLLM and Infinity send it), ``type`` a stable machine word.
Input never causes a 500: bad input is 400/413/422, load is 429, shutdown 503.
"""
from __future__ import annotations

import json
from typing import Optional

#: nginx's status for "client closed request": counted in the metrics, never sent (nobody is there)
CLIENT_CLOSED = 499

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
