// The unpacked kernels (kernels/cpu/gemm_direct.hpp, through gemm::gemm_nn_direct, gemm_nt_direct and gemm_tn_direct:
// the build's widest instruction set, AVX-512 or AVX2) against a double-precision reference: every
// tile height (1-14 on AVX-512, 1-6 on AVX2) and the equal-height row split, column edges (1, 7, 8, 9,
// 15, 16, 17, 31, 32, 33 columns), k from 1 to past 128, strided operands with padding that must stay
// untouched, beta 0 over NaN, beta 1 and beta 0.5; no allocation in steady state. Double goes to
// Eigen (checked too), as does everything on builds without AVX2 + FMA. AVX-512 builds also run the
// AVX2 kernel by name.
#include <doctest/doctest.h>

#include <cmath>
#include <limits>
#include <omp.h>
#include <vector>

#include <mnemo/kernels/cpu/ops.hpp>

#include "allocation_counter.hpp"
#include "testing.hpp"

using mnemo::index_t;
using K = mnemo::ops<mnemo::cpu>;

namespace {

// The products under test: the dispatch (gemm::gemm_*_direct), or one instruction set's kernel.
enum class form { nn, nt, tn };
const char* name(form f) { return f == form::nn ? "nn " : f == form::nt ? "nt " : "tn "; }

struct through_dispatch {
    template <class T>
    static void nt(index_t m, index_t n, index_t k, const T* a, index_t lda, const T* b, index_t ldb, T* c, index_t ldc,
                   T beta) {
        K::gemm_nt_direct(m, n, k, a, lda, b, ldb, c, ldc, beta);
    }
    template <class T>
    static void nn(index_t m, index_t n, index_t k, const T* a, index_t lda, const T* b, index_t ldb, T* c, index_t ldc,
                   T beta) {
        K::gemm_nn_direct(m, n, k, a, lda, b, ldb, c, ldc, beta);
    }
    template <class T>
    static void tn(index_t m, index_t n, index_t k, const T* a, index_t lda, const T* b, index_t ldb, T* c, index_t ldc,
                   T beta) {
        K::gemm_tn_direct(m, n, k, a, lda, b, ldb, c, ldc, beta);
    }
};

template <class T, class Path = through_dispatch>
void check_direct(form f, index_t m, index_t n, index_t k, T beta, std::uint64_t seed) {
    const bool transposed_b = f == form::nt, transposed_a = f == form::tn;
    const index_t pad = 3, lda = (transposed_a ? m : k) + pad, ldb = (transposed_b ? k : n) + pad, ldc = n + pad;
    const auto a = mnemo::testing::random_vector<T>((transposed_a ? k : m) * lda, seed);
    const auto b = mnemo::testing::random_vector<T>((transposed_b ? n : k) * ldb, seed + 1);
    auto c = mnemo::testing::random_vector<T>(m * ldc, seed + 2);
    const T sentinel = T(12345);
    for (index_t i = 0; i < m; ++i) {
        for (index_t j = n; j < ldc; ++j) c[i * ldc + j] = sentinel;
        if (beta == T(0))
            for (index_t j = 0; j < n; ++j) c[i * ldc + j] = std::numeric_limits<T>::quiet_NaN();
    }
    const auto c0 = c;
    if (f == form::nt) Path::nt(m, n, k, a.data(), lda, b.data(), ldb, c.data(), ldc, beta);
    else if (f == form::tn) Path::tn(m, n, k, a.data(), lda, b.data(), ldb, c.data(), ldc, beta);
    else Path::nn(m, n, k, a.data(), lda, b.data(), ldb, c.data(), ldc, beta);
    double worst = 0;
    bool padding_kept = true;
    for (index_t i = 0; i < m; ++i) {
        for (index_t j = 0; j < n; ++j) {
            double ref = beta == T(0) ? 0.0 : double(beta) * double(c0[i * ldc + j]), scale = std::fabs(ref);
            for (index_t p = 0; p < k; ++p) {
                const double x = double(transposed_a ? a[p * lda + i] : a[i * lda + p]) *
                                 double(transposed_b ? b[j * ldb + p] : b[p * ldb + j]);
                ref += x;
                scale += std::fabs(x);
            }
            const double err = std::fabs(double(c[i * ldc + j]) - ref) / (scale + 1e-30);
            worst = std::isnan(err) ? 1e30 : std::max(worst, err);
        }
        for (index_t j = n; j < ldc; ++j) padding_kept = padding_kept && c[i * ldc + j] == sentinel;
    }
    INFO(name(f) << m << "x" << n << "x" << k << " beta " << double(beta));
    CHECK(worst < (sizeof(T) == 4 ? 1e-6 : 1e-14));
    CHECK(padding_kept);
}

template <class Path>
void sweep_float(std::uint64_t& seed) {
    for (form t : {form::nn, form::nt, form::tn})
        for (index_t m : {1, 2, 3, 4, 5, 6, 7, 11, 12, 13, 14, 15, 28, 29, 32, 33, 45})
            for (index_t n : {1, 7, 8, 9, 15, 16, 17, 31, 32, 33, 70})
                for (index_t k : {1, 3, 8, 16, 17, 130})
                    check_direct<float, Path>(t, m, n, k, 0.0f, seed++);
    for (form t : {form::nn, form::nt, form::tn})
        for (float beta : {1.0f, 0.5f}) {
            check_direct<float, Path>(t, 32, 128, 136, beta, seed++);
            check_direct<float, Path>(t, 11, 33, 40, beta, seed++);
        }
}

#ifdef __AVX512F__
template <class Isa>
struct through_kernel {
    using D = mnemo::cpu_kernels::gemm_direct_t<Isa>;
    static void nt(index_t m, index_t n, index_t k, const float* a, index_t lda, const float* b, index_t ldb, float* c,
                   index_t ldc, float beta) {
        D::gemm_nt(m, n, k, a, lda, b, ldb, c, ldc, beta);
    }
    static void nn(index_t m, index_t n, index_t k, const float* a, index_t lda, const float* b, index_t ldb, float* c,
                   index_t ldc, float beta) {
        D::gemm_nn(m, n, k, a, lda, b, ldb, c, ldc, beta);
    }
    static void tn(index_t m, index_t n, index_t k, const float* a, index_t lda, const float* b, index_t ldb, float* c,
                   index_t ldc, float beta) {
        D::gemm_tn(m, n, k, a, lda, b, ldb, c, ldc, beta);
    }
};
#endif

}  // namespace

