#!/usr/bin/env bash
# The README's main command: install what is missing, build the example trainer and run it on its
# built-in default (no download).   tools/main.sh [trainer options...]
set -euo pipefail
cd "$(dirname "$0")/.."
tools/install-deps.sh
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release
cmake --build build -j "$(nproc 2>/dev/null || echo 2)" --target char_mlp
mkdir -p out
exec build/examples/char_mlp --checkpoint out/char_mlp.safetensors "$@"
