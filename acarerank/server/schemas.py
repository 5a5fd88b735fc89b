"""Request and response bodies (pydantic). One rerank schema speaks every client's dialect.

``RerankRequest`` accepts, unchanged, what these clients send:

* Cohere v2 (``POST /v2/rerank``, the ``cohere`` SDK's ``ClientV2.rerank``): ``model``,
  ``query``, ``documents`` (strings), ``top_n``, ``max_tokens_per_doc`` (+ ``priority``,
  ``relevant_spans``: accepted and ignored);
* Cohere v1 / Jina / vLLM (``POST /v1/rerank``, ``/rerank``): the same plus
  ``return_documents``; documents may be ``{"text": ...}`` objects (Cohere v1, Jina), whose other
  keys come back with ``return_documents`` as Cohere v1 keeps them; ``rank_fields`` other than
  ``["text"]`` and ``max_chunks_per_doc`` other than 1 (Cohere v1) are refused, not ignored; ``top_n: 0`` means all (vLLM); vLLM's
  ``truncate_prompt_tokens`` is accepted as -1 (cut to the model's length: what
  ``truncate: true`` does) and refused otherwise, its ``use_activation: false`` (also
  ``activation``, ``softmax``: logits) refused as TEI's ``raw_scores``, and its other options of
  ``VLLMOptions`` (``max_tokens_per_query``, ``truncation_side``, ``padding``,
  ``chat_template_kwargs``) honoured at their defaults and refused otherwise; its
  ``max_tokens_per_doc: 0`` is no cut;
* text-embeddings-inference (``POST /rerank``): ``texts`` instead of ``documents``,
  ``truncate``, ``truncation_direction`` (only ``Right``: documents are cut from their end),
  ``raw_scores``, ``return_text`` — answered with TEI's bare list;
* ACARe context: ``question``, ``trace``, ``instruction`` and ``cache_salt`` (tenant key of
  the prefix cache).

Types are strict (a number where a string belongs is a 422, never coerced); ``null`` in an
optional field is the field left out (TEI's ``truncate`` is an ``Option<bool>``). Unknown
fields are ignored, as the peers do; a known field we cannot honour is a 400, never
silently ignored. Emptiness and size limits are checked by the service so that
they get their own codes (400, 413) instead of a generic 422.
"""
from __future__ import annotations

from typing import List, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, StrictBool, StrictInt, StrictStr, field_validator, model_validator



class TextDocument(BaseModel):
    """A document given as ``{"text": ...}`` (Cohere v1 / Jina). Only ``text`` is scored; the
    other keys are kept, so ``return_documents`` answers the object as sent (Cohere v1: "all
    other fields will be preserved in the response")."""
    model_config = ConfigDict(extra="allow")

    text: StrictStr


Document = Union[StrictStr, TextDocument]


class VLLMOptions(BaseModel):
    """vLLM's options of its rerank and score requests (vllm/entrypoints/pooling/, 0.32) that would
    change the scores: honoured where they can be, else refused by the service (400 naming them),
    never ignored. A client built on vLLM's request models sends every one, at its default."""

    truncate_prompt_tokens: Optional[StrictInt] = Field(
        None, description="vLLM: only -1 (cut to the model's length, as truncate: true); a token count is a 400")
    use_activation: Optional[StrictBool] = Field(
        None, description="vLLM: false asks for logits instead of probabilities (not supported: 400, as raw_scores)")
    activation: Optional[StrictBool] = Field(None, description="vLLM's older name of use_activation")
    softmax: Optional[StrictBool] = Field(None, description="vLLM's older name of use_activation")
    max_tokens_per_query: Optional[StrictInt] = Field(
        None, ge=0, description="vLLM: only 0 (no cut); a query is never cut here (a count is a 400)")
    truncation_side: Optional[StrictStr] = Field(
        None, description="vLLM: 'right' (or absent) only; documents are cut from their end ('left': 400)")
    padding: Optional[StrictStr] = Field(None, description="vLLM: 'do_not_pad' (or absent) only ('max_length': 400)")
    chat_template_kwargs: Optional[dict] = Field(
        None, description="vLLM: only 'instruction' (as the instruction field, which it wins over); any other key "
                          "is a 400")


