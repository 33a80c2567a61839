#!/usr/bin/env bash
# The CUDA backend on a machine with a GPU (docs/cuda.md): builds the CUDA tests and train against the
# bundled dependencies (tools/gpu_deps.sh, carried as gpu-deps/), runs every CUDA test with
# MNEMO_REQUIRE_GPU=1 (a missing GPU is a failure), then the kernel and model tests under
# compute-sanitizer's memcheck and racecheck; with BENCH=1, then the benchmark and the PyTorch
# comparison on the same card (benchmarks/compare_pytorch_cuda.py). Logs go to $OUT when set (the
# device tool's folder).
#   tools/gpu_check.sh [build-dir]   (default build-gpu; CUDA_ARCH=90 by default, 80 for an A100)
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build-gpu}
log=${OUT:-.}
jobs=$(nproc 2>/dev/null || echo 4)
nvidia-smi -L || true
cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$PWD/gpu-deps" -DMNEMO_CUDA=ON \
      -DCMAKE_CUDA_ARCHITECTURES="${CUDA_ARCH:-90}" -DMNEMO_MPI=OFF \
      -DMNEMO_TEST_SECOND_ISA=OFF >"$log/gpu_configure.log"
targets="test_cuda_dense test_cuda_attention test_cuda_memory_optim test_cuda_models test_cuda_golden_compressive
         test_cuda_golden_feedback train bench_cuda"
cmake --build "$build" -j "$jobs" --target $targets >"$log/gpu_build.log" 2>&1 || { tail -50 "$log/gpu_build.log"; exit 1; }
status=0
MNEMO_REQUIRE_GPU=1 ctest --test-dir "$build" -R cuda --output-on-failure | tee "$log/gpu_ctest.log" || status=1
sanitizer=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
for tool in memcheck racecheck; do
    for t in test_cuda_dense test_cuda_attention test_cuda_memory_optim; do
        echo "== compute-sanitizer --tool $tool $t"
        MNEMO_REQUIRE_GPU=1 "$sanitizer" --tool "$tool" --error-exitcode 3 "$build/tests/$t" >"$log/sanitize_${tool}_$t.log" 2>&1 \
            && echo ok || { status=1; tail -30 "$log/sanitize_${tool}_$t.log"; }
    done
done
if [ "${BENCH:-0}" = 1 ]; then
    python3 benchmarks/compare_pytorch_cuda.py --mnemo "$build/benchmarks/bench_cuda" --json "$log/compare_cuda.json" \
        | tee "$log/compare_cuda.md" || status=1
fi
exit $status
