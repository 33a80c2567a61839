#pragma once
// GEMM on row-major matrices through Eigen's GEBP kernel (general_matrix_matrix_product: Eigen packs
// and blocks; mnemo keeps the packing buffers and splits the product over threads). The three forms
// training needs, each C = beta·C + alpha·op(A)·op(B):
//   gemm_nn: A[M,K]   · B[K,N]      (forward of x·W when W is [in, out])
//   gemm_nt: A[M,K]   · B[N,K]ᵀ     (forward of a PyTorch linear, x·Wᵀ; scores Q·Kᵀ)
//   gemm_tn: A[K,M]ᵀ  · B[K,N]      (weight gradients, dW = dYᵀ·X)
// beta = 0 overwrites C (its contents may be garbage), beta = 1 accumulates.
// lda/ldb/ldc are row strides in elements.
//
// Large float products on AVX-512 and AVX2 + FMA builds go to gemm_packed instead (gemm_packed.hpp:
// mnemo's own packed SGEMM, a 14×32 AVX-512 or 6×16 AVX2 micro-kernel with blocking chosen by the
// CPU model, bitwise the same for any thread count): use_packed() takes products of at least 2^21
// multiply-adds with m ≥ 96 (AVX-512) or 40 (AVX2), n ≥ two panels (64 on AVX-512, 32 on AVX2; at
// most 1/8 of the panels padding) and k ≥ 32. Double, other types, smaller, skinnier or shallower float products and builds
// without AVX2 + FMA stay on Eigen; gemm_*_packed call the packed kernel whatever the shape.
//   On the 2-core Zen 2 VM (AVX2) the packed kernel was ahead of Eigen on 98 of the 102 large-product
//   rows (gemm_packed.hpp has the numbers), and on configuration B's n = 32 products (1024×32×512 nn
//   and nt, 512×32×1024 tn: 1.12-1.16× on one thread) and n = 48 (1.07×); on products under 2^21 or
//   with 32 rows it was 0.83-1.07× Eigen's speed (8×76×32 nt: 0.71×), so those stay on Eigen. On a
//   Zen 3 VM (2026-12-04) 40-80 rows ran 1.08-2.05× Eigen's speed (packed_isa_avx2::min_rows).
//   Measured on the 2-core Zen 5 VM (bench_kernels --benchmark_filter='(eigen|packed)_model': the 17
//   large products of configurations B and C in each form, fraction of the FP32 peak measured in the
//   same run, min / median / max over the shapes of each shape's median of 3 repetitions, one run
//   with both paths while nothing else ran):
//                  packed               Eigen
//     2 threads nn 0.78 / 0.87 / 0.92   0.61 / 0.81 / 0.89
//               nt 0.80 / 0.88 / 0.94   0.70 / 0.76 / 0.88
//               tn 0.79 / 0.855/ 0.90   0.69 / 0.75 / 0.85
//     1 thread  nn 0.81 / 0.90 / 0.96   0.77 / 0.84 / 0.90
//               nt 0.82 / 0.90 / 0.96   0.76 / 0.83 / 0.90
//               tn 0.86 / 0.88 / 0.94   0.73 / 0.80 / 0.89
//   The VM's neighbours move these by up to 0.1 from run to run (three more 2-thread runs: packed
//   medians 0.78-0.90 nn, 0.80-0.85 nt, 0.80-0.86 tn against Eigen's 0.81-0.84, 0.77-0.78, 0.71-0.74);
//   packed was ahead on 47 of the 51 products above and 0.01-0.04 behind on the other 4 (nn, three
//   of them with m ≤ 512). Below the thresholds the two are within a few percent either way (64³ to
//   256³, 128×384×64), and Eigen is ahead on few rows (3 to 64: up to 1.7× faster), shallow products
//   (k = 16: 1.1-1.5×) and n = 48 (1.25×).
//
// Threads: mnemo calls Eigen's sequential product (so a user's Eigen::setNbThreads is untouched) and
// splits a large GEMM itself into one block of C per thread. Eigen's own parallel product would otherwise open an OpenMP region for
// products as small as 8×128×128 (the per-token GEMMs of the recurrent models and the per-head
// attention products), whose fork/join costs more than the product, and which stall badly whenever
// another process holds a core. Below parallel_min_work multiply-adds (≈ 20 µs of work) a GEMM runs
// on the calling thread; inside an OpenMP region it always does.
//
// Optional OpenBLAS (cmake -DMNEMO_BLAS=ON: defines MNEMO_USE_BLAS and links OpenBLAS's OpenMP build,
// Debian's libopenblas-openmp-dev; never the pthread build, whose threads fight OpenMP's). Float and
// double products of at least blas_min_work = 2^24 multiply-adds, 12 or more on every side, go to
// cblas_sgemm/cblas_dgemm; everything smaller (the per-head attention products such as 8×152×32 or
// 128×384×32, the one- and two-row GEMVs of generation, other scalar types) keeps the packed,
// row_dots or Eigen path, which is also the whole story without the macro. gemm_*_eigen are the Eigen path,
// always available. (The packed kernel's numbers above are ahead of OpenBLAS's below; this order
// is kept so that a BLAS build behaves as before.)
//   - mnemo still splits the rows of C over the threads (boundaries on multiples of 12 rows, every
//     block at least 2^23 multiply-adds), one single-threaded OpenBLAS call per block: results are
//     bitwise the same for any thread count (OpenBLAS's own threading is not: its threaded driver
//     blocks K differently; below 2^23 its AVX-512 builds switch to "small matrix" and direct-sgemm
//     kernels that round differently, hence the threshold). Called inside an OpenMP region, OpenBLAS
//     runs on the calling thread.
//   - Only when OpenBLAS's kernels are as wide as the code mnemo was compiled for (blas_active(),
//     checked once): OpenBLAS 0.3.21 takes its AVX-512 Cooperlake kernels on Zen 5 by itself, but
//     OPENBLAS_CORETYPE=Haswell in the environment (the development VM sets it) gives AVX2 kernels
//     at 35-44% of the AVX-512 peak, well under Eigen; everything then stays on Eigen.
//   - OpenBLAS takes its work buffers from its own pool: a steady-state GEMM allocates nothing
//     (tests/test_gemm_blas.cpp, tests/test_allocations.cpp).
//   Measured on the 2-core Zen 5 VM, 2 threads, OpenBLAS 0.3.21 with OPENBLAS_CORETYPE=Cooperlake
//   (bench_kernels --benchmark_filter=gemm.*model: the 17 large products of configurations B and C in
//   each form, fraction of the measured FP32 peak, medians of 3 runs; min / median / max):
//     nn  OpenBLAS 0.71 / 0.81 / 0.85   Eigen 0.60 / 0.76 / 0.86
//     nt  OpenBLAS 0.63 / 0.79 / 0.84   Eigen 0.45 / 0.74 / 0.79
//     tn  OpenBLAS 0.70 / 0.79 / 0.86   Eigen 0.62 / 0.69 / 0.84
//   OpenBLAS is ahead on 39 of the 51; it is 5-8 points behind on some long-K products (nn
//   512×256×3072 and 512×512×1024, nt 256×{256,1024}×1024 and 1024×512×{2048,3072}). bench_models: forward B 72 ms against 81 ms on Eigen, C 232 against
//   270; training step B 240 against 268, C 813 against 890. Below 2^24 multiply-adds Eigen was as fast
//   or faster (8×152×32 on one thread: 1.1 µs against 1.8 µs), so the threshold costs nothing.
#include <omp.h>

