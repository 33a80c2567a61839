#pragma once
// The products of one attention head whose shared or output side is the head width d_k, known at
// compile time, for the small shapes of short segments: A's attention over its 8 segment keys is an
// 8×8×32 product per (batch element, head), thousands of them per step, where a general GEMM's call,
// blocking and packing cost several times the 2K multiply-adds. Here the rows of d_k floats stay in
// registers (d_k / SIMD width vectors each); no GEMM packing, only the operand read more than once
// is copied to the stack.
//
//   head_nt: S[M,N]  = X[M,Dk]·Y[N,Dk]ᵀ            (scores q·kᵀ; d attention weights dO·vᵀ)
//   head_nn: O[M,Dk] (=, +=) A[M,N]·Y[N,Dk]          (context a·v; d(q+u) = dS·k)
//   head_tn: O[N,Dk] (=, +=) A[M,N]ᵀ·X[M,Dk]         (dv = aᵀ·dO; dk = dSᵀ·q)
//
// Every pointer is a row-major block with its own row stride (a head's columns inside [rows, D]
// buffers). The kernels need d_k to be a whole number of SIMD vectors (`fits`). What callers use are
// the dispatchers head_gemm_nt / _nn / _tn, which take these kernels where they were measured to win
// and the general GEMMs (gemm.hpp) elsewhere. Measured on one thread with the strides of A's
// buffers (16 KiB) against the general path: nn 2-4× faster up to 64 keys at any number of rows
// (256 too); tn 2-4× up to 64×64 (even beyond: taken up to 64 rows); nt, one horizontal sum per
// score, 2-3× at up to 8 keys, even at 16 keys over 16 rows, slower beyond.
//
// Runtime d_k (a runtime-shape model, config<dynamic, dynamic, dynamic>): every product and
// dispatcher has an overload taking d_k as its first (runtime) argument. It takes the same route for
// the same shape and computes the same sums in the same order (the kernels are one implementation,
// instantiated with Dk = 0 for a runtime width); the operand rows cached in registers become rows of
// at most 8 vectors held in arrays of 8. The vector arithmetic is explicit, so the results are bitwise
// the compile-time ones, except where a plain loop is left to the compiler: heads_dot_rows' scalar
// tail (d_k not a whole number of vectors), which g++'s FMA contraction (-ffp-contract=fast, its
// default) may fuse differently when the trip count is a constant.
#include <algorithm>

#include "../../core/shape.hpp"
#include "gemm.hpp"
#include "simd.hpp"

namespace mnemo::cpu_kernels {

struct head_products {
    /// The most rows an operand that is read more than once may have (it is copied to the stack).
    static constexpr index_t max_reread_rows = 64;

    template <class T, index_t Dk>
    static constexpr bool fits = Dk % simd::width<T> == 0 && Dk / simd::width<T> <= 8;
    /// fits for a runtime d_k.
    template <class T>
    static constexpr bool fits_runtime(index_t dk) {
        return dk > 0 && dk % simd::width<T> == 0 && dk / simd::width<T> <= 8;
    }

    /// S[M,N] = X[M,Dk]·Y[N,Dk]ᵀ
    template <index_t Dk, class T>
    static void head_gemm_nt(index_t m, index_t n, const T* x, index_t ldx, const T* y, index_t ldy, T* s, index_t lds) {
        if constexpr (fits<T, Dk>)
            if (n <= 8 || (n <= 16 && m <= 16)) return head_nt<Dk>(m, n, x, ldx, y, ldy, s, lds);
        gemm::gemm_nt(m, n, Dk, x, ldx, y, ldy, s, lds);
    }
    /// O[M,Dk] = beta·O + A[M,N]·Y[N,Dk], beta 0 or 1
    template <index_t Dk, class T>
    static void head_gemm_nn(index_t m, index_t n, const T* a, index_t lda, const T* y, index_t ldy, T* o, index_t ldo,
                             T beta = T(0)) {
        if constexpr (fits<T, Dk>)
            if (n <= max_reread_rows && (beta == T(0) || beta == T(1)))
                return head_nn<Dk>(m, n, a, lda, y, ldy, o, ldo, beta != T(0));
        gemm::gemm_nn(m, Dk, n, a, lda, y, ldy, o, ldo, beta);
    }
    /// O[N,Dk] = beta·O + A[M,N]ᵀ·X[M,Dk], beta 0 or 1
    template <index_t Dk, class T>
    static void head_gemm_tn(index_t m, index_t n, const T* a, index_t lda, const T* x, index_t ldx, T* o, index_t ldo,
                             T beta = T(0)) {
        if constexpr (fits<T, Dk>)
            if (m <= max_reread_rows && n <= max_reread_rows && (beta == T(0) || beta == T(1)))
                return head_tn<Dk>(m, n, a, lda, x, ldx, o, ldo, beta != T(0));
        gemm::gemm_tn(n, Dk, m, a, lda, x, ldx, o, ldo, beta);
    }

