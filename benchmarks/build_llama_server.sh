#!/usr/bin/env bash
# Builds llama.cpp's llama-server for the serving side-by-side (`make llama-server`),
# and llama-bench for benchmarks/moe.py's prompt and decode rates, from the
# llama-cpp-python 0.3.36 sdist: the same llama.cpp as `make llamacpp`. They are linked
# as .venv/bin/llama-server and .venv/bin/llama-bench, where the benchmarks find them.
#
# ggml is built for this CPU's instruction-set level, or the lower one SLUICE_CPU_ISA
# names (ggml_cpu_flags.sh), never natively. When `make llamacpp` already installed that version's
# shared libraries, only llama-server's own sources are compiled and linked against
# them (minutes instead of ~7 of compiling ggml and libllama again, on 2 cores of Zen 4).
set -euo pipefail

VENV=${VENV:-.venv}
VERSION=0.3.36
WORK="$VENV/llama.cpp"
SRC="$WORK/llama_cpp_python-$VERSION/vendor/llama.cpp"
BUILD="$SRC/build"

mkdir -p "$WORK"
if [ ! -d "$SRC" ]; then
  "$VENV/bin/pip" download -q --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$WORK"
  tar xzf "$WORK/llama_cpp_python-$VERSION.tar.gz" -C "$WORK"
fi

cmake -S "$SRC" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON \
  -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
  -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
  $(bash "$(dirname "$0")/ggml_cpu_flags.sh") >/dev/null

# The installed llama_cpp package's libraries, if they are this version's.
LIBS=$("$VENV/bin/python" - "$VERSION" <<'EOF' 2>/dev/null || true
import os, sys
import llama_cpp
if llama_cpp.__version__ == sys.argv[1]:
    print(os.path.join(os.path.dirname(llama_cpp.__file__), "lib"))
EOF
)

if [ -n "$LIBS" ] && [ -f "$LIBS/libllama.so" ]; then
  echo "linking llama-server against $LIBS"
  mkdir -p "$BUILD/bin"
  cp -a "$LIBS"/lib*.so* "$BUILD/bin/"
  # `/fast` builds one target without rebuilding the libraries it depends on.
  for target in llama-common-base cpp-httplib llama-ui-assets llama-ui llama-common \
                server-context llama-server-impl llama-server llama-bench; do
    make -C "$BUILD" -j"$(nproc)" "$target/fast" >/dev/null
  done
else
  echo "building llama.cpp and llama-server from source (~7 min on 2 cores of Zen 4)"
  cmake --build "$BUILD" --target llama-server llama-bench -j"$(nproc)" >/dev/null
fi

ln -sf "$(realpath "$BUILD/bin/llama-server")" "$VENV/bin/llama-server"
ln -sf "$(realpath "$BUILD/bin/llama-bench")" "$VENV/bin/llama-bench"
"$VENV/bin/llama-server" --version 2>&1 | head -1
