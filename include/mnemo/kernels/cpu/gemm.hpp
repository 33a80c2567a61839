#pragma once
// GEMM on row-major matrices through Eigen::Map (Eigen packs, blocks and, under OpenMP, parallelises
// the product itself). The three forms training needs, each C = beta·C + alpha·op(A)·op(B):
//   gemm_nn: A[M,K]   · B[K,N]      (forward of x·W when W is [in, out])
//   gemm_nt: A[M,K]   · B[N,K]ᵀ     (forward of a PyTorch linear, x·Wᵀ; scores Q·Kᵀ)
//   gemm_tn: A[K,M]ᵀ  · B[K,N]      (weight gradients, dW = dYᵀ·X)
// beta = 0 overwrites C (its contents may be garbage), beta = 1 accumulates.
// lda/ldb/ldc are row strides in elements.
#include <Eigen/Core>

#include "../../core/shape.hpp"

namespace mnemo::cpu_kernels {

struct gemm {
    template <class T>
    using matrix_map = Eigen::Map<Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>, Eigen::Unaligned,
                                  Eigen::OuterStride<>>;
    template <class T>
    using const_matrix_map = Eigen::Map<const Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>,
                                        Eigen::Unaligned, Eigen::OuterStride<>>;

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
        matrix_map<T> cm(c, m, n, Eigen::OuterStride<>(ldc));
        if (k == 0) { if (beta == T(0)) cm.setZero(); else cm *= beta; return; }
        const_matrix_map<T> am(a, m, k, Eigen::OuterStride<>(lda));
        const_matrix_map<T> bm(b, k, n, Eigen::OuterStride<>(ldb));
        store_product(cm, am * bm, alpha, beta);
    }

    /// C[M,N] = beta·C + alpha·A[M,K]·B[N,K]ᵀ
    template <class T>
    static void gemm_nt(index_t m, index_t n, index_t k, const T* a, index_t lda, const T* b, index_t ldb, T* c,
                        index_t ldc, T beta = T(0), T alpha = T(1)) {
        if (m == 0 || n == 0) return;
        matrix_map<T> cm(c, m, n, Eigen::OuterStride<>(ldc));
        if (k == 0) { if (beta == T(0)) cm.setZero(); else cm *= beta; return; }
        const_matrix_map<T> am(a, m, k, Eigen::OuterStride<>(lda));
        const_matrix_map<T> bm(b, n, k, Eigen::OuterStride<>(ldb));
        store_product(cm, am * bm.transpose(), alpha, beta);
    }

    /// C[M,N] = beta·C + alpha·A[K,M]ᵀ·B[K,N]
    template <class T>
    static void gemm_tn(index_t m, index_t n, index_t k, const T* a, index_t lda, const T* b, index_t ldb, T* c,
                        index_t ldc, T beta = T(0), T alpha = T(1)) {
        if (m == 0 || n == 0) return;
        matrix_map<T> cm(c, m, n, Eigen::OuterStride<>(ldc));
        if (k == 0) { if (beta == T(0)) cm.setZero(); else cm *= beta; return; }
        const_matrix_map<T> am(a, k, m, Eigen::OuterStride<>(lda));
        const_matrix_map<T> bm(b, k, n, Eigen::OuterStride<>(ldb));
        store_product(cm, am.transpose() * bm, alpha, beta);
    }
};

}  // namespace mnemo::cpu_kernels
