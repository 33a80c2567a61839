#!/usr/bin/env bash
# ThreadSanitizer over the threaded kernels: the kernel, GEMM, attention and generation tests, built
# with clang, LLVM's OpenMP runtime (libomp) and its Archer tool, which tells TSan about OpenMP's own
# synchronisation. (g++'s libgomp is not instrumented: TSan then reports false races in it.)
# Run on 2 and 3 threads. Takes several minutes; the result goes in docs/reliability.md.
#   tools/tsan.sh [build-dir]          (default: build-tsan; needs clang-14 and libomp-14-dev)
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build-tsan}
cxx=$(command -v clang++-14 || command -v clang++ || true)
archer=$(ls /usr/lib/llvm-14/lib/libarcher.so 2>/dev/null || true)
if [ -z "$cxx" ] || [ -z "$archer" ]; then
    echo "tsan.sh: needs clang++-14 and libomp-14-dev (Archer); apt-get install clang-14 libomp-14-dev" >&2
    exit 1
fi
mkdir -p "$build"
tests=(test_kernels test_gemm_packed test_gemm_direct test_head_products test_relative_attention test_generation_cache)
for t in "${tests[@]}"; do
    if [ ! -x "$build/$t" ] || [ -n "$(find include tests/$t.cpp -newer "$build/$t" -print -quit)" ]; then
        echo "tsan.sh: building $t"
        "$cxx" -std=c++20 -O1 -g -fsanitize=thread -fopenmp=libomp -march=native -mtune=generic -fno-math-errno \
            -Iinclude -isystem /usr/include/eigen3 -DMNEMO_TEST_DATA_DIR="\"$PWD/tests\"" \
            tests/main.cpp "tests/$t.cpp" -o "$build/$t" -L/usr/lib/llvm-14/lib -Wl,-rpath,/usr/lib/llvm-14/lib
    fi
done
export OMP_TOOL_LIBRARIES=$archer
export TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1 ignore_noninstrumented_modules=1"
status=0
for threads in 2 3; do
    for t in "${tests[@]}"; do
        if OMP_NUM_THREADS=$threads "$build/$t" >"$build/$t.$threads.log" 2>&1; then
            echo "tsan.sh: $t on $threads threads: no data race ($(grep -o 'test cases: *[0-9]*' "$build/$t.$threads.log" | grep -o '[0-9]*$') test cases)"
        else
            echo "tsan.sh: $t on $threads threads FAILED; the end of $build/$t.$threads.log:" >&2
            tail -40 "$build/$t.$threads.log" >&2
            status=1
        fi
    done
done
exit $status
