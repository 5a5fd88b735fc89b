#!/usr/bin/env bash
# The test command: set up (idempotent), then the whole suite on CPU.
# Triton kernels run under TRITON_INTERPRET=1 when no GPU is present (tests/conftest.py).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
# A full disk fails tests far from its cause (an OSError in a fixture, then pytest's own output
# capture): say it first. The suite needs about 1 GiB of temporary space at a time (README).
python -c 'import shutil, sys, tempfile
d = tempfile.gettempdir(); free = shutil.disk_usage(d).free / 2**30
if free < 2: print(f"warning: {free:.1f} GiB free in {d}; the tests need about 1 GiB of temporary space", file=sys.stderr)'
# setup.sh built acarerank._C: its tests must run, not skip (tests/_ext.py)
ACARERANK_REQUIRE_EXT=1 python -m pytest -q -p no:cacheprovider "$@"