#include "simd.hpp"  // first: the intrinsics' headers are read in its diagnostic region

#include <Eigen/Core>
#include <algorithm>
#include <cctype>
#include <climits>
#include <cmath>
#include <string>
#include <type_traits>
#include <vector>

#ifdef MNEMO_USE_BLAS
#include <cblas.h>
#ifndef OPENBLAS_VERSION
#error "MNEMO_USE_BLAS: <cblas.h> is not OpenBLAS's (netlib's has no OPENBLAS_VERSION); put OpenBLAS's include directory first (CMake: -DMNEMO_BLAS=ON does)"
#endif
#endif

#include "../../core/shape.hpp"
#include "causal_keys.hpp"
#include "cpu_model.hpp"
#include "elementwise.hpp"
#include "gemm_direct.hpp"
#include "parallel.hpp"

namespace mnemo::cpu_kernels {

/// How the one- and two-row products split their outputs over the threads (gemm::gemv_threads): a
/// product of at least `parallel_min` elements (n·k) splits, the row-major form (row_dots) at
/// multiples of `row_split` outputs. (Eigen's column-major form, Wᵀ·x, always splits at multiples
/// of gemm::gemv_split.) Every output is computed the same way wherever a split puts it: the bits do
/// not depend on the thread count or on this tuning.
struct gemv_splitting {
    const char* name;
    index_t parallel_min;
    index_t row_split;
};

/// gemv_splitting by CPU model (cpu_model.hpp).
struct gemv_tuning {
    // One generated token of configurations B and C reads every weight once (B: 19 MB, C: 75 MB),
    // from DRAM, where two cores read about 1.5× as fast as one: from 64K elements on, B's 256×256
    // attention projections included (on two threads they made B's token 3-10% faster on a Zen 1 VM
    // with an 8 MiB L3, 2026-11-25). A's products (16K-32K elements, 64-128 KiB, from L3) stay on
    // one thread: there the fork cost what the second core saved (on a Zen 3 VM, 2026-11-29, 2^14 to
    // 10^8 elements were within the noise of 2^16 or slower; on an Emerald Rapids VM, 2026-11-28,
    // 2^13 at multiples of 128 took A's token from 0.205-0.214 to 0.185-0.207 ms, and was left).
    static constexpr gemv_splitting defaults{"default", index_t(1) << 16, 128};
    // Granite Rapids (2 MiB L2 a core, a mesh L3 that one core reads at about 22 GB/s): A's token
    // reads its 4.9 MB from L3 as slowly on one thread as on two (0.221 against 0.237 ms), and from
    // 32K elements split at multiples of 32 rows (A's feed-forward and key/value products, the
    // 128-output ones included) it took 0.80-0.81 of the time; 16K / 64 rows 0.81-0.82, 16K / 128
    // rows 0.84-0.87, 32K / 128 rows 0.85-0.88, 4K / 16-32 rows 0.81-0.86; B's token 0.99-1.01 with
    // each (a 2-core VM, CPUID model A7h with AMX, 2026-12-07; one process alternating the settings
    // token block by token block, medians of 12 rounds, two runs).
    static constexpr gemv_splitting xeon_gnr{"xeon-gnr", index_t(1) << 15, 32};
    static constexpr gemv_splitting for_model(cpu_model m) { return m == cpu_model::xeon_gnr ? xeon_gnr : defaults; }
};

/// A gemv_splitting to use instead of this CPU's (tests and benchmarks that run every split on any
/// machine); null: this CPU's. Not meant to change while a product runs.
inline const gemv_splitting* gemv_splitting_override = nullptr;

struct gemm {
    /// Multiply-adds below which a GEMM stays on one thread.
    static constexpr double parallel_min_work = double(1 << 21);

    /// Threads a product of m·n·k multiply-adds may use: all of available_threads() from
    /// parallel_min_work on (one inside an OpenMP region or a held team's job).
    static int threads_for(index_t m, index_t n, index_t k) {
        const double work = double(m) * double(n) * double(k);
        return work >= parallel_min_work ? int(available_threads()) : 1;
    }

