// CPU kernels against naive reference loops, on random shapes including sizes that are not multiples
// of the SIMD width.
#include <doctest/doctest.h>

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include <mnemo/core/buffer.hpp>
#include <mnemo/kernels/cpu/ops.hpp>

#include "testing.hpp"

using mnemo::index_t;
using K = mnemo::ops<mnemo::cpu>;
using mnemo::testing::check_close;
using mnemo::testing::random_tokens;
using mnemo::testing::random_vector;

namespace {

struct gemm_shape {
    index_t m, n, k;
};
// {257, 190, 64} and {40, 700, 90} are large enough to be split across threads (rows, then columns).
const gemm_shape gemm_shapes[] = {{1, 1, 1}, {3, 5, 7}, {17, 33, 9}, {64, 48, 31}, {129, 65, 130}, {5, 0, 3}, {4, 6, 0},
                                  {257, 190, 64}, {40, 700, 90},
                                  // one and two rows (GEMVs): k past whole groups of 4 SIMD widths, a few
                                  // single widths and a scalar tail, or under one width
                                  {1, 37, 71}, {2, 19, 45}, {1, 9, 200}, {2, 5, 3}};

// Naive C = beta·C + alpha·op(A)·op(B) with op chosen by flags, in double.
template <class T>
std::vector<T> naive_gemm(bool ta, bool tb, index_t m, index_t n, index_t k, const std::vector<T>& a, index_t lda,
                          const std::vector<T>& b, index_t ldb, const std::vector<T>& c, index_t ldc, T beta, T alpha) {
    std::vector<T> out = c;
    for (index_t i = 0; i < m; ++i)
        for (index_t j = 0; j < n; ++j) {
            double s = 0;
            for (index_t p = 0; p < k; ++p) {
                const double av = ta ? a[p * lda + i] : a[i * lda + p];
                const double bv = tb ? b[j * ldb + p] : b[p * ldb + j];
                s += av * bv;
            }
            out[i * ldc + j] = static_cast<T>((beta == T(0) ? 0.0 : double(beta) * double(c[i * ldc + j])) + double(alpha) * s);
        }
    return out;
}

template <class T>
void check_gemm_forms(double tol) {
    std::uint64_t seed = 1;
    for (const auto& s : gemm_shapes) {
        for (T beta : {T(0), T(1), T(0.5)}) {
            for (T alpha : {T(1), T(-0.75)}) {
                const index_t pad = 3;  // strided views: ld > cols
                // nn: A[m,k] B[k,n]
                {
                    const index_t lda = s.k + pad, ldb = s.n + pad, ldc = s.n + pad;
                    auto a = random_vector<T>(std::max<index_t>(1, s.m * lda), seed++);
                    auto b = random_vector<T>(std::max<index_t>(1, s.k * ldb), seed++);
                    auto c = random_vector<T>(std::max<index_t>(1, s.m * ldc), seed++);
                    auto ref = naive_gemm(false, false, s.m, s.n, s.k, a, lda, b, ldb, c, ldc, beta, alpha);
                    K::gemm_nn(s.m, s.n, s.k, a.data(), lda, b.data(), ldb, c.data(), ldc, beta, alpha);
                    INFO("gemm_nn m=" << s.m << " n=" << s.n << " k=" << s.k << " beta=" << beta << " alpha=" << alpha);
                    check_close("gemm_nn", c, ref, tol, tol);
                }
                // nt: A[m,k] B[n,k]
                {
                    const index_t lda = s.k + pad, ldb = s.k + pad, ldc = s.n + pad;
                    auto a = random_vector<T>(std::max<index_t>(1, s.m * lda), seed++);
                    auto b = random_vector<T>(std::max<index_t>(1, s.n * ldb), seed++);
                    auto c = random_vector<T>(std::max<index_t>(1, s.m * ldc), seed++);
                    auto ref = naive_gemm(false, true, s.m, s.n, s.k, a, lda, b, ldb, c, ldc, beta, alpha);
                    K::gemm_nt(s.m, s.n, s.k, a.data(), lda, b.data(), ldb, c.data(), ldc, beta, alpha);
                    INFO("gemm_nt m=" << s.m << " n=" << s.n << " k=" << s.k << " beta=" << beta << " alpha=" << alpha);
                    check_close("gemm_nt", c, ref, tol, tol);
                }
                // tn: A[k,m] B[k,n]
                {
                    const index_t lda = s.m + pad, ldb = s.n + pad, ldc = s.n + pad;
                    auto a = random_vector<T>(std::max<index_t>(1, s.k * lda), seed++);
                    auto b = random_vector<T>(std::max<index_t>(1, s.k * ldb), seed++);
                    auto c = random_vector<T>(std::max<index_t>(1, s.m * ldc), seed++);
                    auto ref = naive_gemm(true, false, s.m, s.n, s.k, a, lda, b, ldb, c, ldc, beta, alpha);
                    K::gemm_tn(s.m, s.n, s.k, a.data(), lda, b.data(), ldb, c.data(), ldc, beta, alpha);
                    INFO("gemm_tn m=" << s.m << " n=" << s.n << " k=" << s.k << " beta=" << beta << " alpha=" << alpha);
                    check_close("gemm_tn", c, ref, tol, tol);
                }
            }
        }
    }
}

template <class T>
std::vector<T> naive_softmax(index_t rows, index_t cols, const std::vector<T>& x, T scale, mnemo::softmax_mask mask) {
    std::vector<T> y(x.size(), T(0));
    for (index_t i = 0; i < rows; ++i) {
        auto visible = [&](index_t j) {
            bool v = true;
            if (mask.causal) v = v && j <= mask.causal_offset + i;
            if (mask.keep) v = v && mask.keep[i * mask.ld_keep + j] != 0;
            return v;
        };
        double mx = -std::numeric_limits<double>::infinity();
        for (index_t j = 0; j < cols; ++j)
            if (visible(j)) mx = std::max(mx, double(scale) * x[i * cols + j]);
        if (mx == -std::numeric_limits<double>::infinity()) continue;
        double sum = 0;
        for (index_t j = 0; j < cols; ++j)
            if (visible(j)) sum += std::exp(double(scale) * x[i * cols + j] - mx);
        for (index_t j = 0; j < cols; ++j)
            if (visible(j)) y[i * cols + j] = static_cast<T>(std::exp(double(scale) * x[i * cols + j] - mx) / sum);
    }
    return y;
}

}  // namespace