    /// The three dispatchers with a runtime d_k (the same routes, bitwise the same results).
    template <class T>
    static void head_gemm_nt(index_t dk, index_t m, index_t n, const T* x, index_t ldx, const T* y, index_t ldy, T* s,
                             index_t lds) {
        if (fits_runtime<T>(dk))
            if (n <= 8 || (n <= 16 && m <= 16)) return head_nt_impl<0>(dk, m, n, x, ldx, y, ldy, s, lds);
        gemm::gemm_nt(m, n, dk, x, ldx, y, ldy, s, lds);
    }
    template <class T>
    static void head_gemm_nn(index_t dk, index_t m, index_t n, const T* a, index_t lda, const T* y, index_t ldy, T* o,
                             index_t ldo, T beta = T(0)) {
        if (fits_runtime<T>(dk))
            if (n <= max_reread_rows && (beta == T(0) || beta == T(1)))
                return head_nn_impl<0>(dk, m, n, a, lda, y, ldy, o, ldo, beta != T(0));
        gemm::gemm_nn(m, dk, n, a, lda, y, ldy, o, ldo, beta);
    }
    template <class T>
    static void head_gemm_tn(index_t dk, index_t m, index_t n, const T* a, index_t lda, const T* x, index_t ldx, T* o,
                             index_t ldo, T beta = T(0)) {
        if (fits_runtime<T>(dk))
            if (m <= max_reread_rows && n <= max_reread_rows && (beta == T(0) || beta == T(1)))
                return head_tn_impl<0>(dk, m, n, a, lda, x, ldx, o, ldo, beta != T(0));
        gemm::gemm_tn(n, dk, m, a, lda, x, ldx, o, ldo, beta);
    }

    /// S[i, j] = Σ_d X[i, d]·Y[j, d]
    template <index_t Dk, class T>
    static void head_nt(index_t m, index_t n, const T* x, index_t ldx, const T* y_in, index_t ldy_in, T* s, index_t lds) {
        head_nt_impl<Dk>(Dk, m, n, x, ldx, y_in, ldy_in, s, lds);
    }
    /// The same with a runtime d_k (fits_runtime).
    template <class T>
    static void head_nt(index_t dk, index_t m, index_t n, const T* x, index_t ldx, const T* y_in, index_t ldy_in, T* s,
                        index_t lds) {
        head_nt_impl<0>(dk, m, n, x, ldx, y_in, ldy_in, s, lds);
    }

    /// O[i, :] (= or +=) Σ_j A[i, j]·Y[j, :]
    template <index_t Dk, class T>
    static void head_nn(index_t m, index_t n, const T* a, index_t lda, const T* y_in, index_t ldy_in, T* o, index_t ldo,
                        bool accumulate = false) {
        head_nn_impl<Dk>(Dk, m, n, a, lda, y_in, ldy_in, o, ldo, accumulate);
    }
    template <class T>
    static void head_nn(index_t dk, index_t m, index_t n, const T* a, index_t lda, const T* y_in, index_t ldy_in, T* o,
                        index_t ldo, bool accumulate = false) {
        head_nn_impl<0>(dk, m, n, a, lda, y_in, ldy_in, o, ldo, accumulate);
    }

