#pragma once
// Single-precision GEMM that reads its operands where they lie: no packing. For products small
// enough to run on one thread (tens of thousands to a few million multiply-adds) whose operands are
// re-read too few times to repay a packed copy, in particular the absorbed memory attention's
// per-batch-element products [H·Q, D]·ẑᵀ and [H·Q, M]·ẑ (nn/attention/relative.hpp), where ẑ's rows
// lie B·D floats apart and Eigen spent a fifth of its time copying them into panels (and, on AVX2,
// a quarter of configuration A's training step in its GEBP kernel and packing).
//
// One template, gemm_direct_t<Isa>, over the instruction sets of gemm_packed.hpp (packed_isa_avx512,
// packed_isa_avx2: vector type, partial loads and stores, register transpose); gemm_direct is the
// build's widest.
// gemm_nn: C[M,N] = beta·C + A[M,K]·B[K,N]. A tile of C of MR ≤ mr rows × 2 vectors (AVX-512: 14 ×
//   32 in 28 zmm; AVX2: 6 × 16 in 12 ymm) lives in registers; each step over k loads two vectors of
//   B's row k (partial at C's right edge) and broadcasts MR floats of A's column k. Column blocks of
//   two vectors outside, row tiles inside: a block of B comes from memory for the first row tile and
//   from L1 for the others (on AVX-512 the tile prefetches B's rows Isa::direct_prefetch steps
//   ahead: the first row tile's reads of a block from L3 otherwise wait on each line; and every
//   tile of the first column block fetches the next tile's rows of A, a line a step). Rows are
//   cut into tiles of equal height, give or take a row (AVX-512, 32 → 11, 11, 10, not 14 + 14 + 4;
//   AVX2, 32 → 6, 6, 5, 5, 5, 5, not 6 · 5 + 2: a 2-row tile's 4 FMA chains run at half the rate).
// gemm_tn: C[M,N] = beta·C + A[K,M]ᵀ·B[K,N] on the same kernel, the MR floats of A's column k of Aᵀ
//   read from A's row k (contiguous) instead of down a column.
// gemm_nt: C[M,N] = beta·C + A[M,K]·B[N,K]ᵀ, as Cᵀ = B·Aᵀ on the kernel above: 2·lanes rows of A at a
//   time are transposed (lanes × lanes in registers) into a [K, 2·lanes] block, the rows of B are the
//   kernel's broadcast side (each read once), and the [N, 2·lanes] result is transposed into C. The
//   two transposes move 2·lanes·(K + N) floats against 2·lanes·N·K multiply-adds. Where B is the
//   smaller side (N·K < M·(K + N): the absorbed attention's per-head U_h·W_v,hᵀ, [Q·B, D]·[d_k, D]ᵀ),
//   B is transposed once instead, into [K, N], and gemm_nn runs over it: the same sums in the same
//   order (bitwise the same C). Configuration A's 256×32×128, one thread, operands hot (Granite
//   Rapids VM): 16.8 µs through Aᵀ's blocks, 14.4 µs through Bᵀ (B transposed by a scalar loop).
// Every element of C sums over k in order 0, 1, …, K − 1 with one FMA chain: results do not depend on
// where tiles fall (they do on the instruction set: the AVX-512 and AVX2 kernels are each exact to
// their own order, the same one, but a build's widest ISA decides which runs). Scratch is per
// thread, grown once: a steady-state call allocates nothing.
#include "gemm_packed.hpp"

#ifdef MNEMO_PACKED_GEMM
#include <algorithm>

namespace mnemo::cpu_kernels {

template <class Isa>
struct gemm_direct_t {
    using batch = typename Isa::batch;
    using reg = typename Isa::reg;
    static constexpr index_t lanes = Isa::lanes;
    static constexpr index_t mr_max = Isa::mr;
    static constexpr index_t nr = 2 * lanes;