TEST_CASE("gemm: nn, nt and tn forms with accumulate match a naive loop (float)") { check_gemm_forms<float>(2e-5); }
TEST_CASE("gemm: nn, nt and tn forms with accumulate match a naive loop (double)") { check_gemm_forms<double>(1e-12); }

TEST_CASE("gemm: row_dots gives a row the same bits wherever its group of the SIMD width begins") {
    // From row_dots_group_min_k on, the rows' sums reduce W at a time (transpose_add), the last
    // n % W one by one (halving_sum): started one row later, every row changes its place in a group
    // or leaves the groups. Shorter rows reduce one by one (reduce_add).
    auto check = [](auto zero) {
        using T = decltype(zero);
        constexpr index_t w = mnemo::simd::width<T>;
        constexpr index_t g = mnemo::cpu_kernels::gemm::row_dots_group_min_k;
        for (index_t k : {index_t(16), index_t(37), g - 1, g, g + 37, 4 * g}) {
            const index_t n = 3 * w + 5, ldm = k + 3;
            const auto m = mnemo::testing::random_vector<T>(n * ldm, 31);
            const auto x = mnemo::testing::random_vector<T>(k, 32);
            std::vector<T> whole(std::size_t(n), T(0.5));
            mnemo::cpu_kernels::gemm::row_dots(n, k, m.data(), ldm, x.data(), whole.data(), T(1.5));
            for (index_t s = 1; s <= w; ++s) {
                std::vector<T> part(std::size_t(n), T(0.5));
                mnemo::cpu_kernels::gemm::row_dots(n - s, k, m.data() + s * ldm, ldm, x.data(), part.data() + s, T(1.5));
                CAPTURE(k);
                CAPTURE(s);
                CHECK(std::memcmp(part.data() + s, whole.data() + s, sizeof(T) * std::size_t(n - s)) == 0);
            }
            double worst = 0;  // and right
            for (index_t r = 0; r < n; ++r) {
                double ref = 0;
                for (index_t p = 0; p < k; ++p) ref += double(m[std::size_t(r * ldm + p)]) * double(x[std::size_t(p)]);
                worst = std::max(worst, std::abs(double(whole[std::size_t(r)]) - (0.5 + 1.5 * ref)));
            }
            CHECK(worst < (sizeof(T) == 4 ? 1e-4 : 1e-12));
        }
    };
    check(float(0));
    check(double(0));
}

TEST_CASE("gemm: one- and two-row products (GEMVs) are bitwise the same on 1, 2 and 3 threads") {
    // Large matrix-vector products split their outputs over the threads (gemv_splitting), the
    // row-major form at multiples of row_split outputs, the column-major one at multiples of
    // gemv_split: every output must come out with the same bits. Each splitting of gemv_tuning runs
    // on any machine (gemv_splitting_override), each with shapes it splits; the finer one also takes
    // products of fewer than 256 outputs (and a last chunk that is not whole: 100 = 3·32 + 4).
    struct shape {
        index_t m, n, k;
    };
    struct run {
        const mnemo::cpu_kernels::gemv_splitting* split;
        shape sh;
    };
    using tuning = mnemo::cpu_kernels::gemv_tuning;
    const shape large[] = {{1, 256, 256}, {1, 512, 256}, {1, 1024, 256}, {2, 2048, 512},
                           {1, 1000, 700}, {1, 4100, 64}, {2, 300, 1024}, {1, 129, 2048}};
    std::vector<run> runs;
    for (const shape& sh : large) runs.push_back({&tuning::defaults, sh});
    for (const shape& sh : large) runs.push_back({&tuning::xeon_gnr, sh});
    for (const shape& sh : {shape{1, 128, 256}, shape{2, 96, 512}, shape{1, 100, 400}, shape{1, 64, 1024}})
        runs.push_back({&tuning::xeon_gnr, sh});
    const int saved = omp_get_max_threads();
    for (const run& r : runs) {
        const index_t m = r.sh.m, n = r.sh.n, k = r.sh.k;  // not a structured binding: CAPTURE's lambda (clang 14)
        const std::string split_name = r.split->name;
        CAPTURE(split_name);
        REQUIRE(n * k >= r.split->parallel_min);
        mnemo::cpu_kernels::gemv_splitting_override = r.split;
        // Operands at odd offsets, with row strides wider than the rows.
        const index_t lda = k + 3, ldb_nt = k + 5, ldb_nn = n + 7, ldc = n + 1;
        auto a = mnemo::testing::random_vector<float>(m * lda + 1, 11);
        auto a_t = mnemo::testing::random_vector<float>(k * (m + 2) + 1, 12);  // A [k, m] for tn, stride m + 2
        auto b_nt = mnemo::testing::random_vector<float>(n * ldb_nt + 1, 13);
        auto b_nn = mnemo::testing::random_vector<float>(k * ldb_nn + 1, 14);
        std::vector<float> results[3][3];
        for (int threads = 1; threads <= 3; ++threads) {
            omp_set_num_threads(threads);
            for (int f = 0; f < 3; ++f) {
                std::vector<float> c(std::size_t(m * ldc + 1), 0.25f);
                if (f == 0) K::gemm_nt(m, n, k, a.data() + 1, lda, b_nt.data() + 1, ldb_nt, c.data() + 1, ldc, 1.0f);
                if (f == 1) K::gemm_nn(m, n, k, a.data() + 1, lda, b_nn.data() + 1, ldb_nn, c.data() + 1, ldc, 1.0f);
                if (f == 2) K::gemm_tn(m, n, k, a_t.data() + 1, m + 2, b_nn.data() + 1, ldb_nn, c.data() + 1, ldc, 1.0f);
                results[threads - 1][f] = c;
            }
        }
        omp_set_num_threads(saved);
        mnemo::cpu_kernels::gemv_splitting_override = nullptr;
        for (int f = 0; f < 3; ++f) {
            CAPTURE(f);
            CAPTURE(m);
            CAPTURE(n);
            CAPTURE(k);
            CHECK(results[0][f] == results[1][f]);
            CHECK(results[0][f] == results[2][f]);
            // and right: against a double loop
            std::vector<double> ref(std::size_t(m * n));
            const std::vector<float>& c = results[0][f];
            double worst = 0;
            for (index_t i = 0; i < m; ++i)
                for (index_t j = 0; j < n; ++j) {
                    double s = 0.25;
                    for (index_t p = 0; p < k; ++p) {
                        const double av = f == 2 ? a_t[std::size_t(1 + p * (m + 2) + i)] : a[std::size_t(1 + i * lda + p)];
                        const double bv = f == 0 ? b_nt[std::size_t(1 + j * ldb_nt + p)] : b_nn[std::size_t(1 + p * ldb_nn + j)];
                        s += av * bv;
                    }
                    worst = std::max(worst, std::abs(s - double(c[std::size_t(1 + i * ldc + j)])));
                }
            CHECK(worst < 1e-3);
        }
    }
}

