// The per-head kernels (kernels/cpu/head_products.hpp) against a double-precision reference, through
// the dispatchers the attention calls (head_gemm_nt / _nn / _tn): shapes on both sides of every
// dispatch limit (16 keys for nt, 64 rows for nn and tn, tiles_max_work multiply-adds for all
// three), odd row counts (every register tile's remainders), depths past one stack block of Y (nn,
// tn) and key counts past one block of Yᵀ (nt), d_k of one, two, four and eight SIMD vectors and one that is not a whole number of
// them (the general GEMM then), strided operands with padding that must stay untouched, beta 0 over
// NaN and beta 1, float and double. And the runtime-width overloads (a runtime-shape model's) against
// the compile-time ones, bitwise.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include <mnemo/kernels/cpu/ops.hpp>

#include "testing.hpp"

using mnemo::index_t;
using K = mnemo::ops<mnemo::cpu>;

namespace {

enum class form { nt, nn, tn };

// nt: S[m,n] = X[m,Dk]·Y[n,Dk]ᵀ; nn: O[m,Dk] = A[m,n]·Y[n,Dk]; tn: O[n,Dk] = A[m,n]ᵀ·X[m,Dk].
template <class T, index_t Dk>
void check(form f, index_t m, index_t n, T beta, std::uint64_t seed) {
    const index_t pad = 5;
    const index_t a_rows = f == form::nt ? m : m, a_cols = f == form::nt ? Dk : n;  // left operand
    const index_t b_rows = f == form::nt ? n : (f == form::nn ? n : m), b_cols = Dk;  // right operand
    const index_t c_rows = f == form::nt ? m : (f == form::nn ? m : n), c_cols = f == form::nt ? n : Dk;
    const index_t lda = a_cols + pad, ldb = b_cols + 2 * pad, ldc = c_cols + pad;
    const auto a = mnemo::testing::random_vector<T>(a_rows * lda, seed);
    const auto b = mnemo::testing::random_vector<T>(b_rows * ldb, seed + 1);
    auto c = mnemo::testing::random_vector<T>(c_rows * ldc, seed + 2);
    const T sentinel = T(12345);
    for (index_t i = 0; i < c_rows; ++i) {
        for (index_t j = c_cols; j < ldc; ++j) c[i * ldc + j] = sentinel;
        if (beta == T(0))
            for (index_t j = 0; j < c_cols; ++j) c[i * ldc + j] = std::numeric_limits<T>::quiet_NaN();
    }
    const auto c0 = c;
    if (f == form::nt) {
        REQUIRE(beta == T(0));
        K::head_gemm_nt<Dk>(m, n, a.data(), lda, b.data(), ldb, c.data(), ldc);
    } else if (f == form::nn) {
        K::head_gemm_nn<Dk>(m, n, a.data(), lda, b.data(), ldb, c.data(), ldc, beta);
    } else {
        K::head_gemm_tn<Dk>(m, n, a.data(), lda, b.data(), ldb, c.data(), ldc, beta);
    }
    double worst = 0;
    bool padding_kept = true;
    for (index_t i = 0; i < c_rows; ++i) {
        for (index_t j = 0; j < c_cols; ++j) {
            double ref = beta == T(0) ? 0.0 : double(beta) * double(c0[i * ldc + j]), scale = std::fabs(ref);
            const index_t depth = f == form::nt ? Dk : (f == form::nn ? n : m);
            for (index_t p = 0; p < depth; ++p) {
                double x = 0;
                if (f == form::nt) x = double(a[i * lda + p]) * double(b[j * ldb + p]);
                else if (f == form::nn) x = double(a[i * lda + p]) * double(b[p * ldb + j]);
                else x = double(a[p * lda + i]) * double(b[p * ldb + j]);
                ref += x;
                scale += std::fabs(x);
            }
            const double err = std::fabs(double(c[i * ldc + j]) - ref) / (scale + 1e-30);
            worst = std::isnan(err) ? 1e30 : std::max(worst, err);
        }
        for (index_t j = c_cols; j < ldc; ++j) padding_kept = padding_kept && c[i * ldc + j] == sentinel;
    }
    INFO("form " << int(f) << " d_k " << Dk << " m " << m << " n " << n << " beta " << double(beta));
    CHECK(worst < (sizeof(T) == 4 ? 1e-6 : 1e-14));
    CHECK(padding_kept);
}

template <class T, index_t Dk>
void sweep(std::uint64_t& seed) {
    for (index_t m : {1, 2, 3, 7, 8, 16, 33, 64, 65, 130, 256, 301})
        for (index_t n : {1, 3, 4, 5, 8, 15, 16, 17, 63, 64, 65, 150, 385}) {
            check<T, Dk>(form::nt, m, n, T(0), seed++);
            for (T beta : {T(0), T(1)}) {
                check<T, Dk>(form::nn, m, n, beta, seed++);
                check<T, Dk>(form::tn, m, n, beta, seed++);
            }
        }
}

}  // namespace

