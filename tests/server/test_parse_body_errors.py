"""The 422 messages of a malformed body name what is wrong (``acarerank.server.parsing.parse_body``).

msgspec reports a lone high-surrogate escape (``\\ud800`` with no ``\\udc00``-``\\udfff`` escape
after it) as "Input data was truncated" at the body's end, or as "unexpected end of hex escape"
a few bytes on; the message names the escape and its byte instead. Any other malformed body keeps
msgspec's own message.
"""
import pytest
from _optional import require

require("msgspec", "pydantic")
from acarerank.server.errors import APIError  # noqa: E402
from acarerank.server.parsing import parse_body  # noqa: E402
from acarerank.server.schemas import RerankRequest  # noqa: E402

LONE = "invalid utf-16 surrogate pair"


@pytest.mark.parametrize("body, says", [
    (b'{"query": "q\\ud800"}', [LONE, "\\ud800 at byte 12"]),                       # at the string's end
    (b'{"query": "q\\ud800x", "documents": ["a"]}', [LONE, "\\ud800 at byte 12"]),  # followed by text
    (b'{"query": "q\\uDBFF\\u0041", "documents": ["a"]}', [LONE, "\\uDBFF at byte 12"]),  # by another escape
    (b'{"query": "\\ud800\\ud800\\udc00"}', [LONE, "at byte 11"]),                 # the first of two highs
    (b'{"query": "q\\\\\\ud800x"}', [LONE, "at byte 14"]),                          # after an escaped backslash
    (b'{"query": "q\\\\ud800x", "documents": ["a"', ["Input data was truncated"]),  # text "\ud800": not an escape
    (b'{"query": "\\ud83d\\ude00", "documents": [1 2]}', ["expected ',' or ']'"]),  # a valid pair, then bad JSON
])
def test_a_malformed_body_is_named(body, says):
    with pytest.raises(APIError) as e:
        parse_body(body, RerankRequest)
    assert e.value.status == 422, (e.value.status, e.value.message)
    for part in says:
        assert part in e.value.message, (body, e.value.message)
    if LONE not in says:
        assert LONE not in e.value.message, (body, e.value.message)


def test_a_valid_surrogate_pair_decodes():
    assert parse_body(b'{"query": "\\ud83d\\ude00", "documents": ["a"]}', RerankRequest).query == "\U0001F600"
