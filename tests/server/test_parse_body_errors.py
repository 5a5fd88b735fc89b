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


@pytest.mark.parametrize("kwargs, named", [
    (b'{"a\\u0060b": 1, "instruction": "I"}', "['a`b']"),      # a key escaped, with a backtick
    (b'{"instruction": "I", "x": [[]], "y": 0}', "['x']"),     # the first other key, not the rest
])
def test_chat_template_kwargs_is_read_up_to_its_first_other_key(kwargs, named):
    """docs/serving.md, "Errors": a key other than ``instruction`` is the 400 naming it, and the keys
    after it are never read (read whole, 3.1 million of them took 5 s holding the GIL for a 413)."""
    from acarerank.server.request_checks import check_vllm_options
    req = parse_body(b'{"query": "q", "documents": ["a"], "chat_template_kwargs": ' + kwargs + b"}",
                     RerankRequest, max_items=1000)
    with pytest.raises(APIError) as e:
        check_vllm_options(req)
    assert e.value.status == 400 and f"chat_template_kwargs {named} not supported" in e.value.message, \
        (e.value.status, e.value.message)
    assert len(req.chat_template_kwargs) == 1, req.chat_template_kwargs   # the rest unread


def test_chat_template_kwargs_instruction_alone_is_read():
    ok = parse_body(b'{"query": "q", "documents": ["a"], "chat_template_kwargs": {"instruction": "Judge."}}',
                    RerankRequest)
    assert ok.chat_template_kwargs == {"instruction": "Judge."}, ok.chat_template_kwargs
    with pytest.raises(APIError) as e:   # a number out of range where the schema reads one
        parse_body(b'{"query": "q", "documents": ["a"], "chat_template_kwargs": {"instruction": 1e999}}',
                   RerankRequest)
    assert e.value.status == 422 and "$.chat_template_kwargs.instruction" in e.value.message, e.value.message