TEST_CASE("parallel_phases: each phase sees every write of the one before, on 1, 2 and 3 threads, held or not") {
    // Four phases over different item counts; each item of a phase reads items of the phase before
    // that other threads wrote (reversed, shifted), so a missing barrier shows as a wrong sum.
    constexpr index_t n = 97;
    const int saved = omp_get_max_threads();
    for (int threads = 1; threads <= 3; ++threads) {
        omp_set_num_threads(threads);
        for (int round = 0; round < 20; ++round) {
            std::vector<long> a(n, -1), b(n, -1), c(n / 2, -1), d(1, -1);
            auto phases = [&] { mnemo::parallel_phases(
                true, n, [&](index_t i0, index_t i1) { for (index_t i = i0; i < i1; ++i) a[std::size_t(i)] = i; },
                n, [&](index_t i0, index_t i1) { for (index_t i = i0; i < i1; ++i) b[std::size_t(i)] = a[std::size_t(n - 1 - i)] + 1; },
                n / 2, [&](index_t i0, index_t i1) {
                    for (index_t i = i0; i < i1; ++i) c[std::size_t(i)] = b[std::size_t(2 * i)] + b[std::size_t(2 * i + 1)];
                },
                1, [&](index_t i0, index_t i1) {
                    for (index_t i = i0; i < i1; ++i) {
                        long sum = 0;
                        for (long v : c) sum += v;
                        d[std::size_t(i)] = sum;
                    }
                }); };
            if (round % 2 == 1) mnemo::hold_threads(phases);  // odd rounds with the threads held
            else phases();
            long want = 0;
            for (index_t i = 0; i < n / 2; ++i) want += (n - 1 - 2 * i) + 1 + (n - 2 - 2 * i) + 1;
            CHECK(d[0] == want);
        }
    }
    omp_set_num_threads(saved);
}

TEST_CASE("hold_threads: loops inside run on the held threads with the same split; nested calls, values, exceptions") {
    constexpr index_t n = 37;
    constexpr int rounds = 200;
    // What the loops below compute, on one thread.
    std::vector<long> want(n, 1), tmp(n);
    for (int round = 0; round < rounds; ++round) {
        for (index_t i = 0; i < n; ++i) tmp[std::size_t(i)] = want[std::size_t(n - 1 - i)] + i + round;
        std::swap(want, tmp);
    }
    const int saved = omp_get_max_threads();
    for (int threads = 1; threads <= 3; ++threads) {
        omp_set_num_threads(threads);
        std::vector<long> a(n, 1), b(n);
        const int got = mnemo::hold_threads([&] {
            CHECK(mnemo::available_threads() == threads);
            CHECK(mnemo::hold_threads([] { return 7; }) == 7);  // nested: a plain call
            for (int round = 0; round < rounds; ++round) {  // each loop reads what other threads wrote in the one before
                std::vector<int> by(n, -1);
                mnemo::parallel_range(n, true, [&](index_t i0, index_t i1) {
                    CHECK(mnemo::available_threads() == 1);  // inside a loop: one thread
                    for (index_t i = i0; i < i1; ++i) {
                        b[std::size_t(i)] = a[std::size_t(n - 1 - i)] + i + round;
                        by[std::size_t(i)] = omp_get_thread_num();
                    }
                });
                std::swap(a, b);
                for (int t = 0; t < threads; ++t)  // the static partition: thread t's block
                    for (index_t i = n * t / threads; i < n * (t + 1) / threads; ++i) CHECK(by[std::size_t(i)] == t);
            }
            // a team body with a barrier: each thread reads the slot the next one wrote before it
            std::vector<int> slot(std::size_t(threads), -1), seen(std::size_t(threads), -1);
            if (threads > 1)
                mnemo::parallel_team(threads, [&](index_t t, index_t nt) {
                    CHECK(nt == threads);
                    slot[std::size_t(t)] = int(t) + 100;
                    mnemo::team_barrier();
                    seen[std::size_t(t)] = slot[std::size_t((t + 1) % nt)];
                });
            for (int t = 0; threads > 1 && t < threads; ++t) CHECK(seen[std::size_t(t)] == (t + 1) % threads + 100);
            return 42;
        });
        CHECK(got == 42);
        CHECK(a == want);
        // An exception from the held code, or from the calling thread's share of a loop, reaches the
        // caller; the threads are released and a later hold works.
        CHECK_THROWS_AS(mnemo::hold_threads([] { throw std::runtime_error("held"); }), std::runtime_error);
        CHECK_THROWS_AS(mnemo::hold_threads([&] {
                            mnemo::parallel_range(n, true, [&](index_t i0, index_t) {
                                if (i0 == 0) throw std::runtime_error("share");
                            });
                        }),
                        std::runtime_error);
    }
    omp_set_num_threads(saved);
}

