"""Every option of ``acarerank serve`` in one place, with its default (vLLM's ``EngineArgs`` is
the model): the CLI, the Ray Serve deployment and the tests all build a ``ServeConfig``.

Standard library only: the CLI parser imports this module, and ``acarerank --help`` must not
import torch or FastAPI.

    parser = argparse.ArgumentParser()
    ServeConfig.add_cli_args(parser)
    config = ServeConfig.from_cli_args(parser.parse_args())
    service = build_service(config)            # acarerank.server.build

The limits and timeouts and how they compare with TEI's and nginx's defaults: docs/serving.md,
"Limits and timeouts".
"""
from __future__ import annotations

import argparse
import dataclasses
import math
from dataclasses import dataclass, field
from typing import Optional

from .._validate import check_seconds  # stdlib only, as this module
from ..limits import DEFAULT_MAX_DOCUMENTS  # stdlib only; the CLI and the service read it here
from ..malloc_tuning import CHOICES as MALLOC_CHOICES  # stdlib only

DEFAULT_MAX_BODY_BYTES = 32 * 1024 * 1024   # 1,000 documents of ~32 kB each
DEFAULT_MAX_QUEUE = 512                      # TEI's default max_concurrent_requests
#: request bodies being received at once (--max-uploads) when the flag is left out: the larger of this
#: and --max-queue. Never below --max-queue: uploads held the queue's slots before they had their own
#: bound, and a smaller one would let fewer stalled uploads refuse every client than it took then.
#: Memory: that many × --max-body-bytes of bodies arriving (16 GiB at the defaults' 512 × 32 MiB,
#: as the queue's own bound); honest uploads are short (32 MiB takes ~0.3 s at 1 Gb/s):
#: docs/serving.md, "Limits and timeouts"
DEFAULT_MAX_UPLOADS = 64
#: seconds a request waits for room in --max-queue-tokens before its 429 (docs/serving.md,
#: "Admission by tokens": under a clients' timeout of 60 s, with time left for the passes)
DEFAULT_TOKEN_WAIT_TIMEOUT = 30.0
#: the most --select-max-new-tokens a server takes: setwise.grammar.max_new_tokens_cap(n) for every
#: pool of up to 1,000 documents (the longest selection of 1,000: 1,000 × (2 + 4 digits) + 1), the
#: cap each /v1/select of such a pool is checked against; a test keeps the two equal
MAX_SELECT_NEW_TOKENS = DEFAULT_MAX_DOCUMENTS * (2 + len(str(DEFAULT_MAX_DOCUMENTS))) + 1
MAX_HEAD_BYTES = 16 * 1024                   # request line + headers: h11's default (nginx: 4 x 8 kB buffers)
#: the names a backend preference takes (acarerank.ops._backend.KNOWN_BACKENDS, spelled out here so
#: that --help imports no torch; a test keeps the two equal)
BACKEND_NAMES = "torch | triton | cpp | cuda | flash_attn_cascade | native | onednn"


def _opt(help: str, *, repr: bool = True, **kw):
    """A field whose metadata carries its ``--flag`` help (and argparse extras: choices, type);
    ``repr=False`` keeps its value out of the config's repr (a secret)."""
    default = kw.pop("default")
    return field(default=default, repr=repr, metadata=dict(help=help, **kw))


