"""parse_selection against independent references of the paper's rules (Eq. 2 / Eq. 6).

Strict reference: the output is valid iff re-writing the numbers it contains in the canonical
form "[a] [b] ..." gives back the (stripped) text, and those ids are in 1..n, distinct, at
least one and at most the cap. Lenient reference: a character scan for "[", digits, "]".
"""
import re

import pytest
from _hypothesis import given, settings, st  # hypothesis, or skips where absent

from acarerank.setwise.selection import ParsedSelection, parse_selection


def strict_ref(text, n, cap):
    body = text.strip()
    ids = [int(x) for x in re.findall(r"[0-9]+", body)]
    ok = (len(ids) >= 1 and " ".join(f"[{i}]" for i in ids) == body and all(1 <= i <= n for i in ids)
          and len(set(ids)) == len(ids) and (cap is None or len(ids) <= cap))
    return ids if ok else None


def lenient_ref(text, n, cap):
    out, i = [], 0
    while i < len(text):
        if text[i] == "[":
            j = i + 1
            while j < len(text) and text[j].isspace():
                j += 1
            k = j
            while k < len(text) and text[k] in "0123456789":
                k += 1
            m = k
            while m < len(text) and text[m].isspace():
                m += 1
            if k > j and m < len(text) and text[m] == "]":
                v = int(text[j:k])
                if 1 <= v <= n and v not in out and (cap is None or len(out) < cap):
                    out.append(v)
                i = m + 1
                continue
        i += 1
    return out


def _check(text, n, cap):
    s = parse_selection(text, n, cap, strict=True)
    ln = parse_selection(text, n, cap, strict=False)
    want = strict_ref(text, n, cap)
    assert s.valid == (want is not None) == ln.valid, (text, n, cap, s, want)
    assert s.ids == (want or []), (text, n, cap, s.ids, want)
    assert s.indices == [i - 1 for i in s.ids]
    assert (s.error is None) == s.valid and (ln.error is None) == ln.valid
    assert ln.ids == lenient_ref(text, n, cap), (text, n, cap, ln.ids, lenient_ref(text, n, cap))
    assert ln.indices == [i - 1 for i in ln.ids]
    if s.valid:
        assert ln.ids == s.ids


# Cases written from the paper's format rules, with the expected strict ids (None: invalid).
CASES = [
    ("[2] [5] [8]", 10, 10, [2, 5, 8]),                 # Eq. 2's example
    ("[4] [2] [7] [11] [1]", 11, 10, [4, 2, 7, 11, 1]),  # Appendix F's example
    ("[4] [2] [7] [11] [1]", 10, 10, None),             # 11 out of range
    ("[1]", 1, 10, [1]),
    ("  [3] [1]\n", 3, 10, [3, 1]),                     # surrounding whitespace carries no identifier
    ("", 5, 10, None),
    ("   ", 5, 10, None),
    ("[0]", 5, 10, None),
    ("[04]", 5, 10, None),                              # leading zero
    ("[4][2]", 5, 10, None),                            # missing space
    ("[4]  [2]", 5, 10, None),                          # two spaces
    ("[4], [2]", 5, 10, None),
    ("[4] [2] [4]", 5, 10, None),                       # duplicate
    ("[1] [2] [3]", 5, 2, None),                        # over the cap
    ("[1] [2]", 5, 2, [1, 2]),
    ("[ 3]", 5, 10, None),
    ("The answer is [3]", 5, 10, None),
    ("[3] is best", 5, 10, None),
    ("[1] [12]", 12, 10, [1, 12]),
    ("[12] [1]", 12, 10, [12, 1]),
    ("[100]", 100, 10, [100]),
    ("[1] [2] [3] [4] [5] [6] [7] [8] [9] [10] [11]", 20, None, list(range(1, 12))),
]


@pytest.mark.parametrize("text,n,cap,want", CASES)
def test_cases(text, n, cap, want):
    s = parse_selection(text, n, cap)
    assert s.valid == (want is not None), (text, s)
    assert s.ids == (want or []), (text, s.ids, want)
    _check(text, n, cap)


def test_lenient_salvage():
    # out of range, duplicate and over-cap identifiers are dropped, order kept
    s = parse_selection("Sure: [3], [9] [3] [ 1 ] [04] [2]", 5, max_select=3, strict=False)
    assert s == ParsedSelection(ids=[3, 1, 4], indices=[2, 0, 3], valid=False, error=s.error)
    assert s.error and "[<id>]" in s.error


@settings(max_examples=150, deadline=None)
@given(ids=st.lists(st.integers(1, 60), min_size=1, max_size=12, unique=True), n=st.integers(1, 60),
       cap=st.one_of(st.none(), st.integers(1, 12)))
def test_canonical_selections(ids, n, cap):
    text = " ".join(f"[{i}]" for i in ids)
    s = parse_selection(text, n, cap)
    expect_valid = max(ids) <= n and (cap is None or len(ids) <= cap)
    assert s.valid == expect_valid, (text, n, cap, s)
    assert s.ids == (ids if expect_valid else [])
    _check(text, n, cap)


@settings(max_examples=300, deadline=None)
@given(text=st.text(alphabet="[]0123456789 ,x\n", max_size=24), n=st.integers(1, 30),
       cap=st.one_of(st.none(), st.integers(1, 5)))
def test_random_text_against_reference(text, n, cap):
    _check(text, n, cap)


@pytest.mark.parametrize("args,err", [
    ((None, 5), TypeError), ((b"[1]", 5), TypeError), (("[1]", 0), ValueError), (("[1]", 2.0), ValueError),
    (("[1]", True), ValueError), (("[1]", 5, 0), ValueError), (("[1]", 5, 1.5), ValueError),
])
def test_bad_arguments(args, err):
    with pytest.raises(err):
        parse_selection(*args)