TEST_CASE("softmax: masked rows match a naive loop, including fully masked rows") {
    std::uint64_t seed = 100;
    for (index_t rows : {1, 3, 17, 40}) {
        for (index_t cols : {1, 7, 16, 33, 100}) {
            auto x = random_vector<float>(rows * cols, seed++, -8.0, 8.0);
            std::vector<std::uint8_t> keep(static_cast<std::size_t>(rows * cols));
            mnemo::rng r(seed++);
            for (auto& k : keep) k = r.uniform() < 0.7 ? 1 : 0;
            for (auto& k : keep) (void)k;
            keep[0] = 0;  // row 0 may become fully masked below
            const mnemo::softmax_mask masks[] = {mnemo::softmax_mask::none(), mnemo::softmax_mask::causal_from(0),
                                                 mnemo::softmax_mask::causal_from(5), mnemo::softmax_mask::causal_from(-2),
                                                 {false, 0, keep.data(), cols}, {true, 2, keep.data(), cols}};
            for (const auto& mask : masks) {
                for (float scale : {1.0f, 0.125f, -0.5f}) {
                    std::vector<float> y(x.size(), 42.0f);
                    K::softmax_forward(rows, cols, x.data(), cols, y.data(), cols, scale, mask);
                    auto ref = naive_softmax(rows, cols, x, scale, mask);
                    INFO("rows=" << rows << " cols=" << cols << " causal=" << mask.causal << " offset="
                                 << mask.causal_offset << " keep=" << (mask.keep != nullptr) << " scale=" << scale);
                    check_close("softmax", y, ref, 1e-6, 1e-5);
                    for (float v : y) REQUIRE(std::isfinite(v));
                }
            }
        }
    }
}

TEST_CASE("softmax: in place and huge logits stay finite") {
    std::vector<float> x = {1000.f, 999.f, -1000.f, 3.f, 88.f, 89.f, 90.f};
    auto ref = naive_softmax<float>(1, 7, x, 1.0f, {});
    K::softmax_forward(1, 7, x.data(), 7, x.data(), 7, 1.0f);
    check_close("softmax in place", x, ref, 1e-7, 1e-6);
}

TEST_CASE("softmax: contiguous short rows match a double-precision softmax, long rows softmax_forward") {
    std::uint64_t seed = 40;
    for (index_t cols : {1, 2, 3, 4, 7, 8, 15, 16, 17, 40})
        for (index_t rows : {1, 2, 3, 8, 9})
            for (float scale : {0.17677669f, 1.0f, -0.5f}) {
                auto x = mnemo::testing::random_vector<float>(rows * cols, seed++);
                for (auto& v : x) v *= 6.0f;
                const auto x0 = x;
                K::softmax_contiguous(rows, cols, x.data(), scale);
                double worst = 0;
                for (index_t i = 0; i < rows; ++i) {
                    double mx = -1e300, sum = 0;
                    for (index_t j = 0; j < cols; ++j) mx = std::max(mx, double(scale) * x0[i * cols + j]);
                    for (index_t j = 0; j < cols; ++j) sum += std::exp(double(scale) * x0[i * cols + j] - mx);
                    for (index_t j = 0; j < cols; ++j) {
                        const double ref = std::exp(double(scale) * x0[i * cols + j] - mx) / sum;
                        worst = std::max(worst, std::fabs(double(x[i * cols + j]) - ref));
                    }
                }
                INFO("rows " << rows << " cols " << cols << " scale " << scale);
                CHECK(worst < 1e-6);
                if (cols >= 16) {  // the row path itself, bitwise
                    auto y = x0;
                    K::softmax_forward(rows, cols, y.data(), cols, y.data(), cols, scale);
                    CHECK(y == x);
                }
            }
    double d[6] = {1, 2, 3, 4, 5, 6}, e[6] = {1, 2, 3, 4, 5, 6};  // double: softmax_forward's result
    K::softmax_contiguous<double>(2, 3, d, 0.5);
    K::softmax_forward<double>(2, 3, e, 3, e, 3, 0.5);
    for (int i = 0; i < 6; ++i) CHECK(d[i] == e[i]);
}

TEST_CASE("softmax: backward matches the Jacobian product") {
    std::uint64_t seed = 200;
    for (index_t rows : {1, 5, 19}) {
        for (index_t cols : {1, 9, 32, 47}) {
            auto x = random_vector<double>(rows * cols, seed++, -3, 3);
            auto dy = random_vector<double>(rows * cols, seed++);
            const double scale = 0.3;
            auto mask = mnemo::softmax_mask::causal_from(1);
            std::vector<double> y(x.size()), dx(x.size());
            K::softmax_forward(rows, cols, x.data(), cols, y.data(), cols, scale, mask);
            K::softmax_backward(rows, cols, y.data(), cols, dy.data(), cols, dx.data(), cols, scale);
            std::vector<double> ref(x.size(), 0.0);
            for (index_t i = 0; i < rows; ++i)
                for (index_t j = 0; j < cols; ++j) {
                    double s = 0;  // Σ_k dy_k ∂y_k/∂x_j
                    for (index_t k = 0; k < cols; ++k) {
                        const double yk = y[i * cols + k], yj = y[i * cols + j];
                        s += dy[i * cols + k] * scale * yk * ((k == j ? 1.0 : 0.0) - yj);
                    }
                    ref[i * cols + j] = s;
                }
            check_close("softmax backward", dx, ref, 1e-13, 1e-10);
        }
    }
}