    /// Two independent products of about m·n·k multiply-adds each (a linear layer's dW = dyᵀ·x and
    /// dx = dy·W) are better run at the same time, one per thread (parallel_invoke), than one after
    /// the other on all threads: from 2^19 multiply-adds (a fork costs about 4 µs on the 2-core VM)
    /// to under 2^24, where the threads split one product well. Measured in configuration A's step
    /// (256×128×128 to 256×256×128): two threads on one packed product ran only 1.25× one thread.
    static bool concurrent_pair(index_t m, index_t n, index_t k) {
        const double work = double(m) * double(n) * double(k);
        return work >= double(1 << 19) && work < double(1 << 24) && available_threads() >= 2;
    }

    /// Calls f(m0, m1, n0, n1) over blocks of C [m, n]: one block of rows per thread when the product
    /// is big enough. Only rows are split, in multiples of 16: Eigen computes a row-major C as its
    /// transpose, so C's rows are the columns of Eigen's kernel, whose 4-wide panels each sum over k
    /// in the same order whatever the block. The result is bitwise the same for any thread count
    /// (splitting C's columns would move some of them into Eigen's remainder micro-kernels, which
    /// round differently).
    template <class F>
    static void split(index_t m, index_t n, index_t k, F&& f) {
        int threads = threads_for(m, n, k);
        threads = int(std::min<index_t>(threads, std::max<index_t>(1, m / 16)));
        if (threads <= 1) {
            f(index_t(0), m, index_t(0), n);
            return;
        }
        const index_t chunk = (m + threads - 1) / threads;
        const index_t step = (chunk + 15) / 16 * 16;
        parallel_team(threads, [&](index_t t, index_t) {
            const index_t b = std::min(m, t * step), e = std::min(m, b + step);
            if (b < e) f(b, e, index_t(0), n);
        });
    }

    template <class T>
    using matrix_map = Eigen::Map<Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>, Eigen::Unaligned,
                                  Eigen::OuterStride<>>;

    /// Eigen's packing buffers for one thread, kept between calls. Eigen's product expression takes
    /// them from the heap (malloc, not operator new) whenever they exceed 128 KiB, i.e. on every large
    /// GEMM, and glibc then maps and unmaps fresh pages each time; here they grow once and are reused,
    /// so a steady-state GEMM allocates nothing. Blocking sizes are Eigen's own for one thread, so
    /// results are bitwise those of `C.noalias() += A·B`.
    template <class T>
    class blocking : public Eigen::internal::level3_blocking<T, T> {
    public:
        /// Eigen's cache blocking for a row-major C [m, n] with depth k (the kernel works on Cᵀ).
        void prepare(index_t m, index_t n, index_t k) {
            this->m_mc = n;
            this->m_nc = m;
            this->m_kc = k;
            Eigen::internal::computeProductBlockingSizes<T, T, 1>(this->m_kc, this->m_mc, this->m_nc, Eigen::Index(1));
            const std::size_t a = std::size_t(this->m_mc * this->m_kc), b = std::size_t(this->m_kc * this->m_nc);
            if (a > a_.size()) a_.resize(a);
            if (b > b_.size()) b_.resize(b);
            this->m_blockA = a_.data();
            this->m_blockB = b_.data();
        }

    private:
        std::vector<T, Eigen::aligned_allocator<T>> a_, b_;
    };

    template <class T>
    static blocking<T>& thread_blocking() {
        thread_local blocking<T> b;
        return b;
    }

    /// C ← beta·C before a product adds into it (beta = 0 overwrites, whatever C held).
    template <class Dst, class T>
    static void apply_beta(Dst& c, T beta) {
        if (beta == T(0)) c.setZero();
        else if (beta != T(1)) c *= beta;
    }

    /// C [m, n] (row-major, stride ldc) = beta·C + alpha·op(A)·op(B); A is row-major [m, k] (LhsOrder =
    /// RowMajor) or [k, m] read transposed (ColMajor view), likewise B.
    template <int LhsOrder, int RhsOrder, class T>
    static void product(index_t m, index_t n, index_t k, const T* a, index_t lda, const T* b, index_t ldb, T* c,
                        index_t ldc, T beta, T alpha) {
        matrix_map<T> cm(c, m, n, Eigen::OuterStride<>(ldc));
        apply_beta(cm, beta);
        if (k == 0) return;
        auto& bl = thread_blocking<T>();
        bl.prepare(m, n, k);
        Eigen::internal::general_matrix_matrix_product<index_t, T, LhsOrder, false, T, RhsOrder, false, Eigen::RowMajor,
                                                       1>::run(m, n, k, a, lda, b, ldb, c, 1, ldc, alpha, bl, nullptr);
    }

    /// Rows of C up to which a product is a few matrix-vector products instead of a GEMM: packing B
    /// (a weight matrix, typically) for one row of A costs more than the product itself, which is
    /// what one-token generation does in every layer.
    static constexpr index_t gemv_max_rows = 2;

    template <class T>
    using vector_map = Eigen::Map<Eigen::Matrix<T, Eigen::Dynamic, 1>, Eigen::Unaligned, Eigen::InnerStride<>>;
    template <class T>
    using const_vector_map = Eigen::Map<const Eigen::Matrix<T, Eigen::Dynamic, 1>, Eigen::Unaligned, Eigen::InnerStride<>>;
    template <class T>
    using const_row_major = Eigen::Map<const Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>,
                                       Eigen::Unaligned, Eigen::OuterStride<>>;

