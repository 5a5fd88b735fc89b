#!/usr/bin/env bash
# The test command: set up (idempotent), then the whole suite on CPU.
# Triton kernels run under TRITON_INTERPRET=1 when no GPU is present (tests/conftest.py).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
# setup.sh built acarerank._C: its tests must run, not skip (tests/_ext.py)
ACARERANK_REQUIRE_EXT=1 python -m pytest -q -p no:cacheprovider "$@"
