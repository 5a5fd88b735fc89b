#!/usr/bin/env bash
# The main job: set up (idempotent), then score a sample agent context against documents
# with the embedded default model (random weights: the scores carry no meaning).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
acarerank score --query "who proposed adaptive tutoring optimization" --docs examples/docs.jsonl \
  --question "Which training method lets a setwise reranker learn from a tutor?" --trace-file examples/trace.txt "$@"