TEST_CASE("gemm direct: nn, nt and tn against a double reference over tile heights, edges and depths") {
    std::uint64_t seed = 1;
    sweep_float<through_dispatch>(seed);
    for (form t : {form::nn, form::nt, form::tn}) {
        check_direct<double>(t, 9, 20, 7, 0.0, seed++);
        check_direct<double>(t, 9, 20, 7, 1.0, seed++);
    }
}

#ifdef __AVX512F__
TEST_CASE("gemm direct: the AVX2 kernel by name (also on AVX-512 builds, where the dispatch takes AVX-512's)") {
    std::uint64_t seed = 1000;
    sweep_float<through_kernel<mnemo::cpu_kernels::packed_isa_avx2>>(seed);
}
#endif

TEST_CASE("gemm direct: no allocation in steady state") {
    const index_t m = 32, n = 136, k = 128;
    const auto a = mnemo::testing::random_vector<float>(m * k, 7), b = mnemo::testing::random_vector<float>(n * k, 8);
    std::vector<float> c(std::size_t(m * n)), d(std::size_t(m * k)), e(std::size_t(k * k));
    K::gemm_nt_direct(m, n, k, a.data(), k, b.data(), k, c.data(), n);  // scratch grows here, once
    CHECK(mnemo::testing::count_allocations([&] {
              for (int i = 0; i < 3; ++i) {
                  K::gemm_nt_direct(m, n, k, a.data(), k, b.data(), k, c.data(), n);
                  K::gemm_nn_direct(m, k, n, c.data(), n, b.data(), k, d.data(), k);
                  K::gemm_tn_direct(k, k, m, a.data(), k, d.data(), k, e.data(), k);
              }
          }) == 0);
}

TEST_CASE("gemm direct: a product split over the threads is bitwise the one-thread product") {
    // From gemm::direct_split_min multiply-adds on, outside a parallel region, C's columns go to the
    // threads in blocks of 64 (those past the last full block too).
    const index_t m = 32, n = 520, k = 64;
    REQUIRE(m * n * k >= K::direct_split_min);
    const auto a = mnemo::testing::random_vector<float>(m * k, 11), at = mnemo::testing::random_vector<float>(k * m, 12);
    const auto b = mnemo::testing::random_vector<float>(k * n, 13), bt = mnemo::testing::random_vector<float>(n * k, 14);
    std::vector<float> out[2][3];
    const int saved = omp_get_max_threads();
    for (int threads = 1; threads <= 2; ++threads) {
        omp_set_num_threads(threads);
        for (auto& o : out[threads - 1]) o.assign(std::size_t(m * n), 1.0f);
        K::gemm_nn_direct(m, n, k, a.data(), k, b.data(), n, out[threads - 1][0].data(), n, 0.5f);
        K::gemm_nt_direct(m, n, k, a.data(), k, bt.data(), k, out[threads - 1][1].data(), n, 0.5f);
        K::gemm_tn_direct(m, n, k, at.data(), m, b.data(), n, out[threads - 1][2].data(), n, 0.5f);
    }
    omp_set_num_threads(saved);
    for (int f = 0; f < 3; ++f) {
        INFO(name(form(f)));
        CHECK(out[0][f] == out[1][f]);
    }
}