    /// O[j, :] (= or +=) Σ_i A[i, j]·X[i, :]
    /// (Taken max_reread_rows rows of X at a time.)
    template <index_t Dk, class T>
    static void head_tn(index_t m, index_t n, const T* a, index_t lda, const T* x_in, index_t ldx_in, T* o, index_t ldo,
                        bool accumulate = false) {
        head_tn_impl<Dk>(Dk, m, n, a, lda, x_in, ldx_in, o, ldo, accumulate);
    }
    template <class T>
    static void head_tn(index_t dk, index_t m, index_t n, const T* a, index_t lda, const T* x_in, index_t ldx_in, T* o,
                        index_t ldo, bool accumulate = false) {
        head_tn_impl<0>(dk, m, n, a, lda, x_in, ldx_in, o, ldo, accumulate);
    }

private:
    // The kernels, for a compile-time d_k (Dk > 0; dk == Dk) or a runtime one (Dk == 0, d_k = dk): one
    // source, so the two compute the same sums in the same order. V: the vectors of a row (a constant
    // when Dk is); VMax: the size of the arrays that hold a row's vectors.
    template <index_t Dk, class T>
    static constexpr index_t max_vectors = Dk > 0 ? Dk / simd::width<T> : 8;

    template <index_t Dk, class T>
    static void head_nt_impl(index_t dk, index_t m, index_t n, const T* x, index_t ldx, const T* y_in, index_t ldy_in,
                             T* s, index_t lds) {
        using B = simd::batch<T>;
        constexpr index_t W = simd::width<T>, VMax = max_vectors<Dk, T>;
        const index_t V = (Dk > 0 ? Dk : dk) / W;
        alignas(64) T pack[max_reread_rows * VMax * W];
        const T* y = packed<Dk>(Dk > 0 ? Dk : dk, n, y_in, ldy_in, pack);
        const index_t ldy = Dk > 0 ? Dk : dk;
        for (index_t i = 0; i < m; ++i) {
            B xi[VMax];
            for (index_t v = 0; v < V; ++v) xi[v] = simd::load(x + i * ldx + v * W);
            T* si = s + i * lds;
            index_t j = 0;
            for (; j + 4 <= n; j += 4) {
                B a0 = xi[0] * simd::load(y + (j + 0) * ldy), a1 = xi[0] * simd::load(y + (j + 1) * ldy);
                B a2 = xi[0] * simd::load(y + (j + 2) * ldy), a3 = xi[0] * simd::load(y + (j + 3) * ldy);
                for (index_t v = 1; v < V; ++v) {
                    a0 = xsimd::fma(xi[v], simd::load(y + (j + 0) * ldy + v * W), a0);
                    a1 = xsimd::fma(xi[v], simd::load(y + (j + 1) * ldy + v * W), a1);
                    a2 = xsimd::fma(xi[v], simd::load(y + (j + 2) * ldy + v * W), a2);
                    a3 = xsimd::fma(xi[v], simd::load(y + (j + 3) * ldy + v * W), a3);
                }
                si[j] = simd::reduce_add(a0);
                si[j + 1] = simd::reduce_add(a1);
                si[j + 2] = simd::reduce_add(a2);
                si[j + 3] = simd::reduce_add(a3);
            }
            for (; j < n; ++j) {
                B a = xi[0] * simd::load(y + j * ldy);
                for (index_t v = 1; v < V; ++v) a = xsimd::fma(xi[v], simd::load(y + j * ldy + v * W), a);
                si[j] = simd::reduce_add(a);
            }
        }
    }

