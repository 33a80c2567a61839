#!/usr/bin/env bash
# The CUDA backend on a machine with a GPU (docs/cuda.md): builds the CUDA tests, train and bench_cuda
# against the bundled dependencies (tools/gpu_deps.sh, carried as gpu-deps/), runs every CUDA test with
# MNEMO_REQUIRE_GPU=1 (a missing GPU is a failure); with BENCH=1, then bench_cuda and the PyTorch
# reference models on the same card (benchmarks/compare_pytorch_cuda.py, PyTorch alone: bench_cuda's
# own run gives mnemo's figures); then, unless SANITIZE=0, the kernel tests under compute-sanitizer's
# memcheck and racecheck. Stages run in that order (most wanted first), each under a time limit, and
# each writes its log to $OUT when set (the device tool's folder; seven files at most) as it goes, so that a run cut short
# still returns what it finished.
#   tools/gpu_check.sh [build-dir]   (default build-gpu; CUDA_ARCH=90 by default, 80 for an A100)
set -uo pipefail
cd "$(dirname "$0")/.."
build=${1:-build-gpu}
log=${OUT:-.}
jobs=$(nproc 2>/dev/null || echo 4)
stage() { echo "== $(date +%T) $*"; }
stage "machine"; nvidia-smi -L || true; g++ --version | head -1; cmake --version | head -1; nvcc --version | tail -1
stage "configure"
# Ninja builds the targets below side by side; Make's top level (.NOTPARALLEL) builds them one after
# another, one file each: 9 minutes on 16 cores (2026-12-04, H200 machine).
generator=()
command -v ninja >/dev/null || PATH="$PATH:$PWD/gpu-deps/bin"
if command -v ninja >/dev/null && [ ! -f "$build/Makefile" ]; then generator=(-G Ninja); fi
cmake -S . -B "$build" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$PWD/gpu-deps" -DMNEMO_CUDA=ON \
      -DCMAKE_CUDA_ARCHITECTURES="${CUDA_ARCH:-90}" -DMNEMO_MPI=OFF \
      -DMNEMO_TEST_SECOND_ISA=OFF >"$log/gpu_build.log" 2>&1 || { tail -40 "$log/gpu_build.log"; exit 1; }
targets="test_cuda_dense test_cuda_attention test_cuda_memory_optim test_cuda_models test_cuda_golden_compressive
         test_cuda_golden_feedback test_cuda_generation_cache test_cuda_padding train bench_cuda"
stage "build"
cmake --build "$build" -j "$jobs" --target $targets >>"$log/gpu_build.log" 2>&1 || { tail -60 "$log/gpu_build.log"; exit 1; }
status=0
stage "ctest"
MNEMO_REQUIRE_GPU=1 ctest --test-dir "$build" -R cuda -j 4 --timeout 300 --output-on-failure >"$log/gpu_ctest.log" 2>&1 || status=1
grep -E "Test +#|tests passed|tests failed|Failed|Error" "$log/gpu_ctest.log" | head -60
if [ "${BENCH:-0}" = 1 ]; then
    stage "bench_cuda"
    timeout "${BENCH_LIMIT:-150}" "$build/benchmarks/bench_cuda" --json "$log/bench_cuda.json" 2>&1 | tee "$log/bench_cuda.md" || status=1
    stage "PyTorch on the same card"
    PYTHONUNBUFFERED=1 timeout "${TORCH_LIMIT:-200}" python3 benchmarks/compare_pytorch_cuda.py --skip-mnemo \
        --json "$log/compare_cuda.json" 2>&1 | tee "$log/compare_cuda.md" || status=1
fi
if [ "${SANITIZE:-1}" = 1 ]; then
    sanitizer=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
    for tool in memcheck racecheck; do
        for t in test_cuda_dense test_cuda_attention test_cuda_memory_optim; do
            stage "compute-sanitizer --tool $tool $t"
            MNEMO_REQUIRE_GPU=1 timeout "${SANITIZE_LIMIT:-120}" "$sanitizer" --tool "$tool" --error-exitcode 3 \
                "$build/tests/$t" >"$log/sanitize_one.log" 2>&1 \
                && echo ok || { status=1; tail -15 "$log/sanitize_one.log"; }
            { echo "== $tool $t"; cat "$log/sanitize_one.log"; } >>"$log/gpu_sanitize.log"; rm -f "$log/sanitize_one.log"
        done
    done
fi
stage "done (status $status)"
exit $status
