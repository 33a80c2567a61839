#pragma once
// Single-precision GEMM for AVX-512 that reads its operands where they lie: no packing. For products
// small enough to run on one thread (tens of thousands to a few million multiply-adds) whose
// operands are re-read too few times to repay a packed copy, in particular the absorbed memory
// attention's per-batch-element products [H·Q, D]·ẑᵀ and [H·Q, M]·ẑ (nn/attention/relative.hpp), where
// ẑ's rows lie B·D floats apart and Eigen spent a fifth of its time copying them into panels.
//
// gemm_nn: C[M,N] = beta·C + A[M,K]·B[K,N]. A tile of C of MR ≤ 14 rows × 32 columns lives in
//   2·MR zmm accumulators; each step over k loads two vectors of B's row k (masked at C's right
//   edge) and broadcasts MR floats of A's column k. Column blocks of 32 outside, row tiles inside:
//   a block of B (K × 128 bytes) comes from memory for the first row tile and from L1 for the
//   others. Rows are cut into tiles of equal height (32 → 11, 11, 10), not 14 + 14 + 4.
// gemm_nt: C[M,N] = beta·C + A[M,K]·B[N,K]ᵀ, as Cᵀ = B·Aᵀ on the kernel above: 32 rows of A at a
//   time are transposed (16×16 in registers) into a [K, 32] block, the rows of B are the kernel's
//   broadcast side (each read once), and the [N, 32] result is transposed into C. The two transposes
//   move 32·(K + N) floats against 32·N·K multiply-adds.
// Every element of C sums over k in order 0, 1, …, K − 1 with one FMA chain: results do not depend on
// where tiles fall. Scratch is per thread, grown once: a steady-state call allocates nothing.
#ifdef __AVX512F__
#include <immintrin.h>

#include <algorithm>

#include "gemm_packed.hpp"

namespace mnemo::cpu_kernels {

struct gemm_direct {
    static constexpr index_t lanes = 16;
    static constexpr index_t mr_max = 14;
    static constexpr index_t nr = 2 * lanes;

    static __mmask16 mask(index_t n) { return packed_isa_avx512::mask(n); }

    /// The tile: C[0:MR, 0:cols] (cols ≤ 32) = beta·C + A[0:MR, 0:k]·B[0:k, 0:cols].
    template <int MR, bool Two>
    [[gnu::noinline]] static void tile(index_t k, const float* a, index_t lda, const float* b, index_t ldb, float* c,
                                       index_t ldc, index_t cols, float beta) {
        __m512 acc[MR][2];
#pragma GCC unroll 16
        for (int i = 0; i < MR; ++i) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
        const __mmask16 m0 = mask(cols), m1 = mask(cols - lanes);
        for (index_t p = 0; p < k; ++p) {
            const float* bp = b + p * ldb;
            const __m512 b0 = _mm512_maskz_loadu_ps(m0, bp);
            __m512 b1 = _mm512_setzero_ps();
            if constexpr (Two) b1 = _mm512_maskz_loadu_ps(m1, bp + lanes);
#pragma GCC unroll 16
            for (int i = 0; i < MR; ++i) {
                const __m512 ai = _mm512_set1_ps(a[i * lda + p]);
                acc[i][0] = _mm512_fmadd_ps(ai, b0, acc[i][0]);
                if constexpr (Two) acc[i][1] = _mm512_fmadd_ps(ai, b1, acc[i][1]);
            }
        }
        const __m512 vb = _mm512_set1_ps(beta);
#pragma GCC unroll 16
        for (int i = 0; i < MR; ++i) {
            float* ci = c + i * ldc;
            if (beta != 0.0f) {
                acc[i][0] = _mm512_fmadd_ps(vb, _mm512_maskz_loadu_ps(m0, ci), acc[i][0]);
                if constexpr (Two) acc[i][1] = _mm512_fmadd_ps(vb, _mm512_maskz_loadu_ps(m1, ci + lanes), acc[i][1]);
            }
            _mm512_mask_storeu_ps(ci, m0, acc[i][0]);
            if constexpr (Two) _mm512_mask_storeu_ps(ci + lanes, m1, acc[i][1]);
        }
    }

