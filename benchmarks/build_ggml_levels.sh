#!/usr/bin/env bash
# Builds ggml's CPU backend (libggml-cpu) of the llama.cpp that `make llamacpp` installs
# once per instruction-set level below this CPU's (avx2, generic), into
# .venv/llama.cpp/ggml-cpu-<level>/, for `make llamacpp-levels`. benchmarks/cpu_levels.py
# (and gguf_models.py, which runs it) then puts that level's library first on
# LD_LIBRARY_PATH, so llama.cpp runs at the same level as sluice's kernels: on an
# AVX-512 machine, "sluice at avx2 against llama.cpp at avx2" stands in for an AVX2
# machine, where a comparison against AVX-512 llama.cpp would not. Only the CPU backend
# differs between levels (about a minute each on 2 cores); libllama and libggml-base
# are the installed ones, from the same sources.
set -euo pipefail

VENV=${VENV:-.venv}
VERSION=0.3.36
WORK="$VENV/llama.cpp"
SRC="$WORK/llama_cpp_python-$VERSION/vendor/llama.cpp"
HERE="$(dirname "$0")"

mkdir -p "$WORK"
if [ ! -d "$SRC" ]; then
  "$VENV/bin/pip" download -q --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$WORK"
  tar xzf "$WORK/llama_cpp_python-$VERSION.tar.gz" -C "$WORK"
fi

native=$(bash "$HERE/ggml_cpu_flags.sh")
for level in avx2 generic; do
  flags=$(SLUICE_CPU_ISA=$level bash "$HERE/ggml_cpu_flags.sh")
  [ "$flags" = "$native" ] && continue  # this CPU's own level: the installed library
  build="$WORK/build-ggml-$level"
  out="$WORK/ggml-cpu-$level"
  echo "ggml CPU backend at $level -> $out"
  cmake -S "$SRC" -B "$build" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_CURL=OFF $flags >/dev/null
  cmake --build "$build" --target ggml-cpu -j"$(nproc)" >/dev/null
  mkdir -p "$out"
  cp -a "$build"/bin/libggml-cpu.so* "$out/"
done
