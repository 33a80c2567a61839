#pragma once
// GEMM on row-major matrices through Eigen::Map (Eigen packs, blocks and, under OpenMP, parallelises
// the product itself). The three forms training needs, each C = beta·C + alpha·op(A)·op(B):
//   gemm_nn: A[M,K]   · B[K,N]      (forward of x·W when W is [in, out])
//   gemm_nt: A[M,K]   · B[N,K]ᵀ     (forward of a PyTorch linear, x·Wᵀ; scores Q·Kᵀ)
//   gemm_tn: A[K,M]ᵀ  · B[K,N]      (weight gradients, dW = dYᵀ·X)
// beta = 0 overwrites C (its contents may be garbage), beta = 1 accumulates.
// lda/ldb/ldc are row strides in elements.
//
// Threads: mnemo runs Eigen's product single-threaded (Eigen::setNbThreads(1), once) and splits a
// large GEMM itself into one block of C per thread. Eigen would otherwise open an OpenMP region for
// products as small as 8×128×128 (the per-token GEMMs of the recurrent models and the per-head
// attention products), whose fork/join costs more than the product, and which stall badly whenever
// another process holds a core. Below parallel_min_work multiply-adds (≈ 20 µs of work) a GEMM runs
// on the calling thread; inside an OpenMP region it always does.
#include <omp.h>

#include <Eigen/Core>
#include <algorithm>

#include "../../core/shape.hpp"

namespace mnemo::cpu_kernels {

struct gemm {
    /// Multiply-adds below which a GEMM stays on one thread.
    static constexpr double parallel_min_work = double(1 << 21);

    /// Calls f(m0, m1, n0, n1) over blocks of C [m, n]: one block of rows per thread when the product
    /// is big enough. Only rows are split, in multiples of 16: Eigen computes a row-major C as its
    /// transpose, so C's rows are the columns of Eigen's kernel, whose 4-wide panels each sum over k
    /// in the same order whatever the block. The result is bitwise the same for any thread count
    /// (splitting C's columns would move some of them into Eigen's remainder micro-kernels, which
    /// round differently).
    template <class F>
    static void split(index_t m, index_t n, index_t k, F&& f) {
        static const bool eigen_single_threaded = [] {
            Eigen::setNbThreads(1);
            return true;
        }();
        (void)eigen_single_threaded;
        const double work = double(m) * double(n) * double(k);
        int threads = (work >= parallel_min_work && !omp_in_parallel()) ? omp_get_max_threads() : 1;
        threads = int(std::min<index_t>(threads, std::max<index_t>(1, m / 16)));
        if (threads <= 1) {
            f(index_t(0), m, index_t(0), n);
            return;
        }
        const index_t chunk = (m + threads - 1) / threads;
        const index_t step = (chunk + 15) / 16 * 16;
#pragma omp parallel num_threads(threads)
        {
            const index_t t = omp_get_thread_num();
            const index_t b = std::min(m, t * step), e = std::min(m, b + step);
            if (b < e) f(b, e, index_t(0), n);
        }
    }

    template <class T>
    using matrix_map = Eigen::Map<Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>, Eigen::Unaligned,
                                  Eigen::OuterStride<>>;
    template <class T>
    using const_matrix_map = Eigen::Map<const Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>,
                                        Eigen::Unaligned, Eigen::OuterStride<>>;

    template <class T>
    static void scale(matrix_map<T>& c, T beta) {
        if (beta == T(0)) c.setZero();
        else if (beta != T(1)) c *= beta;
    }

    template <class T, class Product>
    static void store_product(matrix_map<T>& c, const Product& product, T alpha, T beta) {
        if (beta == T(0)) {
            if (alpha == T(1)) c.noalias() = product;
            else c.noalias() = alpha * product;
        } else {
            if (beta != T(1)) c *= beta;
            if (alpha == T(1)) c.noalias() += product;
            else c.noalias() += alpha * product;
        }
    }

    /// C[M,N] = beta·C + alpha·A[M,K]·B[K,N]
    template <class T>
    static void gemm_nn(index_t m, index_t n, index_t k, const T* a, index_t lda, const T* b, index_t ldb, T* c,
                        index_t ldc, T beta = T(0), T alpha = T(1)) {
        if (m == 0 || n == 0) return;
        split(m, n, k, [&](index_t m0, index_t m1, index_t n0, index_t n1) {
            matrix_map<T> cm(c + m0 * ldc + n0, m1 - m0, n1 - n0, Eigen::OuterStride<>(ldc));
            if (k == 0) return scale(cm, beta);
            const_matrix_map<T> am(a + m0 * lda, m1 - m0, k, Eigen::OuterStride<>(lda));
            const_matrix_map<T> bm(b + n0, k, n1 - n0, Eigen::OuterStride<>(ldb));
            store_product(cm, am * bm, alpha, beta);
        });
    }

    /// C[M,N] = beta·C + alpha·A[M,K]·B[N,K]ᵀ
    template <class T>
    static void gemm_nt(index_t m, index_t n, index_t k, const T* a, index_t lda, const T* b, index_t ldb, T* c,
                        index_t ldc, T beta = T(0), T alpha = T(1)) {
        if (m == 0 || n == 0) return;
        split(m, n, k, [&](index_t m0, index_t m1, index_t n0, index_t n1) {
            matrix_map<T> cm(c + m0 * ldc + n0, m1 - m0, n1 - n0, Eigen::OuterStride<>(ldc));
            if (k == 0) return scale(cm, beta);
            const_matrix_map<T> am(a + m0 * lda, m1 - m0, k, Eigen::OuterStride<>(lda));
            const_matrix_map<T> bm(b + n0 * ldb, n1 - n0, k, Eigen::OuterStride<>(ldb));
            store_product(cm, am * bm.transpose(), alpha, beta);
        });
    }

    /// C[M,N] = beta·C + alpha·A[K,M]ᵀ·B[K,N]
    template <class T>
    static void gemm_tn(index_t m, index_t n, index_t k, const T* a, index_t lda, const T* b, index_t ldb, T* c,
                        index_t ldc, T beta = T(0), T alpha = T(1)) {
        if (m == 0 || n == 0) return;
        split(m, n, k, [&](index_t m0, index_t m1, index_t n0, index_t n1) {
            matrix_map<T> cm(c + m0 * ldc + n0, m1 - m0, n1 - n0, Eigen::OuterStride<>(ldc));
            if (k == 0) return scale(cm, beta);
            const_matrix_map<T> am(a + m0, k, m1 - m0, Eigen::OuterStride<>(lda));
            const_matrix_map<T> bm(b + n0, k, n1 - n0, Eigen::OuterStride<>(ldb));
            store_product(cm, am.transpose() * bm, alpha, beta);
        });
    }
};

}  // namespace mnemo::cpu_kernels