    template <bool Two>
    static void tile_rows(index_t rows, index_t k, const float* a, index_t lda, const float* b, index_t ldb, float* c,
                          index_t ldc, index_t cols, float beta) {
        switch (rows) {
#define MNEMO_DIRECT_TILE(R) \
    case R: return tile<R, Two>(k, a, lda, b, ldb, c, ldc, cols, beta);
            MNEMO_DIRECT_TILE(1) MNEMO_DIRECT_TILE(2) MNEMO_DIRECT_TILE(3) MNEMO_DIRECT_TILE(4)
            MNEMO_DIRECT_TILE(5) MNEMO_DIRECT_TILE(6) MNEMO_DIRECT_TILE(7) MNEMO_DIRECT_TILE(8)
            MNEMO_DIRECT_TILE(9) MNEMO_DIRECT_TILE(10) MNEMO_DIRECT_TILE(11) MNEMO_DIRECT_TILE(12)
            MNEMO_DIRECT_TILE(13) MNEMO_DIRECT_TILE(14)
#undef MNEMO_DIRECT_TILE
            default: break;
        }
    }

    /// C[M,N] = beta·C + A[M,K]·B[K,N] (row-major, row strides lda, ldb, ldc). beta = 0 never reads C.
    static void gemm_nn(index_t m, index_t n, index_t k, const float* a, index_t lda, const float* b, index_t ldb,
                        float* c, index_t ldc, float beta = 0.0f) {
        if (m <= 0 || n <= 0) return;
        const index_t tiles = (m + mr_max - 1) / mr_max, height = (m + tiles - 1) / tiles;
        for (index_t j = 0; j < n; j += nr) {
            const index_t cols = std::min(nr, n - j);
            for (index_t i = 0; i < m; i += height) {
                const index_t rows = std::min(height, m - i);
                if (cols > lanes) tile_rows<true>(rows, k, a + i * lda, lda, b + j, ldb, c + i * ldc + j, ldc, cols, beta);
                else tile_rows<false>(rows, k, a + i * lda, lda, b + j, ldb, c + i * ldc + j, ldc, cols, beta);
            }
        }
    }

    /// C[M,N] = beta·C + A[M,K]·B[N,K]ᵀ (row-major, row strides lda, ldb, ldc). beta = 0 never reads C.
    static void gemm_nt(index_t m, index_t n, index_t k, const float* a, index_t lda, const float* b, index_t ldb,
                        float* c, index_t ldc, float beta = 0.0f) {
        if (m <= 0 || n <= 0) return;
        const index_t kp = (k + lanes - 1) / lanes * lanes, np = (n + lanes - 1) / lanes * lanes;
        float* at = gemm_packed::thread_buffer(0, kp * nr + np * nr);  // Aᵀ block [K, 32], then Cᵀ [N, 32]
        float* ct = at + kp * nr;
        for (index_t r0 = 0; r0 < m; r0 += nr) {
            const index_t rows = std::min(nr, m - r0);
            // Aᵀ block: at[p·32 + i] = A[r0 + i, p], zero for i ≥ rows.
            for (index_t i0 = 0; i0 < nr; i0 += lanes)
                for (index_t p0 = 0; p0 < k; p0 += lanes) {
                    const __mmask16 ld = mask(k - p0);
                    __m512 x[16];
                    for (index_t i = 0; i < lanes; ++i)
                        x[i] = i0 + i < rows ? _mm512_maskz_loadu_ps(ld, a + (r0 + i0 + i) * lda + p0) : _mm512_setzero_ps();
                    packed_isa_avx512::transpose(x);
                    for (index_t p = 0; p < std::min(lanes, k - p0); ++p) _mm512_storeu_ps(at + (p0 + p) * nr + i0, x[p]);
                }
            gemm_nn(n, rows, k, b, ldb, at, nr, ct, nr);  // Cᵀ [N, rows] = B·Aᵀ
            // C[r0 + i, j] = beta·C + ct[j·32 + i]
            const __m512 vb = _mm512_set1_ps(beta);
            for (index_t i0 = 0; i0 < rows; i0 += lanes)
                for (index_t j0 = 0; j0 < n; j0 += lanes) {
                    __m512 x[16];
                    for (index_t j = 0; j < lanes; ++j)
                        x[j] = j0 + j < n ? _mm512_loadu_ps(ct + (j0 + j) * nr + i0) : _mm512_setzero_ps();
                    packed_isa_avx512::transpose(x);
                    const __mmask16 st = mask(n - j0);
                    for (index_t i = 0; i < std::min(lanes, rows - i0); ++i) {
                        float* ci = c + (r0 + i0 + i) * ldc + j0;
                        __m512 v = x[i];
                        if (beta != 0.0f) v = _mm512_fmadd_ps(vb, _mm512_maskz_loadu_ps(st, ci), v);
                        _mm512_mask_storeu_ps(ci, st, v);
                    }
                }
        }
    }
};

}  // namespace mnemo::cpu_kernels
#endif