TEST_CASE("head products: the routes the sweep below exercises") {
    using H = mnemo::cpu_kernels::head_products;
    CHECK(H::nt_route(8, 8, 32) == H::route::reduce);
    CHECK(H::nt_route(128, 384, 32) == H::route::tiles);  // configuration B's scores per (batch, head)
    CHECK(H::nt_route(8, 144, 32) == H::route::general);  // A's: too few rows to repay Yᵀ's copy
    CHECK(H::nt_route(1024, 512, 32) == H::route::general);
    CHECK(H::rows_route(128, 384, 32, true, 0.0f));
    CHECK(H::rows_route(384, 128, 32, false, 1.0f));
    CHECK(H::rows_route(8, 144, 32, false, 0.0f));
    CHECK_FALSE(H::rows_route(1024, 512, 32, true, 0.0f));
    CHECK_FALSE(H::rows_route(8, 8, 32, true, 0.5f));
#ifdef MNEMO_PACKED_GEMM
    CHECK(H::tiles_max_work == mnemo::cpu_kernels::gemm::packed_min_work);  // the tiles end where packing begins
#endif
}

TEST_CASE("head products: nt, nn and tn against a double reference across the dispatch limits") {
    std::uint64_t seed = 1;
    sweep<float, 16>(seed);
    sweep<float, 32>(seed);
    sweep<float, 64>(seed);
    sweep<float, 128>(seed);
    sweep<float, 24>(seed);  // not a whole number of AVX-512 vectors: the general GEMM
    sweep<double, 32>(seed);
}