@dataclass
class ServeConfig:
    """What one server (one model, one engine, one HTTP front) runs with. Field ``x_y`` is flag ``--x-y``."""

    # -- the model
    model: Optional[str] = _opt("HF checkpoint folder; default: the embedded random-weight model", default=None)
    dtype: str = _opt("auto: bfloat16 on a CPU with native bf16 (AVX512_BF16/AMX), else float32", default="auto",
                      choices=("auto", "float32", "bfloat16", "float16"))
    device: str = _opt("torch device of the model", default="cpu")
    backend: Optional[str] = _opt(f"backend preference: {BACKEND_NAMES}, or per op: "
                                  "attention=triton,yes_no=cuda (default: ACARERANK_BACKEND, else by device)",
                                  default=None)
    max_length: Optional[int] = _opt("token cap per document prompt (default 8,192, or the model's maximum context "
                                     "length when less; past it the server does not start)", default=None, type=int)
    # /v1/select's own caps: the setwise prompt holds every document (AdaTutoRank, Appendix C.4)
    select_max_length: Optional[int] = _opt("/v1/select: prompt token cap; documents are cut evenly to fit (default "
                                            "16,000, the paper's, or the model's maximum context length less "
                                            "--select-max-new-tokens when less; past it the server does not start)",
                                            default=None, type=int)
    select_max_new_tokens: int = _opt("/v1/select: output token cap (default 64, the paper's); a max_select above "
                                      "15 can need more, and is refused (400) when it could", default=64)
    # -- the engine
    max_batch_tokens: Optional[int] = _opt("segment tokens per packed pass (default: on CPU 4,096 with --malloc tuned, "
                                           "else 2,048; 16,384 on GPU)",
                                           default=None, type=int)
    cache_budget: Optional[int] = _opt("prefix-cache budget in tokens, of the rerank cache and of the /v1/select "
                                       "prompt cache each, at least one page of 16 (default: 1 GiB of KV on CPU, 8 GiB on GPU, at most "
                                       "65,536 tokens, each); the running requests pin at most that many "
                                       "shared-part tokens together, the first in line always runs",
                                       default=None, type=int)
    tokenize_workers: int = _opt("threads of the tokenization pool (one request uses at most one)", default=2)
    canary_after_failures: int = _opt("requests failed by the model (or failed scheduler iterations) in a row, "
                                      "no successful pass between, "
                                      "after which a known-good canary request runs alone; if it fails too the "
                                      "engine is dead (503, exit status 70; docs/serving.md, 'A broken engine "
                                      "is found')", default=3)
    request_timeout: Optional[float] = _opt("seconds from a parsed request to its answer (waiting to tokenize, "
                                            "the queue and the passes); past it 504 and its remaining work is "
                                            "dropped (default: none; docs/serving.md, 'Limits and timeouts')",
                                            default=None, type=float)
    max_pass_timeout: float = _opt("seconds one model step (a scheduler pass) may run; past it the engine is "
                                   "dead: /health and /ready 503, every waiting and new request 503 at once, and "
                                   "the process exits 70 for its supervisor to restart (inf: no bound; "
                                   "docs/serving.md, 'What to probe')", default=math.inf)
    # -- admission and per-request limits
    max_queue: int = _opt("requests admitted and unanswered at once, each counted once its whole body has "
                          "arrived; one more gets 429 (before its body is read when the queue is already full "
                          "at its head, else once its body has arrived)", default=DEFAULT_MAX_QUEUE)
    max_uploads: Optional[int] = _opt("request bodies being received at once (POSTs to the rerank, score and "
                                      "select endpoints, before they count in --max-queue); one more gets 429 "
                                      "before its body is read. Memory: up to this × --max-body-bytes of bodies "
                                      "arriving, besides --max-queue × --max-body-bytes held (default: the larger "
                                      f"of {DEFAULT_MAX_UPLOADS} and --max-queue)", default=None, type=int)
    max_queue_tokens: Optional[int] = _opt("tokens of the requests tokenized and unanswered at once (each counted "
                                           "as the engine computes it: the shared part once, every document's "
                                           "segment; a /v1/select's prompt and output cap); one that would pass it "
                                           "waits for room in arrival order (--token-wait-timeout, then 429), one "
                                           "over it alone gets 413 (default: none, only --max-queue bounds the "
                                           "queue; docs/serving.md, 'Admission by tokens')",
                                           default=None, type=int)
    token_wait_timeout: float = _opt("seconds a request that does not fit --max-queue-tokens now waits for room, "
                                     "in arrival order (no later request goes first), holding its --max-queue "
                                     "slot; then 429 with Retry-After (inf: until --request-timeout)",
                                     default=DEFAULT_TOKEN_WAIT_TIMEOUT)
    max_documents: int = _opt("documents per request; more gets 413", default=DEFAULT_MAX_DOCUMENTS)
    max_body_bytes: int = _opt("request body cap in bytes (413)", default=DEFAULT_MAX_BODY_BYTES)
    max_request_chars: int = _opt("characters of query, question, trace, instruction and documents together "
                                  "per request (413)", default=4_000_000)
    max_salt_chars: int = _opt("characters of a cache_salt (422): the prefix cache keeps one tree per salt",
                               default=256)
    # -- connections (nginx's client_header_timeout / client_body_timeout / keepalive_timeout / send_timeout /
    #    worker_connections)
    header_timeout: float = _opt("seconds a connection may take to send a request's headers, then it is closed",
                                 default=60.0)
    body_timeout: float = _opt("seconds a request may take to send its whole body, then 408 (meanwhile it holds "
                               "one of --max-uploads, not a --max-queue slot)", default=60.0)
    keepalive_timeout: float = _opt("seconds an idle keep-alive connection stays open", default=5.0)
    send_timeout: float = _opt("seconds a client may leave a response unread once the socket's buffers are full "
                               "(it reads nothing, or too slowly); then the connection is closed", default=60.0)
    max_connections: int = _opt("open client connections at once; more are closed at once, but 8 for one "
                                "probe each (GET /health, /ready, /metrics) (kept under the process's "
                                "file-descriptor limit)", default=1024)
    # -- the HTTP front
    host: str = _opt("address to listen on", default="127.0.0.1")
    port: int = _opt("port to listen on", default=8000)
    api_key: Optional[str] = _opt("require 'Authorization: Bearer KEY'; unset: $ACARERANK_API_KEY, else open",
                                  default=None, repr=False)   # never in a log line of the config
    trust_cache: bool = _opt("report usage.cached_tokens to requests without a cache_salt (all callers trust "
                             "each other; docs/serving.md, 'Tenancy')", default=False)
    drain_timeout: float = _opt("seconds SIGTERM waits for in-flight requests; then they get 503 and the "
                                "process exits", default=30.0)
    log_level: str = _opt("uvicorn's log level", default="info",
                          choices=("critical", "error", "warning", "info", "debug", "trace"))
    malloc: str = _opt("glibc's malloc in this process: 'tuned' keeps freed blocks in the heap (mmap / trim "
                       "thresholds 512 MB / 1 GB), so a pass's layers reuse them instead of faulting in new pages; "
                       "'default' leaves glibc's adaptive ones. MALLOC_MMAP_THRESHOLD_ / MALLOC_TRIM_THRESHOLD_ in "
                       "the environment win over either (docs/cpu.md, 'Memory between passes')", default="tuned",
                       choices=MALLOC_CHOICES)

    def __post_init__(self):
        self.check()

    def check(self) -> None:
        """ValueError naming the flag for a value no server can run with (no import beyond stdlib)."""
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if v is None and not f.type.startswith("Optional"):
                # a field with no 'off' (max_queue, max_documents, the timeouts: inf is none): None reached
                # the Ray front's arithmetic (build_app's max_queue + 1: a TypeError) or a replica's start
                off = "; inf: no limit" if f.type == "float" else ""
                raise ValueError(f"{_flag(f.name)} must be set (None is not a value of it; leave it out for its "
                                 f"default, {f.default!r}{off})")
            if v is None or f.type in ("str", "Optional[str]", "bool"):
                continue
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise ValueError(f"{_flag(f.name)} must be a number, got {v!r}")
            if f.type == "int" or f.type == "Optional[int]":
                if not isinstance(v, int):
                    raise ValueError(f"{_flag(f.name)} must be an integer, got {v!r}")
                if v < 1 and f.name != "port":
                    raise ValueError(f"{_flag(f.name)} must be >= 1, got {v}")
            else:  # a duration; stored as the float the timers get (an int past a float's range: inf)
                setattr(self, f.name, check_seconds(_flag(f.name), v))
        if self.malloc not in MALLOC_CHOICES:  # argparse checks the flag; Ray's options come as keywords
            raise ValueError(f"--malloc must be one of {', '.join(MALLOC_CHOICES)}, got {self.malloc!r}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be in 0..65535, got {self.port}")
        if self.api_key is not None:
            check_api_key(self.api_key, "--api-key")
        if self.select_max_new_tokens > MAX_SELECT_NEW_TOKENS:  # it started, then refused every /v1/select (400)
            raise ValueError(f"--select-max-new-tokens must be at most {MAX_SELECT_NEW_TOKENS:,} (the longest selection "
                             f"of {DEFAULT_MAX_DOCUMENTS:,} documents; past it every /v1/select of up to "
                             f"{DEFAULT_MAX_DOCUMENTS:,} documents is refused), got {self.select_max_new_tokens:,}")

    # -- the command line ----------------------------------------------------------------------
    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        """One ``--flag`` per field, its default and help from the field."""
        for f in dataclasses.fields(cls):
            meta = dict(f.metadata)
            help = meta.pop("help")
            if f.type == "bool":
                parser.add_argument(_flag(f.name), action="store_true", default=f.default, help=help)
                continue
            kind = meta.pop("type", None) or {"int": int, "float": float}.get(f.type, str)
            parser.add_argument(_flag(f.name), type=kind, default=f.default, help=help, **meta)
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "ServeConfig":
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})

    def replace(self, **changes) -> "ServeConfig":
        return dataclasses.replace(self, **changes)

    def uploads_beside(self, admits: Optional[int]) -> int:
        """Request bodies a gate reads at once in front of a service that admits ``admits``
        requests at once (its own ``max_queue``, or a Ray front's share; None: ``max_queue``):
        ``max_uploads``, or when it is left out the larger of ``DEFAULT_MAX_UPLOADS`` and
        ``admits`` — never fewer stalled uploads refuse every client than filling that queue took."""
        if self.max_uploads is not None:
            return self.max_uploads
        return max(DEFAULT_MAX_UPLOADS, self.max_queue if admits is None else admits)


def check_api_key(key: str, source: str) -> None:
    """ValueError naming ``source`` (the flag or variable) unless a client can send ``key``: the
    gate compares it with the header value, which HTTP strips of surrounding whitespace and
    clients encode as ASCII (or Latin-1), so a key with a trailing newline or a non-ASCII
    character refused every request (401), and an empty ``--api-key`` (``--api-key "$UNSET"``)
    left the server open."""
    if not key:
        raise ValueError(f"{source} is empty: give the key, or leave {source} out for an open server")
    if key != key.strip():
        raise ValueError(f"{source} starts or ends with whitespace, which no client's header can carry "
                         "(HTTP strips it): every request would get 401")
    bad = next((i for i, c in enumerate(key) if not " " <= c <= "~"), None)
    if bad is not None:  # its position, not the character: the key is never printed
        raise ValueError(f"{source} holds a character outside printable ASCII (at position {bad + 1}): HTTP clients "
                         "do not send other characters in a header as UTF-8, so every request would get 401")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")
