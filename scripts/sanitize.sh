#!/usr/bin/env bash
# The C++ kernels (acarerank._cpu and acarerank._C's CPU twins) under AddressSanitizer and
# UndefinedBehaviorSanitizer: an out-of-bounds read or write, a use after free, a signed overflow
# or a bad shift in a kernel stops the run with its report, where the plain build would go on with
# a wrong value or none (docs/cpu.md, "Checking the kernels under sanitizers").
#
#   bash scripts/sanitize.sh                     # the native kernels' tests (~3 min build + ~4 min on 2 cores)
#   bash scripts/sanitize.sh tests/ops/test_op_attention.py -k cpp   # any pytest arguments instead
#
# Needs `bash scripts/setup.sh` first (its .venv: torch, pybind11, cmake, ninja) and gcc's
# libasan/libubsan (Debian: part of gcc). Builds in build/sanitize/ (CUDA off) and runs the tests
# in a copy of acarerank/ and tests/ there, so the package's own modules are never replaced.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=$ROOT/build/sanitize
TREE=$OUT/tree
. .venv/bin/activate

asan=$(gcc -print-file-name=libasan.so)
ubsan=$(gcc -print-file-name=libubsan.so)
for lib in "$asan" "$ubsan"; do
  [ -e "$lib" ] || { echo "sanitize.sh: gcc has no $(basename "$lib") (install gcc's sanitizer runtimes)" >&2; exit 2; }
done

rm -rf "$TREE" "$OUT/reports"
mkdir -p "$TREE" "$OUT/reports"
cp -r acarerank tests csrc pyproject.toml "$TREE"/   # csrc: a test compiles a kernel source itself
find "$TREE" -name '__pycache__' -prune -exec rm -rf {} +
rm -f "$TREE"/acarerank/_C*.so "$TREE"/acarerank/_cpu*.so

read -r TORCH_DIR TORCH_VERSION TORCH_ABI < <(python -c \
  "import os, torch; print(os.path.dirname(torch.__file__), torch.__version__, int(torch._C._GLIBCXX_USE_CXX11_ABI))")
flags="-fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined"
cmake -S "$ROOT" -B "$OUT/cmake" -G Ninja -DCMAKE_MAKE_PROGRAM="$(command -v ninja)" \
  -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_LIBRARY_OUTPUT_DIRECTORY="$TREE/acarerank" \
  -DPython_EXECUTABLE="$(command -v python)" -Dpybind11_DIR="$(python -c 'import pybind11; print(pybind11.get_cmake_dir())')" \
  -DACARERANK_NO_CUDA=ON -DACARERANK_TORCH_DIR="$TORCH_DIR" -DACARERANK_TORCH_VERSION="$TORCH_VERSION" \
  -DACARERANK_TORCH_CXX11_ABI="$TORCH_ABI" "-DCMAKE_CXX_FLAGS=$flags" "-DCMAKE_SHARED_LINKER_FLAGS=-fsanitize=address,undefined" \
  > "$OUT/configure.log"
cmake --build "$OUT/cmake" -j "${ACARERANK_BUILD_JOBS:-$(nproc)}"

if [ "$#" -eq 0 ]; then
  set -- tests/ops/test_native_ext.py tests/ops/test_logits_gemm.py tests/ops/test_op_cpu_attention_native.py \
    tests/ops/test_op_cpu_attention_property.py tests/ops/test_op_cpu_attention_vnni.py \
    tests/ops/test_op_cpu_attention_direct.py \
    tests/ops/test_op_cpu_attention_bf16_paths.py tests/ops/test_op_layer_elementwise.py \
    tests/ops/test_op_qk_norm_rope_pages.py tests/ops/test_cpu_kernel_caches.py tests/ops/test_op_topk_logprobs.py \
    tests/ops/test_op_linear_logprob.py tests/ops/test_ext_yes_no.py tests/ops/test_op_topk_merge.py \
    tests/ops/test_op_merge_states.py
fi

# torch itself is not instrumented: the runtimes are preloaded, leaks are not checked (torch's
# allocator caches on purpose), and each report goes to a file as well as to stderr: pytest
# captures a test's stderr, and a process the sanitizer stops leaves no test report of its own
cd "$TREE"
set +e
LD_PRELOAD="$asan $ubsan" \
ASAN_OPTIONS="detect_leaks=0:verify_asan_link_order=0:log_path=$OUT/reports/asan" \
UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:log_path=$OUT/reports/ubsan" \
PYTHONPATH="$TREE:$TREE/tests${PYTHONPATH:+:$PYTHONPATH}" ACARERANK_REQUIRE_EXT=1 \
  python -m pytest -q -p no:cacheprovider "$@"
rc=$?
set -e
if compgen -G "$OUT/reports/*" > /dev/null; then
  cat "$OUT"/reports/*
  echo "sanitize.sh: the sanitizers reported the errors above (also in $OUT/reports/)" >&2
  exit 1
fi
exit $rc
