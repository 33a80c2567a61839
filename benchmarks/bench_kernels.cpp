// Kernel benchmarks: GEMM GFLOP/s at transformer shapes against this machine's measured FP32 peak,
// the attention's per-head products (BM_head_products), and throughput of softmax, layer norm and
// cross-entropy.
//
//   ./build/benchmarks/bench_kernels                       everything, 1 and 2 threads
//   ./build/benchmarks/bench_kernels --benchmark_filter=gemm
//
// BM_read_bandwidth measures the DRAM read bandwidth, the roofline of memory-bound work (generation).
// BM_parallel_region measures what one of mnemo's parallel regions costs with nothing in it (its
// start and end, the time per iteration), BM_phases_region one with a barrier inside, BM_held_loop
// the same loops inside hold_threads (its us_per_loop counter), and BM_cache_line_round_trip the
// hardware's floor under them: one cache line handed from one thread to another and back.
// BM_peak_fp32 measures the peak: independent FMA chains on registers, no memory traffic. The
// GEMM rows report `peak_frac`, their GFLOP/s over the peak measured in the same run with the same
// thread count. BM_gemm and BM_gemm_model go through K::gemm_*, i.e. the packed kernel (AVX-512 or
// AVX2, with the blocking chosen for this CPU: the label says which) or
// OpenBLAS (a build with -DMNEMO_BLAS=ON) where gemm.hpp sends that shape (the label says which path
// ran); BM_gemm_eigen_model always takes mnemo's Eigen path and BM_gemm_packed_model (AVX2 or AVX-512 builds)
// always the packed kernel, both on 2 and 1 threads, so one run compares them.
// BM_gemm_model_cold runs BM_gemm_model's products with the caches emptied before each (see
// evict_caches), as a training step mostly finds its operands.
//
//   OMP_NUM_THREADS=2 ./build/benchmarks/bench_kernels --benchmark_filter=gemm.*model
//                                                       the large GEMMs of configurations B and C
#include <benchmark/benchmark.h>
#include <omp.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include <mnemo/kernels/cpu/ops.hpp>
#include <mnemo/kernels/cpu/simd.hpp>

#include "peak.hpp"

