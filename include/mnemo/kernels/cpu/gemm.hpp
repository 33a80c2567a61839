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
// Threads: mnemo calls Eigen's sequential product (so a user's Eigen::setNbThreads is untouched) and
// splits a large GEMM itself into one block of C per thread. Eigen's own parallel product would otherwise open an OpenMP region for
// products as small as 8×128×128 (the per-token GEMMs of the recurrent models and the per-head
// attention products), whose fork/join costs more than the product, and which stall badly whenever
// another process holds a core. Below parallel_min_work multiply-adds (≈ 20 µs of work) a GEMM runs
// on the calling thread; inside an OpenMP region it always does.
#include <omp.h>

#include <Eigen/Core>
#include <algorithm>
#include <vector>

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

    /// c[n] (stride 1) = beta·c + alpha·M·x, with M [n, k] row-major (Transposed: M = Bᵀ, B [k, n]).
    template <bool Transposed, class T>
    static void gemv(index_t n, index_t k, const T* b, index_t ldb, const T* x, index_t incx, T* c, T beta, T alpha) {
        vector_map<T> cv(c, n, Eigen::InnerStride<>(1));
        apply_beta(cv, beta);
        if (k == 0) return;
        const_vector_map<T> xv(x, k, Eigen::InnerStride<>(incx));
        if constexpr (Transposed) {
            const_row_major<T> bm(b, k, n, Eigen::OuterStride<>(ldb));
            cv.noalias() += alpha * (bm.transpose() * xv);
        } else {
            const_row_major<T> bm(b, n, k, Eigen::OuterStride<>(ldb));
            cv.noalias() += alpha * (bm * xv);
        }
    }

    /// C[M,N] = beta·C + alpha·A[M,K]·B[K,N]
    template <class T>
    static void gemm_nn(index_t m, index_t n, index_t k, const T* a, index_t lda, const T* b, index_t ldb, T* c,
                        index_t ldc, T beta = T(0), T alpha = T(1)) {
        if (m == 0 || n == 0) return;
        if (m <= gemv_max_rows) {
            for (index_t i = 0; i < m; ++i) gemv<true>(n, k, b, ldb, a + i * lda, 1, c + i * ldc, beta, alpha);
            return;
        }
        split(m, n, k, [&](index_t m0, index_t m1, index_t n0, index_t n1) {
            product<Eigen::RowMajor, Eigen::RowMajor>(m1 - m0, n1 - n0, k, a + m0 * lda, lda, b + n0, ldb,
                                                      c + m0 * ldc + n0, ldc, beta, alpha);
        });
    }

    /// C[M,N] = beta·C + alpha·A[M,K]·B[N,K]ᵀ
    template <class T>
    static void gemm_nt(index_t m, index_t n, index_t k, const T* a, index_t lda, const T* b, index_t ldb, T* c,
                        index_t ldc, T beta = T(0), T alpha = T(1)) {
        if (m == 0 || n == 0) return;
        if (m <= gemv_max_rows) {
            for (index_t i = 0; i < m; ++i) gemv<false>(n, k, b, ldb, a + i * lda, 1, c + i * ldc, beta, alpha);
            return;
        }
        split(m, n, k, [&](index_t m0, index_t m1, index_t n0, index_t n1) {
            product<Eigen::RowMajor, Eigen::ColMajor>(m1 - m0, n1 - n0, k, a + m0 * lda, lda, b + n0 * ldb, ldb,
                                                      c + m0 * ldc + n0, ldc, beta, alpha);
        });
    }

    /// C[M,N] = beta·C + alpha·A[K,M]ᵀ·B[K,N]
    template <class T>
    static void gemm_tn(index_t m, index_t n, index_t k, const T* a, index_t lda, const T* b, index_t ldb, T* c,
                        index_t ldc, T beta = T(0), T alpha = T(1)) {
        if (m == 0 || n == 0) return;
        if (m <= gemv_max_rows) {  // row i of C is Bᵀ·(column i of A)
            for (index_t i = 0; i < m; ++i) gemv<true>(n, k, b, ldb, a + i, lda, c + i * ldc, beta, alpha);
            return;
        }
        split(m, n, k, [&](index_t m0, index_t m1, index_t n0, index_t n1) {
            product<Eigen::ColMajor, Eigen::RowMajor>(m1 - m0, n1 - n0, k, a + m0, lda, b + n0, ldb,
                                                      c + m0 * ldc + n0, ldc, beta, alpha);
        });
    }
};

}  // namespace mnemo::cpu_kernels
