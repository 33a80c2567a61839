#!/usr/bin/env bash
# The suite built and run under AddressSanitizer and UndefinedBehaviorSanitizer (any report fails the
# test that triggered it): every test binary, the trainer and mnemo_eval tests, the fuzz replays;
# UBSan without its null, alignment and pointer-overflow checks (below).
# Not repeated there: the bitwise build of test_dynamic_shape, the compile-error tests, the
# installed-package test, the header checks, the second instruction set, the benchmarks (they run no
# code of their own under test) and the CUDA backend (its tests need a GPU; without one they only say
# so).
#   tools/sanitize.sh [--full] [build-dir]   (default: build-asan; tools/test.sh runs it after the suite)
#   --full: every UBSan check, the three below too (the sweep docs/reliability.md reports; about twice
#           the build time)
set -euo pipefail
cd "$(dirname "$0")/.."
skip=null,alignment,pointer-overflow
if [ "${1:-}" = --full ]; then skip=; shift; fi
build=${1:-build-asan}
jobs=$(nproc 2>/dev/null || echo 2)
# -O1: sanitized code at -O3 takes far longer to compile and gains little in run time here.
# UBSan's null, alignment and pointer-overflow checks instrument every pointer use and nearly double
# the compile time of the model tests (test_compressive.cpp, g++ 12 -O1: 40 s unsanitized, 99 s with
# ASan and the rest of UBSan, 172 s with those three too). They are left out here: a null access
# still faults and ASan reports it with its stack; the model code's pointers are offsets into mnemo's
# own allocations, whose every access ASan checks; and the file readers, where the input decides the
# offsets, keep every UBSan check in the fuzz build (tools/fuzz.sh).
cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=None -DCMAKE_CXX_FLAGS="-O1 -g1" -DMNEMO_SANITIZE=address,undefined \
      -DMNEMO_SANITIZE_SKIP="$skip" \
      -DMNEMO_BUILD_BENCHMARKS=OFF -DMNEMO_TEST_SECOND_ISA=OFF -DMNEMO_CUDA=OFF >/dev/null
cmake --build "$build" -j "$jobs"
export ASAN_OPTIONS=detect_leaks=1:strict_string_checks=1
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
ctest --test-dir "$build" --output-on-failure -j "$jobs"