    template <index_t Dk, class T>
    static void head_nn_impl(index_t dk, index_t m, index_t n, const T* a, index_t lda, const T* y_in, index_t ldy_in,
                             T* o, index_t ldo, bool accumulate) {
        using B = simd::batch<T>;
        constexpr index_t W = simd::width<T>, VMax = max_vectors<Dk, T>;
        const index_t V = (Dk > 0 ? Dk : dk) / W;
        alignas(64) T pack[max_reread_rows * VMax * W];
        const T* y = m > 2 ? packed<Dk>(Dk > 0 ? Dk : dk, n, y_in, ldy_in, pack) : y_in;
        const index_t ldy = m > 2 ? (Dk > 0 ? Dk : dk) : ldy_in;
        index_t i = 0;
        for (; i + 2 <= m; i += 2) {  // two rows share each load of Y
            B c0[VMax], c1[VMax];
            for (index_t v = 0; v < V; ++v) {
                c0[v] = accumulate ? simd::load(o + i * ldo + v * W) : simd::splat<T>(0);
                c1[v] = accumulate ? simd::load(o + (i + 1) * ldo + v * W) : simd::splat<T>(0);
            }
            const T *a0 = a + i * lda, *a1 = a0 + lda;
            for (index_t j = 0; j < n; ++j) {
                const B s0 = simd::splat(a0[j]), s1 = simd::splat(a1[j]);
                for (index_t v = 0; v < V; ++v) {
                    const B yj = simd::load(y + j * ldy + v * W);
                    c0[v] = xsimd::fma(s0, yj, c0[v]);
                    c1[v] = xsimd::fma(s1, yj, c1[v]);
                }
            }
            for (index_t v = 0; v < V; ++v) {
                simd::store(o + i * ldo + v * W, c0[v]);
                simd::store(o + (i + 1) * ldo + v * W, c1[v]);
            }
        }
        for (; i < m; ++i) {
            B c0[VMax];
            for (index_t v = 0; v < V; ++v) c0[v] = accumulate ? simd::load(o + i * ldo + v * W) : simd::splat<T>(0);
            for (index_t j = 0; j < n; ++j) {
                const B s0 = simd::splat(a[i * lda + j]);
                for (index_t v = 0; v < V; ++v) c0[v] = xsimd::fma(s0, simd::load(y + j * ldy + v * W), c0[v]);
            }
            for (index_t v = 0; v < V; ++v) simd::store(o + i * ldo + v * W, c0[v]);
        }
    }

    template <index_t Dk, class T>
    static void head_tn_impl(index_t dk, index_t m, index_t n, const T* a, index_t lda, const T* x_in, index_t ldx_in,
                             T* o, index_t ldo, bool accumulate) {
        index_t i0 = 0;
        do {  // at least once: m = 0 still writes O = 0 when not accumulating
            head_tn_block<Dk>(dk, std::min(max_reread_rows, m - i0), n, a + i0 * lda, lda, x_in + i0 * ldx_in, ldx_in,
                              o, ldo, accumulate || i0 > 0);
            i0 += max_reread_rows;
        } while (i0 < m);
    }

public:
    // One query row over many rows, every head in one pass (one generated token: the per-head
    // products read each cached key row once per head, d_k floats at a time, rows 2·D floats apart;
    // these read each row once, whole). Any d_k: whole SIMD vectors, then a scalar tail. Each output
    // is computed the same way whatever range of rows or heads a call is given, so splitting a product
    // over threads leaves its bits alone.

    /// s[h·lds + r] = Σ_{d<Dk} x[h·Dk + d]·y[r·ldy + h·Dk + d], for rows r in [r0, r1) and heads h < heads.
    /// Rows go W (the SIMD width) at a time: each head's W partial sums reduce together
    /// (simd::transpose_add, the same tree for every lane, so a row's bits do not depend on r0).
    template <index_t Dk, class T>
    static void heads_dot_rows(index_t heads, index_t r0, index_t r1, const T* x, const T* y, index_t ldy, T* s,
                               index_t lds) {
        heads_dot_rows_impl<Dk>(Dk, heads, r0, r1, x, y, ldy, s, lds);
    }
    /// The same with a runtime d_k (any): bitwise the compile-time one's results.
    template <class T>
    static void heads_dot_rows(index_t dk, index_t heads, index_t r0, index_t r1, const T* x, const T* y, index_t ldy,
                               T* s, index_t lds) {
        heads_dot_rows_impl<0>(dk, heads, r0, r1, x, y, ldy, s, lds);
    }