class RerankRequest(VLLMOptions):
    model_config = ConfigDict(extra="ignore")

    model: Optional[StrictStr] = Field(None, description="accepted for compatibility; the server has one model")
    query: StrictStr
    documents: Optional[List[Document]] = None
    texts: Optional[List[StrictStr]] = Field(None, description="TEI: documents; the response is TEI's bare list")
    top_n: Optional[StrictInt] = Field(None, ge=0, description="best n results; None or 0: all")
    return_documents: StrictBool = False
    max_tokens_per_doc: Optional[StrictInt] = Field(
        None, ge=0, description="cut each document to this many tokens; 0 (vLLM's default): no cut")
    truncate: StrictBool = Field(True, description="false: an over-long input is a 400 instead of being cut")
    return_text: StrictBool = False   # TEI
    raw_scores: StrictBool = False    # TEI: logits instead of probabilities (not supported: 400)
    truncation_direction: Optional[StrictStr] = Field(
        None, description="TEI: 'Right' (or absent) only; documents are cut from their end ('Left': 400)")
    rank_fields: Optional[List[StrictStr]] = Field(
        None, description="Cohere v1: only ['text'] (the field scored); any other field is a 400")
    max_chunks_per_doc: Optional[StrictInt] = Field(
        None, description="Cohere v1: only 1 (a document is scored as one chunk, cut from its end); more is a 400")
    question: Optional[StrictStr] = None
    trace: Optional[StrictStr] = None
    instruction: Optional[StrictStr] = None
    cache_salt: Optional[StrictStr] = None
    #: each object document's raw JSON (``msgspec.Raw``; None for a string), set by ``parse_body``,
    #: which never builds an object's other keys (parsing.py says why)
    _as_sent: Optional[list] = PrivateAttr(None)

    @field_validator("return_documents", "truncate", "return_text", "raw_scores", mode="before")
    @classmethod
    def _null_is_the_default(cls, v, info):
        # a client's null is the field left out: TEI declares truncate Option<bool>, Cohere's
        # return_documents is Optional[bool]; without this a null was a 422
        return cls.model_fields[info.field_name].default if v is None else v

    @model_validator(mode="after")
    def _documents_or_texts(self):
        if (self.documents is None) == (self.texts is None):
            raise ValueError("send exactly one of 'documents' (Cohere/Jina/vLLM) or 'texts' (TEI)")
        return self

    @property
    def is_tei(self) -> bool:
        return self.texts is not None

    def document_texts(self) -> list:
        if self.texts is not None:
            return list(self.texts)
        return [d if isinstance(d, str) else d.text for d in self.documents]

    def response_document(self, i: int):
        """Result ``i``'s ``document`` with ``return_documents``: ``{"text": ...}`` for a string,
        the object as sent (its other keys included) for a ``{"text": ...}`` object — its raw JSON
        (``msgspec.Raw``: the response is encoded by ``msgspec.json.encode``) when ``parse_body``
        read it, else the model's dump."""
        d = self.documents[i]
        if isinstance(d, str):
            return {"text": d}
        raw = self._as_sent[i] if self._as_sent is not None else None
        return raw if raw is not None else d.model_dump()


#: vLLM's score API names its two sides in four ways (vllm/entrypoints/pooling/scoring/protocol.py, 0.32):
#: the first of each pair is the query side, the second the document side
SCORE_PAIRS = (("queries", "documents"), ("queries", "items"), ("data_1", "data_2"), ("text_1", "text_2"))
ScoreText = Union[StrictStr, List[StrictStr]]


#: characters of a score request's ``request_id`` (422 past it): a client's id (vLLM sends a uuid)
MAX_REQUEST_ID_CHARS = 256