namespace {

// heads_dot_rows, heads_weighted_rows, heads_row_dots and heads_rescale_add (one query row, every head
// in one pass over the rows) against a double reference: rows [r0, r1) that start and end off the SIMD width, a run of heads [h0, h1),
// d_k shorter than a SIMD vector, a whole number of them, and one with a scalar tail; rows strided
// wider than the heads, outputs outside the range left untouched.
// |got − Σ_{i<n} term(i)| relative to Σ |term(i)|, the sum in double.
template <class T, class Term>
double relative_error(T got, index_t n, Term&& term) {
    double ref = 0, scale = 0;
    for (index_t i = 0; i < n; ++i) {
        const double p = term(i);
        ref += p;
        scale += std::fabs(p);
    }
    return std::fabs(double(got) - ref) / (scale + 1e-30);
}

template <class T, index_t Dk>
void check_heads(std::uint64_t seed, index_t heads = 3) {
    const index_t ldy = heads * Dk + 7, rows = 45;
    const auto x = mnemo::testing::random_vector<T>(heads * Dk, seed);
    const auto y = mnemo::testing::random_vector<T>(rows * ldy, seed + 1);
    const T sentinel = T(-777);
    const double tol = sizeof(T) == 4 ? 1e-6 : 1e-14;
    for (const auto& range : {std::pair<index_t, index_t>{0, rows}, {0, 1}, {5, 6}, {3, 40}, {16, 45}, {8, 24}}) {
        const index_t r0 = range.first, r1 = range.second;  // not structured bindings: lambdas below (clang 14)
        const index_t lds = rows + 2;
        std::vector<T> s(std::size_t(heads * lds), sentinel);
        K::heads_dot_rows<Dk>(heads, r0, r1, x.data(), y.data(), ldy, s.data(), lds);
        double worst = 0;
        bool untouched = true;
        for (index_t h = 0; h < heads; ++h)
            for (index_t r = 0; r < lds; ++r) {
                const T got = s[std::size_t(h * lds + r)];
                if (r < r0 || r >= r1) {
                    untouched = untouched && got == sentinel;
                    continue;
                }
                worst = std::max(worst, relative_error(got, Dk, [&](index_t d) {
                    return double(x[std::size_t(h * Dk + d)]) * double(y[std::size_t(r * ldy + h * Dk + d)]);
                }));
            }
        // Each row alone: heads counts that divide the SIMD width (or that it divides) take whole
        // groups of rows where a range holds them and pair by pair otherwise, with the same bits.
        std::vector<T> one(s.size(), sentinel);
        for (index_t r = r0; r < r1; ++r) K::heads_dot_rows<Dk>(heads, r, r + 1, x.data(), y.data(), ldy, one.data(), lds);
        INFO("dot rows: d_k " << Dk << " heads " << heads << " rows [" << r0 << ", " << r1 << ")");
        CHECK(worst < tol);
        CHECK(untouched);
        CHECK(std::memcmp(one.data(), s.data(), sizeof(T) * s.size()) == 0);
    }
    // heads_row_dots: every head's x·k + y·r over one key row and one more row (or x·k alone), written
    // in whole SIMD vectors (the lanes past the heads are the caller's scratch), heads counts on the
    // compile-time groups (those that divide the SIMD width or that it divides) and the others.
    for (const bool with_r : {true, false}) {
        constexpr index_t W = mnemo::simd::width<T>;
        const index_t kr = 7, rr = 30, room = (heads + W - 1) / W * W;
        const auto x2 = mnemo::testing::random_vector<T>(heads * Dk, seed + 3);
        std::vector<T> got(std::size_t(room + 1), sentinel);
        K::heads_row_dots<Dk>(heads, x.data(), y.data() + kr * ldy, x2.data(), with_r ? y.data() + rr * ldy : nullptr,
                              got.data());
        double worst = 0;
        for (index_t h = 0; h < heads; ++h)
            worst = std::max(worst, relative_error(got[std::size_t(h)], 2 * Dk, [&](index_t d) {
                if (d < Dk) return double(x[std::size_t(h * Dk + d)]) * double(y[std::size_t(kr * ldy + h * Dk + d)]);
                d -= Dk;
                return with_r ? double(x2[std::size_t(h * Dk + d)]) * double(y[std::size_t(rr * ldy + h * Dk + d)]) : 0.0;
            }));
        INFO("row dots: d_k " << Dk << " heads " << heads << (with_r ? std::string(" with") : std::string(" without"))
                              << " a second row");
        CHECK(worst < tol);
        CHECK(got[std::size_t(room)] == sentinel);
    }
    // heads_rescale_add: o·c + e·v by head, heads with c = 1 (not multiplied) among the others.
    {
        const index_t vr = 11;
        auto o = mnemo::testing::random_vector<T>(heads * Dk + 1, seed + 4);
        o.back() = sentinel;
        const auto o0 = o;
        std::vector<T> c(static_cast<std::size_t>(heads)), e(c.size());
        for (index_t h = 0; h < heads; ++h) {
            c[std::size_t(h)] = h % 2 ? T(1) : T(0.25) + T(0.125) * T(h);
            e[std::size_t(h)] = T(0.5) + T(0.0625) * T(h);
        }
        K::heads_rescale_add<Dk>(heads, c.data(), e.data(), y.data() + vr * ldy, o.data());
        double worst = 0;
        for (index_t h = 0; h < heads; ++h)
            for (index_t d = 0; d < Dk; ++d) {
                const std::size_t i = std::size_t(h * Dk + d);
                const double ref = double(o0[i]) * double(c[std::size_t(h)]) + double(e[std::size_t(h)]) * double(y[std::size_t(vr * ldy) + i]);
                worst = std::max(worst, std::fabs(double(o[i]) - ref) / (std::fabs(ref) + 1.0));
            }
        INFO("rescale add: d_k " << Dk << " heads " << heads);
        CHECK(worst < tol);
        CHECK(o.back() == sentinel);
    }
    const index_t lda = rows + 3;
    const auto a = mnemo::testing::random_vector<T>(heads * lda, seed + 2);
    for (index_t n : {1, 3, 4, 5, 8, 45})
        for (const auto& hr : {std::pair<index_t, index_t>{0, heads}, {1, 2}, {1, 3}}) {
            const index_t h0 = hr.first, h1 = hr.second;
            if (h1 > heads) continue;
            std::vector<T> o(std::size_t(heads * Dk), sentinel);
            K::heads_weighted_rows<Dk>(h0, h1, n, a.data(), lda, y.data(), ldy, o.data());
            double worst = 0;
            bool untouched = true;
            for (index_t h = 0; h < heads; ++h)
                for (index_t d = 0; d < Dk; ++d) {
                    const T got = o[std::size_t(h * Dk + d)];
                    if (h < h0 || h >= h1) {
                        untouched = untouched && got == sentinel;
                        continue;
                    }
                    worst = std::max(worst, relative_error(got, n, [&](index_t r) {
                        return double(a[std::size_t(h * lda + r)]) * double(y[std::size_t(r * ldy + h * Dk + d)]);
                    }));
                }
            INFO("weighted rows: d_k " << Dk << " rows " << n << " heads [" << h0 << ", " << h1 << ")");
            CHECK(worst < tol);
            CHECK(untouched);
        }
}

}  // namespace