    /// o[h·Dk + d] = Σ_{r<n} a[h·lda + r]·y[r·ldy + h·Dk + d], for heads h in [h0, h1) (o's other heads
    /// are not touched). The rows are summed in order, four at a time into registers.
    template <index_t Dk, class T>
    static void heads_weighted_rows(index_t h0, index_t h1, index_t n, const T* a, index_t lda, const T* y, index_t ldy,
                                    T* o) {
        heads_weighted_rows_impl<Dk>(Dk, h0, h1, n, a, lda, y, ldy, o);
    }
    /// The same with a runtime d_k (any): bitwise the compile-time one's results.
    template <class T>
    static void heads_weighted_rows(index_t dk, index_t h0, index_t h1, index_t n, const T* a, index_t lda, const T* y,
                                    index_t ldy, T* o) {
        heads_weighted_rows_impl<0>(dk, h0, h1, n, a, lda, y, ldy, o);
    }

private:
    template <index_t Dk_, class T>
    static void heads_dot_rows_impl(index_t dk, index_t heads, index_t r0, index_t r1, const T* x, const T* y,
                                    index_t ldy, T* s, index_t lds) {
        using B = simd::batch<T>;
        constexpr index_t W = simd::width<T>;
        const index_t Dk = Dk_ > 0 ? Dk_ : dk, V = Dk / W;
        for (index_t r = r0; r < r1; r += W) {
            const index_t n = std::min(W, r1 - r);
            for (index_t h = 0; h < heads; ++h) {
                const T* xh = x + h * Dk;
                const T* yh = y + r * ldy + h * Dk;
                alignas(64) T sums[W];
                if constexpr (Dk_ > 0) {
                    constexpr index_t CV = Dk_ / W;
                    if constexpr (CV > 0) {
                        B xv[CV];
                        for (index_t v = 0; v < CV; ++v) xv[v] = simd::load(xh + v * W);
                        B acc[W];
                        for (index_t i = 0; i < W; ++i) {
                            if (i >= n) {
                                acc[i] = simd::splat(T(0));
                                continue;
                            }
                            const T* yi = yh + i * ldy;
                            B a = xv[0] * simd::load(yi);
                            for (index_t v = 1; v < CV; ++v) a = xsimd::fma(xv[v], simd::load(yi + v * W), a);
                            acc[i] = a;
                        }
                        simd::transpose_add(acc).store_aligned(sums);
                    } else {
                        for (index_t i = 0; i < W; ++i) sums[i] = T(0);
                    }
                } else if (V > 0) {  // runtime d_k: x's vectors are loaded again for each row (the same values)
                    B acc[W];
                    for (index_t i = 0; i < W; ++i) {
                        if (i >= n) {
                            acc[i] = simd::splat(T(0));
                            continue;
                        }
                        const T* yi = yh + i * ldy;
                        B a = simd::load(xh) * simd::load(yi);
                        for (index_t v = 1; v < V; ++v)
                            a = xsimd::fma(simd::load(xh + v * W), simd::load(yi + v * W), a);
                        acc[i] = a;
                    }
                    simd::transpose_add(acc).store_aligned(sums);
                } else {
                    for (index_t i = 0; i < W; ++i) sums[i] = T(0);
                }
                for (index_t i = 0; i < n; ++i) {
                    T t = sums[i];
                    for (index_t d = V * W; d < Dk; ++d) t += xh[d] * yh[i * ldy + d];
                    s[h * lds + r + i] = t;
                }
            }
        }
    }

    template <index_t Dk_, class T>
    static void heads_weighted_rows_impl(index_t dk, index_t h0, index_t h1, index_t n, const T* a, index_t lda,
                                         const T* y, index_t ldy, T* o) {
        using B = simd::batch<T>;
        constexpr index_t W = simd::width<T>;
        const index_t Dk = Dk_ > 0 ? Dk_ : dk, V = Dk / W;
        std::fill(o + h0 * Dk, o + h1 * Dk, T(0));
        // o += rows [r, r + R) of every head, in order
        auto add_rows = [&]<index_t R>(index_t r) {
            for (index_t h = h0; h < h1; ++h) {
                const T* ah = a + h * lda + r;
                const T* yh = y + r * ldy + h * Dk;
                T* oh = o + h * Dk;
                for (index_t v = 0; v < V; ++v) {
                    B c = simd::load(oh + v * W);
                    for (index_t i = 0; i < R; ++i) c = xsimd::fma(simd::splat(ah[i]), simd::load(yh + i * ldy + v * W), c);
                    simd::store(oh + v * W, c);
                }
                for (index_t d = V * W; d < Dk; ++d)
                    for (index_t i = 0; i < R; ++i) oh[d] += ah[i] * yh[i * ldy + d];
            }
        };
        index_t r = 0;
        for (; r + 4 <= n; r += 4) add_rows.template operator()<4>(r);
        for (; r < n; ++r) add_rows.template operator()<1>(r);
    }