    /// The tile: C[0:MR, 0:cols] (cols ≤ 2·lanes) = beta·C + A[0:MR, 0:k]·B[0:k, 0:cols], or with
    /// TransA, A[0:k, 0:MR]ᵀ·B[0:k, 0:cols].
    template <int MR, bool Two, bool TransA = false>
    [[gnu::noinline]] static void tile(index_t k, const float* a, index_t lda, const float* b, index_t ldb, float* c,
                                       index_t ldc, index_t cols, float beta, const float* next_a = nullptr,
                                       index_t next_rows = 0) {
        batch acc[MR][2];
#pragma GCC unroll 16
        for (int i = 0; i < MR; ++i) acc[i][0] = acc[i][1] = batch(0.0f);
        // C's lines asked for with intent to write while the k loop runs (as gemm_packed's tile):
        // configuration A's training step 0.6-4.7% faster in 3 runs (Zen 5, steps alternated).
#pragma GCC unroll 16
        for (int i = 0; i < MR; ++i) simd::prefetch_for_write(c + i * ldc, cols);
        const index_t c1 = cols - lanes;
        // The next tile's rows of A (next_a: its first row, next_rows of them, k floats each), one line
        // a step: short rows far apart (the absorbed attention's ẑ slab, 512 B a row) end before the
        // hardware prefetchers have learnt them.
        constexpr index_t line = 64 / sizeof(float);
        const index_t row_lines = (k + line - 1) / line;
        index_t ahead_row = next_a ? 0 : next_rows, ahead_line = 0;
        for (index_t p = 0; p < k; ++p) {
            const float* bp = b + p * ldb;
            if (ahead_row < next_rows) {
                _mm_prefetch(reinterpret_cast<const char*>(next_a + ahead_row * lda + ahead_line * line), _MM_HINT_T0);
                if (++ahead_line == row_lines) ahead_line = 0, ++ahead_row;
            }
            if constexpr (Isa::direct_prefetch > 0) {  // B's row a few steps ahead (the first row tile fetches it)
                const char* ahead = reinterpret_cast<const char*>(bp + Isa::direct_prefetch * ldb);
                _mm_prefetch(ahead, _MM_HINT_T0);
                if constexpr (Two) _mm_prefetch(ahead + lanes * sizeof(float), _MM_HINT_T0);
            }
            const batch b0 = Isa::load_partial(bp, cols);
            batch b1(0.0f);
            if constexpr (Two) b1 = Isa::load_partial(bp + lanes, c1);
#pragma GCC unroll 16
            for (int i = 0; i < MR; ++i) {
                const batch ai(TransA ? a[p * lda + i] : a[i * lda + p]);
                acc[i][0] = simd::fma(ai, b0, acc[i][0]);
                if constexpr (Two) acc[i][1] = simd::fma(ai, b1, acc[i][1]);
            }
        }
        const batch vb(beta);
#pragma GCC unroll 16
        for (int i = 0; i < MR; ++i) {
            float* ci = c + i * ldc;
            if (beta != 0.0f) {
                acc[i][0] = simd::fma(vb, batch(Isa::load_partial(ci, cols)), acc[i][0]);
                if constexpr (Two) acc[i][1] = simd::fma(vb, batch(Isa::load_partial(ci + lanes, c1)), acc[i][1]);
            }
            Isa::store_partial(ci, cols, acc[i][0]);
            if constexpr (Two) Isa::store_partial(ci + lanes, c1, acc[i][1]);
        }
    }

    /// tile<rows, Two, TransA> for a runtime 1 ≤ rows ≤ mr_max.
    template <bool Two, bool TransA, int R = int(mr_max)>
    static void tile_rows(index_t rows, index_t k, const float* a, index_t lda, const float* b, index_t ldb, float* c,
                          index_t ldc, index_t cols, float beta, const float* next_a, index_t next_rows) {
        if constexpr (R > 1)
            if (rows < R)
                return tile_rows<Two, TransA, R - 1>(rows, k, a, lda, b, ldb, c, ldc, cols, beta, next_a, next_rows);
        tile<R, Two, TransA>(k, a, lda, b, ldb, c, ldc, cols, beta, next_a, next_rows);
    }

    /// gemm_nn (TransA false) or gemm_tn (true): column blocks of two vectors outside, row tiles of
    /// equal height inside.
    template <bool TransA>
    static void product(index_t m, index_t n, index_t k, const float* a, index_t lda, const float* b, index_t ldb,
                        float* c, index_t ldc, float beta) {
        if (m <= 0 || n <= 0) return;
        // The first m % tiles tiles take one row more than the others.
        const index_t tiles = (m + mr_max - 1) / mr_max, height = m / tiles, taller = m % tiles;
        for (index_t j = 0; j < n; j += nr) {
            const index_t cols = std::min(nr, n - j);
            for (index_t t = 0, i = 0; t < tiles; ++t) {
                const index_t rows = height + (t < taller ? 1 : 0);
                const float* ai = TransA ? a + i : a + i * lda;  // the tile's rows of C: A's rows, or Aᵀ's
                // A's rows of the next tile, fetched while this one runs (the first column block's
                // tiles read them first; Aᵀ's columns lie in lines this tile reads).
                const index_t next_rows = TransA || j > 0 || t + 1 == tiles ? 0 : height + (t + 1 < taller ? 1 : 0);
                const float* next_a = next_rows > 0 ? ai + rows * lda : nullptr;
                if (cols > lanes)
                    tile_rows<true, TransA>(rows, k, ai, lda, b + j, ldb, c + i * ldc + j, ldc, cols, beta, next_a, next_rows);
                else
                    tile_rows<false, TransA>(rows, k, ai, lda, b + j, ldb, c + i * ldc + j, ldc, cols, beta, next_a, next_rows);
                i += rows;
            }
        }
    }

