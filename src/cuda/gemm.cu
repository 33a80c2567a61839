// The CUDA backend's products (kernels/cuda/kernels.hpp): the row-major GEMMs through cuBLAS, the
// per-head products, the linear and key/value projections' backward, and the frozen norm rows' share.
//
// Row-major to cuBLAS: a row-major C [m, n] with row stride ldc is the column-major Cᵀ [n, m] with
// leading dimension ldc, so C = op(A)·op(B) is computed as Cᵀ = op(B)ᵀ·op(A)ᵀ: cuBLAS gets B first
// and A second with the same transpose flags, and the dimensions (n, m, k).
#include <climits>

#include "common.cuh"
#include "device_math.cuh"
#include "mnemo/kernels/cuda/kernels.hpp"

namespace mnemo::cuda_kernels {
namespace {

using namespace cuda_detail;  // common.cuh, device_math.cuh

// ---- cuBLAS calls ---------------------------------------------------------------------------------------

cublasStatus_t blas_gemm(cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k, const float* alpha,
                         const float* a, int lda, const float* b, int ldb, const float* beta, float* c, int ldc) {
    return cublasSgemm(cuda_detail::blas(), ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}
cublasStatus_t blas_gemm(cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k, const double* alpha,
                         const double* a, int lda, const double* b, int ldb, const double* beta, double* c, int ldc) {
    return cublasDgemm(cuda_detail::blas(), ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}
cublasStatus_t blas_gemm_batched(cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k, const float* alpha,
                                 const float* a, int lda, long long sa, const float* b, int ldb, long long sb,
                                 const float* beta, float* c, int ldc, long long sc, int count) {
    return cublasSgemmStridedBatched(cuda_detail::blas(), ta, tb, m, n, k, alpha, a, lda, sa, b, ldb, sb, beta, c, ldc,
                                     sc, count);
}
cublasStatus_t blas_gemm_batched(cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k,
                                 const double* alpha, const double* a, int lda, long long sa, const double* b, int ldb,
                                 long long sb, const double* beta, double* c, int ldc, long long sc, int count) {
    return cublasDgemmStridedBatched(cuda_detail::blas(), ta, tb, m, n, k, alpha, a, lda, sa, b, ldb, sb, beta, c, ldc,
                                     sc, count);
}

enum class form { nn, nt, tn };

/// C [rows, cols] (row stride ldc, count matrices stride_c apart) = beta·C; beta = 0 writes zeros
/// whatever C held (the product of a zero-depth GEMM).
template <class T>
__global__ void scale_matrices_kernel(index_t count, index_t rows, index_t cols, T* c, index_t ldc, index_t stride_c,
                                      T beta) {
    const index_t per = rows * cols, total = count * per;
    for (index_t e = global_index(); e < total; e += global_stride()) {
        const index_t b = e / per, rc = e - b * per, r = rc / cols, j = rc - r * cols;
        T* p = c + b * stride_c + r * ldc + j;
        *p = beta == T(0) ? T(0) : beta * *p;
    }
}

int to_int(index_t v, const char* what) {
    MNEMO_CHECK(v >= 0 && v <= index_t(INT_MAX), "cuda gemm: ", what, " = ", v, " is out of cuBLAS's int range");
    return int(v);
}

/// A column-major operand's leading dimension for cuBLAS: at least its row count (cuBLAS checks
/// ld >= max(1, rows) even when there is one column, where the row-major caller may pass any stride).
int leading(index_t ld, index_t rows, index_t cols, const char* what) {
    const index_t need = rows > 1 ? rows : 1;
    if (cols <= 1 && ld < need) ld = need;
    MNEMO_CHECK(ld >= need, "cuda gemm: ", what, " = ", ld, " is less than the ", need, " columns of a row");
    return to_int(ld, what);
}

/// count row-major products C = beta·C + alpha·op(A)·op(B), C [m, n], depth k (count 1: one plain GEMM).
template <class T>
void gemm_any(form f, index_t count, index_t m, index_t n, index_t k, const T* a, index_t lda, index_t sa, const T* b,
              index_t ldb, index_t sb, T* c, index_t ldc, index_t sc, T beta, T alpha) {
    MNEMO_CHECK(count >= 0 && m >= 0 && n >= 0 && k >= 0, "cuda gemm: negative size (count ", count, ", m ", m,
                ", n ", n, ", k ", k, ")");
    if (count == 0 || m == 0 || n == 0) return;
    if (k == 0) {  // C = beta·C
        if (beta == T(1)) return;
        const index_t total = count * m * n;
        scale_matrices_kernel<T><<<blocks_for(total), 256, 0, cuda_detail::stream()>>>(count, m, n, c, ldc, sc, beta);
        MNEMO_CUDA_LAUNCHED("scale_matrices_kernel");
        return;
    }
    // Column-major view: Cᵀ [n, m] = op(B)ᵀ [n, k] · op(A)ᵀ [k, m].
    const cublasOperation_t tb = f == form::nt ? CUBLAS_OP_T : CUBLAS_OP_N;  // B's view: [n, k] (N) or [k, n] (T)
    const cublasOperation_t ta = f == form::tn ? CUBLAS_OP_T : CUBLAS_OP_N;  // A's view: [k, m] (N) or [m, k] (T)
    // Rows and columns of the stored column-major views.
    const index_t b_rows = f == form::nt ? k : n, b_cols = f == form::nt ? n : k;
    const index_t a_rows = f == form::tn ? m : k, a_cols = f == form::tn ? k : m;
    const int ib = leading(ldb, b_rows, b_cols, "ldb"), ia = leading(lda, a_rows, a_cols, "lda"),
              ic = leading(ldc, n, m, "ldc");
    const int im = to_int(m, "m"), in = to_int(n, "n"), ik = to_int(k, "k");
    if (count == 1) {
        MNEMO_CUDA(blas_gemm(tb, ta, in, im, ik, &alpha, b, ib, a, ia, &beta, c, ic));
    } else {
        MNEMO_CUDA(blas_gemm_batched(tb, ta, in, im, ik, &alpha, b, ib, (long long)sb, a, ia, (long long)sa, &beta, c,
                                     ic, (long long)sc, to_int(count, "count")));
    }
    cuda_detail::count_launch();
}

// ---- per-head rows ------------------------------------------------------------------------------------------

/// heads_dot_rows: one warp per output s[h, r] (r in [r0, r1)), lanes over the head's d_k columns,
/// then a fixed butterfly sum. 8 warps a block.
template <class T>
__global__ void heads_dot_rows_kernel(index_t dk, index_t heads, index_t r0, index_t r1, const T* x, const T* y,
                                      index_t ldy, T* s, index_t lds) {
    const int lane = threadIdx.x & 31;
    const index_t warp = global_index() >> 5, warps = global_stride() >> 5;
    const index_t nr = r1 - r0, total = heads * nr;
    for (index_t o = warp; o < total; o += warps) {
        const index_t h = o / nr, r = r0 + (o - h * nr);
        const T* xh = x + h * dk;
        const T* yh = y + r * ldy + h * dk;
        T acc = T(0);
        for (index_t d = lane; d < dk; d += 32) acc += xh[d] * yh[d];
        for (int off = 16; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
        if (lane == 0) s[h * lds + r] = acc;
    }
}

/// heads_weighted_rows as a column reduction: column c = h·d_k + d over heads [h0, h1), rows r < n.
template <class T>
struct weighted_rows_op {
    index_t dk, h0, lda, ldy;
    const T* a;
    const T* y;
    T* o;
    __device__ void term(index_t r, index_t c, T (&acc)[1]) const {
        const index_t col = h0 * dk + c, h = col / dk;
        acc[0] += a[h * lda + r] * y[r * ldy + col];
    }
    __device__ void finish(index_t c, const T (&acc)[1]) const { o[h0 * dk + c] = acc[0]; }
};

// ---- the frozen norm rows ---------------------------------------------------------------------------------------

/// c[j] = Σ rows dkv[:, j] (assigned) over the 2D columns; the value half also goes into db_v.
template <class T>
struct frozen_col_sums_op {
    index_t d;
    const T* dkv;
    T* c;
    T* gbv;
    __device__ void term(index_t r, index_t j, T (&acc)[1]) const { acc[0] += dkv[r * 2 * d + j]; }
    __device__ void finish(index_t j, const T (&acc)[1]) const {
        c[j] = acc[0];
        if (j >= d) gbv[j - d] += acc[0];
    }
};

/// Per column i of W = [W_k; W_v] (rows j < 2D): dW[j, i] += G[j, i]·γ_i + c_j·β_i, and
/// dγ_i += Σ_j W[j, i]·G[j, i], dβ_i += Σ_j W[j, i]·c_j. Each (j, i) is visited by one thread once.
template <class T>
struct frozen_norm_op {
    index_t d;
    const T *wk, *wv, *g, *c, *gamma, *beta;
    T *gk, *gv, *dgamma, *dbeta;
    __device__ void term(index_t j, index_t i, T (&acc)[2]) const {
        const bool key = j < d;
        const index_t row = key ? j : j - d;
        const T w = (key ? wk : wv)[row * d + i], gji = g[j * d + i], cj = c[j];
        T* dw = (key ? gk : gv) + row * d + i;
        *dw += gji * gamma[i] + cj * beta[i];
        acc[0] += w * gji;
        acc[1] += w * cj;
    }
    __device__ void finish(index_t i, const T (&acc)[2]) const {
        if (dgamma) dgamma[i] += acc[0];
        if (dbeta) dbeta[i] += acc[1];
    }
};

/// db[j] += Σ rows dy[:, j] for the linear layer and projections' bias gradients.
template <class T>
void bias_grad(index_t rows, index_t n, const T* dy, index_t ld, T* db) {
    sum_rows_accumulate(rows, n, dy, ld, db);  // elementwise.cu
}

}  // namespace

// ---- GEMM ------------------------------------------------------------------------------------------------------

template <class T>
void gemm_nn(index_t m, index_t n, index_t k, const T* a, index_t lda, const T* b, index_t ldb, T* c, index_t ldc,
             T beta, T alpha) {
    gemm_any(form::nn, 1, m, n, k, a, lda, 0, b, ldb, 0, c, ldc, 0, beta, alpha);
}
template <class T>
void gemm_nt(index_t m, index_t n, index_t k, const T* a, index_t lda, const T* b, index_t ldb, T* c, index_t ldc,
             T beta, T alpha) {
    gemm_any(form::nt, 1, m, n, k, a, lda, 0, b, ldb, 0, c, ldc, 0, beta, alpha);
}
template <class T>
void gemm_tn(index_t m, index_t n, index_t k, const T* a, index_t lda, const T* b, index_t ldb, T* c, index_t ldc,
             T beta, T alpha) {
    gemm_any(form::tn, 1, m, n, k, a, lda, 0, b, ldb, 0, c, ldc, 0, beta, alpha);
}
template <class T>
void gemm_nn_batched(index_t count, index_t m, index_t n, index_t k, const T* a, index_t lda, index_t stride_a,
                     const T* b, index_t ldb, index_t stride_b, T* c, index_t ldc, index_t stride_c, T beta, T alpha) {
    gemm_any(form::nn, count, m, n, k, a, lda, stride_a, b, ldb, stride_b, c, ldc, stride_c, beta, alpha);
}
template <class T>
void gemm_nt_batched(index_t count, index_t m, index_t n, index_t k, const T* a, index_t lda, index_t stride_a,
                     const T* b, index_t ldb, index_t stride_b, T* c, index_t ldc, index_t stride_c, T beta, T alpha) {
    gemm_any(form::nt, count, m, n, k, a, lda, stride_a, b, ldb, stride_b, c, ldc, stride_c, beta, alpha);
}
template <class T>
void gemm_tn_batched(index_t count, index_t m, index_t n, index_t k, const T* a, index_t lda, index_t stride_a,
                     const T* b, index_t ldb, index_t stride_b, T* c, index_t ldc, index_t stride_c, T beta, T alpha) {
    gemm_any(form::tn, count, m, n, k, a, lda, stride_a, b, ldb, stride_b, c, ldc, stride_c, beta, alpha);
}

// ---- per-head products ------------------------------------------------------------------------------------------

template <class T>
void head_gemm_nt(index_t dk, index_t m, index_t n, const T* x, index_t ldx, const T* y, index_t ldy, T* s,
                  index_t lds) {
    gemm_any(form::nt, 1, m, n, dk, x, ldx, 0, y, ldy, 0, s, lds, 0, T(0), T(1));
}
template <class T>
void head_gemm_nn(index_t dk, index_t m, index_t n, const T* a, index_t lda, const T* y, index_t ldy, T* o, index_t ldo,
                  T beta) {
    gemm_any(form::nn, 1, m, dk, n, a, lda, 0, y, ldy, 0, o, ldo, 0, beta, T(1));
}
template <class T>
void head_gemm_tn(index_t dk, index_t m, index_t n, const T* a, index_t lda, const T* x, index_t ldx, T* o, index_t ldo,
                  T beta) {
    gemm_any(form::tn, 1, n, dk, m, a, lda, 0, x, ldx, 0, o, ldo, 0, beta, T(1));
}

template <class T>
void heads_dot_rows(index_t dk, index_t heads, index_t r0, index_t r1, const T* x, const T* y, index_t ldy, T* s,
                    index_t lds) {
    if (heads <= 0 || r1 <= r0) return;
    const index_t outputs = heads * (r1 - r0);
    if (dk <= 0) {  // empty dot products: zeros
        const index_t rows = heads, cols = r1 - r0;
        scale_matrices_kernel<T><<<blocks_for(rows * cols), 256, 0, cuda_detail::stream()>>>(1, rows, cols, s + r0,
                                                                                              lds, 0, T(0));
        MNEMO_CUDA_LAUNCHED("scale_matrices_kernel");
        return;
    }
    heads_dot_rows_kernel<T><<<blocks_for(outputs * 32), 256, 0, cuda_detail::stream()>>>(dk, heads, r0, r1, x, y, ldy,
                                                                                           s, lds);
    MNEMO_CUDA_LAUNCHED("heads_dot_rows_kernel");
}

template <class T>
void heads_weighted_rows(index_t dk, index_t h0, index_t h1, index_t n, const T* a, index_t lda, const T* y,
                         index_t ldy, T* o) {
    if (h1 <= h0 || dk <= 0) return;
    column_reduce<T, 1>(n, (h1 - h0) * dk, weighted_rows_op<T>{dk, h0, lda, ldy, a, y, o}, "heads_weighted_rows");
}

// ---- linear layer, key/value projections ------------------------------------------------------------------------

template <class T>
void linear_backward(index_t rows, index_t in, index_t out, const T* x, index_t ldx, const T* dy, index_t lddy,
                     const T* w, T* gw, T* gb, T* dx, index_t lddx, bool accumulate_dx) {
    gemm_tn(out, in, rows, dy, lddy, x, ldx, gw, in, T(1), T(1));
    if (gb) bias_grad(rows, out, dy, lddy, gb);
    if (dx) gemm_nn(rows, in, out, dy, lddy, w, in, dx, lddx, accumulate_dx ? T(1) : T(0), T(1));
}

template <class T>
void kv_projection_backward(index_t rows, index_t d, const T* z, index_t ldz, const T* dkv, const T* wk, const T* wv,
                            T* gk, T* gv, T* gbv, bool fused, T* dz, index_t lddz) {
    if (fused) {
        gemm_tn(2 * d, d, rows, dkv, 2 * d, z, ldz, gk, d, T(1), T(1));
    } else {
        gemm_tn(d, d, rows, dkv, 2 * d, z, ldz, gk, d, T(1), T(1));
        gemm_tn(d, d, rows, dkv + d, 2 * d, z, ldz, gv, d, T(1), T(1));
    }
    bias_grad(rows, d, dkv + d, 2 * d, gbv);
    if (!dz) return;
    if (fused) {
        gemm_nn(rows, d, 2 * d, dkv, 2 * d, wk, d, dz, lddz, T(0), T(1));
    } else {
        gemm_nn(rows, d, d, dkv, 2 * d, wk, d, dz, lddz, T(0), T(1));
        gemm_nn(rows, d, d, dkv + d, 2 * d, wv, d, dz, lddz, T(1), T(1));
    }
}

template <class T>
void frozen_norm_backward(index_t d, const frozen_key_rows<T>& f, const T* dkv, const T* wk, const T* wv, T* gk, T* gv,
                          T* gbv, T* g, T* c) {
    if (d <= 0) return;
    const index_t n = 2 * d;
    gemm_tn(n, d, f.rows, dkv, n, f.zhat, f.ld_zhat, g, d, T(0), T(1));  // G = dkvᵀ·ẑ
    column_reduce<T, 1>(f.rows, n, frozen_col_sums_op<T>{d, dkv, c, gbv}, "frozen_col_sums");
    column_reduce<T, 2>(n, d, frozen_norm_op<T>{d, wk, wv, g, c, f.gamma, f.beta, gk, gv, f.dgamma, f.dbeta},
                        "frozen_norm_columns");
}

template <class T>
void key_value_projections(index_t m_rows, index_t c_rows, index_t d, const T* mn, index_t ldmn, const T* cn,
                           index_t ldcn, const T* wk, const T* wv, const T* bv, T* km, T* kc, T* vm, T* vc) {
    gemm_nt(m_rows, d, d, mn, ldmn, wk, d, km, d, T(0), T(1));
    gemm_nt(c_rows, d, d, cn, ldcn, wk, d, kc, d, T(0), T(1));
    gemm_nt(m_rows, d, d, mn, ldmn, wv, d, vm, d, T(0), T(1));
    add_bias_rows(m_rows, d, bv, vm, d);
    gemm_nt(c_rows, d, d, cn, ldcn, wv, d, vc, d, T(0), T(1));
    add_bias_rows(c_rows, d, bv, vc, d);
}

// ---- explicit instantiations ------------------------------------------------------------------------------------

#define MNEMO_GEMM(T)                                                                                                  \
    template void gemm_nn<T>(index_t, index_t, index_t, const T*, index_t, const T*, index_t, T*, index_t, T, T);     \
    template void gemm_nt<T>(index_t, index_t, index_t, const T*, index_t, const T*, index_t, T*, index_t, T, T);     \
    template void gemm_tn<T>(index_t, index_t, index_t, const T*, index_t, const T*, index_t, T*, index_t, T, T);     \
    template void gemm_nn_batched<T>(index_t, index_t, index_t, index_t, const T*, index_t, index_t, const T*,        \
                                     index_t, index_t, T*, index_t, index_t, T, T);                                    \
    template void gemm_nt_batched<T>(index_t, index_t, index_t, index_t, const T*, index_t, index_t, const T*,        \
                                     index_t, index_t, T*, index_t, index_t, T, T);                                    \
    template void gemm_tn_batched<T>(index_t, index_t, index_t, index_t, const T*, index_t, index_t, const T*,        \
                                     index_t, index_t, T*, index_t, index_t, T, T);                                    \
    template void head_gemm_nt<T>(index_t, index_t, index_t, const T*, index_t, const T*, index_t, T*, index_t);      \
    template void head_gemm_nn<T>(index_t, index_t, index_t, const T*, index_t, const T*, index_t, T*, index_t, T);   \
    template void head_gemm_tn<T>(index_t, index_t, index_t, const T*, index_t, const T*, index_t, T*, index_t, T);   \
    template void heads_dot_rows<T>(index_t, index_t, index_t, index_t, const T*, const T*, index_t, T*, index_t);    \
    template void heads_weighted_rows<T>(index_t, index_t, index_t, index_t, const T*, index_t, const T*, index_t,    \
                                         T*);                                                                          \
    template void linear_backward<T>(index_t, index_t, index_t, const T*, index_t, const T*, index_t, const T*, T*,   \
                                     T*, T*, index_t, bool);                                                           \
    template void kv_projection_backward<T>(index_t, index_t, const T*, index_t, const T*, const T*, const T*, T*,    \
                                            T*, T*, bool, T*, index_t);                                                \
    template void frozen_norm_backward<T>(index_t, const frozen_key_rows<T>&, const T*, const T*, const T*, T*, T*,   \
                                          T*, T*, T*);                                                                 \
    template void key_value_projections<T>(index_t, index_t, index_t, const T*, index_t, const T*, index_t, const T*, \
                                           const T*, const T*, T*, T*, T*, T*);
MNEMO_CUDA_INSTANTIATE_T(MNEMO_GEMM)
#undef MNEMO_GEMM

}  // namespace mnemo::cuda_kernels
