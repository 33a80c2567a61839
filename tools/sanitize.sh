#!/usr/bin/env bash
# The suite built and run under AddressSanitizer and UndefinedBehaviorSanitizer (any report fails the
# test that triggered it): every test binary, the trainer and mnemo_eval tests, the fuzz replays.
# Not repeated there: the compile-error tests, the installed-package test, the header checks, the
# second instruction set, the benchmarks (they run no code of their own under test) and the CUDA
# backend (its tests need a GPU; without one they only say so).
#   tools/sanitize.sh [build-dir]      (default: build-asan; tools/test.sh runs it after the suite)
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build-asan}
jobs=$(nproc 2>/dev/null || echo 2)
# -O1: sanitized code at -O3 takes far longer to compile and gains little in run time here.
cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=None -DCMAKE_CXX_FLAGS="-O1 -g1" -DMNEMO_SANITIZE=address,undefined \
      -DMNEMO_BUILD_BENCHMARKS=OFF -DMNEMO_TEST_SECOND_ISA=OFF -DMNEMO_CUDA=OFF >/dev/null
cmake --build "$build" -j "$jobs"
export ASAN_OPTIONS=detect_leaks=1:strict_string_checks=1
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
ctest --test-dir "$build" --output-on-failure -j "$jobs"