TEST_CASE("heads_dot_rows, heads_weighted_rows, heads_row_dots and heads_rescale_add against a double reference") {
    std::uint64_t seed = 900;
    check_heads<float, 4>(seed += 10);
    check_heads<float, 8>(seed += 10);
    check_heads<float, 16>(seed += 10);
    check_heads<float, 32>(seed += 10);
    check_heads<float, 36>(seed += 10);
    check_heads<double, 2>(seed += 10);
    check_heads<double, 4>(seed += 10);
    check_heads<double, 12>(seed += 10);
    check_heads<double, 32>(seed += 10);
    for (index_t heads : {1, 2, 4, 5, 8, 16, 32}) {
        check_heads<float, 16>(seed += 10, heads);
        check_heads<float, 36>(seed += 10, heads);
        check_heads<double, 12>(seed += 10, heads);
    }
}

namespace {

template <class T>
bool bitwise_equal(const std::vector<T>& a, const std::vector<T>& b) {
    return a.size() == b.size() && std::memcmp(a.data(), b.data(), sizeof(T) * a.size()) == 0;
}

// The runtime-width overloads (d_k as the first argument: a runtime-shape model's) against the
// compile-time ones: the same dispatch and the same sums, so bitwise the same results. Except in one
// place: heads_dot_rows' scalar tail (d_k not a whole number of SIMD vectors), a plain loop
// t += x·y whose trip count is a constant in the compile-time kernel, which g++ (-ffp-contract=fast)
// may then compute as a vector of products added in order, where the runtime loop fuses each step
// into one FMA: there the two agree to float rounding (tests/test_dynamic_shape.cpp checks the models
// bitwise in a build without contraction).
template <class T, index_t Dk>
void check_runtime_width(std::uint64_t seed) {
    const index_t ld = 3 * Dk + 5;
    for (index_t m : {1, 2, 3, 8, 16, 17, 64, 65, 150})
        for (index_t n : {1, 4, 7, 8, 9, 16, 17, 64, 65, 150, 300}) {
            INFO("d_k " << Dk << " m " << m << " n " << n);
            const auto x = mnemo::testing::random_vector<T>(std::max(m, n) * ld, seed++);
            const auto y = mnemo::testing::random_vector<T>(std::max(m, n) * ld, seed++);
            const auto a = mnemo::testing::random_vector<T>(m * (n + 3), seed++);
            std::vector<T> s1(std::size_t(m * n)), s2(s1.size());
            K::head_gemm_nt<Dk>(m, n, x.data(), ld, y.data(), ld, s1.data(), n);
            K::head_gemm_nt(Dk, m, n, x.data(), ld, y.data(), ld, s2.data(), n);
            CHECK(bitwise_equal(s1, s2));
            for (T beta : {T(0), T(1)}) {
                auto o1 = mnemo::testing::random_vector<T>(std::max(m, n) * ld, seed++), o2 = o1;
                K::head_gemm_nn<Dk>(m, n, a.data(), n + 3, y.data(), ld, o1.data(), ld, beta);
                K::head_gemm_nn(Dk, m, n, a.data(), n + 3, y.data(), ld, o2.data(), ld, beta);
                CHECK(bitwise_equal(o1, o2));
                K::head_gemm_tn<Dk>(m, n, a.data(), n + 3, x.data(), ld, o1.data(), ld, beta);
                K::head_gemm_tn(Dk, m, n, a.data(), n + 3, x.data(), ld, o2.data(), ld, beta);
                CHECK(bitwise_equal(o1, o2));
            }
        }
    const index_t heads = 3, rows = 45, lds = rows + 2, lda = rows + 3;
    const auto x = mnemo::testing::random_vector<T>(heads * Dk, seed++);
    const auto y = mnemo::testing::random_vector<T>(rows * ld, seed++);
    const auto a = mnemo::testing::random_vector<T>(heads * lda, seed++);
    std::vector<T> s1(std::size_t(heads * lds)), s2(s1.size());
    K::heads_dot_rows<Dk>(heads, 3, 40, x.data(), y.data(), ld, s1.data(), lds);
    K::heads_dot_rows(Dk, heads, 3, 40, x.data(), y.data(), ld, s2.data(), lds);
    INFO("d_k " << Dk << ": heads_dot_rows, heads_weighted_rows");
    if (Dk % mnemo::simd::width<T> == 0) {
        CHECK(bitwise_equal(s1, s2));
    } else {
        double worst = 0;
        for (std::size_t i = 0; i < s1.size(); ++i)
            worst = std::max(worst, std::fabs(double(s1[i]) - double(s2[i])) / (std::fabs(double(s1[i])) + 1e-3));
        CHECK(worst < (sizeof(T) == 4 ? 1e-5 : 1e-13));
    }
    {
        // heads_row_dots: the compile-time groups (4 heads) and the general loop (3) against the
        // runtime width's general loop.
        for (index_t hh : {index_t(3), index_t(4)}) {
            const auto xr = mnemo::testing::random_vector<T>(hh * Dk, seed++);
            std::vector<T> r1(std::size_t(hh + 16)), r2(r1.size());
            K::heads_row_dots<Dk>(hh, xr.data(), y.data() + 9 * ld, xr.data(), y.data() + 20 * ld, r1.data());
            K::heads_row_dots(Dk, hh, xr.data(), y.data() + 9 * ld, xr.data(), y.data() + 20 * ld, r2.data());
            r1.resize(std::size_t(hh));
            r2.resize(std::size_t(hh));
            if (Dk % mnemo::simd::width<T> == 0) CHECK(bitwise_equal(r1, r2));
        }
        std::vector<T> c{T(1), T(0.5), T(0.75)}, e{T(0.25), T(1), T(0.125)}, p1(std::size_t(heads * Dk), T(2)), p2 = p1;
        K::heads_rescale_add<Dk>(heads, c.data(), e.data(), y.data() + 5 * ld, p1.data());
        K::heads_rescale_add(Dk, heads, c.data(), e.data(), y.data() + 5 * ld, p2.data());
        CHECK(bitwise_equal(p1, p2));
    }
    std::vector<T> o1(std::size_t(heads * Dk)), o2(o1.size());
    K::heads_weighted_rows<Dk>(0, heads, 45, a.data(), lda, y.data(), ld, o1.data());
    K::heads_weighted_rows(Dk, 0, heads, 45, a.data(), lda, y.data(), ld, o2.data());
    CHECK(bitwise_equal(o1, o2));
    // Rows [0, m) and then [m, 45) accumulated (the keys of a generated token read from two buffers):
    // the bits of one call, wherever the rows part.
    for (index_t m : {1, 3, 4, 17, 44}) {
        INFO("rows parted at " << m);
        std::vector<T> o3(o1.size(), T(7));
        K::heads_weighted_rows<Dk>(0, heads, m, a.data(), lda, y.data(), ld, o3.data());
        K::heads_weighted_rows<Dk>(0, heads, 45 - m, a.data() + m, lda, y.data() + m * ld, ld, o3.data(), true);
        CHECK(bitwise_equal(o1, o3));
    }
}

}  // namespace

