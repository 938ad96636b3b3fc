#!/usr/bin/env bash
# Builds the performance peer, llama.cpp's `llama-server`, `llama-bench` and `llama-quantize` (which makes the
# 16-bit and 8-bit copies of the GGUF that benchmarks/peer/spec_decode_peer.py --method draft uses), from the source tree that the
# pinned PyPI sdist of llama-cpp-python vendors (no git, no model hub): `make bench-peer` runs it.
# About 10 minutes on 2 cores; the binaries land in .cache/peer/llama.cpp-<version>/build/bin.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"   # vendors llama.cpp commit 0c1e57098
PY="$ROOT/.venv/bin/python"
DEST="$ROOT/.cache/peer/llama.cpp-$VERSION"
BIN="$DEST/build/bin"
if [ -x "$BIN/llama-server" ] && [ -x "$BIN/llama-bench" ] && [ -x "$BIN/llama-quantize" ]; then
  echo "[peer] llama.cpp $VERSION already built: $BIN" >&2
  exit 0
fi
mkdir -p "$DEST"
if [ ! -d "$DEST/src" ]; then
  # the sdist only: with --no-binary :all: pip builds every build dependency of its metadata from source too
  echo "[peer] downloading the llama-cpp-python==$VERSION source distribution" >&2
  "$PY" -m pip download --quiet --no-deps --no-binary llama-cpp-python --dest "$DEST/sdist" "llama-cpp-python==$VERSION"
  mkdir -p "$DEST/src"
  tar -xzf "$DEST"/sdist/llama_cpp_python-"$VERSION".tar.gz -C "$DEST/src" --strip-components=1
fi
CMAKE=cmake
if ! command -v cmake >/dev/null; then
  echo "[peer] cmake not found: installing the cmake wheel into .venv" >&2
  "$PY" -m pip install --quiet "cmake==3.31.6"
  CMAKE="$ROOT/.venv/bin/cmake"
fi
echo "[peer] configuring llama.cpp (Release, GGML_NATIVE=ON)" >&2
"$CMAKE" -S "$DEST/src/vendor/llama.cpp" -B "$DEST/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
  -DLLAMA_CURL=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_TESTS=OFF \
  -DLLAMA_BUILD_EXAMPLES=OFF >"$DEST/configure.log" 2>&1 || { tail -30 "$DEST/configure.log" >&2; exit 1; }
echo "[peer] building llama-server, llama-bench and llama-quantize (about 10 minutes on 2 cores; log: $DEST/build.log)" >&2
"$CMAKE" --build "$DEST/build" --target llama-server llama-bench llama-quantize -j "$(nproc)" >"$DEST/build.log" 2>&1 \
  || { tail -30 "$DEST/build.log" >&2; exit 1; }
echo "[peer] built: $BIN/llama-server" >&2