TEST_CASE("softmax: backward with a causal mask reads the visible prefix only, bitwise the unmasked result") {
    std::uint64_t seed = 250;
    for (index_t rows : {3, 17})
        for (index_t cols : {5, 8, 23, 64, 71})
            for (index_t offset : {0, 2, 9, 40}) {
                auto x = random_vector<float>(rows * cols, seed++, -3, 3);
                auto dy = random_vector<float>(rows * cols, seed++);
                const auto mask = mnemo::softmax_mask::causal_from(offset);
                std::vector<float> y(x.size()), full(x.size()), masked(x.size());
                K::softmax_forward(rows, cols, x.data(), cols, y.data(), cols, 0.7f, mask);
                K::softmax_backward(rows, cols, y.data(), cols, dy.data(), cols, full.data(), cols, 0.7f);
                auto dy_hidden = dy;  // what a product that skipped the masked keys leaves there
                for (index_t i = 0; i < rows; ++i)
                    for (index_t j = std::min(cols, offset + i + 1); j < cols; ++j)
                        dy_hidden[i * cols + j] = std::numeric_limits<float>::quiet_NaN();
                K::softmax_backward(rows, cols, y.data(), cols, dy_hidden.data(), cols, masked.data(), cols, 0.7f, mask);
                INFO("rows " << rows << " cols " << cols << " offset " << offset);
                bool same = true;
                for (std::size_t k = 0; k < full.size(); ++k) same = same && masked[k] == full[k];
                CHECK(same);
            }
}

TEST_CASE("layer_norm: forward and backward match a naive loop") {
    std::uint64_t seed = 300;
    for (index_t rows : {1, 4, 37}) {
        for (index_t d : {1, 5, 16, 67, 128}) {
            auto x = random_vector<double>(rows * d, seed++, -2, 3);
            auto w = random_vector<double>(d, seed++, 0.5, 1.5);
            auto b = random_vector<double>(d, seed++);
            auto dy = random_vector<double>(rows * d, seed++);
            const double eps = 1e-5;
            std::vector<double> y(x.size()), mean(rows), rstd(rows), dx(x.size());
            std::vector<double> dw(d, 0.25), db(d, -0.5);  // pre-filled: must accumulate
            K::layer_norm_forward(rows, d, x.data(), d, w.data(), b.data(), eps, y.data(), d, mean.data(), rstd.data());
            K::layer_norm_backward(rows, d, x.data(), d, w.data(), mean.data(), rstd.data(), dy.data(), d, dx.data(), d,
                                   dw.data(), db.data());
            std::vector<double> ry(x.size()), rdx(x.size()), rdw(d, 0.25), rdb(d, -0.5);
            for (index_t i = 0; i < rows; ++i) {
                const double* xi = &x[i * d];
                double mu = 0, var = 0;
                for (index_t j = 0; j < d; ++j) mu += xi[j];
                mu /= d;
                for (index_t j = 0; j < d; ++j) var += (xi[j] - mu) * (xi[j] - mu);
                var /= d;
                const double r = 1 / std::sqrt(var + eps);
                double mg = 0, mgx = 0;
                for (index_t j = 0; j < d; ++j) {
                    const double xh = (xi[j] - mu) * r;
                    ry[i * d + j] = xh * w[j] + b[j];
                    const double g = dy[i * d + j] * w[j];
                    mg += g / d;
                    mgx += g * xh / d;
                    rdw[j] += dy[i * d + j] * xh;
                    rdb[j] += dy[i * d + j];
                }
                for (index_t j = 0; j < d; ++j) {
                    const double xh = (xi[j] - mu) * r;
                    rdx[i * d + j] = r * (dy[i * d + j] * w[j] - mg - xh * mgx);
                }
            }
            INFO("rows=" << rows << " d=" << d);
            check_close("layer_norm y", y, ry, 1e-12, 1e-12);
            check_close("layer_norm dx", dx, rdx, 1e-11, 1e-10);
            check_close("layer_norm dw", dw, rdw, 1e-11, 1e-11);
            check_close("layer_norm db", db, rdb, 1e-11, 1e-11);
        }
    }
}

// x̂ by batch element (the absorbed attention's layout): row p·B + b of x lands at b·ld_batch + p·ld,
// bitwise the row the plain layout gives; split over threads (65K elements) and not.
TEST_CASE("layer_norm: x̂ laid out by batch element holds the same rows, moved") {
    for (index_t positions : {3, 130}) {
        const index_t B = 4, d = 128, rows = positions * B, ld = d + 3, ld_batch = (positions + 1) * ld;
        INFO("positions " << positions);
        auto x = random_vector<float>(rows * d, 900 + std::uint64_t(positions), -2, 3);
        std::vector<float> plain(rows * d), by_batch(B * ld_batch, -99.0f);
        K::layer_norm_forward<float>(rows, d, x.data(), d, nullptr, nullptr, 1e-5f, nullptr, 0, nullptr, nullptr,
                                     plain.data(), d);
        K::layer_norm_forward<float>(rows, d, x.data(), d, nullptr, nullptr, 1e-5f, nullptr, 0, nullptr, nullptr,
                                     by_batch.data(), ld, B, ld_batch);
        bool same = true, untouched = true;
        for (index_t b = 0; b < B; ++b)
            for (index_t p = 0; p <= positions; ++p)
                for (index_t j = 0; j < ld; ++j) {
                    const float got = by_batch[b * ld_batch + p * ld + j];
                    if (p < positions && j < d) same = same && got == plain[(p * B + b) * d + j];
                    else untouched = untouched && got == -99.0f;  // row padding and the spare position
                }
        CHECK(same);
        CHECK(untouched);
    }
}