    /// c[r] += alpha·(row r of M)·x for r in [0, n): M row-major [n, k] (row stride ldm), x stride 1.
    /// One row at a time, front to back, four SIMD accumulators over k: the matrix is read as one
    /// sequential stream, which the hardware prefetchers follow at full speed. Eigen's row-major GEMV
    /// reads 4-8 rows side by side instead, as many short streams (k = 512 floats is 2 KiB, 32 cache
    /// lines a row): on the 2-core Zen 3 VM, over configuration C's 40 weight matrices (100 MB, 2
    /// threads, split as gemv_threads splits them), Eigen read 17.4 GB/s and this loop 19.4, where a
    /// plain sum of the same bytes read 20.9 (best of 30 passes, averaged over 8 interleaved rounds).
    /// From row_dots_group_min_k on, the rows' vector sums go W (the SIMD width) at a time through one
    /// transpose_add instead of a horizontal sum each; every row's lanes are then summed in
    /// transpose_add's order (the last rows, fewer than W, by halving_sum), below it in xsimd::hadd's.
    /// Either way each output is computed the same way wherever a split or a group puts its row.
    template <class T>
    static void row_dots(index_t n, index_t k, const T* m, index_t ldm, const T* x, T* c, T alpha) {
        using B = simd::batch<T>;
        constexpr index_t w = simd::width<T>;
        // Row r's vector of partial sums, and its scalar tail (k not a whole number of vectors).
        auto partial = [&](index_t r, T& tail) {
            const T* a = m + r * ldm;
            B s0(T(0)), s1(T(0)), s2(T(0)), s3(T(0));
            index_t j = 0;
            for (; j + 4 * w <= k; j += 4 * w) {
                s0 = simd::fma(simd::load(a + j), simd::load(x + j), s0);
                s1 = simd::fma(simd::load(a + j + w), simd::load(x + j + w), s1);
                s2 = simd::fma(simd::load(a + j + 2 * w), simd::load(x + j + 2 * w), s2);
                s3 = simd::fma(simd::load(a + j + 3 * w), simd::load(x + j + 3 * w), s3);
            }
            for (; j + w <= k; j += w) s0 = simd::fma(simd::load(a + j), simd::load(x + j), s0);
            tail = T(0);  // by pointer: with an index, g++ 12 misreads a constant k (-Waggressive-loop-optimizations)
            for (const T *p = a + j, *q = x + j; p < a + k; ++p, ++q) tail += *p * *q;
            return (s0 + s1) + (s2 + s3);
        };
        index_t r = 0;
        if (k < row_dots_group_min_k) {
            for (; r < n; ++r) {
                T tail;
                const B v = partial(r, tail);
                c[r] += alpha * (simd::reduce_add(v) + tail);
            }
            return;
        }
        for (; r + w <= n; r += w) {
            B v[w];
            T tails[w];
            for (index_t i = 0; i < w; ++i) v[i] = partial(r + i, tails[i]);
            alignas(64) T sums[w];
            simd::transpose_add(v).store_aligned(sums);
            for (index_t i = 0; i < w; ++i) c[r + i] += alpha * (sums[i] + tails[i]);
        }
        for (; r < n; ++r) {
            T tail;
            alignas(64) T lanes[w];
            partial(r, tail).store_aligned(lanes);
            c[r] += alpha * (simd::halving_sum<T, int(w)>(lanes) + tail);
        }
    }

    /// Row length from which row_dots sums its rows' lanes W rows at a time. Zen 4 VM (AVX-512),
    /// C's weight matrices (k 512 and 2048, 72 MB, from DRAM): one row at a time 22.2-23.8 GB/s on
    /// one thread, 28.2-28.5 on two; W at a time 25.7-27.5 and 31.3-32.4, where a plain sum of the
    /// same halves read 33.3-34.2 (medians of 15 passes, two runs); C's cached token 0.909-0.929 of
    /// the time on two threads, 0.945 on one (one process alternating the two, medians of 8-12
    /// rounds). With the rows in L1 or L2 the groups cost more than they save: 128×128 1.10×, 256×128
    /// 1.10×, 128×256 1.05×, 512×512 1.04×, 2048×512 1.005× (one thread), A's token 1.09-1.10×.
    /// B's token (k 256 and 1024) moved within the noise (1.005).
    static constexpr index_t row_dots_group_min_k = 512;

    /// c[n] (stride 1) = beta·c + alpha·M·x, with M [n, k] row-major (Transposed: M = Bᵀ, B [k, n]).
    /// The row-major form with a contiguous x is row_dots; the others are Eigen's GEMV.
    template <bool Transposed, class T>
    static void gemv(index_t n, index_t k, const T* b, index_t ldb, const T* x, index_t incx, T* c, T beta, T alpha) {
        vector_map<T> cv(c, n, Eigen::InnerStride<>(1));
        apply_beta(cv, beta);
        if (k == 0) return;
        if constexpr (!Transposed) {
            if (incx == 1) {
                row_dots(n, k, b, ldb, x, c, alpha);
                return;
            }
        }
        const_vector_map<T> xv(x, k, Eigen::InnerStride<>(incx));
        if constexpr (Transposed) {
            const_row_major<T> bm(b, k, n, Eigen::OuterStride<>(ldb));
            cv.noalias() += alpha * (bm.transpose() * xv);
        } else {
            const_row_major<T> bm(b, n, k, Eigen::OuterStride<>(ldb));
            cv.noalias() += alpha * (bm * xv);
        }
    }

    /// This machine's gemv_splitting (gemv_tuning, by CPUID, chosen once per process), or
    /// gemv_splitting_override's.
    static const gemv_splitting& gemv_split_here() {
        static const gemv_splitting mine = gemv_tuning::for_model(this_cpu_model());
        return gemv_splitting_override ? *gemv_splitting_override : mine;
    }
    /// The Transposed form's split points are multiples of 128 outputs: Eigen's column-major GEMV
    /// takes the outputs in blocks of at most 128 (8 packets of 16) and computes each output the same
    /// way in every block type, so each block of a split meets the blocks the whole product would.
    /// row_dots (the row-major form) computes every output on its own, at any split
    /// (gemv_splitting::row_split). The bits do not depend on the thread count (tested).
    static constexpr index_t gemv_split = 128;

