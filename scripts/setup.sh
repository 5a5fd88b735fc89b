#!/usr/bin/env bash
# Create .venv (once) and install acarerank with its test extras, on a fresh CPU machine.
# torch is pinned to 2.13.0, from the configured pip index; PyPI's Linux wheel is the multi-GB
# CUDA build, pinned or not (docs/install.md: put the CPU wheel in .venv first). The extensions
# acarerank._C and acarerank._cpu are built by CMake + ninja during the editable install
# (C++ always; CUDA when nvcc is found unless ACARERANK_NO_CUDA=1).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip
python -m pip install -q "torch==2.13.0"
python -m pip install -q "setuptools>=64" wheel "pybind11>=2.12" "cmake>=3.24" ninja
python -m pip install -q --no-build-isolation -e ".[test]"
# pip -q hides the build's lines: say whether acarerank._C and acarerank._cpu load (_C missing: exit 1)
python scripts/check_install.py
