#!/usr/bin/env bash
# The main job: set up (idempotent), then `acarerank bench` — end-to-end pointwise scoring
# latency versus reranking depth (10, 20, 50, 100; modes M0 and M3), acarerank beside the
# official transformers path and transformers with a reused prefix KV cache, in one run, on
# the embedded default model (random weights: timings are real, scores mean nothing).
# On a CPU with native bf16 (AVX512_BF16/AMX) bf16 rows at depth 50 follow the fp32 ones in
# the same run (--dtype float32,auto), each dtype with its GEMM peak and %peak column.
# Writes results/bench-tiny-cpu-<dtypes>-cpu/{bench.csv,bench.png,bench.txt}. Extra
# arguments go to `acarerank bench` (e.g. --quick for a one-minute smoke run).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
acarerank bench "$@"