TEST_CASE("head products with a runtime d_k: bitwise the compile-time ones") {
    std::uint64_t seed = 5000;
    check_runtime_width<float, 4>(seed += 1000);
    check_runtime_width<float, 8>(seed += 1000);
    check_runtime_width<float, 12>(seed += 1000);
    check_runtime_width<float, 16>(seed += 1000);
    check_runtime_width<float, 32>(seed += 1000);
    check_runtime_width<float, 36>(seed += 1000);
    check_runtime_width<float, 64>(seed += 1000);
    check_runtime_width<float, 128>(seed += 1000);
    check_runtime_width<double, 2>(seed += 1000);
    check_runtime_width<double, 12>(seed += 1000);
    check_runtime_width<double, 32>(seed += 1000);
}

namespace {

// A causal band (causal_keys{offset}: query row i sees keys j ≤ offset + i) on the dispatchers, against
// the same products without it: nt's scores inside the band bitwise (the rest may stay unwritten);
// nn (A·Y) and tn (Aᵀ·X) over weights that are zero past the band, as a masked softmax and its
// backward leave them, bitwise whole, from 0 and accumulated onto O. Both the compile-time and the
// runtime-width dispatchers.
template <class T, index_t Dk>
void check_band(index_t m, index_t n, index_t offset, std::uint64_t seed) {
    using H = mnemo::cpu_kernels::head_products;
    const H::causal_keys band{offset};
    const index_t ld = Dk + 3, lda = n + 2;
    const auto x = mnemo::testing::random_vector<T>(m * ld, seed);
    const auto y = mnemo::testing::random_vector<T>(n * ld, seed + 1);
    auto a = mnemo::testing::random_vector<T>(m * lda, seed + 2);
    for (index_t i = 0; i < m; ++i)
        for (index_t j = std::min(n, offset + i + 1); j < n; ++j) a[i * lda + j] = T(0);
    INFO("d_k " << Dk << " m " << m << " n " << n << " offset " << offset);
    const T nan = std::numeric_limits<T>::quiet_NaN();
    for (bool runtime : {false, true}) {
        INFO("runtime d_k " << runtime);
        std::vector<T> full(m * lda, nan), banded(m * lda, nan);
        if (runtime) {
            K::head_gemm_nt(Dk, m, n, x.data(), ld, y.data(), ld, full.data(), lda);
            K::head_gemm_nt(Dk, m, n, x.data(), ld, y.data(), ld, banded.data(), lda, band);
        } else {
            K::head_gemm_nt<Dk>(m, n, x.data(), ld, y.data(), ld, full.data(), lda);
            K::head_gemm_nt<Dk>(m, n, x.data(), ld, y.data(), ld, banded.data(), lda, band);
        }
        bool same = true;
        for (index_t i = 0; i < m; ++i)
            for (index_t j = 0; j < std::min(n, offset + i + 1); ++j)
                same = same && std::memcmp(&full[i * lda + j], &banded[i * lda + j], sizeof(T)) == 0;
        CHECK(same);
        for (T beta : {T(0), T(1)}) {
            INFO("beta " << double(beta));
            const auto start_nn = mnemo::testing::random_vector<T>(m * ld, seed + 3);
            const auto start_tn = mnemo::testing::random_vector<T>(n * ld, seed + 4);
            auto nn_full = start_nn, nn_band = start_nn, tn_full = start_tn, tn_band = start_tn;
            if (runtime) {
                K::head_gemm_nn(Dk, m, n, a.data(), lda, y.data(), ld, nn_full.data(), ld, beta);
                K::head_gemm_nn(Dk, m, n, a.data(), lda, y.data(), ld, nn_band.data(), ld, beta, band);
                K::head_gemm_tn(Dk, m, n, a.data(), lda, x.data(), ld, tn_full.data(), ld, beta);
                K::head_gemm_tn(Dk, m, n, a.data(), lda, x.data(), ld, tn_band.data(), ld, beta, band);
            } else {
                K::head_gemm_nn<Dk>(m, n, a.data(), lda, y.data(), ld, nn_full.data(), ld, beta);
                K::head_gemm_nn<Dk>(m, n, a.data(), lda, y.data(), ld, nn_band.data(), ld, beta, band);
                K::head_gemm_tn<Dk>(m, n, a.data(), lda, x.data(), ld, tn_full.data(), ld, beta);
                K::head_gemm_tn<Dk>(m, n, a.data(), lda, x.data(), ld, tn_band.data(), ld, beta, band);
            }
            CHECK(bitwise_equal(nn_full, nn_band));
            CHECK(bitwise_equal(tn_full, tn_band));
        }
    }
}

template <class T, index_t Dk>
void band_sweep(std::uint64_t& seed) {
    // (queries, keys, offset): B's per-head shape (memory 256 of 384 keys), keys past several stack
    // blocks with no memory, odd counts off every tile, fewer keys than queries see, and the
    // general GEMM's side of the limits (its packed path skips the band by tiles: the last two, with
    // two K blocks over the keys (nn) and over the queries (tn), nt split by columns).
    const index_t shapes[][3] = {{128, 384, 256}, {16, 300, 0}, {37, 70, 33}, {45, 40, 3}, {20, 17, 0},
                                 {130, 200, 70}, {300, 800, 500}, {600, 900, 300}};
    for (const auto& s : shapes) check_band<T, Dk>(s[0], s[1], s[2], seed++);
}

}  // namespace

