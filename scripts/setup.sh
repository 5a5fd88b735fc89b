#!/usr/bin/env bash
# Create .venv (once) and install acarerank with its test extras, on a fresh CPU machine.
# torch is pinned to 2.13.0, from the configured pip index; PyPI's Linux wheel is the multi-GB
# CUDA build, pinned or not (docs/install.md: put the CPU wheel in .venv first). The extensions
# acarerank._C and acarerank._cpu are built by CMake + ninja during the editable install
# (C++ always; CUDA when nvcc is found unless ACARERANK_NO_CUDA=1).
set -euo pipefail
cd "$(dirname "$0")/.."
# Python 3.10+ (setup.py's python_requires): checked first, as pip would otherwise report an older
# one as a torch dependency conflict
python3 -c 'import sys; sys.exit(sys.version_info < (3, 10))' || {
  echo "scripts/setup.sh: Python 3.10+ is needed, python3 is $(python3 -V 2>&1)" >&2; exit 1; }
# a .venv whose creation failed (no ensurepip: Debian's python3-venv missing; or cut short) has
# bin/python but no bin/activate: made again, not reused. One made without pip (uv venv,
# --without-pip) is kept, with what was put in it (torch's CPU wheel, docs/install.md): pip added
if [ ! -x .venv/bin/python ] || [ ! -f .venv/bin/activate ]; then
  rm -rf .venv
  python3 -m venv .venv || {
    echo "scripts/setup.sh: python3 -m venv failed (on Debian/Ubuntu: apt install python3-venv)" >&2; exit 1; }
elif ! .venv/bin/python -m pip --version > /dev/null 2>&1; then
  .venv/bin/python -m ensurepip --upgrade > /dev/null || {
    echo "scripts/setup.sh: .venv has no pip and ensurepip failed; install pip into .venv, or remove .venv" >&2
    exit 1; }
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip
python -m pip install -q "torch==2.13.0"
python -m pip install -q "setuptools>=64" wheel "pybind11>=2.12" "cmake>=3.24" ninja
python -m pip install -q --no-build-isolation -e ".[test]"
# pip -q hides the build's lines: say whether acarerank._C and acarerank._cpu load (_C missing: exit 1)
python scripts/check_install.py
