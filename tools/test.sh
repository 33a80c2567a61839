#!/usr/bin/env bash
# The README's test command: install what is missing, configure, build everything, run the suite.
#   tools/test.sh [build-dir]       (default: build)
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
jobs=$(nproc 2>/dev/null || echo 2)
tools/install-deps.sh
cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release
cmake --build "$build" -j "$jobs"
# Which SIMD instruction sets the kernel tests cover on this host (tests/CMakeLists.txt decides).
coverage=$(cat "$build/isa_coverage.txt" 2>/dev/null || echo "SIMD paths tested: unknown (no $build/isa_coverage.txt)")
echo "test.sh: $coverage"
trap 'echo "test.sh: $coverage"' EXIT
ctest --test-dir "$build" --output-on-failure -j "$jobs"