    /// C[M,N] = beta·C + A[M,K]·B[K,N] (row-major, row strides lda, ldb, ldc). beta = 0 never reads C.
    static void gemm_nn(index_t m, index_t n, index_t k, const float* a, index_t lda, const float* b, index_t ldb,
                        float* c, index_t ldc, float beta = 0.0f) {
        product<false>(m, n, k, a, lda, b, ldb, c, ldc, beta);
    }
    /// C[M,N] = beta·C + A[K,M]ᵀ·B[K,N] (row-major, row strides lda, ldb, ldc). beta = 0 never reads C.
    static void gemm_tn(index_t m, index_t n, index_t k, const float* a, index_t lda, const float* b, index_t ldb,
                        float* c, index_t ldc, float beta = 0.0f) {
        product<true>(m, n, k, a, lda, b, ldb, c, ldc, beta);
    }

    /// C[M,N] = beta·C + A[M,K]·B[N,K]ᵀ (row-major, row strides lda, ldb, ldc). beta = 0 never reads C.
    static void gemm_nt(index_t m, index_t n, index_t k, const float* a, index_t lda, const float* b, index_t ldb,
                        float* c, index_t ldc, float beta = 0.0f) {
        if (m <= 0 || n <= 0) return;
        const index_t kp = (k + lanes - 1) / lanes * lanes, np = (n + lanes - 1) / lanes * lanes;
        if (n * k < m * (k + n)) {  // Bᵀ [K, np] once (columns past N zero, never read), then gemm_nn
            float* bt = gemm_packed_t<Isa>::thread_buffer(0, k * np);
            for (index_t j0 = 0; j0 < n; j0 += lanes)
                for (index_t p0 = 0; p0 < k; p0 += lanes) {
                    reg x[lanes];
                    for (index_t j = 0; j < lanes; ++j)
                        x[j] = j0 + j < n ? Isa::load_partial(b + (j0 + j) * ldb + p0, k - p0) : Isa::zero();
                    Isa::transpose(x);
                    for (index_t p = 0; p < std::min(lanes, k - p0); ++p) Isa::storeu(bt + (p0 + p) * np + j0, x[p]);
                }
            return product<false>(m, n, k, a, lda, bt, np, c, ldc, beta);
        }
        float* at = gemm_packed_t<Isa>::thread_buffer(0, kp * nr + np * nr);  // Aᵀ block [K, nr], then Cᵀ [N, nr]
        float* ct = at + kp * nr;
        for (index_t r0 = 0; r0 < m; r0 += nr) {
            const index_t rows = std::min(nr, m - r0);
            // Aᵀ block: at[p·nr + i] = A[r0 + i, p], zero for i ≥ rows.
            for (index_t i0 = 0; i0 < nr; i0 += lanes)
                for (index_t p0 = 0; p0 < k; p0 += lanes) {
                    reg x[lanes];
                    for (index_t i = 0; i < lanes; ++i)
                        x[i] = i0 + i < rows ? Isa::load_partial(a + (r0 + i0 + i) * lda + p0, k - p0) : Isa::zero();
                    Isa::transpose(x);
                    for (index_t p = 0; p < std::min(lanes, k - p0); ++p) Isa::storeu(at + (p0 + p) * nr + i0, x[p]);
                }
            gemm_nn(n, rows, k, b, ldb, at, nr, ct, nr);  // Cᵀ [N, rows] = B·Aᵀ
            // C[r0 + i, j] = beta·C + ct[j·nr + i]
            const batch vb(beta);
            for (index_t i0 = 0; i0 < rows; i0 += lanes)
                for (index_t j0 = 0; j0 < n; j0 += lanes) {
                    reg x[lanes];
                    for (index_t j = 0; j < lanes; ++j)
                        x[j] = j0 + j < n ? reg(batch::load_unaligned(ct + (j0 + j) * nr + i0)) : Isa::zero();
                    Isa::transpose(x);
                    for (index_t i = 0; i < std::min(lanes, rows - i0); ++i) {
                        float* ci = c + (r0 + i0 + i) * ldc + j0;
                        batch v(x[i]);
                        if (beta != 0.0f) v = simd::fma(vb, batch(Isa::load_partial(ci, n - j0)), v);
                        Isa::store_partial(ci, n - j0, v);
                    }
                }
        }
    }
};

#ifdef __AVX512F__
using gemm_direct = gemm_direct_t<packed_isa_avx512>;
#else
using gemm_direct = gemm_direct_t<packed_isa_avx2>;
#endif

}  // namespace mnemo::cpu_kernels
#endif