// The forward normalises rows four at a time (interleaved sums) and the rest one by one: every row
// must come out bitwise as it does alone, wherever it falls, in place too, on one thread and split.
TEST_CASE("layer_norm: a row's output does not depend on the rows normalised with it") {
    for (index_t d : {5, 8, 67, 128}) {
        for (index_t rows : {1, 3, 4, 7, 9, 600}) {
            INFO("rows " << rows << " d " << d);
            auto x = random_vector<float>(rows * d, 1000 + std::uint64_t(rows * d), -2, 3);
            const auto w = random_vector<float>(d, 7, 0.5, 1.5), b = random_vector<float>(d, 8);
            std::vector<float> y(x.size()), mean(rows), rstd(rows), xhat(x.size());
            K::layer_norm_forward<float>(rows, d, x.data(), d, w.data(), b.data(), 1e-5f, y.data(), d, mean.data(),
                                         rstd.data(), xhat.data(), d);
            bool same = true;
            for (index_t i = 0; i < rows; ++i) {
                float yi[128], hi[128], mi, ri;
                K::layer_norm_forward<float>(1, d, x.data() + i * d, d, w.data(), b.data(), 1e-5f, yi, d, &mi, &ri, hi, d);
                same = same && mi == mean[i] && ri == rstd[i];
                for (index_t j = 0; j < d; ++j) same = same && yi[j] == y[i * d + j] && hi[j] == xhat[i * d + j];
            }
            CHECK(same);
            K::layer_norm_forward<float>(rows, d, x.data(), d, w.data(), b.data(), 1e-5f, x.data(), d, nullptr, nullptr);
            CHECK(x == y);  // in place
        }
    }
}

TEST_CASE("layer_norm: float forward matches double reference") {
    const index_t rows = 9, d = 77;
    auto x = random_vector<float>(rows * d, 7, -4, 4);
    std::vector<float> y(x.size()), mean(rows), rstd(rows);
    K::layer_norm_forward<float>(rows, d, x.data(), d, nullptr, nullptr, 1e-5f, y.data(), d, mean.data(), rstd.data());
    std::vector<double> xd(x.begin(), x.end()), yd(x.size()), md(rows), rd(rows);
    K::layer_norm_forward<double>(rows, d, xd.data(), d, nullptr, nullptr, 1e-5, yd.data(), d, md.data(), rd.data());
    check_close("layer_norm float", y, yd, 1e-5, 1e-5);
}

TEST_CASE("activations: relu and gelu forward and backward match scalar formulas") {
    for (index_t n : {1, 3, 16, 31, 1000, 70001}) {
        auto x = random_vector<double>(n, 400 + n, -5, 5);
        auto dy = random_vector<double>(n, 500 + n);
        std::vector<double> y(n), dx(n), ry(n), rdx(n);
        K::relu_forward(n, x.data(), y.data());
        K::relu_backward(n, x.data(), dy.data(), dx.data());
        for (index_t i = 0; i < n; ++i) {
            ry[i] = x[i] > 0 ? x[i] : 0;
            rdx[i] = x[i] > 0 ? dy[i] : 0;
        }
        check_close("relu", y, ry, 0, 0);
        check_close("relu backward", dx, rdx, 0, 0);
        K::activation_forward<mnemo::gelu>(n, x.data(), y.data());
        K::activation_backward<mnemo::gelu>(n, x.data(), dy.data(), dx.data());
        for (index_t i = 0; i < n; ++i) {
            const double c = 0.5 * std::erfc(-x[i] * 0.70710678118654752440);  // the kernel's argument
            ry[i] = x[i] * c;
            rdx[i] = dy[i] * (c + x[i] * std::exp(-0.5 * x[i] * x[i]) / std::sqrt(2 * M_PI));
        }
        // Both sides use libm's erfc in double (simd::erfc); what is left is the order of the products
        // and the exp. xsimd's double erfc, used before, needed 1e-11 relative here.
        check_close("gelu", y, ry, 4e-16, 4e-16);
        check_close("gelu backward", dx, rdx, 1e-15, 1e-15);
        // float path
        std::vector<float> xf(x.begin(), x.end()), yf(n);
        K::gelu_forward(n, xf.data(), yf.data());
        std::vector<double> ryf(n);
        for (index_t i = 0; i < n; ++i) ryf[i] = 0.5 * double(xf[i]) * std::erfc(-double(xf[i]) / std::sqrt(2.0));
        check_close("gelu float", yf, ryf, 1e-6, 1e-6);
    }
}

TEST_CASE("cross_entropy: fused and split forms match a naive log-softmax, with ignored rows") {
    for (index_t vocab : {1, 5, 16, 65, 257}) {
        const index_t rows = 13;
        auto x = random_vector<double>(rows * vocab, 600 + vocab, -6, 6);
        auto t = random_tokens(rows, vocab, std::uint64_t(vocab));
        t[3] = -100;  // ignored
        std::vector<double> losses(rows), lse(rows), dx(x.size()), losses2(rows), dx2(x.size());
        K::cross_entropy_forward(rows, vocab, x.data(), vocab, t.data(), losses.data(), lse.data());
        K::cross_entropy_backward(rows, vocab, x.data(), vocab, t.data(), lse.data(), (const double*)nullptr, 0.25,
                                  dx.data(), vocab);
        K::cross_entropy_fused(rows, vocab, x.data(), vocab, t.data(), losses2.data(), 0.25, dx2.data(), vocab);
        std::vector<double> rl(rows), rdx(x.size());
        for (index_t i = 0; i < rows; ++i) {
            double mx = -1e300, s = 0;
            for (index_t j = 0; j < vocab; ++j) mx = std::max(mx, x[i * vocab + j]);
            for (index_t j = 0; j < vocab; ++j) s += std::exp(x[i * vocab + j] - mx);
            const double l = mx + std::log(s);
            rl[i] = t[i] < 0 ? 0 : l - x[i * vocab + t[i]];
            for (index_t j = 0; j < vocab; ++j)
                rdx[i * vocab + j] = t[i] < 0 ? 0 : 0.25 * (std::exp(x[i * vocab + j] - l) - (j == t[i] ? 1 : 0));
        }
        INFO("vocab=" << vocab);
        check_close("ce losses", losses, rl, 1e-12, 1e-12);
        check_close("ce dlogits", dx, rdx, 1e-14, 1e-12);
        check_close("ce fused losses", losses2, rl, 1e-12, 1e-12);
        check_close("ce fused dlogits", dx2, rdx, 1e-14, 1e-12);
    }
}

