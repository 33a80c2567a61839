#pragma once
// This machine's FP32 peak, measured: independent FMA chains on registers, no memory traffic, on
// `threads` OpenMP threads. Shared by the benchmark binaries so that every `peak_frac` counter is
// relative to the peak measured in the same process, at the same thread count.
#include <benchmark/benchmark.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <map>

#include <mnemo/kernels/cpu/simd.hpp>

namespace mnemo_bench {

// 12 independent accumulators hide the FMA latency (4 cycles × 2 pipes, with margin).
inline double fma_loop(std::int64_t iters) {
    using B = mnemo::simd::batch<float>;
    B acc[12];
    for (int i = 0; i < 12; ++i) acc[i] = B(1.0f + 0.001f * i);
    const B a(0.999999f), b(1e-7f);
    for (std::int64_t it = 0; it < iters; ++it)
        for (int i = 0; i < 12; ++i) acc[i] = xsimd::fma(acc[i], a, b);
    float s = 0;
    for (int i = 0; i < 12; ++i) s += xsimd::hadd(acc[i]);
    return s;
}

/// FP32 GFLOP/s of `threads` threads running fma_loop, timed with a wall clock.
inline double run_peak(int threads, std::int64_t iters) {
    double sink = 0;
    const auto t0 = std::chrono::steady_clock::now();
#pragma omp parallel num_threads(threads) reduction(+ : sink)
    sink += fma_loop(iters);
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    benchmark::DoNotOptimize(sink);
    return 2.0 * 12 * mnemo::simd::width<float> * static_cast<double>(iters) * threads / seconds / 1e9;
}

/// The peak for a thread count, measured once per process (best of five short runs).
inline double peak_gflops(int threads) {
    static std::map<int, double> cache;
    auto it = cache.find(threads);
    if (it != cache.end()) return it->second;
    double best = 0;
    for (int i = 0; i < 5; ++i) best = std::max(best, run_peak(threads, 4'000'000));
    return cache[threads] = best;
}

}  // namespace mnemo_bench
