#!/usr/bin/env bash
# The README's test command: install what is missing, configure, build everything, run the suite;
# then the allocation, kernel and model tests built with LLVM's OpenMP runtime, the suite again
# under ASan + UBSan (tools/sanitize.sh) and a short run of each fuzz harness (tools/fuzz.sh, 15 s
# each).
#   tools/test.sh [build-dir]       (default: build; the sanitizer build goes to <build-dir>-asan)
#   MNEMO_TEST_QUICK=1 tools/test.sh   the suite alone (no libomp build, no sanitizer build, no fuzzing)
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
if [ "${MNEMO_TEST_QUICK:-0}" = 1 ]; then exit 0; fi
echo "test.sh: the allocation, kernel and model tests with LLVM's OpenMP runtime (-DMNEMO_OPENMP_RUNTIME=llvm)"
t0=$SECONDS
libomp_tests=(test_allocations test_kernels test_compressive)
cmake -S . -B "$build-libomp" -DCMAKE_BUILD_TYPE=Release -DMNEMO_OPENMP_RUNTIME=llvm -DMNEMO_CUDA=OFF -DMNEMO_MPI=OFF \
    -DMNEMO_BUILD_EXAMPLES=OFF -DMNEMO_BUILD_BENCHMARKS=OFF -DMNEMO_TEST_SECOND_ISA=OFF > /dev/null
cmake --build "$build-libomp" -j "$jobs" --target "${libomp_tests[@]}"
libs=$(ldd "$build-libomp/tests/test_kernels")
if [[ $libs != *libomp.so* || $libs == *libgomp* ]]; then
    echo "test.sh: $build-libomp/tests/test_kernels is not linked to libomp alone:" >&2
    echo "$libs" >&2
    exit 1
fi
ctest --test-dir "$build-libomp" --output-on-failure -j "$jobs" -R "^($(IFS='|'; echo "${libomp_tests[*]}"))\$"
echo "test.sh: libomp build and run: $((SECONDS - t0)) s"
echo "test.sh: the suite under AddressSanitizer + UndefinedBehaviorSanitizer"
t0=$SECONDS
tools/sanitize.sh "$build-asan"
echo "test.sh: sanitizer build and run: $((SECONDS - t0)) s"
echo "test.sh: fuzzing each reader for 15 s (tools/fuzz.sh; the long run is in docs/reliability.md)"
t0=$SECONDS
tools/fuzz.sh --seconds 15 --build "$build-fuzz" --train "$build/examples/train"
echo "test.sh: fuzzing: $((SECONDS - t0)) s"