    /// gemv over the threads from gemv_split_here().parallel_min elements on; on the calling thread
    /// below it or inside a parallel region.
    template <bool Transposed, class T>
    static void gemv_threads(index_t n, index_t k, const T* b, index_t ldb, const T* x, index_t incx, T* c, T beta,
                             T alpha) {
        const gemv_splitting& sp = gemv_split_here();
        // row_dots (the row-major form with a contiguous x) may split anywhere; Eigen's GEMV at its blocks.
        const index_t split = !Transposed && incx == 1 ? sp.row_split : gemv_split;
        const index_t chunks = n / split;
        const int threads = (n * k >= sp.parallel_min && chunks >= 2) ? int(std::min<index_t>(available_threads(), chunks)) : 1;
        if (threads <= 1) {
            gemv<Transposed>(n, k, b, ldb, x, incx, c, beta, alpha);
            return;
        }
        parallel_team(threads, [&](index_t t, index_t nt) {
            const index_t r0 = chunks * t / nt * split, r1 = t + 1 == nt ? n : chunks * (t + 1) / nt * split;
            // Output rows [r0, r1): rows of B (B [n, k]) or its columns (Transposed: B [k, n]).
            if (r0 < r1) gemv<Transposed>(r1 - r0, k, Transposed ? b + r0 : b + r0 * ldb, ldb, x, incx, c + r0, beta, alpha);
        });
    }

    /// gemm_nn on the Eigen path, whatever MNEMO_USE_BLAS says.
    template <class T>
    static void gemm_nn_eigen(index_t m, index_t n, index_t k, const T* a, index_t lda, const T* b, index_t ldb,
                              T* c, index_t ldc, T beta = T(0), T alpha = T(1)) {
        if (m == 0 || n == 0) return;
        if (m <= gemv_max_rows) {
            for (index_t i = 0; i < m; ++i) gemv_threads<true>(n, k, b, ldb, a + i * lda, 1, c + i * ldc, beta, alpha);
            return;
        }
        split(m, n, k, [&](index_t m0, index_t m1, index_t n0, index_t n1) {
            product<Eigen::RowMajor, Eigen::RowMajor>(m1 - m0, n1 - n0, k, a + m0 * lda, lda, b + n0, ldb,
                                                      c + m0 * ldc + n0, ldc, beta, alpha);
        });
    }

    /// gemm_nt on the Eigen path, whatever MNEMO_USE_BLAS says.
    template <class T>
    static void gemm_nt_eigen(index_t m, index_t n, index_t k, const T* a, index_t lda, const T* b, index_t ldb,
                              T* c, index_t ldc, T beta = T(0), T alpha = T(1)) {
        if (m == 0 || n == 0) return;
        if (m <= gemv_max_rows) {
            for (index_t i = 0; i < m; ++i) gemv_threads<false>(n, k, b, ldb, a + i * lda, 1, c + i * ldc, beta, alpha);
            return;
        }
        split(m, n, k, [&](index_t m0, index_t m1, index_t n0, index_t n1) {
            product<Eigen::RowMajor, Eigen::ColMajor>(m1 - m0, n1 - n0, k, a + m0 * lda, lda, b + n0 * ldb, ldb,
                                                      c + m0 * ldc + n0, ldc, beta, alpha);
        });
    }

    /// gemm_tn on the Eigen path, whatever MNEMO_USE_BLAS says.
    template <class T>
    static void gemm_tn_eigen(index_t m, index_t n, index_t k, const T* a, index_t lda, const T* b, index_t ldb,
                              T* c, index_t ldc, T beta = T(0), T alpha = T(1)) {
        if (m == 0 || n == 0) return;
        if (m <= gemv_max_rows) {  // row i of C is Bᵀ·(column i of A)
            for (index_t i = 0; i < m; ++i) gemv_threads<true>(n, k, b, ldb, a + i, lda, c + i * ldc, beta, alpha);
            return;
        }
        split(m, n, k, [&](index_t m0, index_t m1, index_t n0, index_t n1) {
            product<Eigen::ColMajor, Eigen::RowMajor>(m1 - m0, n1 - n0, k, a + m0, lda, b + n0, ldb,
                                                      c + m0 * ldc + n0, ldc, beta, alpha);
        });
    }

