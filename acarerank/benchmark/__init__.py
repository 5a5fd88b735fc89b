"""Latency versus reranking depth — the package's main benchmark (``acarerank bench``).

    workload.py   seeded agent contexts and documents, sized in real Qwen3 tokens
    baselines.py  (a) the Qwen3-Reranker model card's transformers path, (b) transformers
                  with a reused prefix KV cache, written as a careful user would
    harness.py    providers side by side: timing, repeats, memory, score agreement
    report.py     CSV, PNG, printed table, depth-scaling figure, FLOP-bound speedup

Imports nothing heavy at package import; ``acarerank.cli.bench`` drives it.
"""
