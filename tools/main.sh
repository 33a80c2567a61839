#!/usr/bin/env bash
# The README's main command: install what is missing, build the example trainer and run it on its
# built-in default (no download): the recall task, Compressive Transformer against Transformer-XL.
# The run's output, its metrics (JSON lines) and the two runs' curves (curves.png, also drawn in the
# terminal) land in build/main_job/.
#   tools/main.sh                        the main job
#   tools/main.sh [trainer options...]   build/examples/train with these options instead
set -euo pipefail
cd "$(dirname "$0")/.."
tools/install-deps.sh
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release
cmake --build build -j "$(nproc 2>/dev/null || echo 2)" --target train
if [ $# -gt 0 ]; then exec build/examples/train "$@"; fi
out=build/main_job
mkdir -p "$out"
build/examples/train --metrics "$out/metrics.jsonl" | tee "$out/output.txt"
tools/plot.sh --dumb --out "$out/curves.png" --title "main job: recall task, validation and training loss" \
    "$out/metrics.jsonl"
echo "main.sh: output, metrics and curves in $out/"