namespace {

using mnemo::index_t;
using K = mnemo::ops<mnemo::cpu>;

std::vector<float> filled(index_t n, float v) { return std::vector<float>(static_cast<std::size_t>(n), v); }

using mnemo_bench::peak_gflops;
using mnemo_bench::run_peak;

void BM_peak_fp32(benchmark::State& state) {
    const int threads = static_cast<int>(state.range(0));
    const std::int64_t iters = 2'000'000;
    for (auto _ : state) benchmark::DoNotOptimize(run_peak(threads, iters));
    const double flops = 2.0 * 12 * mnemo::simd::width<float> * static_cast<double>(iters) * threads;
    state.counters["GFLOPs"] = benchmark::Counter(flops / 1e9, benchmark::Counter::kIsIterationInvariantRate);
    // The GEMM rows' counters too: Google Benchmark's CSV output takes its columns from the first
    // row and aborts on a later row with a counter it has no column for. This row is the peak.
    state.counters["peak_GFLOPs"] = state.counters["GFLOPs"];
    state.counters["peak_frac"] = 1.0;
    state.counters["threads"] = threads;
    state.counters["read_GBps"] = mnemo_bench::read_bandwidth_gbs(threads);  // the other limit (BM_read_bandwidth)
    state.SetLabel("simd width " + std::to_string(mnemo::simd::width<float>) + " floats");
}

// The roofline of memory-bound work: DRAM read bandwidth, each thread summing its share of a 512 MiB
// buffer (peak.hpp; bench_models' generation rows report their roofline_frac against it).
void BM_read_bandwidth(benchmark::State& state) {
    const int threads = static_cast<int>(state.range(0));
    mnemo_bench::read_buffer();  // allocated and touched outside the timing
    double gbs = 0;
    for (auto _ : state) gbs = std::max(gbs, mnemo_bench::run_read(threads));
    state.counters["read_GBps"] = gbs;  // best pass
    state.counters["threads"] = threads;
    state.SetLabel("bytes " + std::to_string(mnemo_bench::read_buffer_bytes >> 20) + " MiB");
}

// One empty region of parallel_range over `threads` threads an iteration: what every split kernel
// pays on top of its work outside hold_threads (inside, see BM_held_loop). Only the counter every row has (see
// BM_peak_fp32 on CSV output); the time column is the region's cost.
void BM_parallel_region(benchmark::State& state) {
    const int threads = static_cast<int>(state.range(0));
    omp_set_num_threads(threads);
    std::atomic<index_t> sink{0};
    for (auto _ : state)
        mnemo::parallel_range(threads, true, [&](index_t begin, index_t) { sink.store(begin, std::memory_order_relaxed); });
    omp_set_num_threads(omp_get_num_procs());
    benchmark::DoNotOptimize(sink.load());
    state.counters["threads"] = threads;
}

// The same empty loop, and an empty two-phase loop (parallel_phases: one barrier), inside
// hold_threads: what a loop costs a model's entry point, whose threads are held (parallel.hpp).
// The iterations run in batches of 1000 inside one hold; the time column is one loop's cost.
void BM_held_loop(benchmark::State& state) {
    const int threads = static_cast<int>(state.range(0));
    const bool phases = state.range(1) != 0;
    omp_set_num_threads(threads);
    std::atomic<index_t> sink{0};
    constexpr int batch = 1000;
    auto empty = [&](index_t begin, index_t) { sink.store(begin, std::memory_order_relaxed); };
    for (auto _ : state) {
        mnemo::hold_threads([&] {
            for (int i = 0; i < batch; ++i) {
                if (phases) mnemo::parallel_phases(true, threads, empty, threads, empty);
                else mnemo::parallel_range(threads, true, empty);
            }
        });
    }
    omp_set_num_threads(omp_get_num_procs());
    benchmark::DoNotOptimize(sink.load());
    state.SetItemsProcessed(state.iterations() * batch);
    state.counters["threads"] = threads;
    state.counters["us_per_loop"] = benchmark::Counter(double(batch) * 1e-6, benchmark::Counter::kIsIterationInvariantRate | benchmark::Counter::kInvert);
}

// The same two-phase loop as regions of their own (one region with a barrier inside).
void BM_phases_region(benchmark::State& state) {
    const int threads = static_cast<int>(state.range(0));
    omp_set_num_threads(threads);
    std::atomic<index_t> sink{0};
    auto empty = [&](index_t begin, index_t) { sink.store(begin, std::memory_order_relaxed); };
    for (auto _ : state) mnemo::parallel_phases(true, threads, empty, threads, empty);
    omp_set_num_threads(omp_get_num_procs());
    benchmark::DoNotOptimize(sink.load());
    state.counters["threads"] = threads;
}

// A cache line handed to a second thread and back, both spinning: the least a region's start and
// end together can cost (each is at least one such hand-off).
void BM_cache_line_round_trip(benchmark::State& state) {
    alignas(64) std::atomic<std::int64_t> flag{0};
    std::atomic<bool> stop{false};
    std::thread other([&] {
        std::int64_t seen = 0;
        while (!stop.load(std::memory_order_relaxed)) {
            const std::int64_t v = flag.load(std::memory_order_acquire);
            if (v != seen && v % 2 == 1) {
                seen = v + 1;
                flag.store(seen, std::memory_order_release);
            }
        }
    });
    std::int64_t v = 0;
    for (auto _ : state) {
        flag.store(++v, std::memory_order_release);
        while (flag.load(std::memory_order_acquire) != v + 1) {
        }
        ++v;
    }
    stop.store(true);
    other.join();
    state.counters["threads"] = 2;
}

// C[M,N] = A·op(B) for the three forms; shape m × n × k.
enum form { nn, nt, tn };

// Which implementation a GEMM row calls: K::gemm_* (whatever gemm.hpp dispatches to), mnemo's Eigen
// path, or the packed kernel (gemm_packed.hpp).
enum class path { dispatch, eigen, packed };

// Cold operands (BM_gemm_model_cold): before each product, the threads read the first 128 MiB of
// peak.hpp's read buffer, so that A, B and C come from DRAM, as a training step's products mostly
// find them (the activations written a few products before, the weights once per step); only the
// product is timed.
void evict_caches() {
    const float* x = mnemo_bench::read_buffer();
    constexpr std::int64_t n = std::int64_t((std::size_t(128) << 20) / sizeof(float));
    float sum = 0.0f;
#pragma omp parallel for reduction(+ : sum) schedule(static)
    for (std::int64_t i = 0; i < n; i += 16) sum += x[i];
    benchmark::DoNotOptimize(sum);
}

void BM_gemm(benchmark::State& state, form f, path p = path::dispatch, bool cold = false) {
    const index_t m = state.range(0), n = state.range(1), k = state.range(2);
    const int threads = static_cast<int>(state.range(3));
    omp_set_num_threads(threads);
    auto a = filled(m * k, 0.5f), b = filled(k * n, 0.25f), c = filled(m * n, 0.0f);
    if (cold) mnemo_bench::read_buffer();  // allocated and touched outside the timing
    const double peak = peak_gflops(threads);  // measured before the timed loop
    double seconds = 0.0;
    auto t0 = std::chrono::steady_clock::now();
    for (auto _ : state) {
        if (cold) {
            evict_caches();
            t0 = std::chrono::steady_clock::now();
        }
        if (p == path::eigen) {
            switch (f) {
                case nn: K::gemm_nn_eigen(m, n, k, a.data(), k, b.data(), n, c.data(), n); break;
                case nt: K::gemm_nt_eigen(m, n, k, a.data(), k, b.data(), k, c.data(), n); break;
                case tn: K::gemm_tn_eigen(m, n, k, a.data(), m, b.data(), n, c.data(), n); break;
            }
#ifdef MNEMO_PACKED_GEMM
        } else if (p == path::packed) {
            switch (f) {
                case nn: K::gemm_nn_packed(m, n, k, a.data(), k, b.data(), n, c.data(), n); break;
                case nt: K::gemm_nt_packed(m, n, k, a.data(), k, b.data(), k, c.data(), n); break;
                case tn: K::gemm_tn_packed(m, n, k, a.data(), m, b.data(), n, c.data(), n); break;
            }
#endif
        } else {
            switch (f) {
                case nn: K::gemm_nn(m, n, k, a.data(), k, b.data(), n, c.data(), n); break;
                case nt: K::gemm_nt(m, n, k, a.data(), k, b.data(), k, c.data(), n); break;
                case tn: K::gemm_tn(m, n, k, a.data(), m, b.data(), n, c.data(), n); break;
            }
        }
        benchmark::DoNotOptimize(c.data());
        benchmark::ClobberMemory();
        if (cold) {
            const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
            state.SetIterationTime(dt);
            seconds += dt;
        }
    }
    if (!cold) seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const double flops = 2.0 * double(m) * double(n) * double(k);
    const double gflops = flops * static_cast<double>(state.iterations()) / seconds / 1e9;
    state.counters["GFLOPs"] = gflops;
    state.counters["peak_GFLOPs"] = peak;
    state.counters["peak_frac"] = gflops / peak;  // against the FP32 peak, same thread count
    state.counters["threads"] = threads;
    std::string label = "eigen";
#ifdef MNEMO_PACKED_GEMM
    // The packed kernel's instruction set and the blocking this CPU got (gemm_packed.hpp's traits).
    using GP = mnemo::cpu_kernels::gemm_packed;
    if (p == path::packed || (p == path::dispatch && K::use_packed(m, n, k)))
        label = std::string("packed ") + GP::isa::name + " (blocking " + GP::tuning().measured_on + ")";
#endif
#ifdef MNEMO_USE_BLAS
    // OpenBLAS's kernels as it reports them: mnemo uses them only when as wide as its own (gemm.hpp).
    if (p == path::dispatch && K::use_blas<float>(m, n, k)) label = "openblas";
    label += std::string(" (OpenBLAS core ") + K::blas_core() + (K::blas_active() ? ")" : ", unused)");
#endif
    state.SetLabel(label);
    omp_set_num_threads(omp_get_num_procs());
}

// The attention's per-head products in configuration B's layout (batch 8, 8 heads of d_k 32 in
// d_model 256; 128 queries, 384 keys with a memory of 256; the causal band), one thread: the scores
// q·kᵀ (nt), the context a·v (nn) and dv = aᵀ·dO (tn). Arg 1: one head's products repeated (its
// 196 KB attention block hot in L2); arg 64: all of B's (batch element, head) pairs in turn, each
// its own block in a 12.6 MB buffer; second arg 1: the 64 pairs in turn through one block kept hot,
// as a training step's heads run (relative_attention's score block: only the operands q, k, v
// come from farther than L2). GFLOP/s by the full products' count (bench_models' count;
// the band skips about a sixth).
void BM_head_products(benchmark::State& state, form f) {
    constexpr index_t B = 8, H = 8, D = 256, Dk = 32, Q = 128, M = 256, Kl = Q + M, ld = B * D, ldkv = B * 2 * D;
    const index_t pairs = state.range(0);
    const bool one_block = state.range(1) != 0;
    omp_set_num_threads(1);
    auto q = filled(Q * ld, 0.01f), kv = filled(Kl * ldkv, 0.02f), ctx = filled(Q * ld, 0.0f), dkv = filled(Kl * ldkv, 0.0f);
    auto attn = filled(B * H * Q * Kl, 0.001f);
    for (std::size_t i = 0; i < q.size(); ++i) q[i] = float(i % 89) * 0.01f;
    for (std::size_t i = 0; i < kv.size(); ++i) kv[i] = float(i % 97) * 0.01f;
    const mnemo::cpu_kernels::causal_keys band{M};
    const double peak = peak_gflops(1);
    const auto t0 = std::chrono::steady_clock::now();
    for (auto _ : state) {
        for (index_t bh = 0; bh < pairs; ++bh) {
            const index_t b = bh / H, h = bh % H, off = b * D + h * Dk, koff = b * 2 * D + h * Dk;
            float* a = attn.data() + (one_block ? 0 : bh * Q * Kl);
            switch (f) {
                case nt: K::head_gemm_nt<Dk>(Q, Kl, q.data() + off, ld, kv.data() + koff, ldkv, a, Kl, band); break;
                case nn: K::head_gemm_nn<Dk>(Q, Kl, a, Kl, kv.data() + koff + D, ldkv, ctx.data() + off, ld, 0.0f, band); break;
                case tn: K::head_gemm_tn<Dk>(Q, Kl, a, Kl, q.data() + off, ld, dkv.data() + koff + D, ldkv, 0.0f, band); break;
            }
        }
        benchmark::DoNotOptimize(attn.data());
        benchmark::DoNotOptimize(ctx.data());
        benchmark::DoNotOptimize(dkv.data());
        benchmark::ClobberMemory();
    }
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const double gflops = 2.0 * Q * Kl * Dk * double(pairs) * double(state.iterations()) / seconds / 1e9;
    state.counters["GFLOPs"] = gflops;
    state.counters["peak_GFLOPs"] = peak;
    state.counters["peak_frac"] = gflops / peak;
    state.counters["threads"] = 1;
    state.SetLabel(pairs == 1 ? "one head, hot"
                   : one_block ? "B's 64 heads in turn, one score block"
                               : "B's 64 heads in turn, a block each");
    omp_set_num_threads(omp_get_num_procs());
}

void BM_softmax(benchmark::State& state) {
    const index_t rows = state.range(0), cols = state.range(1);
    auto x = filled(rows * cols, 0.1f), y = filled(rows * cols, 0.0f);
    for (index_t i = 0; i < rows * cols; ++i) x[i] = float(i % 97) * 0.01f;
    for (auto _ : state) {
        K::softmax_forward(rows, cols, x.data(), cols, y.data(), cols, 0.125f, mnemo::softmax_mask::causal_from(cols / 2));
        benchmark::DoNotOptimize(y.data());
    }
    state.SetItemsProcessed(state.iterations() * rows);
    state.SetBytesProcessed(state.iterations() * rows * cols * 2 * index_t(sizeof(float)));
}

void BM_layer_norm(benchmark::State& state) {
    const index_t rows = state.range(0), d = state.range(1);
    auto x = filled(rows * d, 0.0f), y = filled(rows * d, 0.0f), w = filled(d, 1.0f), b = filled(d, 0.0f);
    for (index_t i = 0; i < rows * d; ++i) x[i] = float(i % 89) * 0.02f;
    std::vector<float> mean(rows), rstd(rows);
    for (auto _ : state) {
        K::layer_norm_forward(rows, d, x.data(), d, w.data(), b.data(), 1e-5f, y.data(), d, mean.data(), rstd.data());
        benchmark::DoNotOptimize(y.data());
    }
    state.SetItemsProcessed(state.iterations() * rows);
    state.SetBytesProcessed(state.iterations() * rows * d * 2 * index_t(sizeof(float)));
}

void BM_layer_norm_backward(benchmark::State& state) {
    const index_t rows = state.range(0), d = state.range(1);
    auto x = filled(rows * d, 0.0f), dy = filled(rows * d, 0.5f), dx = filled(rows * d, 0.0f), w = filled(d, 1.0f);
    auto dw = filled(d, 0.0f), db = filled(d, 0.0f);
    for (index_t i = 0; i < rows * d; ++i) x[i] = float(i % 89) * 0.02f;
    std::vector<float> mean(rows), rstd(rows);
    K::layer_norm_forward<float>(rows, d, x.data(), d, w.data(), nullptr, 1e-5f, dx.data(), d, mean.data(), rstd.data());
    for (auto _ : state) {
        K::layer_norm_backward(rows, d, x.data(), d, w.data(), mean.data(), rstd.data(), dy.data(), d, dx.data(), d,
                               dw.data(), db.data());
        benchmark::DoNotOptimize(dx.data());
    }
    state.SetItemsProcessed(state.iterations() * rows);
    state.SetBytesProcessed(state.iterations() * rows * d * 3 * index_t(sizeof(float)));
}

void BM_cross_entropy_fused(benchmark::State& state) {
    const index_t rows = state.range(0), vocab = state.range(1);
    auto x = filled(rows * vocab, 0.0f), dx = filled(rows * vocab, 0.0f), losses = filled(rows, 0.0f);
    for (index_t i = 0; i < rows * vocab; ++i) x[i] = float(i % 31) * 0.1f;
    std::vector<int> t(rows);
    for (index_t i = 0; i < rows; ++i) t[i] = int(i % vocab);
    for (auto _ : state) {
        K::cross_entropy_fused(rows, vocab, x.data(), vocab, t.data(), losses.data(), 1.0f / rows, dx.data(), vocab);
        benchmark::DoNotOptimize(dx.data());
    }
    state.SetItemsProcessed(state.iterations() * rows);
    state.SetBytesProcessed(state.iterations() * rows * vocab * 2 * index_t(sizeof(float)));
}

void gemm_shapes(benchmark::internal::Benchmark* b) {
    // (m, n, k): a d_model 256 / d_ff 768 projection over 1024 tokens, a 512 → 2048 feed-forward
    // over 2048 tokens, and the square 1024 case.
    for (int threads : {1, 2}) {
        b->Args({1024, 256, 768, threads});
        b->Args({1024, 768, 256, threads});
        b->Args({2048, 512, 2048, threads});
        b->Args({2048, 2048, 512, threads});
        b->Args({1024, 1024, 1024, threads});
    }
}

// The large products of a training step of configurations B (d_model 256, d_ff 1024) and C (512,
// 2048) over 1024 tokens (seq × batch) and 3072 key/value rows (seq + mem + c_mem, × batch), as
// (m, n, k) (model_gemm_shapes_on registers them on each of its thread counts). Each form runs every
// shape; the ones a step uses are
//   nt (forward, x·Wᵀ): (1024, d, d) query/output, (3072, 2d, d) keys and values, (1024, d_ff, d),
//                       (1024, d, d_ff) feed-forward
//   nn (dX = dY·W):     (1024, d, d), (1024, d, d_ff), (1024, d_ff, d), (3072, d, 2d)
//   tn (dW = dYᵀ·X):    (d, d, 1024), (d_ff, d, 1024), (d, d_ff, 1024), (2d, d, 3072)
std::vector<std::array<index_t, 3>> model_gemm_shape_list() {
    std::vector<std::array<index_t, 3>> shapes;
    for (index_t d : {256, 512}) {
        const index_t ff = 4 * d;
        for (auto s : {std::array<index_t, 3>{1024, d, d}, {1024, ff, d}, {1024, d, ff}, {3072, 2 * d, d},
                       {3072, d, 2 * d}, {d, d, 1024}, {ff, d, 1024}, {d, ff, 1024}, {2 * d, d, 3072}})
            if (std::find(shapes.begin(), shapes.end(), s) == shapes.end()) shapes.push_back(s);  // B's (1024, 256, 1024) twice
    }
    return shapes;
}
void model_gemm_shapes_on(benchmark::internal::Benchmark* b, std::initializer_list<int> thread_counts) {
    b->ArgNames({"m", "n", "k", "threads"});
    for (int threads : thread_counts)
        for (const auto& s : model_gemm_shape_list()) b->Args({s[0], s[1], s[2], threads});
}
void model_gemm_shapes(benchmark::internal::Benchmark* b) { model_gemm_shapes_on(b, {2}); }
// The Eigen and packed rows also on one thread.
void model_gemm_shapes_1_2(benchmark::internal::Benchmark* b) { model_gemm_shapes_on(b, {2, 1}); }

// The packed kernel's blocking swept over the 51 large products of B and C as one set (every shape of
// model_gemm_shape_list in each form, run once an iteration): the set's GFLOP/s and fraction of the
// peak for a given (kc, mc, nc, column split) and thread count, so a new microarchitecture's trait
// (gemm_packed.hpp's packed_tuning) can be measured in one run. The label names the blocking this
// CPU gets by default. Arguments that are no valid blocking for the build's kernel are skipped with
// an error naming them. Compare settings interleaved, the VMs drift:
//   bench_kernels --benchmark_filter=packed_blocking --benchmark_repetitions=5 \
//                 --benchmark_enable_random_interleaving=true --benchmark_report_aggregates_only=true
#ifdef MNEMO_PACKED_GEMM
void BM_packed_blocking(benchmark::State& state) {
    using GP = mnemo::cpu_kernels::gemm_packed;
    const mnemo::cpu_kernels::packed_blocking bl{"sweep", state.range(0), state.range(1), state.range(2), state.range(3)};
    const int threads = static_cast<int>(state.range(4));
    if (bl.kc <= 0 || bl.kc % GP::lanes != 0 || bl.kc > GP::isa::kc_cap || bl.mc <= 0 || bl.mc % GP::mr != 0 ||
        bl.nc <= 0 || bl.nc % GP::task_cols != 0 || bl.col_split_rows < 0) {
        state.SkipWithError(("not a blocking of the " + std::string(GP::isa::name) + " kernel: kc a multiple of " +
                             std::to_string(GP::lanes) + " up to " + std::to_string(GP::isa::kc_cap) + ", mc of " +
                             std::to_string(GP::mr) + ", nc of " + std::to_string(GP::task_cols))
                                .c_str());
        return;
    }
    const auto shapes = model_gemm_shape_list();
    index_t max_mk = 0, max_kn = 0, max_mn = 0;
    double flops = 0;
    for (const auto& s : shapes) {
        max_mk = std::max(max_mk, s[0] * s[2]), max_kn = std::max(max_kn, s[2] * s[1]), max_mn = std::max(max_mn, s[0] * s[1]);
        flops += 3 * 2.0 * double(s[0]) * double(s[1]) * double(s[2]);
    }
    auto a = filled(max_mk, 0.5f), b = filled(max_kn, 0.25f), c = filled(max_mn, 0.0f);
    omp_set_num_threads(threads);
    const double peak = peak_gflops(threads);
    const auto t0 = std::chrono::steady_clock::now();
    for (auto _ : state) {
        for (const auto& s : shapes) {
            const index_t m = s[0], n = s[1], k = s[2];
            GP::run<GP::form::nn>(m, n, k, a.data(), k, b.data(), n, c.data(), n, 0.0f, 1.0f, threads, bl);
            GP::run<GP::form::nt>(m, n, k, a.data(), k, b.data(), k, c.data(), n, 0.0f, 1.0f, threads, bl);
            GP::run<GP::form::tn>(m, n, k, a.data(), m, b.data(), n, c.data(), n, 0.0f, 1.0f, threads, bl);
        }
        benchmark::DoNotOptimize(c.data());
        benchmark::ClobberMemory();
    }
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const double gflops = flops * static_cast<double>(state.iterations()) / seconds / 1e9;
    state.counters["GFLOPs"] = gflops;
    state.counters["peak_GFLOPs"] = peak;
    state.counters["peak_frac"] = gflops / peak;
    state.counters["threads"] = threads;
    const auto& def = GP::tuning();
    state.SetLabel(std::string(GP::isa::name) + ", default " + def.measured_on + " kc " + std::to_string(def.kc) + " mc " +
                   std::to_string(def.mc) + " nc " + std::to_string(def.nc));
    omp_set_num_threads(omp_get_num_procs());
}

// The default blocking's neighbours for the build's kernel (kc, mc, nc, column split up to), each on
// 2 and 1 threads; other values with --benchmark_filter and a rebuild, or by editing this list.
void packed_blocking_sweep(benchmark::internal::Benchmark* b) {
    using GP = mnemo::cpu_kernels::gemm_packed;
    b->ArgNames({"kc", "mc", "nc", "colsplit", "threads"});
    const index_t r = GP::mr;  // 14 (AVX-512) or 6 (AVX2)
    const std::vector<std::array<index_t, 4>> settings =
        GP::lanes == 16 ? std::vector<std::array<index_t, 4>>{{512, 18 * r, 2048, 1024}, {512, 9 * r, 2048, 1024},
                                                              {512, 36 * r, 2048, 1024}, {384, 27 * r, 2048, 1024},
                                                              {256, 36 * r, 2048, 1024}, {512, 18 * r, 4096, 1024},
                                                              {512, 18 * r, 2048, 0}}
                        : std::vector<std::array<index_t, 4>>{{512, 12 * r, 4096, 1024}, {512, 8 * r, 4096, 1024},
                                                              {512, 16 * r, 4096, 1024}, {512, 24 * r, 4096, 1024},
                                                              {512, 42 * r, 4096, 1024}, {384, 16 * r, 4096, 1024},
                                                              {256, 24 * r, 4096, 1024}, {512, 12 * r, 2048, 1024},
                                                              {512, 12 * r, 4096, 0}};
    for (int threads : {2, 1})
        for (const auto& s : settings) b->Args({s[0], s[1], s[2], s[3], threads});
}
#endif

void BM_gemm_model(benchmark::State& state, form f) { BM_gemm(state, f); }
void BM_gemm_model_cold(benchmark::State& state, form f) { BM_gemm(state, f, path::dispatch, true); }
void BM_gemm_eigen_model(benchmark::State& state, form f) { BM_gemm(state, f, path::eigen); }
#ifdef MNEMO_PACKED_GEMM
void BM_gemm_packed_model(benchmark::State& state, form f) { BM_gemm(state, f, path::packed); }
#endif

}  // namespace