class ScorePairsRequest(VLLMOptions):
    """vLLM's score API (``POST /score``, ``/v1/score``): the relevance of query/document pairs.

    The two sides are one of the pairs of ``SCORE_PAIRS``, each a string or a list of strings:
    1 query with N documents (N >= 1), or N queries with N documents (pair i: query i with
    document i); the pairing rule and the limits are ``RerankService.score``'s. vLLM's multi-modal
    ``{"content": [...]}`` items are a 422 (this is a text model). Its options that would change the
    scores are refused (400) by the service as on the rerank route; ``truncate`` and ACARe's
    ``question``, ``trace``, ``instruction``, ``cache_salt`` apply to every pair.
    """
    model_config = ConfigDict(extra="ignore")

    model: Optional[StrictStr] = Field(None, description="accepted for compatibility; the server has one model")
    queries: Optional[ScoreText] = Field(None, description="the query side (with documents or items)")
    documents: Optional[ScoreText] = Field(None, description="the document side (with queries)")
    items: Optional[ScoreText] = Field(None, description="the document side (with queries)")
    data_1: Optional[ScoreText] = Field(None, description="the query side (with data_2)")
    data_2: Optional[ScoreText] = Field(None, description="the document side (with data_1)")
    text_1: Optional[ScoreText] = Field(None, description="the query side (with text_2)")
    text_2: Optional[ScoreText] = Field(None, description="the document side (with text_1)")
    # echoed into the response's id and counted in no other limit: a 30 MB id came back whole
    request_id: Optional[StrictStr] = Field(None, max_length=MAX_REQUEST_ID_CHARS,
                                            description="vLLM: the response's id is 'score-<request_id>'")
    max_tokens_per_doc: Optional[StrictInt] = Field(
        None, ge=0, description="cut each document to this many tokens; 0 (vLLM's default): no cut")
    truncate: StrictBool = Field(True, description="false: an over-long input is a 400 instead of being cut")
    question: Optional[StrictStr] = None
    trace: Optional[StrictStr] = None
    instruction: Optional[StrictStr] = None
    cache_salt: Optional[StrictStr] = None

    @field_validator("queries", "documents", "items", "data_1", "data_2", "text_1", "text_2", mode="before")
    @classmethod
    def _text_only(cls, v, info):
        # vLLM's ScoreInput is also {"content": [parts]} (images, video): named, not a bare type error
        if isinstance(v, dict) or (isinstance(v, list) and any(isinstance(x, dict) for x in v)):
            raise ValueError(f"multi-modal items ({{'content': [...]}}) are not supported: this is a text model, "
                             f"send {info.field_name} as a string or a list of strings")
        return v

    @field_validator("truncate", mode="before")
    @classmethod
    def _null_is_the_default(cls, v):
        return True if v is None else v

    @model_validator(mode="after")
    def _one_pair(self):
        sent = [name for name in dict.fromkeys(n for pair in SCORE_PAIRS for n in pair) if getattr(self, name) is not None]
        pairs = [pair for pair in SCORE_PAIRS if set(sent) == set(pair)]
        if len(pairs) != 1:
            names = ", ".join(f"{a} and {b}" for a, b in SCORE_PAIRS)
            raise ValueError(f"send the texts to score as exactly one pair of fields ({names}); got "
                             f"{', '.join(sent) if sent else 'none of them'}")
        return self

    @property
    def pair_names(self) -> tuple:
        """The two field names this request used, e.g. ``("text_1", "text_2")``."""
        return next(pair for pair in SCORE_PAIRS if getattr(self, pair[0]) is not None
                    and getattr(self, pair[1]) is not None)

    def query_texts(self) -> list:
        """The query side as a list (a single string is a list of one)."""
        v = getattr(self, self.pair_names[0])
        return [v] if isinstance(v, str) else list(v)

    def document_texts(self) -> list:
        """The document side as a list (a single string is a list of one)."""
        v = getattr(self, self.pair_names[1])
        return [v] if isinstance(v, str) else list(v)


class ScoreData(BaseModel):
    index: int
    object: str = "score"
    score: float


class ScoreUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int
    completion_tokens: int = 0
    cached_tokens: int = 0


class ScoreResponse(BaseModel):
    id: str
    object: str = "list"
    created: int
    model: str
    data: List[ScoreData]
    usage: ScoreUsage


class DocumentText(BaseModel):
    model_config = ConfigDict(extra="allow")   # an object document's other keys (Cohere v1)

    text: str


class RerankResult(BaseModel):
    index: int
    relevance_score: float
    document: Optional[DocumentText] = None


class Usage(BaseModel):
    prompt_tokens: int
    total_tokens: int
    cached_tokens: int = 0


class BilledUnits(BaseModel):
    search_units: int


class Meta(BaseModel):
    billed_units: BilledUnits


class RerankResponse(BaseModel):
    id: str
    model: str
    results: List[RerankResult]
    usage: Usage
    meta: Meta


class TEIRank(BaseModel):
    index: int
    score: float
    text: Optional[str] = None


class SelectRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: Optional[StrictStr] = None
    query: StrictStr
    documents: List[Document]
    intent: Optional[StrictStr] = Field(None, description="the agent's query intent: the deep-research prompt")
    max_select: StrictInt = Field(10, ge=1)
    cache_salt: Optional[StrictStr] = Field(None, description="prefix-cache namespace (tenant key), as /v1/rerank's")

    def document_texts(self) -> list:
        return [d if isinstance(d, str) else d.text for d in self.documents]


class SelectUsage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class SelectResponse(BaseModel):
    id: str
    model: str
    ids: List[int] = Field(description="1-based identifiers as the model emitted them, most useful first")
    indices: List[int] = Field(description="0-based positions in documents, most useful first")
    text: str
    valid: bool
    usage: SelectUsage


class ErrorDetail(BaseModel):
    message: str
    type: str
    code: int


class ErrorResponse(BaseModel):
    error: ErrorDetail
