#!/usr/bin/env bash
# llama.cpp's server serving a Qwen3-Reranker GGUF on loopback, for bench/bench_serve.py and
# `acarerank bench --peer`. Prints the server's URL on stdout.
PEER=llama_cpp
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

LLAMA_CPP_PYTHON_VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
OUTTYPE=f32
CTX=32768
PARALLEL=4

usage() {
    cat <<EOF
usage: bench/peers/llama_cpp.sh [--model DIR | --preset NAME --seed N] [--outtype f32|q8_0] [--port N]
                                [--threads N] [--ctx N] [--parallel N] [--cache DIR]
                                [--dry-run] [--stop | --status | --model-dir] [--help]

Builds and starts llama.cpp's llama-server in rerank mode (POST /v1/rerank, --reranking
--pooling rank) on 127.0.0.1, and prints its URL. Steps, each skipped when done before:
  1. build \$CACHE/llama_cpp/build: the llama.cpp source vendored in the PyPI sdist of
           llama-cpp-python $LLAMA_CPP_PYTHON_VERSION (pip download, no wheel), CMake Release,
           -march=native, OpenMP, no network features; target llama-server (~15 min on 2 cores,
           run under nice -n 19)
  2. venv  \$CACHE/llama_cpp/venv: what its convert_hf_to_gguf.py needs (torch 2.13.0 CPU,
           transformers 4.57.6, sentencepiece, numpy, protobuf, its own gguf-py)
  3. model \$CACHE/models/...: the embedded default (--preset, --seed) or --model DIR, then
           convert_hf_to_gguf.py --outtype f32 or q8_0 (the Qwen3 reranker head becomes a
           [yes, no] classifier; the server returns softmax P(yes), as acarerank)
  4. serve llama-server --reranking --pooling rank -c CTX -np PARALLEL -t THREADS
Options:
  --model DIR      an HF checkpoint folder (default: the embedded random-weight model)
  --preset NAME    embedded model shape: tiny-cpu (default), qwen3-reranker-0.6b, ...
  --seed N         embedded model seed (default 0, as acarerank serve)
  --outtype T      f32 (default) or q8_0
  --port N         port (default: a free one)
  --threads N      threads of the model (default: nproc)
  --ctx N          total context (default $CTX; every slot gets CTX / PARALLEL tokens)
  --parallel N     slots: requests' prompts evaluated side by side (default $PARALLEL)
  --cache DIR      where build, venv, models and run files live (default ~/.cache/acarerank-peers,
                   or \$ACARERANK_PEERS_CACHE)
  --dry-run        print the commands, run nothing
  --stop           stop the server this script started for --outtype (by its PID file)
  --status         say whether it runs
  --model-dir      print the model folder step 3 writes for these options (bench_serve.py --model)
Environment: PYTHON (a Python that imports acarerank, for step 3), LLAMA_CPP_PYTHON_VERSION,
JOBS (build jobs, default nproc).
EOF
}

parse_common "$@"
set -- "${EXTRA_ARGS[@]+"${EXTRA_ARGS[@]}"}"
while [[ $# -gt 0 ]]; do
    case $1 in
        --outtype) OUTTYPE=${2:?--outtype needs f32 or q8_0}; shift 2 ;;
        --ctx) CTX=${2:?--ctx needs a number}; shift 2 ;;
        --parallel) PARALLEL=${2:?--parallel needs a number}; shift 2 ;;
        *) die "unknown option '$1' (see --help)" ;;
    esac
done
[[ $OUTTYPE == f32 || $OUTTYPE == q8_0 ]] || die "--outtype must be f32 or q8_0, got '$OUTTYPE'"
[[ $CTX =~ ^[0-9]+$ && $PARALLEL =~ ^[1-9][0-9]*$ ]] || die "--ctx and --parallel must be positive numbers"
RUN_DIR=$CACHE/$PEER/run-$OUTTYPE  # f32 and q8_0 servers side by side; --stop --outtype T stops one
case $ACTION in
    stop) stop_server; exit 0 ;;
    status) status_server; exit 0 ;;
    model-dir) model_dir; exit 0 ;;
esac

HOME_DIR=$CACHE/llama_cpp
SRC=$HOME_DIR/src/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION/vendor/llama.cpp
BUILD=$HOME_DIR/build
SERVER=$BUILD/bin/llama-server
VENV=$HOME_DIR/venv

# 1. build
if [[ $DRY_RUN == 1 || ! -x $SERVER ]]; then
    if [[ $DRY_RUN == 1 || ! -f $SRC/CMakeLists.txt ]]; then
        run mkdir -p "$HOME_DIR/dl" "$HOME_DIR/src"
        run python3 -m pip download --no-deps --no-binary :all: "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION" \
            -d "$HOME_DIR/dl"
        run tar xzf "$HOME_DIR/dl/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION.tar.gz" -C "$HOME_DIR/src"
    fi
    # no UI download, no HTTPS, no curl: the server runs offline on loopback
    run nice -n 19 cmake -S "$SRC" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF -DGGML_NATIVE=ON \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON \
        -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF
    run nice -n 19 cmake --build "$BUILD" --target llama-server -j "${JOBS:-$(nproc)}"
fi

# 2. the converter's venv
if [[ $DRY_RUN == 1 || ! -x $VENV/bin/python ]] || ! "$VENV/bin/python" -c "import gguf, sentencepiece, torch" 2>/dev/null; then
    run python3 -m venv "$VENV"
    run "$VENV/bin/pip" install torch==2.13.0 "numpy~=2.2.6" "sentencepiece>=0.1.98,<0.3.0" "transformers==4.57.6" \
        "protobuf>=4.21.0,<5.0.0" safetensors "$SRC/gguf-py"
fi

# 3. model folder and GGUF
prepare_model
DIR=$(model_dir)
GGUF=$DIR/model-$OUTTYPE.gguf
if [[ $DRY_RUN == 1 || ! -f $GGUF ]]; then
    run env OMP_NUM_THREADS=1 "$VENV/bin/python" "$SRC/convert_hf_to_gguf.py" "$DIR" --outtype "$OUTTYPE" \
        --outfile "$GGUF"
fi

# 4. serve
PORT=${PORT:-$(free_port)}
THREADS=${THREADS:-$(nproc)}
EXTRA=()
# ggml's AMX q8_0 matmul segfaults in the warm-up pass on an AMX CPU (this llama.cpp build, seen
# with the embedded default's shape); --no-repack keeps the weights out of the AMX buffer
if [[ $OUTTYPE == q8_0 ]] && grep -q amx_int8 /proc/cpuinfo 2>/dev/null; then EXTRA+=(--no-repack); fi
start_server "http://127.0.0.1:$PORT" /health "${LLAMA_STARTUP_TIMEOUT:-300}" \
    "$SERVER" -m "$GGUF" --reranking --pooling rank --host 127.0.0.1 --port "$PORT" -t "$THREADS" \
    -c "$CTX" -np "$PARALLEL" --no-webui "${EXTRA[@]+"${EXTRA[@]}"}"