TEST_CASE("dropout: seeded mask is reproducible, scaled, and backward reuses it") {
    const index_t n = 100003;
    auto x = random_vector<float>(n, 9, 0.5, 1.5);
    std::vector<float> y(n), y2(n), dx(n);
    const float p = 0.3f;
    K::dropout_forward(n, x.data(), y.data(), p, 1234, 77);
    K::dropout_forward(n, x.data(), y2.data(), p, 1234, 77);
    CHECK(y == y2);
    index_t kept = 0;
    for (index_t i = 0; i < n; ++i) {
        const bool keep = mnemo::random_uniform(1234, 77 + static_cast<std::uint64_t>(i)) >= p;
        REQUIRE(y[i] == (keep ? x[i] * (1.0f / (1.0f - p)) : 0.0f));
        kept += keep;
    }
    CHECK(std::abs(double(kept) / n - (1 - p)) < 0.01);  // ~6 sigma for n = 1e5
    K::dropout_backward(n, x.data(), dx.data(), p, 1234, 77);
    CHECK(dx == y);
    K::dropout_forward(n, x.data(), y2.data(), p, 1235, 77);  // another seed, another mask
    CHECK(y != y2);
    K::dropout_forward(n, x.data(), y2.data(), 0.0f, 1, 0);
    CHECK(y2 == x);
}

TEST_CASE("elementwise: bias add and column sums") {
    const index_t rows = 11, n = 37, ld = 40;
    auto c = random_vector<double>(rows * ld, 1);
    auto b = random_vector<double>(n, 2);
    auto ref = c;
    K::add_bias_rows(rows, n, b.data(), c.data(), ld);
    for (index_t i = 0; i < rows; ++i)
        for (index_t j = 0; j < n; ++j) ref[i * ld + j] += b[j];
    check_close("add_bias_rows", c, ref, 0, 0);
    std::vector<double> db(n, 1.0), rdb(n, 1.0);
    K::sum_rows_accumulate(rows, n, c.data(), ld, db.data());
    for (index_t i = 0; i < rows; ++i)
        for (index_t j = 0; j < n; ++j) rdb[j] += c[i * ld + j];
    check_close("sum_rows_accumulate", db, rdb, 1e-14, 1e-14);
    // add with b's stride 0: b's one row added to every row (an attention's q + u), out of place and
    // in place, bitwise add_bias_rows's sums; large enough to be split over the threads.
    for (index_t r : {rows, index_t(1200)}) {
        auto x = random_vector<float>(r * ld, 3);
        auto u = random_vector<float>(n, 4);
        std::vector<float> want = x, out(std::size_t(r * ld), -7.0f), in_place = x;
        K::add_bias_rows(r, n, u.data(), want.data(), ld);
        K::add(r, n, x.data(), ld, u.data(), 0, out.data(), ld);
        K::add(r, n, in_place.data(), ld, u.data(), 0, in_place.data(), ld);
        for (index_t i = 0; i < r; ++i)
            for (index_t j = 0; j < ld; ++j) {
                const std::size_t e = std::size_t(i * ld + j);
                if (j < n) {
                    REQUIRE(out[e] == want[e]);
                    REQUIRE(in_place[e] == want[e]);
                } else {
                    REQUIRE(out[e] == -7.0f);  // past n: untouched
                }
            }
    }
}

TEST_CASE("elementwise: copy_block copies every element, streamed or not, from any alignment") {
    const auto x = random_vector<float>(300, 5);
    for (bool stream : {false, true})
        for (index_t offset : {0, 1, 7, 15, 16})
            for (index_t n : {0, 1, 15, 16, 17, 40, 255}) {
                INFO("stream=" << stream << " offset=" << offset << " n=" << n);
                std::vector<float> y(300, -1.0f);
                K::copy_block(n, x.data() + 3, y.data() + offset, stream);
                K::copy_fence();
                for (index_t i = 0; i < index_t(y.size()); ++i)
                    CHECK(y[std::size_t(i)] == (i >= offset && i < offset + n ? x[std::size_t(i - offset + 3)] : -1.0f));
            }
}

TEST_CASE("scale_by_count: x times numerator / (count · per_count), zero for a count of 0") {
    const std::vector<float> x0 = random_vector<float>(37, 3);
    std::vector<float> x = x0;
    const double count = 3;
    K::scale_by_count(index_t(x.size()), x.data(), &count, 4, 2.0f);
    const float s = 2.0f / 12.0f;
    for (std::size_t i = 0; i < x.size(); ++i) CHECK(x[i] == x0[i] * s);
    const double none = 0;
    K::scale_by_count(index_t(x.size()), x.data(), &none, 4, 2.0f);
    for (float v : x) CHECK(v == 0.0f);
}

TEST_CASE("CPU memory: blocks from one huge page on start on a 2 MiB boundary, smaller ones on 64 bytes; a buffer "
          "growing past the threshold keeps its contents") {
    using memory = mnemo::device_memory<mnemo::cpu>;
    const std::size_t huge = mnemo::huge_page_bytes;
    for (std::size_t bytes : {std::size_t(4), std::size_t(1000), huge - 64, huge, huge + 4096, 3 * huge + 12}) {
        CAPTURE(bytes);
        void* p = memory::allocate(bytes);
        const auto at = reinterpret_cast<std::uintptr_t>(p);
        CHECK(at % mnemo::buffer_alignment == 0);
        if (bytes >= mnemo::huge_page_min_bytes) CHECK(at % huge == 0);
        std::memset(p, 0x5a, bytes);  // every byte is ours (ASan checks the block and the matching free)
        memory::deallocate(p, bytes);
    }
    mnemo::buffer<float> b;
    const index_t small = index_t(huge / sizeof(float) / 2), large = index_t(3 * huge / sizeof(float));
    float* p = b.ensure(small);
    for (index_t i = 0; i < small; ++i) p[i] = float(i % 977);
    p = b.ensure(large);
    CHECK(reinterpret_cast<std::uintptr_t>(p) % huge == 0);
    bool kept = true;
    for (index_t i = 0; i < small; ++i) kept = kept && p[i] == float(i % 977);
    CHECK(kept);
}

