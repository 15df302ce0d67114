#!/usr/bin/env bash
# Build the peers that the benchmarks compare against, from PyPI's llama-cpp-python 0.3.36 sdist:
#   build/llama.cpp/bin/llama-server   llama.cpp's own HTTP server (benchmarks/serve.py)
#   build/llama.cpp/bin/llama-bench    its benchmark tool (benchmarks/shared.py), and llama-batched-bench
#                                      (batched decode) and llama-perplexity (KL divergence)
#   build/llama.cpp/bin/llama-quantize llama.cpp's quantizer (benchmarks/make_gguf.py)
#   build/llama.cpp/bin/libllama.so    the library, used by the llama-cpp-python bindings
#   llama-cpp-python in .venv          installed without compiling again (LLAMA_BUILD=OFF), loading
#                                      the library above through LLAMA_CPP_LIB_PATH
# One cmake build (~15-25 min on 2 cores) instead of two; kept out of `make test`.
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=0.3.36
PY=${PY:-.venv/bin/python}
SRC=build/peers/llama_cpp_python-$VERSION
mkdir -p build/peers
if [ ! -d "$SRC" ]; then
  $PY -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d build/peers
  tar -xzf "build/peers/llama_cpp_python-$VERSION.tar.gz" -C build/peers
fi
# -march=native without AMX: ggml's AMX matmul (prompts of Q4_0/Q4_1/Q8_0/K-quant files on a CPU with AMX)
# dies with SIGILL at its first tile instruction, the tile configuration on the stack optimized away
# (GCC drops its stores: checked in the built library; ggml-org/llama.cpp PR 26954, open); its
# AVX-512 paths and repacking stay.
NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
cmake -S "$SRC/vendor/llama.cpp" -B build/llama.cpp -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON \
  -DCMAKE_C_FLAGS="$NO_AMX" -DCMAKE_CXX_FLAGS="$NO_AMX" -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
  -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON >/dev/null
cmake --build build/llama.cpp --target llama-server llama-bench llama-batched-bench llama-perplexity llama-quantize llama -j "${JOBS:-2}"
CMAKE_ARGS="-DLLAMA_BUILD=OFF -DLLAVA_BUILD=OFF" $PY -m pip install -q --no-deps "$SRC"
$PY -m pip install -q diskcache  # a runtime import of llama_cpp
echo "peers built: build/llama.cpp/bin/llama-server; llama_cpp (export LLAMA_CPP_LIB_PATH=$(pwd)/build/llama.cpp/bin)"