BENCHMARK(BM_peak_fp32)->Arg(1)->Arg(2)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_read_bandwidth)->Arg(1)->Arg(2)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_parallel_region)->Arg(2)->UseRealTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_phases_region)->Arg(2)->UseRealTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_held_loop)->ArgNames({"threads", "phases"})->Args({2, 0})->Args({2, 1})->UseRealTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_cache_line_round_trip)->UseRealTime()->Unit(benchmark::kMicrosecond);
BENCHMARK_CAPTURE(BM_gemm, nn, nn)->Apply(gemm_shapes)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_gemm, nt, nt)->Apply(gemm_shapes)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_gemm, tn, tn)->Apply(gemm_shapes)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_gemm_model, nn, nn)->Apply(model_gemm_shapes)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_gemm_model, nt, nt)->Apply(model_gemm_shapes)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_gemm_model, tn, tn)->Apply(model_gemm_shapes)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_gemm_model_cold, nn, nn)->Apply(model_gemm_shapes)->UseManualTime()->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_gemm_model_cold, nt, nt)->Apply(model_gemm_shapes)->UseManualTime()->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_gemm_model_cold, tn, tn)->Apply(model_gemm_shapes)->UseManualTime()->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_gemm_eigen_model, nn, nn)->Apply(model_gemm_shapes_1_2)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_gemm_eigen_model, nt, nt)->Apply(model_gemm_shapes_1_2)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_gemm_eigen_model, tn, tn)->Apply(model_gemm_shapes_1_2)->UseRealTime()->Unit(benchmark::kMillisecond);
#ifdef MNEMO_PACKED_GEMM
BENCHMARK_CAPTURE(BM_gemm_packed_model, nn, nn)->Apply(model_gemm_shapes_1_2)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_gemm_packed_model, nt, nt)->Apply(model_gemm_shapes_1_2)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_gemm_packed_model, tn, tn)->Apply(model_gemm_shapes_1_2)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_packed_blocking)->Apply(packed_blocking_sweep)->UseRealTime()->Unit(benchmark::kMillisecond);
#endif
BENCHMARK_CAPTURE(BM_head_products, nt, nt)->Args({1, 0})->Args({64, 0})->Args({64, 1})->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_head_products, nn, nn)->Args({1, 0})->Args({64, 0})->Args({64, 1})->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_head_products, tn, tn)->Args({1, 0})->Args({64, 0})->Args({64, 1})->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_softmax)->Args({4096, 512})->Args({1024, 4096})->Args({8192, 65})->UseRealTime();
BENCHMARK(BM_layer_norm)->Args({4096, 128})->Args({4096, 512})->Args({8192, 256})->UseRealTime();
BENCHMARK(BM_layer_norm_backward)->Args({4096, 128})->Args({4096, 512})->UseRealTime();
BENCHMARK(BM_cross_entropy_fused)->Args({4096, 65})->Args({1024, 256})->Args({1024, 50257})->UseRealTime();

BENCHMARK_MAIN();