TEST_CASE("CPU memory: copy gives memmove's bytes for overlapping and apart ranges, moved down or up, on 1-3 "
          "threads") {
    using memory = mnemo::device_memory<mnemo::cpu>;
    const std::size_t big = 3 * memory::copy_parallel_min_bytes + 12;  // split over the threads
    const int saved = omp_get_max_threads();
    // Gaps: a few rows (every part sets bytes aside), more than a part (one thread), apart (memcpy).
    for (std::size_t bytes : {std::size_t(1000), memory::copy_parallel_min_bytes, big}) {
        for (std::size_t gap : {std::size_t(4), std::size_t(12 * 1024) + 4, bytes / 2 + 4, bytes + 64}) {
            for (bool up : {false, true}) {
                for (int threads : {1, 2, 3}) {
                    CAPTURE(bytes);
                    CAPTURE(gap);
                    CAPTURE(up);
                    CAPTURE(threads);
                    std::vector<unsigned char> got(bytes + gap), want;
                    for (std::size_t i = 0; i < got.size(); ++i)
                        got[i] = static_cast<unsigned char>((i * 7919 + i / 251) % 253);
                    want = got;
                    const std::size_t from = up ? 0 : gap, to = up ? gap : 0;
                    std::memmove(want.data() + to, want.data() + from, bytes);
                    omp_set_num_threads(threads);
                    memory::copy(got.data() + to, got.data() + from, bytes);
                    omp_set_num_threads(saved);
                    CHECK(got == want);
                }
            }
        }
    }
}

TEST_CASE("plain attention: with no probabilities buffer, the context is bitwise the saved run's, on 1-3 threads, "
          "masked keys too, and matches a double-precision attention") {
    // plain_attention_forward with a null `a` (ops<cpu>::plain_attention_scratch) keeps each head's
    // probabilities in its thread's block instead of [B, H, Q, n].
    constexpr mnemo::static_extents dyn{};
    const index_t B = 3, H = 2, dk = 8, d = H * dk, Q = 5, n = 7, ld = B * d;
    const float scale = 1.0f / std::sqrt(float(dk));
    const auto q = random_vector<float>(Q * ld, 21), k = random_vector<float>(n * ld, 22),
               v = random_vector<float>(n * ld, 23);
    // Batch element 1 masks keys 0, 3 and 6; the others mask none.
    std::vector<std::uint8_t> keep(std::size_t(B * n), 1), any{0, 1, 0};
    for (index_t j : {0, 3, 6}) keep[std::size_t(n + j)] = 0;
    const int saved = omp_get_max_threads();
    for (bool masked : {false, true}) {
        CAPTURE(masked);
        const std::uint8_t* kp = masked ? keep.data() : nullptr;
        const std::uint8_t* ap = masked ? any.data() : nullptr;
        std::vector<float> a(std::size_t(B * H * Q * n)), saved_out(std::size_t(Q * ld));
        omp_set_num_threads(1);
        K::plain_attention_forward<dyn>(B, H, d, dk, Q, n, scale, q.data(), k.data(), v.data(), a.data(),
                                        saved_out.data(), kp, ap);
        for (int threads = 1; threads <= 3; ++threads) {
            CAPTURE(threads);
            omp_set_num_threads(threads);
            std::vector<float> out(std::size_t(Q * ld), -1.0f);
            float* no_probabilities = nullptr;
            K::plain_attention_forward<dyn>(B, H, d, dk, Q, n, scale, q.data(), k.data(), v.data(), no_probabilities,
                                            out.data(), kp, ap);
            CHECK(out == saved_out);
        }
        omp_set_num_threads(saved);
        // Against a double-precision attention, probabilities and context.
        double worst_a = 0, worst_out = 0;
        for (index_t b = 0; b < B; ++b)
            for (index_t h = 0; h < H; ++h)
                for (index_t i = 0; i < Q; ++i) {
                    std::vector<double> p(static_cast<std::size_t>(n));
                    double mx = -1e300, sum = 0;
                    for (index_t j = 0; j < n; ++j) {
                        if (masked && !keep[std::size_t(b * n + j)]) continue;
                        double s = 0;
                        for (index_t t = 0; t < dk; ++t)
                            s += double(q[std::size_t(i * ld + b * d + h * dk + t)]) *
                                 double(k[std::size_t(j * ld + b * d + h * dk + t)]);
                        p[std::size_t(j)] = s * scale;
                        mx = std::max(mx, p[std::size_t(j)]);
                    }
                    for (index_t j = 0; j < n; ++j) {
                        const bool hidden = masked && !keep[std::size_t(b * n + j)];
                        p[std::size_t(j)] = hidden ? 0.0 : std::exp(p[std::size_t(j)] - mx);
                        sum += p[std::size_t(j)];
                    }
                    for (index_t j = 0; j < n; ++j) {
                        p[std::size_t(j)] /= sum;
                        const float got = a[std::size_t(((b * H + h) * Q + i) * n + j)];
                        worst_a = std::max(worst_a, std::abs(double(got) - p[std::size_t(j)]));
                    }
                    for (index_t t = 0; t < dk; ++t) {
                        double o = 0;
                        for (index_t j = 0; j < n; ++j)
                            o += p[std::size_t(j)] * double(v[std::size_t(j * ld + b * d + h * dk + t)]);
                        worst_out = std::max(worst_out,
                                             std::abs(o - double(saved_out[std::size_t(i * ld + b * d + h * dk + t)])));
                    }
                }
        CHECK(worst_a < 1e-6);
        CHECK(worst_out < 1e-5);
    }
}