TEST_CASE("head products: a causal band skips only what it masks") {
    std::uint64_t seed = 9000;
    band_sweep<float, 32>(seed);
    band_sweep<float, 64>(seed);
    band_sweep<float, 8>(seed);
    band_sweep<double, 32>(seed);
}

TEST_CASE("head products: outputs written around the caches (stream_output) hold ordinary stores' bits") {
    // rows_product streams a large single-block O whose rows lie apart (configuration B's dK and dV,
    // 384 keys × 32, 16 KB apart). The same products into a misaligned O take ordinary stores; both
    // must hold the same bits, with the columns between the rows untouched.
    using H = mnemo::cpu_kernels::head_products;
    constexpr index_t Dk = 32, ldo = 4096;
    const float sentinel = -777.0f;
    struct shape {
        form f;
        index_t m, n;
    };
    for (const shape& sh : {shape{form::tn, 128, 384}, shape{form::nn, 300, 100}}) {
        const form f = sh.f;
        const index_t m = sh.m, n = sh.n;  // nn: O [m, Dk], depth n; tn: O [n, Dk], depth m
        const index_t rows = f == form::nn ? m : n;
        const auto a = mnemo::testing::random_vector<float>(m * n, 71);
        const auto y = mnemo::testing::random_vector<float>((f == form::nn ? n : m) * Dk, 72);
        std::vector<float> bufs[2];
        float* outs[2];
        for (int k = 0; k < 2; ++k) {
            bufs[k].assign(std::size_t(rows * ldo + 64), sentinel);
            const std::size_t skew = (64 - reinterpret_cast<std::uintptr_t>(bufs[k].data()) % 64) % 64 / sizeof(float);
            outs[k] = bufs[k].data() + skew + (k == 1 ? 1 : 0);  // k = 1: off the 64-byte lines
        }
        CAPTURE(int(f));
        CHECK(H::stream_output(rows, Dk, outs[0], ldo) == mnemo::simd::streams<float>);
        CHECK_FALSE(H::stream_output(rows, Dk, outs[1], ldo));
        for (int k = 0; k < 2; ++k) {
            if (f == form::nn) K::head_gemm_nn<Dk>(m, n, a.data(), n, y.data(), Dk, outs[k], ldo);
            else K::head_gemm_tn<Dk>(m, n, a.data(), n, y.data(), Dk, outs[k], ldo);
        }
        bool same = true, untouched = true;
        for (index_t r = 0; r < rows; ++r) {
            same = same && std::memcmp(outs[0] + r * ldo, outs[1] + r * ldo, sizeof(float) * Dk) == 0;
            for (index_t j = Dk; j < ldo && r + 1 < rows; ++j) untouched = untouched && outs[0][r * ldo + j] == sentinel;
        }
        CHECK(same);
        CHECK(untouched);
        // and right: one row against a double loop
        double worst = 0;
        for (index_t j = 0; j < Dk; ++j) {
            double ref = 0;
            const index_t r = rows / 2;
            for (index_t p = 0; p < (f == form::nn ? n : m); ++p)
                ref += f == form::nn ? double(a[std::size_t(r * n + p)]) * double(y[std::size_t(p * Dk + j)])
                                     : double(a[std::size_t(p * n + r)]) * double(y[std::size_t(p * Dk + j)]);
            worst = std::max(worst, std::fabs(ref - double(outs[0][r * ldo + j])));
        }
        CHECK(worst < 1e-4);
    }
}