    /// One-thread products whose operands are better read in place than packed (gemm_direct.hpp:
    /// float on AVX-512 and AVX2 + FMA builds; Eigen otherwise): C = beta·C + A·B (nn), A·Bᵀ (nt) or
    /// Aᵀ·B (tn), alpha 1. For a caller that knows its shapes, such as the absorbed memory attention's
    /// per-batch-element products over strided rows (there, AVX-512 on Zen 5: 1.3× (nn) and 1.7× (nt)
    /// Eigen's speed; AVX2 on Zen 2, configuration A's 32×136×128 over rows 4096 floats apart: 1.14×
    /// and 1.85×) and its per-head products with the weights (relative_attention_pass::head_direct).
    /// Measured and not kept: sending every float product with A and B under 64K floats here (rows
    /// split over threads). Alone, with hot operands, those ran 1.1-1.5× Eigen and up to 1.15× the
    /// packed kernel (configuration A's 128-256-sided linears); inside A's training step, where the
    /// operands come from L3, 10-30% slower than packed, and the step no faster (17.4 → 17.6 ms).
    /// All three split C's columns (for nt: B's rows) over the threads in blocks of 64 from
    /// direct_split_min multiply-adds, when the caller is not in a parallel region (the absorbed
    /// route's per-batch-element loop is one, from batch 2 on). Only on the direct kernel, whose
    /// elements each sum over k in one chain wherever their tile falls: a split keeps the bits.
    /// (Eigen's path, for double or without the packed GEMM, chooses its K blocking from the shape,
    /// so it stays on one thread.)
    template <class T>
    static void gemm_nn_direct(index_t m, index_t n, index_t k, const T* a, index_t lda, const T* b, index_t ldb, T* c,
                               index_t ldc, T beta = T(0)) {
        direct_columns<T>(m, n, k, [&](index_t j0, index_t j1) {
#ifdef MNEMO_PACKED_GEMM
            if constexpr (std::is_same_v<T, float>)
                return gemm_direct::gemm_nn(m, j1 - j0, k, a, lda, b + j0, ldb, c + j0, ldc, beta);
#endif
            gemm_nn_eigen(m, j1 - j0, k, a, lda, b + j0, ldb, c + j0, ldc, beta, T(1));
        });
    }
    template <class T>
    static void gemm_nt_direct(index_t m, index_t n, index_t k, const T* a, index_t lda, const T* b, index_t ldb, T* c,
                               index_t ldc, T beta = T(0)) {
        direct_columns<T>(m, n, k, [&](index_t j0, index_t j1) {
#ifdef MNEMO_PACKED_GEMM
            if constexpr (std::is_same_v<T, float>)
                return gemm_direct::gemm_nt(m, j1 - j0, k, a, lda, b + j0 * ldb, ldb, c + j0, ldc, beta);
#endif
            gemm_nt_eigen(m, j1 - j0, k, a, lda, b + j0 * ldb, ldb, c + j0, ldc, beta, T(1));
        });
    }
    template <class T>
    static void gemm_tn_direct(index_t m, index_t n, index_t k, const T* a, index_t lda, const T* b, index_t ldb, T* c,
                               index_t ldc, T beta = T(0)) {
        direct_columns<T>(m, n, k, [&](index_t j0, index_t j1) {
#ifdef MNEMO_PACKED_GEMM
            if constexpr (std::is_same_v<T, float>)
                return gemm_direct::gemm_tn(m, j1 - j0, k, a, lda, b + j0, ldb, c + j0, ldc, beta);
#endif
            gemm_tn_eigen(m, j1 - j0, k, a, lda, b + j0, ldb, c + j0, ldc, beta, T(1));
        });
    }

    /// Multiply-adds from which gemm_{nn,nt,tn}_direct split C's columns over the threads. The
    /// absorbed route's products at one query position and batch 1 (a recomputing generated token:
    /// q̃·ẑᵀ and [H, M]·ẑ over the memory's rows) ran on one thread while the other waited. Zen 5
    /// VM, 2 threads, ten interleaved pairs (2026-12-02): C's (2.1M each) split, token 4.33 → 4.04
    /// ms (medians; faster in 9 of 10 pairs); B's (524K) split, 0.888 → 0.873 ms, within the noise
    /// (5 of 10), so B's and A's (70K) stay on one thread.
    static constexpr index_t direct_split_min = index_t(1) << 20;

    /// body(j0, j1) over C's columns [0, n): in blocks of 64 split over the threads (see
    /// direct_split_min), or all at once on the calling thread.
    template <class T, class Body>
    static void direct_columns([[maybe_unused]] index_t m, index_t n, [[maybe_unused]] index_t k, Body&& body) {
        if (n <= 0) return;
        bool split = false;
#ifdef MNEMO_PACKED_GEMM
        split = std::is_same_v<T, float> && m * n * k >= direct_split_min;
#endif
        constexpr index_t block = 64;
        parallel_range((n + block - 1) / block, split, [&](index_t b0, index_t b1) {
            body(b0 * block, std::min(n, b1 * block));
        });
    }

    /// C[M,N] = beta·C + alpha·A[M,K]·B[K,N]
    template <class T>
    static void gemm_nn(index_t m, index_t n, index_t k, const T* a, index_t lda, const T* b, index_t ldb, T* c,
                        index_t ldc, T beta = T(0), T alpha = T(1)) {
        gemm_nn_banded(m, n, k, a, lda, b, ldb, c, ldc, beta, alpha, causal_keys{});
    }
    /// gemm_nn over an attention head's causal band (head_products' general route): the packed path
    /// skips the band's masked part (gemm_packed_t::run says how); BLAS and Eigen compute everything.
    template <class T>
    static void gemm_nn_banded(index_t m, index_t n, index_t k, const T* a, index_t lda, const T* b, index_t ldb, T* c,
                               index_t ldc, T beta, T alpha, [[maybe_unused]] causal_keys band) {
#ifdef MNEMO_USE_BLAS
        if (use_blas<T>(m, n, k) && lda >= k && ldb >= n && ldc >= n) {
            blas_gemm(CblasNoTrans, CblasNoTrans, m, n, k, a, lda, b, ldb, c, ldc, beta, alpha);
            return;
        }
#endif
#ifdef MNEMO_PACKED_GEMM
        if constexpr (std::is_same_v<T, float>) {
            if (use_packed(m, n, k)) {
                gemm_nn_packed(m, n, k, a, lda, b, ldb, c, ldc, beta, alpha, band);
                return;
            }
        }
#endif
        gemm_nn_eigen(m, n, k, a, lda, b, ldb, c, ldc, beta, alpha);
    }