    template <index_t Dk, class T>
    static void head_tn_block(index_t dk, index_t m, index_t n, const T* a, index_t lda, const T* x_in, index_t ldx_in,
                              T* o, index_t ldo, bool accumulate) {
        using B = simd::batch<T>;
        constexpr index_t W = simd::width<T>, VMax = max_vectors<Dk, T>;
        const index_t V = (Dk > 0 ? Dk : dk) / W;
        alignas(64) T pack[max_reread_rows * VMax * W];
        const T* x = n > 2 ? packed<Dk>(Dk > 0 ? Dk : dk, m, x_in, ldx_in, pack) : x_in;
        const index_t ldx = n > 2 ? (Dk > 0 ? Dk : dk) : ldx_in;
        index_t j = 0;
        for (; j + 2 <= n; j += 2) {  // two output rows share each load of X
            B c0[VMax], c1[VMax];
            for (index_t v = 0; v < V; ++v) {
                c0[v] = accumulate ? simd::load(o + j * ldo + v * W) : simd::splat<T>(0);
                c1[v] = accumulate ? simd::load(o + (j + 1) * ldo + v * W) : simd::splat<T>(0);
            }
            for (index_t i = 0; i < m; ++i) {
                const B s0 = simd::splat(a[i * lda + j]), s1 = simd::splat(a[i * lda + j + 1]);
                for (index_t v = 0; v < V; ++v) {
                    const B xi = simd::load(x + i * ldx + v * W);
                    c0[v] = xsimd::fma(s0, xi, c0[v]);
                    c1[v] = xsimd::fma(s1, xi, c1[v]);
                }
            }
            for (index_t v = 0; v < V; ++v) {
                simd::store(o + j * ldo + v * W, c0[v]);
                simd::store(o + (j + 1) * ldo + v * W, c1[v]);
            }
        }
        for (; j < n; ++j) {
            B c0[VMax];
            for (index_t v = 0; v < V; ++v) c0[v] = accumulate ? simd::load(o + j * ldo + v * W) : simd::splat<T>(0);
            for (index_t i = 0; i < m; ++i) {
                const B s0 = simd::splat(a[i * lda + j]);
                for (index_t v = 0; v < V; ++v) c0[v] = xsimd::fma(s0, simd::load(x + i * ldx + v * W), c0[v]);
            }
            for (index_t v = 0; v < V; ++v) simd::store(o + j * ldo + v * W, c0[v]);
        }
    }

    // The rows of an operand read more than once, copied to contiguous stack memory: a head's rows
    // lie batch·D floats apart (A: 16 or 32 KiB), so more than a few of them share one L1 set.
    // (dk == Dk when Dk > 0.)
    template <index_t Dk, class T>
    static const T* packed(index_t dk, index_t rows, const T* p, index_t ld, T* pack) {
        constexpr index_t W = simd::width<T>;
        const index_t row = Dk > 0 ? Dk : dk, V = row / W;
        for (index_t r = 0; r < rows; ++r)
            for (index_t v = 0; v < V; ++v) simd::store(pack + r * row + v * W, simd::load(p + r * ld + v * W));
        return pack;
    }
};

/// The per-head products for the extents E: with d_head a compile-time width (E.d_head) for a static
/// config, with the runtime width dk of a runtime-shape model otherwise (the same routes and sums).
/// Each takes dk first and passes the rest on to head_products.
template <static_extents E>
struct heads_for {
#define MNEMO_HEADS_FOR(name, kernel)                                                              \
    template <class... A>                                                                        \
    static void name(index_t dk, A... a) {                                                       \
        if constexpr (E.d_head != dynamic) head_products::template kernel<index_t(E.d_head)>(a...); \
        else head_products::kernel(dk, a...);                                                    \
    }
    MNEMO_HEADS_FOR(gemm_nt, head_gemm_nt)
    MNEMO_HEADS_FOR(gemm_nn, head_gemm_nn)
    MNEMO_HEADS_FOR(gemm_tn, head_gemm_tn)
    MNEMO_HEADS_FOR(dot_rows, heads_dot_rows)
    MNEMO_HEADS_FOR(weighted_rows, heads_weighted_rows)
#undef MNEMO_HEADS_FOR
};

}  // namespace mnemo::cpu_kernels
