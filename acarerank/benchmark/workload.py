"""Synthetic but realistic agent contexts and retrieved documents, sized in real Qwen3 tokens.

The benchmark needs text whose *token counts* look like a deep-research agent's: a
sub-query of ~20 tokens, the user's question ~60, a reasoning trace ~1,500 (Thought /
Search / Observation steps), and retrieved documents whose lengths vary as retrieval
returns them (uniform 60–380 tokens). Words are sampled (seeded) from a fixed list of
plain English words that the tokenizer keeps whole, arranged into sentences, and each text is cut at a token boundary so that the real tokenizer gives
exactly the wanted count (checked by re-tokenizing; ``token_count`` reports what it is).

Documents of a pool are nested by depth: depth d scores the pool's first d documents,
so the depth-scaling figure compares like with like.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Optional, Sequence

from .._validate import positive_int
from ..limits import DEFAULT_MAX_DOCUMENTS

MAX_DOCS = DEFAULT_MAX_DOCUMENTS  # documents per call (a depth; not a pool): what one server request may carry
MAX_TEXT_TOKENS = 32_768          # tokens of one synthetic text: Qwen3-Reranker's context length

MODES = ("M0", "M1", "M2", "M3")
# Which context fields each ACARe mode carries (docs/ARCHITECTURE.md, "Scoring facts"): M0 sub-query only.
MODE_FIELDS = {"M0": (False, False), "M1": (False, True), "M2": (True, False), "M3": (True, True)}  # (question, trace)


@dataclass(frozen=True)
class WorkloadSpec:
    """Token counts of the synthetic workload (all measured with the real tokenizer).

    doc_tokens: (low, high) inclusive; each document's length is uniform in it (seeded).
    Equal-length documents: low == high.
    """
    query_tokens: int = 20
    question_tokens: int = 60
    trace_tokens: int = 1500
    doc_tokens: tuple = (60, 380)
    num_docs: int = 100
    seed: int = 0

    def __post_init__(self):
        for name in ("query_tokens", "question_tokens", "trace_tokens", "num_docs"):
            v = getattr(self, name)
            positive_int(f"WorkloadSpec.{name}", v)
        lo, hi = self.doc_tokens
        if not (isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= hi):
            raise ValueError(f"WorkloadSpec.doc_tokens must be (low, high) ints with 1 <= low <= high, got {self.doc_tokens!r}")
        check_sizes("WorkloadSpec", dict(query_tokens=self.query_tokens, question_tokens=self.question_tokens,
                                         trace_tokens=self.trace_tokens, doc_tokens=hi), {})


def check_sizes(owner: str, tokens: dict, docs: dict) -> None:
    """ValueError naming the field when a text is over MAX_TEXT_TOKENS or a document count over
    MAX_DOCS: the workload is built in memory before anything is timed."""
    for caps, cap, what in ((tokens, MAX_TEXT_TOKENS, "tokens (Qwen3-Reranker's context length)"),
                            (docs, MAX_DOCS, "documents (the server's documents per request)")):
        for name, v in caps.items():
            if v > cap:
                raise ValueError(f"{owner}.{name} must be at most {cap:,} {what}, got {v:,}")


@dataclass
class Workload:
    """One agent context and a pool of documents; ``context(mode)`` gives the score() kwargs."""
    query: str
    question: str
    trace: str
    documents: list
    doc_token_counts: list = field(default_factory=list)
    spec: Optional[WorkloadSpec] = None

    def context(self, mode: str) -> dict:
        """kwargs for ``score(query, documents, **context)`` in ACARe mode ``mode``."""
        if mode not in MODE_FIELDS:
            raise ValueError(f"unknown context mode {mode!r}; modes: {', '.join(MODES)}")
        with_q, with_t = MODE_FIELDS[mode]
        return dict(query=self.query, question=self.question if with_q else None, trace=self.trace if with_t else None)

    def docs(self, depth: int) -> list:
        if not 1 <= depth <= len(self.documents):
            raise ValueError(f"depth {depth} outside 1..{len(self.documents)} (the workload's document pool)")
        return self.documents[:depth]


# Plain English words for the synthetic text. A fixed list, not the tokenizer's vocabulary:
# the vocabulary holds fragments and words nobody wants printed in a benchmark log.
_WORDS = """
about above account across action active actual added address adult advice after again against age agency agent
agree ahead air allow almost alone along already also always amount analysis ancient animal annual answer appear
apply approach area argue around arrive article artist assume attack attempt author available average avoid away
balance bank base basic battle beach bear beautiful become before begin behind believe benefit best better between
beyond bill biology black blood board body book border both brain branch bread break bridge brief bring broad
brother budget build building burn business call camera campaign capital card care career carry case catch cause
cell center central century certain chain chair challenge chance change chapter charge cheap check chemical chief
child choice choose church circle citizen city civil claim class clean clear climate close coast cold collect
college color column common community company compare complete concept concern condition conference consider
contain content context continue contract control cost could country county couple course court cover create
credit crime critical crop cross culture current customer cycle daily damage data date daughter dead deal debate
decade decide decision deep defense degree demand depend describe design detail develop device differ direct
director discover discuss disease distance district doctor document dollar domestic double draft drive during
early earth east economic economy edge editor education effect effort eight either election electric element
energy engine enough enter entire environment equal error escape estate event evidence exact example exchange
exist expect expert explain export express extend factor fair family famous farm father feature federal field
figure final finance find finger fire firm first fish five flat flight floor focus follow food force foreign
forest form former forward four free fresh friend front fruit full function fund future game garden general
glass global goal gold good govern great green ground group growth guess guide half hand happen hard health
heart heat heavy height help high history hold home hope hospital hotel hour house human hundred idea image
impact import include income increase index industry inform inside instead interest island issue item join
journal judge keep kind kitchen know labor land language large later launch leader learn least leave legal level
library light limit line list listen little live local long machine main major manage market material matter
measure media medical meeting member memory method middle might military million mind minute model modern moment
money month morning mother motion mountain move movie music nation native natural nature near network never
news night north note number object ocean offer office often open option order organ origin other output owner
page paper parent part party pass past patient pattern peace people percent period person phase physical picture
piece place plan plant player point police policy political popular population port position power practice
prepare present press pressure price print private problem process produce product program project property
protect provide public purpose quality question quick radio range rate rather reach read ready real reason
recent record reduce region release remain report research resource response result return river road role
room rule safe sample save scale scene school science score season second section sector security seed select
sense series serve service seven share short side signal simple single sister site size skill small social
soil solar some sound source south space speak special speed spring staff stage standard start state station
step stock stone store story street strong student study style subject success summer supply support surface
system table take talent target task teacher team term test text theory thing third thousand three through
time today total tour trade train travel treat tree trial trip true truth type under union unit update upon
usual valley value various version view village visit voice volume wall water wave wealth weather week weight
west western whole wide wild window winter within without woman wood word work world write year young zone
""".split()


def vocab_words(tokenizer) -> list:
    """The fixed English word list, kept to words that are one token after a space (' word')."""
    words = sorted({w for w in _WORDS if len(tokenizer(" " + w, add_special_tokens=False)["input_ids"]) == 1})
    if len(words) < 100:
        raise ValueError(f"only {len(words)} of the benchmark's {len(_WORDS)} words are single tokens for this "
                         "tokenizer; the workload expects a Qwen3-like byte-level BPE vocabulary")
    return words


def token_count(tokenizer, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def _sentences(rng: random.Random, words: Sequence[str], n_words: int) -> str:
    """n_words words as sentences of 6–18 words, capitalised, with commas and full stops."""
    out, i = [], 0
    while i < n_words:
        k = min(rng.randint(6, 18), n_words - i)
        sent = [rng.choice(words) for _ in range(k)]
        sent[0] = sent[0].capitalize()
        if k > 8 and rng.random() < 0.5:
            sent[rng.randint(2, k - 3)] += ","
        out.append(" ".join(sent) + ".")
        i += k
    return " ".join(out)


def _cut_to_tokens(tokenizer, text: str, n: int) -> str:
    """The longest prefix of ``text`` ending on a token boundary with exactly ``n`` tokens.

    Cutting at the n-th token's end offset can (rarely) change how the last word splits,
    so re-tokenise and step back a character until the count is right.
    """
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    if len(enc["input_ids"]) < n:
        raise ValueError(f"internal: text of {len(enc['input_ids'])} tokens is shorter than the {n} wanted")
    end = enc["offset_mapping"][n - 1][1]
    cut = text[:end].rstrip()
    if token_count(tokenizer, cut) < n:  # the n-th token is whitespace (the newline between trace steps): kept
        cut = text[:end]
    while token_count(tokenizer, cut) > n:
        cut = cut[:-1].rstrip()
    return cut


def _text(tokenizer, rng: random.Random, words, n_tokens: int) -> str:
    # Sentences tokenise to ~1.15 tokens per word (capitals, punctuation); overshoot, then cut.
    return _cut_to_tokens(tokenizer, _sentences(rng, words, n_tokens + 8), n_tokens)


def _trace(tokenizer, rng: random.Random, words, n_tokens: int) -> str:
    """An agent reasoning trace: numbered Thought / Search / Observation steps."""
    parts, step = [], 1
    approx = 0
    while approx < n_tokens + 40:
        thought = _sentences(rng, words, rng.randint(20, 50))
        search = " ".join(rng.choice(words) for _ in range(rng.randint(3, 8)))
        obs = _sentences(rng, words, rng.randint(40, 120))
        parts.append(f"Step {step}.\nThought: {thought}\nSearch: {search}\nObservation: {obs}")
        approx += token_count(tokenizer, parts[-1]) + 1
        step += 1
    return _cut_to_tokens(tokenizer, "\n".join(parts), n_tokens)


def make_workload(tokenizer, spec: WorkloadSpec = WorkloadSpec()) -> Workload:
    """Seeded workload per ``spec``; every text has exactly its wanted token count."""
    rng = random.Random(spec.seed)
    words = vocab_words(tokenizer)
    query = _text(tokenizer, rng, words, spec.query_tokens)
    question = _text(tokenizer, rng, words, spec.question_tokens)
    trace = _trace(tokenizer, rng, words, spec.trace_tokens)
    lo, hi = spec.doc_tokens
    lengths = [rng.randint(lo, hi) for _ in range(spec.num_docs)]
    docs = [_text(tokenizer, rng, words, n) for n in lengths]
    return Workload(query=query, question=question, trace=trace, documents=docs,
                    doc_token_counts=[token_count(tokenizer, d) for d in docs], spec=spec)