    /// C[M,N] = beta·C + alpha·A[M,K]·B[N,K]ᵀ
    template <class T>
    static void gemm_nt(index_t m, index_t n, index_t k, const T* a, index_t lda, const T* b, index_t ldb, T* c,
                        index_t ldc, T beta = T(0), T alpha = T(1)) {
        gemm_nt_banded(m, n, k, a, lda, b, ldb, c, ldc, beta, alpha, causal_keys{});
    }
    /// gemm_nt over an attention head's causal band (see gemm_nn_banded), then bias[j] (null: none)
    /// added to column j of every row. The packed path adds the bias as its last K block's tiles
    /// store C (it then computes the whole product, band or not), which spares a pass over C and a
    /// hand-off between the threads (configuration A's step: the separate pass was about 1% of it);
    /// the other paths add it after the product (add_bias_rows). Either way each element is the
    /// product's result plus its bias, one rounding after the other: the same bits.
    template <class T>
    static void gemm_nt_banded(index_t m, index_t n, index_t k, const T* a, index_t lda, const T* b, index_t ldb, T* c,
                               index_t ldc, T beta, T alpha, [[maybe_unused]] causal_keys band, const T* bias = nullptr) {
#ifdef MNEMO_USE_BLAS
        if (use_blas<T>(m, n, k) && lda >= k && ldb >= k && ldc >= n) {
            blas_gemm(CblasNoTrans, CblasTrans, m, n, k, a, lda, b, ldb, c, ldc, beta, alpha);
            if (bias) elementwise::add_bias_rows(m, n, bias, c, ldc);
            return;
        }
#endif
#ifdef MNEMO_PACKED_GEMM
        if constexpr (std::is_same_v<T, float>) {
            if (use_packed(m, n, k)) {
                gemm_nt_packed(m, n, k, a, lda, b, ldb, c, ldc, beta, alpha, band, bias);
                return;
            }
        }
#endif
        gemm_nt_eigen(m, n, k, a, lda, b, ldb, c, ldc, beta, alpha);
        if (bias) elementwise::add_bias_rows(m, n, bias, c, ldc);
    }

    /// C[M,N] = A[M,K]·B[N,K]ᵀ + bias (a linear layer's forward; see gemm_nt_banded).
    template <class T>
    static void gemm_nt_bias(index_t m, index_t n, index_t k, const T* a, index_t lda, const T* b, index_t ldb,
                             const T* bias, T* c, index_t ldc) {
        gemm_nt_banded(m, n, k, a, lda, b, ldb, c, ldc, T(0), T(1), causal_keys{}, bias);
    }

    /// C[M,N] = beta·C + alpha·A[K,M]ᵀ·B[K,N]
    template <class T>
    static void gemm_tn(index_t m, index_t n, index_t k, const T* a, index_t lda, const T* b, index_t ldb, T* c,
                        index_t ldc, T beta = T(0), T alpha = T(1)) {
        gemm_tn_banded(m, n, k, a, lda, b, ldb, c, ldc, beta, alpha, causal_keys{});
    }
    /// gemm_tn over an attention head's causal band (see gemm_nn_banded).
    template <class T>
    static void gemm_tn_banded(index_t m, index_t n, index_t k, const T* a, index_t lda, const T* b, index_t ldb, T* c,
                               index_t ldc, T beta, T alpha, [[maybe_unused]] causal_keys band) {
#ifdef MNEMO_USE_BLAS
        if (use_blas<T>(m, n, k) && lda >= m && ldb >= n && ldc >= n) {
            blas_gemm(CblasTrans, CblasNoTrans, m, n, k, a, lda, b, ldb, c, ldc, beta, alpha);
            return;
        }
#endif
#ifdef MNEMO_PACKED_GEMM
        if constexpr (std::is_same_v<T, float>) {
            if (use_packed(m, n, k)) {
                gemm_tn_packed(m, n, k, a, lda, b, ldb, c, ldc, beta, alpha, band);
                return;
            }
        }
#endif
        gemm_tn_eigen(m, n, k, a, lda, b, ldb, c, ldc, beta, alpha);
    }

#ifdef MNEMO_PACKED_GEMM
    /// Whether a float product goes to gemm_packed (gemm_packed.hpp): at least packed_min_work
    /// multiply-adds (from there on both paths use every thread; below it, and for the per-head
    /// attention products such as 128×384×32, Eigen is as fast), and no side where the packed tiles
    /// would waste much: m of at least the kernel's min_rows (AVX-512's 14-row tiles 96: Eigen was up
    /// to 1.7× faster on 3 to 64 rows; AVX2's 6-row tiles 40), k ≥ 32 (at k = 16 updating C outweighs the products: Eigen 1.1-1.5× faster), n of two
    /// panels or more with at most 1/8 of the panels padding (AVX-512, 32-column panels: n = 48 was
    /// 1.25× faster on Eigen; AVX2, 16-column panels: n = 32 and 48 1.07-1.16× faster packed).
    static constexpr double packed_min_work = parallel_min_work;

    static bool use_packed(index_t m, index_t n, index_t k) {
        const index_t n_padded = (n + gemm_packed::nr - 1) / gemm_packed::nr * gemm_packed::nr;
        return m >= gemm_packed::isa::min_rows && n >= 2 * gemm_packed::nr && 8 * n >= 7 * n_padded && k >= 32 &&
               double(m) * double(n) * double(k) >= packed_min_work;
    }

    /// The packed path itself, whatever the shape (float only; AVX2 + FMA and AVX-512 builds).
    static void gemm_nn_packed(index_t m, index_t n, index_t k, const float* a, index_t lda, const float* b, index_t ldb,
                               float* c, index_t ldc, float beta = 0.0f, float alpha = 1.0f, causal_keys band = {}) {
        gemm_packed::run<gemm_packed::form::nn>(m, n, k, a, lda, b, ldb, c, ldc, beta, alpha, threads_for(m, n, k),
                                                gemm_packed::tuning(), band);
    }
    static void gemm_nt_packed(index_t m, index_t n, index_t k, const float* a, index_t lda, const float* b, index_t ldb,
                               float* c, index_t ldc, float beta = 0.0f, float alpha = 1.0f, causal_keys band = {},
                               const float* bias = nullptr) {
        gemm_packed::run<gemm_packed::form::nt>(m, n, k, a, lda, b, ldb, c, ldc, beta, alpha, threads_for(m, n, k),
                                                gemm_packed::tuning(), band, bias);
    }
    static void gemm_tn_packed(index_t m, index_t n, index_t k, const float* a, index_t lda, const float* b, index_t ldb,
                               float* c, index_t ldc, float beta = 0.0f, float alpha = 1.0f, causal_keys band = {}) {
        gemm_packed::run<gemm_packed::form::tn>(m, n, k, a, lda, b, ldb, c, ldc, beta, alpha, threads_for(m, n, k),
                                                gemm_packed::tuning(), band);
    }
#endif

#ifdef MNEMO_USE_BLAS
    /// Multiply-adds from which a float/double GEMM goes to OpenBLAS (2^24 ≈ 16.8M), and the least
    /// any one thread's block of rows gets (2^23). Below 2^23 OpenBLAS 0.3.21's AVX-512 builds switch
    /// to other kernels (the "small matrix" kernels below 100³, the direct sgemm below 28·512² for
    /// nn with alpha 1, beta 0), which round differently; with every block above that, a product
    /// gives the same bits whether it runs as one block or as several.
    static constexpr double blas_min_work = double(1 << 24);
    static constexpr double blas_min_block_work = double(1 << 23);
    /// Block boundaries are multiples of this many rows of C: OpenBLAS computes a row-major C as its
    /// transpose and walks C's rows in chunks of 3 (Haswell kernels: 12 floats) or 6 (AVX-512: 24)
    /// times its kernel's width, and a boundary inside such a chunk changes which kernel path some
    /// rows take; 12 keeps every boundary aligned for the kernels measured (Haswell, SkylakeX,
    /// Cooperlake: any multiple of 4 does for the AVX-512 ones).
    static constexpr index_t blas_row_step = 12;

