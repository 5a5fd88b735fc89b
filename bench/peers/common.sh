# Shared by bench/peers/*.sh (sourced, not run): options, dry-run, model folder, start/stop by PID.
#
# Every peer lives under $CACHE (default ~/.cache/acarerank-peers): its venv or build in
# $CACHE/<peer>/, model folders in $CACHE/models/, the running server's PID, log and URL in
# $CACHE/<peer>/run/. Nothing is written into the repository.

set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
CACHE=${ACARERANK_PEERS_CACHE:-$HOME/.cache/acarerank-peers}
PYTHON=${PYTHON:-python3}          # a Python with acarerank importable (writes the model folder)
MODEL=""                           # --model: an HF checkpoint folder; empty = the embedded default
PRESET=tiny-cpu                    # --preset: the embedded default's shape (acarerank.model.default)
SEED=0
PORT=""
THREADS=""
DRY_RUN=0
ACTION=start
EXTRA_ARGS=()

# run CMD...: echo it; run it unless --dry-run. Its stdout goes to stderr: a script's stdout is
# only the URL it prints (URL=$(bench/peers/vllm_cpu.sh ...)), even on the run that sets up.
run() {
    echo "+ $*" >&2
    if [[ $DRY_RUN == 0 ]]; then "$@" >&2; fi
}

die() { echo "$PEER: error: $*" >&2; exit 2; }

parse_common() {  # parse_common "$@"; sets the globals above, leaves peer options in EXTRA_ARGS
    while [[ $# -gt 0 ]]; do
        case $1 in
            --model) MODEL=${2:?--model needs a folder}; shift 2 ;;
            --preset) PRESET=${2:?--preset needs a name}; shift 2 ;;
            --seed) SEED=${2:?--seed needs an int}; shift 2 ;;
            --port) PORT=${2:?--port needs a number}; shift 2 ;;
            --threads) THREADS=${2:?--threads needs a value}; shift 2 ;;
            --cache) CACHE=${2:?--cache needs a folder}; shift 2 ;;
            --dry-run) DRY_RUN=1; shift ;;
            --stop) ACTION=stop; shift ;;
            --status) ACTION=status; shift ;;
            --model-dir) ACTION=model-dir; shift ;;
            -h|--help) usage; exit 0 ;;
            *) EXTRA_ARGS+=("$1"); shift ;;
        esac
    done
    [[ $PORT =~ ^[0-9]*$ ]] || die "--port must be a number, got '$PORT'"
    [[ $SEED =~ ^[0-9]+$ ]] || die "--seed must be a non-negative int, got '$SEED'"
    if [[ -n $MODEL && ! -f $MODEL/config.json ]]; then die "--model '$MODEL' has no config.json"; fi
    RUN_DIR=$CACHE/$PEER/run
}

# model_dir: the folder prepare_model.py writes for --model / --preset + --seed
model_dir() {
    if [[ -n $MODEL ]]; then
        echo "$CACHE/models/$(basename "$(cd "$MODEL" && pwd)")-$(cd "$MODEL" && pwd | cksum | cut -d' ' -f1)"
    else
        echo "$CACHE/models/$PRESET-seed$SEED"
    fi
}

prepare_model() {  # writes $(model_dir) once (weights, tokenizer, README title, vLLM chat template)
    local dir; dir=$(model_dir)
    if [[ -f $dir/qwen3_reranker.jinja && $DRY_RUN == 0 ]]; then return 0; fi
    run env PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} "$PYTHON" \
        "$REPO/bench/peers/prepare_model.py" --out "$dir" \
        $(if [[ -n $MODEL ]]; then echo --model "$MODEL"; else echo --preset "$PRESET" --seed "$SEED"; fi)
}

# start_server URL HEALTH_PATH TIMEOUT_S CMD...: start CMD in the background (log, PID), wait until
# URL+HEALTH_PATH answers 200 (or the process dies), print the URL on stdout
start_server() {
    local url=$1 health=$2 timeout=$3; shift 3
    if [[ $DRY_RUN == 1 ]]; then echo "+ $* > $RUN_DIR/server.log 2>&1 &" >&2; echo "$url"; return 0; fi
    if [[ -f $RUN_DIR/pid ]] && kill -0 "$(cat "$RUN_DIR/pid")" 2>/dev/null; then
        die "already running (PID $(cat "$RUN_DIR/pid"), $(cat "$RUN_DIR/url" 2>/dev/null)); --stop first"
    fi
    mkdir -p "$RUN_DIR"
    echo "+ $*" >&2
    nohup "$@" > "$RUN_DIR/server.log" 2>&1 &
    local pid=$!
    echo "$pid" > "$RUN_DIR/pid"
    echo "$url" > "$RUN_DIR/url"
    local deadline=$((SECONDS + timeout))
    while ((SECONDS < deadline)); do
        if ! kill -0 "$pid" 2>/dev/null; then
            tail -n 30 "$RUN_DIR/server.log" >&2
            rm -f "$RUN_DIR/pid"
            die "the server exited before $url$health answered (log: $RUN_DIR/server.log)"
        fi
        if curl -sf -o /dev/null "$url$health"; then
            echo "$PEER: ready at $url (PID $pid, log $RUN_DIR/server.log)" >&2
            echo "$url"
            return 0
        fi
        sleep 2
    done
    kill "$pid" 2>/dev/null || true
    rm -f "$RUN_DIR/pid"
    die "$url$health did not answer within $timeout s (log: $RUN_DIR/server.log)"
}

stop_server() {  # the PID this script started, and only it
    if [[ ! -f $RUN_DIR/pid ]]; then echo "$PEER: not running (no $RUN_DIR/pid)" >&2; return 0; fi
    local pid; pid=$(cat "$RUN_DIR/pid")
    if kill -0 "$pid" 2>/dev/null; then
        run kill "$pid"
        for _ in $(seq 60); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
        if kill -0 "$pid" 2>/dev/null; then run kill -9 "$pid"; fi
        echo "$PEER: stopped PID $pid" >&2
    else
        echo "$PEER: PID $pid was not running" >&2
    fi
    if [[ $DRY_RUN == 0 ]]; then rm -f "$RUN_DIR/pid" "$RUN_DIR/url"; fi
}

status_server() {
    if [[ -f $RUN_DIR/pid ]] && kill -0 "$(cat "$RUN_DIR/pid")" 2>/dev/null; then
        echo "$PEER: running, PID $(cat "$RUN_DIR/pid"), $(cat "$RUN_DIR/url")"
    else
        echo "$PEER: not running"
    fi
}

free_port() {
    "$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}
