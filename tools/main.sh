#!/usr/bin/env bash
# The README's main command: install what is missing, build the example trainer and run it on its
# built-in default (no download): the recall task, Compressive Transformer against Transformer-XL.
#   tools/main.sh [trainer options...]
set -euo pipefail
cd "$(dirname "$0")/.."
tools/install-deps.sh
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release
cmake --build build -j "$(nproc 2>/dev/null || echo 2)" --target train
exec build/examples/train "$@"