    /// Whether the OpenBLAS that was loaded is worth calling: its kernels must be as wide as the
    /// code mnemo was compiled for. OpenBLAS 0.3.21 (Debian 12) does not know Zen 4/5 and takes its
    /// AVX2 Haswell kernels there, half as fast as Eigen's AVX-512 path; OPENBLAS_CORETYPE=SkylakeX
    /// (or Cooperlake) in the environment gives its AVX-512 kernels. Checked once per process.
    static bool blas_active() {
        static const bool active = [] {
#ifdef __AVX512F__
            std::string core = openblas_get_corename();
            for (auto& ch : core) ch = char(std::tolower(static_cast<unsigned char>(ch)));
            return core.find("skylakex") != std::string::npos || core.find("cooperlake") != std::string::npos ||
                   core.find("sapphirerapids") != std::string::npos;
#else
            return true;
#endif
        }();
        return active;
    }

    /// OpenBLAS's name for the kernels it picked (e.g. "Haswell", "SkylakeX").
    static const char* blas_core() { return openblas_get_corename(); }

    template <class T>
    static bool use_blas(index_t m, index_t n, index_t k) {
        if constexpr (std::is_same_v<T, float> || std::is_same_v<T, double>) {
            return std::min({m, n, k}) >= blas_row_step && std::max({m, n, k}) <= INT_MAX / 2 &&
                   double(m) * double(n) * double(k) >= blas_min_work && blas_active();
        } else {
            return false;
        }
    }

    static void blas_call(CBLAS_TRANSPOSE ta, CBLAS_TRANSPOSE tb, index_t m, index_t n, index_t k, const float* a,
                          index_t lda, const float* b, index_t ldb, float* c, index_t ldc, float beta, float alpha) {
        cblas_sgemm(CblasRowMajor, ta, tb, blasint(m), blasint(n), blasint(k), alpha, a, blasint(lda), b, blasint(ldb),
                    beta, c, blasint(ldc));
    }
    static void blas_call(CBLAS_TRANSPOSE ta, CBLAS_TRANSPOSE tb, index_t m, index_t n, index_t k, const double* a,
                          index_t lda, const double* b, index_t ldb, double* c, index_t ldc, double beta, double alpha) {
        cblas_dgemm(CblasRowMajor, ta, tb, blasint(m), blasint(n), blasint(k), alpha, a, blasint(lda), b, blasint(ldb),
                    beta, c, blasint(ldc));
    }

    /// One block of rows per thread, each a single-threaded OpenBLAS call (OpenBLAS's OpenMP build
    /// runs on one thread inside a parallel region). mnemo splits rather than letting OpenBLAS thread
    /// the product itself: OpenBLAS's own split changes the results with the thread count (a
    /// different K blocking in its threaded driver) and was slower here (57-72% of peak against
    /// 78-86% at 1024×256×256).
    template <class T>
    static void blas_gemm(CBLAS_TRANSPOSE ta, CBLAS_TRANSPOSE tb, index_t m, index_t n, index_t k, const T* a,
                          index_t lda, const T* b, index_t ldb, T* c, index_t ldc, T beta, T alpha) {
        const double work = double(m) * double(n) * double(k);
        int threads = int(available_threads());
        threads = int(std::min<double>(threads, std::floor(work / blas_min_block_work)));
        threads = int(std::min<index_t>(threads, m / blas_row_step));
        auto rows = [&](index_t m0, index_t m1) {
            const T* ab = ta == CblasNoTrans ? a + m0 * lda : a + m0;
            blas_call(ta, tb, m1 - m0, n, k, ab, lda, b, ldb, c + m0 * ldc, ldc, beta, alpha);
        };
        if (threads <= 1) {
            // Outside a parallel region OpenBLAS would thread the call over omp_get_max_threads():
            // that setting is the calling thread's own, so lower it for this call only.
            const int saved = omp_get_max_threads();
            if (saved > 1 && !omp_in_parallel()) omp_set_num_threads(1);
            rows(0, m);
            if (saved > 1 && !omp_in_parallel()) omp_set_num_threads(saved);
            return;
        }
        // Boundaries at the multiple of blas_row_step nearest to t·m/threads.
        auto bound = [&](index_t t) {
            if (t >= threads) return m;
            const index_t x = t * m / threads;
            return (x + blas_row_step / 2) / blas_row_step * blas_row_step;
        };
        parallel_team(threads, [&](index_t t, index_t) {
            const index_t b0 = bound(t), b1 = bound(t + 1);
            if (b0 < b1) rows(b0, b1);
        });
    }
#endif
};

}  // namespace mnemo::cpu_kernels
