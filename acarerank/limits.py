"""Request-size limits the library, the command line and the server share.

Standard library only: ``acarerank --help`` imports it through the server's option list, and
the setwise grammar and the benchmark workloads read it without importing the server.
"""
from __future__ import annotations

#: documents one call may carry: a server request's default cap (``--max-documents``; Cohere's
#: recommended ceiling per request), the benchmark's deepest depth, and the pool size up to which
#: the setwise output cap stays that of a 1,000-document pool (``setwise.grammar.max_new_tokens_cap``)
DEFAULT_MAX_DOCUMENTS = 1000
