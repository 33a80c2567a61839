// The CUDA backend's dense kernels (src/cuda/gemm.cu, elementwise.cu, norm.cu) against the CPU kernels
// (ops<cpu>) on the same inputs, in the style of ggml's test-backend-ops: awkward shapes (1, odd
// sizes, sizes that are not multiples of 32, k = 0, empty ranges), row strides wider than the rows
// (the padding must come back untouched: every output buffer is compared whole), NaN in outputs that
// beta = 0 must overwrite, masked and fully masked rows, repeated ids, aliasing where the kernels allow it,
// and one shape past the 65535-block grid cap for each launch shape (the grid-stride loops).
// A last case runs the reductions twice and wants the same bits (no atomics, fixed orders).
//
// Tolerances (eps = the type's machine epsilon; "normalised" is cuda_testing::normalized_error, the
// largest difference over max(1, largest |value|)):
//   GEMM, per-head products, linear / key-value / frozen-norm backward, heads_dot_rows,
//     heads_weighted_rows: normalised 1e-5 (float), 1e-12 (double) — cuBLAS sums in its own order
//   copies, gathers, add, scale, bias rows, relu, dropout (the mask is the CPU's bit for bit),
//     scatter_add_rows (the same additions in the same row order): exact
//   scale_shift_rows, axpy: normalised 2 eps (x·g + b may or may not be one fused multiply-add)
//   weighted_sum_rows: normalised 32 eps (the same order; each step fused or not)
//   column sums (sum_rows_accumulate, layer norm dw/db, frozen rows' c): normalised 64 eps (fixed
//     but different order of the row sums)
//   softmax forward: max(32, 2·sqrt(cols)) ulp (exp's last bits, and the row sum in another order: one
//     factor for the row, whose error grows as sqrt(cols) — the CPU's masked path sums a row one term
//     at a time; emulated on the host, 1030 columns reach 28 ulp and 4000 reach 53);
//     backward normalised 64 eps (the row's dot product in another order)
//   gelu forward normalised 8 eps (erfc of CUDA against the host's, whose relative accuracy in the far
//     tail is not documented); gelu backward, GRU gates: normalised 16 eps
//   layer norm forward (y, mean, rstd, x̂) and dx, cross-entropy (loss, gradient): normalised 64 eps
//   sum_as_double: relative 1e-12 of Σ|x|
//   scale_by_count: bitwise (one product by a factor formed the same way)
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <span>
#include <type_traits>
#include <utility>
#include <vector>

#include "cuda_testing.hpp"

namespace {

using cuda_testing::device_vector;
using cuda_testing::random_values;
using mnemo::index_t;
using cpu_ops = mnemo::ops<mnemo::cpu>;
using gpu_ops = mnemo::ops<mnemo::cuda>;

/// A count as a container size (also keeps `std::vector<T> v(sz(n))` from parsing as a declaration).
std::size_t sz(index_t n) { return std::size_t(n); }

std::uint64_t next_seed() {
    static std::uint64_t s = 1234;
    return ++s;
}

template <class T>
std::vector<T> rnd(std::size_t n, double lo = -1.0, double hi = 1.0) {
    return random_values<T>(n, next_seed(), lo, hi);
}

template <class T>
constexpr double eps = double(std::numeric_limits<T>::epsilon());
template <class T>
constexpr double gemm_tol = std::is_same_v<T, float> ? 1e-5 : 1e-12;

template <class T>
double norm_err(const std::vector<T>& gpu, const std::vector<T>& cpu) {
    return cuda_testing::normalized_error<T>(gpu, cpu);
}
template <class T>
double ulp(const std::vector<T>& gpu, const std::vector<T>& cpu) {
    return cuda_testing::max_ulp<T>(gpu, cpu);
}
template <class T>
bool same(const std::vector<T>& gpu, const std::vector<T>& cpu) {
    if (gpu.size() != cpu.size()) return false;
    for (std::size_t i = 0; i < gpu.size(); ++i) {
        const bool both_nan = std::isnan(double(gpu[i])) && std::isnan(double(cpu[i]));
        if (!(gpu[i] == cpu[i]) && !both_nan) return false;
    }
    return true;
}

// ---- GEMM ------------------------------------------------------------------------------------------------------

enum class form { nn, nt, tn };

struct gemm_shape {
    index_t m, n, k;
};
const gemm_shape gemm_shapes[] = {{1, 1, 1},  {7, 13, 5},  {33, 17, 64}, {64, 1, 31}, {1, 50, 9},
                                  {5, 3, 0},  {0, 4, 3},   {4, 0, 3},    {40, 70, 33}, {2, 129, 3}};

template <class T>
void cpu_gemm(form f, index_t m, index_t n, index_t k, const T* a, index_t lda, const T* b, index_t ldb, T* c,
              index_t ldc, T beta, T alpha) {
    if (f == form::nn) cpu_ops::gemm_nn(m, n, k, a, lda, b, ldb, c, ldc, beta, alpha);
    else if (f == form::nt) cpu_ops::gemm_nt(m, n, k, a, lda, b, ldb, c, ldc, beta, alpha);
    else cpu_ops::gemm_tn(m, n, k, a, lda, b, ldb, c, ldc, beta, alpha);
}

// Operand sizes of one product in row-major storage: A is [m, k] (nn, nt) or [k, m] (tn); B is [k, n]
// (nn, tn) or [n, k] (nt). Strides are the row width plus a pad.
struct gemm_layout {
    index_t a_rows, a_cols, b_rows, b_cols, lda, ldb, ldc;
    gemm_layout(form f, gemm_shape s, index_t pad) {
        a_rows = f == form::tn ? s.k : s.m;
        a_cols = f == form::tn ? s.m : s.k;
        b_rows = f == form::nt ? s.n : s.k;
        b_cols = f == form::nt ? s.k : s.n;
        lda = a_cols + pad;
        ldb = b_cols + pad;
        ldc = s.n + pad;
    }
};

template <class T>
void check_gemm(form f, gemm_shape s, T beta, T alpha, index_t pad, index_t count) {
    CAPTURE(int(f));
    CAPTURE(s.m);
    CAPTURE(s.n);
    CAPTURE(s.k);
    CAPTURE(double(beta));
    CAPTURE(double(alpha));
    CAPTURE(pad);
    CAPTURE(count);
    const gemm_layout l(f, s, pad);
    // Batched operands lie stride apart, a little more than each matrix.
    const index_t sa = l.a_rows * l.lda + 3, sb = l.b_rows * l.ldb + 5, sc = s.m * l.ldc + 2;
    std::vector<T> a = rnd<T>(sz(count * sa + 1)), b = rnd<T>(sz(count * sb + 1)),
                   c = rnd<T>(sz(count * sc + 1));
    if (beta == T(0))  // beta = 0 overwrites C, NaN included (but not the padding, which keeps its NaN)
        for (T& v : c) v = std::numeric_limits<T>::quiet_NaN();
    device_vector<T> da(a), db(b), dc(c);
    if (count == 1) {
        auto* plain = f == form::nn   ? &gpu_ops::gemm_nn<T>
                      : f == form::nt ? &gpu_ops::gemm_nt<T>
                                      : &gpu_ops::gemm_tn<T>;
        plain(s.m, s.n, s.k, da.data(), l.lda, db.data(), l.ldb, dc.data(), l.ldc, beta, alpha);
    } else {
        auto* batched = f == form::nn   ? &mnemo::cuda_kernels::gemm_nn_batched<T>
                        : f == form::nt ? &mnemo::cuda_kernels::gemm_nt_batched<T>
                                        : &mnemo::cuda_kernels::gemm_tn_batched<T>;
        batched(count, s.m, s.n, s.k, da.data(), l.lda, sa, db.data(), l.ldb, sb, dc.data(), l.ldc, sc, beta, alpha);
    }
    for (index_t i = 0; i < count; ++i)
        cpu_gemm(f, s.m, s.n, s.k, a.data() + i * sa, l.lda, b.data() + i * sb, l.ldb, c.data() + i * sc, l.ldc, beta,
                 alpha);
    const std::vector<T> got = dc.host();
    // NaN padding on both sides compares equal by position; the products' elements by normalised error.
    std::vector<T> g2 = got, c2 = c;
    for (std::size_t i = 0; i < c2.size(); ++i)
        if (std::isnan(double(c2[i])) && std::isnan(double(g2[i]))) g2[i] = c2[i] = T(0);
    CHECK(norm_err(g2, c2) <= gemm_tol<T>);
}

TEST_CASE_TEMPLATE("gemm nn / nt / tn against the CPU", T, float, double) {
    for (form f : {form::nn, form::nt, form::tn})
        for (const gemm_shape& s : gemm_shapes)
            for (T beta : {T(0), T(1), T(0.5)})
                for (T alpha : {T(1), T(-0.75)}) check_gemm<T>(f, s, beta, alpha, (s.m + s.k) % 3 == 0 ? 0 : 3, 1);
}

TEST_CASE_TEMPLATE("strided-batched gemm against a loop of CPU products", T, float, double) {
    for (form f : {form::nn, form::nt, form::tn})
        for (const gemm_shape& s : gemm_shapes)
            for (T beta : {T(0), T(1)}) check_gemm<T>(f, s, beta, T(1), 2, 3);
}

// ---- per-head products ------------------------------------------------------------------------------------------

TEST_CASE_TEMPLATE("head_gemm_nt / nn / tn against the CPU", T, float, double) {
    struct shape {
        index_t dk, m, n;
    };
    for (shape s : {shape{8, 3, 5}, shape{32, 16, 16}, shape{17, 70, 9}, shape{64, 1, 66}, shape{16, 0, 4},
                    shape{16, 5, 0}}) {
        CAPTURE(s.dk);
        CAPTURE(s.m);
        CAPTURE(s.n);
        const index_t ld = 3 * s.dk + 5;  // a head's columns inside a wider row
        const index_t lds = s.n + 3, ldo = ld;
        for (T beta : {T(0), T(1)}) {
            CAPTURE(double(beta));
            std::vector<T> x = rnd<T>(sz(s.m * ld + 1)), y = rnd<T>(sz(s.n * ld + 1));
            std::vector<T> a = rnd<T>(sz(s.m * lds + 1));
            {  // S = X·Yᵀ
                std::vector<T> sc = rnd<T>(sz(s.m * lds + 1));
                device_vector<T> dx(x), dy(y), ds(sc);
                gpu_ops::head_gemm_nt(s.dk, s.m, s.n, dx.data(), ld, dy.data(), ld, ds.data(), lds);
                cpu_ops::head_gemm_nt(s.dk, s.m, s.n, x.data(), ld, y.data(), ld, sc.data(), lds);
                CHECK(norm_err(ds.host(), sc) <= gemm_tol<T>);
            }
            {  // O [m, dk] (=, +=) A·Y
                std::vector<T> o = rnd<T>(sz(s.m * ldo + 1));
                device_vector<T> da(a), dy(y), d_o(o);
                gpu_ops::head_gemm_nn(s.dk, s.m, s.n, da.data(), lds, dy.data(), ld, d_o.data(), ldo, beta);
                cpu_ops::head_gemm_nn(s.dk, s.m, s.n, a.data(), lds, y.data(), ld, o.data(), ldo, beta);
                CHECK(norm_err(d_o.host(), o) <= gemm_tol<T>);
            }
            {  // O [n, dk] (=, +=) Aᵀ·X
                std::vector<T> o = rnd<T>(sz(s.n * ldo + 1));
                device_vector<T> da(a), dx(x), d_o(o);
                gpu_ops::head_gemm_tn(s.dk, s.m, s.n, da.data(), lds, dx.data(), ld, d_o.data(), ldo, beta);
                cpu_ops::head_gemm_tn(s.dk, s.m, s.n, a.data(), lds, x.data(), ld, o.data(), ldo, beta);
                CHECK(norm_err(d_o.host(), o) <= gemm_tol<T>);
            }
        }
    }
}

TEST_CASE_TEMPLATE("heads_dot_rows against the CPU", T, float, double) {
    for (index_t dk : {1, 8, 13, 64, 100})
        for (index_t heads : {1, 3}) {
            CAPTURE(dk);
            CAPTURE(heads);
            const index_t rows = 12, ldy = 2 * heads * dk + 3, lds = rows + 2;
            std::vector<T> x = rnd<T>(sz(heads * dk)), y = rnd<T>(sz(rows * ldy));
            using range = std::pair<index_t, index_t>;
            for (auto [r0, r1] : std::initializer_list<range>{{0, rows}, {2, 11}, {5, 6}, {4, 4}}) {
                std::vector<T> s = rnd<T>(sz(heads * lds));  // columns outside [r0, r1) stay
                device_vector<T> dx(x), dy(y), ds(s);
                gpu_ops::heads_dot_rows(dk, heads, r0, r1, dx.data(), dy.data(), ldy, ds.data(), lds);
                cpu_ops::heads_dot_rows(dk, heads, r0, r1, x.data(), y.data(), ldy, s.data(), lds);
                CHECK(norm_err(ds.host(), s) <= gemm_tol<T>);
            }
        }
}

TEST_CASE_TEMPLATE("heads_weighted_rows against the CPU", T, float, double) {
    for (index_t dk : {1, 13, 32})
        for (index_t n : {0, 1, 7, 37, 300}) {
            CAPTURE(dk);
            CAPTURE(n);
            const index_t heads = 4, lda = n + 3, ldy = 2 * heads * dk + 1;
            std::vector<T> a = rnd<T>(sz(heads * lda)), y = rnd<T>(sz(std::max<index_t>(n, 1) * ldy));
            using range = std::pair<index_t, index_t>;
            for (auto [h0, h1] : std::initializer_list<range>{{0, heads}, {1, 3}, {2, 2}}) {
                std::vector<T> o = rnd<T>(sz(heads * dk));  // heads outside [h0, h1) stay
                device_vector<T> da(a), dy(y), d_o(o);
                gpu_ops::heads_weighted_rows(dk, h0, h1, n, da.data(), lda, dy.data(), ldy, d_o.data());
                cpu_ops::heads_weighted_rows(dk, h0, h1, n, a.data(), lda, y.data(), ldy, o.data());
                CHECK(norm_err(d_o.host(), o) <= gemm_tol<T>);
            }
        }
}

// ---- linear and projection backward -----------------------------------------------------------------------------

TEST_CASE_TEMPLATE("linear_backward against the CPU", T, float, double) {
    struct shape {
        index_t rows, in, out;
    };
    for (shape s : {shape{9, 13, 7}, shape{1, 1, 1}, shape{40, 33, 65}, shape{0, 5, 3}})
        for (bool bias : {false, true})
            for (int dx_mode : {0, 1, 2}) {  // no dx, dx assigned, dx accumulated
                CAPTURE(s.rows);
                CAPTURE(s.in);
                CAPTURE(s.out);
                CAPTURE(bias);
                CAPTURE(dx_mode);
                const index_t ldx = s.in + 2, lddy = s.out + 1, lddx = s.in + 3;
                std::vector<T> x = rnd<T>(sz(s.rows * ldx + 1)), dy = rnd<T>(sz(s.rows * lddy + 1));
                std::vector<T> w = rnd<T>(sz(s.out * s.in)), gw = rnd<T>(sz(s.out * s.in));
                std::vector<T> gb = rnd<T>(sz(s.out)), dx = rnd<T>(sz(s.rows * lddx + 1));
                device_vector<T> d_x(x), d_dy(dy), d_w(w), d_gw(gw), d_gb(gb), d_dx(dx);
                gpu_ops::linear_backward(s.rows, s.in, s.out, d_x.data(), ldx, d_dy.data(), lddy, d_w.data(),
                                         d_gw.data(), bias ? d_gb.data() : nullptr, dx_mode ? d_dx.data() : nullptr,
                                         lddx, dx_mode == 2);
                cpu_ops::linear_backward(s.rows, s.in, s.out, x.data(), ldx, dy.data(), lddy, w.data(), gw.data(),
                                         bias ? gb.data() : nullptr, dx_mode ? dx.data() : nullptr, lddx, dx_mode == 2);
                CHECK(norm_err(d_gw.host(), gw) <= gemm_tol<T>);
                CHECK(norm_err(d_gb.host(), gb) <= 64 * eps<T>);
                CHECK(norm_err(d_dx.host(), dx) <= gemm_tol<T>);
            }
}

TEST_CASE_TEMPLATE("kv_projection_backward against the CPU", T, float, double) {
    for (index_t rows : {0, 1, 11, 70})
        for (index_t d : {1, 6, 33})
            for (bool fused : {false, true})
                for (bool want_dz : {false, true}) {
                    CAPTURE(rows);
                    CAPTURE(d);
                    CAPTURE(fused);
                    CAPTURE(want_dz);
                    const index_t ldz = d + 2, lddz = d + 1;
                    std::vector<T> z = rnd<T>(sz(rows * ldz + 1)), dkv = rnd<T>(sz(rows * 2 * d + 1));
                    std::vector<T> w = rnd<T>(sz(2 * d * d)), g = rnd<T>(sz(2 * d * d));
                    std::vector<T> gbv = rnd<T>(sz(d)), dz = rnd<T>(sz(rows * lddz + 1));
                    device_vector<T> d_z(z), d_dkv(dkv), d_w(w), d_g(g), d_gbv(gbv), d_dz(dz);
                    // fused: W_v right after W_k (one [2D, D] matrix), and so the gradients; else the same
                    // memory used as two separate matrices
                    gpu_ops::kv_projection_backward(rows, d, d_z.data(), ldz, d_dkv.data(), d_w.data(),
                                                    d_w.data() + d * d, d_g.data(), d_g.data() + d * d, d_gbv.data(),
                                                    fused, want_dz ? d_dz.data() : nullptr, lddz);
                    cpu_ops::kv_projection_backward(rows, d, z.data(), ldz, dkv.data(), w.data(), w.data() + d * d,
                                                    g.data(), g.data() + d * d, gbv.data(), fused,
                                                    want_dz ? dz.data() : nullptr, lddz);
                    CHECK(norm_err(d_g.host(), g) <= gemm_tol<T>);
                    CHECK(norm_err(d_gbv.host(), gbv) <= 64 * eps<T>);
                    CHECK(norm_err(d_dz.host(), dz) <= gemm_tol<T>);
                }
}

TEST_CASE_TEMPLATE("frozen_norm_backward against the CPU", T, float, double) {
    for (index_t rows : {0, 1, 9, 75})
        for (index_t d : {1, 6, 40}) {
            CAPTURE(rows);
            CAPTURE(d);
            const index_t ldh = d + 3, n = 2 * d;
            std::vector<T> zhat = rnd<T>(sz(rows * ldh + 1)), dkv = rnd<T>(sz(rows * n + 1));
            std::vector<T> gamma = rnd<T>(sz(d)), beta = rnd<T>(sz(d));
            std::vector<T> dgamma = rnd<T>(sz(d)), dbeta = rnd<T>(sz(d));
            std::vector<T> wk = rnd<T>(sz(d * d)), wv = rnd<T>(sz(d * d));
            std::vector<T> gk = rnd<T>(sz(d * d)), gv = rnd<T>(sz(d * d)), gbv = rnd<T>(sz(d));
            std::vector<T> g(sz(n * d), T(7)), c(sz(n), T(7));  // scratch, assigned
            device_vector<T> d_zhat(zhat), d_dkv(dkv), d_gamma(gamma), d_beta(beta), d_dgamma(dgamma), d_dbeta(dbeta);
            device_vector<T> d_wk(wk), d_wv(wv), d_gk(gk), d_gv(gv), d_gbv(gbv), d_g(g), d_c(c);
            mnemo::frozen_key_rows<T> fg, fc;
            fg.rows = fc.rows = rows;
            fg.ld_zhat = fc.ld_zhat = ldh;
            fg.zhat = d_zhat.data();
            fg.gamma = d_gamma.data();
            fg.beta = d_beta.data();
            fg.dgamma = d_dgamma.data();
            fg.dbeta = d_dbeta.data();
            fc.zhat = zhat.data();
            fc.gamma = gamma.data();
            fc.beta = beta.data();
            fc.dgamma = dgamma.data();
            fc.dbeta = dbeta.data();
            gpu_ops::frozen_norm_backward(d, fg, d_dkv.data(), d_wk.data(), d_wv.data(), d_gk.data(), d_gv.data(),
                                          d_gbv.data(), d_g.data(), d_c.data());
            cpu_ops::frozen_norm_backward(d, fc, dkv.data(), wk.data(), wv.data(), gk.data(), gv.data(), gbv.data(),
                                          g.data(), c.data());
            CHECK(norm_err(d_g.host(), g) <= gemm_tol<T>);
            CHECK(norm_err(d_c.host(), c) <= 64 * eps<T>);
            CHECK(norm_err(d_gbv.host(), gbv) <= 64 * eps<T>);
            CHECK(norm_err(d_gk.host(), gk) <= gemm_tol<T>);
            CHECK(norm_err(d_gv.host(), gv) <= gemm_tol<T>);
            CHECK(norm_err(d_dgamma.host(), dgamma) <= gemm_tol<T>);
            CHECK(norm_err(d_dbeta.host(), dbeta) <= gemm_tol<T>);
        }
}

TEST_CASE_TEMPLATE("key_value_projections against the CPU", T, float, double) {
    for (index_t m_rows : {0, 5, 37})
        for (index_t c_rows : {0, 3})
            for (index_t d : {1, 7, 64}) {
                CAPTURE(m_rows);
                CAPTURE(c_rows);
                CAPTURE(d);
                const index_t ldm = d + 1, ldc = 2 * d;
                std::vector<T> mn = rnd<T>(sz(m_rows * ldm + 1)), cn = rnd<T>(sz(c_rows * ldc + 1));
                std::vector<T> wk = rnd<T>(sz(d * d)), wv = rnd<T>(sz(d * d)), bv = rnd<T>(sz(d));
                std::vector<T> km(sz(m_rows * d + 1), T(3)), kc(sz(c_rows * d + 1), T(3));
                std::vector<T> vm(sz(m_rows * d + 1), T(3)), vc(sz(c_rows * d + 1), T(3));
                device_vector<T> d_mn(mn), d_cn(cn), d_wk(wk), d_wv(wv), d_bv(bv);
                device_vector<T> d_km(km), d_kc(kc), d_vm(vm), d_vc(vc);
                gpu_ops::key_value_projections(m_rows, c_rows, d, d_mn.data(), ldm, d_cn.data(), ldc, d_wk.data(),
                                               d_wv.data(), d_bv.data(), d_km.data(), d_kc.data(), d_vm.data(),
                                               d_vc.data());
                cpu_ops::key_value_projections(m_rows, c_rows, d, mn.data(), ldm, cn.data(), ldc, wk.data(), wv.data(),
                                               bv.data(), km.data(), kc.data(), vm.data(), vc.data());
                CHECK(norm_err(d_km.host(), km) <= gemm_tol<T>);
                CHECK(norm_err(d_kc.host(), kc) <= gemm_tol<T>);
                CHECK(norm_err(d_vm.host(), vm) <= gemm_tol<T>);
                CHECK(norm_err(d_vc.host(), vc) <= gemm_tol<T>);
            }
}

// ---- softmax ----------------------------------------------------------------------------------------------------

/// The softmax forward's tolerance in ulp for rows of `cols` columns (see the top of the file).
double softmax_ulp(index_t cols) { return std::max(32.0, 2.0 * std::sqrt(double(cols))); }

TEST_CASE_TEMPLATE("softmax_forward against the CPU: masks, fully masked rows, aliasing", T, float, double) {
    const index_t rows = 13;
    for (index_t cols : {1, 7, 33, 100, 1030})
        for (T scale : {T(0.37), T(-0.5)})
            for (int mask_kind : {0, 1, 2, 3, 4}) {  // none, causal, causal with a negative offset, keep, both
                for (bool in_place : {false, true}) {
                    CAPTURE(cols);
                    CAPTURE(double(scale));
                    CAPTURE(mask_kind);
                    CAPTURE(in_place);
                    const index_t ldx = cols + 3, ldy = in_place ? ldx : cols + 1, ld_keep = cols + 2;
                    std::vector<T> x = rnd<T>(sz(rows * ldx), -4.0, 4.0);
                    std::vector<T> y = in_place ? x : rnd<T>(sz(rows * ldy));
                    std::vector<std::uint8_t> keep(sz(rows * ld_keep));
                    {
                        std::vector<T> u = rnd<T>(keep.size(), 0.0, 1.0);
                        for (std::size_t i = 0; i < keep.size(); ++i) keep[i] = u[i] < 0.7 ? 1 : 0;
                        for (index_t j = 0; j < cols; ++j) keep[sz(3 * ld_keep + j)] = 0;  // row 3: none visible
                    }
                    device_vector<std::uint8_t> d_keep(keep);
                    mnemo::softmax_mask cm{}, gm{};
                    if (mask_kind == 1 || mask_kind == 2 || mask_kind == 4) {
                        cm.causal = gm.causal = true;
                        cm.causal_offset = gm.causal_offset = mask_kind == 2 ? -3 : 2;  // -3: rows 0-2 see nothing
                    }
                    if (mask_kind >= 3) {
                        cm.keep = keep.data();
                        gm.keep = d_keep.data();
                        // odd widths: a mask row per row; even widths: one row for all (ld_keep 0)
                        cm.ld_keep = gm.ld_keep = (cols % 2) ? ld_keep : 0;
                    }
                    device_vector<T> dx(x), dy(y);
                    if (in_place) {
                        gpu_ops::softmax_forward(rows, cols, dx.data(), ldx, dx.data(), ldx, scale, gm);
                        cpu_ops::softmax_forward(rows, cols, x.data(), ldx, x.data(), ldx, scale, cm);
                        CHECK(ulp(dx.host(), x) <= softmax_ulp(cols));
                    } else {
                        gpu_ops::softmax_forward(rows, cols, dx.data(), ldx, dy.data(), ldy, scale, gm);
                        cpu_ops::softmax_forward(rows, cols, x.data(), ldx, y.data(), ldy, scale, cm);
                        CHECK(ulp(dy.host(), y) <= softmax_ulp(cols));
                    }
                }
            }
}

TEST_CASE_TEMPLATE("softmax_contiguous (ops<cuda> forwards to softmax_forward) against the CPU", T, float, double) {
    for (index_t cols : {1, 4, 8, 31, 200}) {
        CAPTURE(cols);
        const index_t rows = 9;
        std::vector<T> x = rnd<T>(sz(rows * cols), -3.0, 3.0);
        device_vector<T> dx(x);
        gpu_ops::softmax_contiguous(rows, cols, dx.data(), T(0.125));
        cpu_ops::softmax_contiguous(rows, cols, x.data(), T(0.125));
        CHECK(ulp(dx.host(), x) <= 32);
    }
}

TEST_CASE_TEMPLATE("softmax_backward against the CPU", T, float, double) {
    for (index_t cols : {1, 5, 37, 300})
        for (bool in_place : {false, true}) {
            CAPTURE(cols);
            CAPTURE(in_place);
            const index_t rows = 9, ldy = cols + 1, lddy = cols + 2, lddx = in_place ? lddy : cols + 3;
            std::vector<T> y = rnd<T>(sz(rows * ldy), 0.0, 1.0), dy = rnd<T>(sz(rows * lddy));
            std::vector<T> dx = in_place ? dy : rnd<T>(sz(rows * lddx));
            device_vector<T> d_y(y), d_dy(dy), d_dx(dx);
            const T scale = T(0.3);
            if (in_place) {
                gpu_ops::softmax_backward(rows, cols, d_y.data(), ldy, d_dy.data(), lddy, d_dy.data(), lddy, scale);
                cpu_ops::softmax_backward(rows, cols, y.data(), ldy, dy.data(), lddy, dy.data(), lddy, scale);
                CHECK(norm_err(d_dy.host(), dy) <= 64 * eps<T>);
            } else {
                gpu_ops::softmax_backward(rows, cols, d_y.data(), ldy, d_dy.data(), lddy, d_dx.data(), lddx, scale);
                cpu_ops::softmax_backward(rows, cols, y.data(), ldy, dy.data(), lddy, dx.data(), lddx, scale);
                CHECK(norm_err(d_dx.host(), dx) <= 64 * eps<T>);
            }
        }
}

// ---- layer norm -------------------------------------------------------------------------------------------------

TEST_CASE_TEMPLATE("layer_norm_forward against the CPU", T, float, double) {
    const index_t rows = 7;
    for (index_t d : {1, 5, 64, 129, 1000})
        for (int affine : {0, 1, 2, 3})  // bit 0: w, bit 1: b
            for (int outputs : {0, 1, 2}) {  // y; y and x̂; x̂ only
                CAPTURE(d);
                CAPTURE(affine);
                CAPTURE(outputs);
                const index_t ldx = d + 3, ldy = d + 1, ldxh = d + 2;
                std::vector<T> x = rnd<T>(sz(rows * ldx), -2.0, 3.0), w = rnd<T>(sz(d)),
                               b = rnd<T>(sz(d)), y = rnd<T>(sz(rows * ldy)),
                               xh = rnd<T>(sz(rows * ldxh)), mean = rnd<T>(sz(rows)),
                               rstd = rnd<T>(sz(rows));
                device_vector<T> d_x(x), d_w(w), d_b(b), d_y(y), d_xh(xh), d_mean(mean), d_rstd(rstd);
                const T eps_ln = T(1e-5);
                const bool want_y = outputs != 2, want_xh = outputs != 0;
                gpu_ops::layer_norm_forward(rows, d, d_x.data(), ldx, affine & 1 ? d_w.data() : nullptr,
                                            affine & 2 ? d_b.data() : nullptr, eps_ln, want_y ? d_y.data() : nullptr,
                                            ldy, d_mean.data(), d_rstd.data(), want_xh ? d_xh.data() : nullptr, ldxh);
                cpu_ops::layer_norm_forward(rows, d, x.data(), ldx, affine & 1 ? w.data() : nullptr,
                                            affine & 2 ? b.data() : nullptr, eps_ln, want_y ? y.data() : nullptr, ldy,
                                            mean.data(), rstd.data(), want_xh ? xh.data() : nullptr, ldxh);
                CHECK(norm_err(d_y.host(), y) <= 64 * eps<T>);
                CHECK(norm_err(d_xh.host(), xh) <= 64 * eps<T>);
                CHECK(norm_err(d_mean.host(), mean) <= 64 * eps<T>);
                // rstd of a one-column row is 1/sqrt(eps): relative, not normalised by 1
                const std::vector<T> got_r = d_rstd.host();
                for (std::size_t i = 0; i < rstd.size(); ++i)
                    CHECK(std::abs(double(got_r[i]) - double(rstd[i])) <= 64 * eps<T> * std::abs(double(rstd[i])));
            }
}

TEST_CASE_TEMPLATE("layer_norm_backward against the CPU", T, float, double) {
    for (index_t rows : {1, 7, 100})
        for (index_t d : {1, 5, 64, 129})
            for (bool with_w : {false, true})
                for (int dx_mode : {0, 1, 2})  // none, assigned, accumulated
                    for (int params : {0, 1, 2, 3}) {  // bit 0: dw, bit 1: db
                        CAPTURE(rows);
                        CAPTURE(d);
                        CAPTURE(with_w);
                        CAPTURE(dx_mode);
                        CAPTURE(params);
                        const index_t ldx = d + 2, lddy = d + 3, lddx = d + 1;
                        std::vector<T> x = rnd<T>(sz(rows * ldx), -2.0, 2.0), w = rnd<T>(sz(d));
                        std::vector<T> dy = rnd<T>(sz(rows * lddy)), dx = rnd<T>(sz(rows * lddx));
                        std::vector<T> dw = rnd<T>(sz(d)), db = rnd<T>(sz(d));
                        std::vector<T> mean(sz(rows)), rstd(sz(rows));
                        cpu_ops::layer_norm_forward(rows, d, x.data(), ldx, (const T*)nullptr, (const T*)nullptr,
                                                    T(1e-5), (T*)nullptr, 0, mean.data(), rstd.data(),
                                                    std::vector<T>(sz(rows * d)).data(), d);
                        device_vector<T> d_x(x), d_w(w), d_dy(dy), d_dx(dx), d_dw(dw), d_db(db), d_mean(mean),
                            d_rstd(rstd);
                        gpu_ops::layer_norm_backward(rows, d, d_x.data(), ldx, with_w ? d_w.data() : nullptr,
                                                     d_mean.data(), d_rstd.data(), d_dy.data(), lddy,
                                                     dx_mode ? d_dx.data() : nullptr, lddx,
                                                     params & 1 ? d_dw.data() : nullptr,
                                                     params & 2 ? d_db.data() : nullptr, dx_mode == 2);
                        cpu_ops::layer_norm_backward(rows, d, x.data(), ldx, with_w ? w.data() : nullptr, mean.data(),
                                                     rstd.data(), dy.data(), lddy, dx_mode ? dx.data() : nullptr, lddx,
                                                     params & 1 ? dw.data() : nullptr, params & 2 ? db.data() : nullptr,
                                                     dx_mode == 2);
                        CHECK(norm_err(d_dx.host(), dx) <= 64 * eps<T>);
                        CHECK(norm_err(d_dw.host(), dw) <= 64 * eps<T>);
                        CHECK(norm_err(d_db.host(), db) <= 64 * eps<T>);
                    }
}

// ---- cross-entropy ----------------------------------------------------------------------------------------------

TEST_CASE_TEMPLATE("cross_entropy_fused against the CPU: ignored rows, aliasing", T, float, double) {
    for (index_t vocab : {1, 5, 300, 5000})
        for (bool in_place : {false, true}) {
            CAPTURE(vocab);
            CAPTURE(in_place);
            const index_t rows = 6, ld = vocab + 2, ldd = in_place ? ld : vocab + 1;
            std::vector<T> logits = rnd<T>(sz(rows * ld), -5.0, 5.0);
            std::vector<std::int32_t> targets(sz(rows));
            for (index_t i = 0; i < rows; ++i)
                targets[sz(i)] = (i == 2 || i == 5) ? -1 : std::int32_t((i * 7919 + 3) % vocab);
            std::vector<T> losses = rnd<T>(sz(rows)), dl = in_place ? logits : rnd<T>(sz(rows * ldd));
            device_vector<T> d_logits(logits), d_losses(losses), d_dl(dl);
            device_vector<std::int32_t> d_targets(targets);
            const T g = T(0.25);
            if (in_place) {
                gpu_ops::cross_entropy_fused(rows, vocab, d_logits.data(), ld, d_targets.data(), d_losses.data(), g,
                                             d_logits.data(), ld);
                cpu_ops::cross_entropy_fused(rows, vocab, logits.data(), ld, targets.data(), losses.data(), g,
                                             logits.data(), ld);
                CHECK(norm_err(d_logits.host(), logits) <= 64 * eps<T>);
            } else {
                gpu_ops::cross_entropy_fused(rows, vocab, d_logits.data(), ld, d_targets.data(), d_losses.data(), g,
                                             d_dl.data(), ldd);
                cpu_ops::cross_entropy_fused(rows, vocab, logits.data(), ld, targets.data(), losses.data(), g,
                                             dl.data(), ldd);
                CHECK(norm_err(d_dl.host(), dl) <= 64 * eps<T>);
            }
            const std::vector<T> got = d_losses.host();
            CHECK(norm_err(got, losses) <= 64 * eps<T>);
            CHECK(got[2] == T(0));
            CHECK(got[5] == T(0));
        }
}

// ---- element-wise and rows --------------------------------------------------------------------------------------

struct rows_shape {
    index_t rows, n;
};
const rows_shape row_shapes[] = {{1, 1}, {3, 7}, {17, 33}, {64, 129}, {0, 5}, {5, 0}, {300, 3}};

TEST_CASE_TEMPLATE("add_bias_rows, add, copy, scale, scale_shift_rows against the CPU", T, float, double) {
    for (rows_shape s : row_shapes) {
        CAPTURE(s.rows);
        CAPTURE(s.n);
        const index_t la = s.n + 2, lb = s.n + 3, ly = s.n + 1;
        const std::size_t ra = sz(s.rows * la + 1), rb = sz(s.rows * lb + 1),
                          ry = sz(s.rows * ly + 1);
        const std::vector<T> a = rnd<T>(ra), b = rnd<T>(rb), bias = rnd<T>(sz(s.n) + 1),
                             g = rnd<T>(sz(s.n) + 1);
        {  // C += b per row (exact)
            std::vector<T> c = a;
            device_vector<T> d_bias(bias), dc(c);
            gpu_ops::add_bias_rows(s.rows, s.n, d_bias.data(), dc.data(), la);
            cpu_ops::add_bias_rows(s.rows, s.n, bias.data(), c.data(), la);
            CHECK(same(dc.host(), c));
        }
        {  // y = a + b (exact), and in place into a
            std::vector<T> y = rnd<T>(ry), a2 = a;
            device_vector<T> da(a), db(b), dy(y);
            gpu_ops::add(s.rows, s.n, da.data(), la, db.data(), lb, dy.data(), ly);
            cpu_ops::add(s.rows, s.n, a.data(), la, b.data(), lb, y.data(), ly);
            CHECK(same(dy.host(), y));
            gpu_ops::add(s.rows, s.n, da.data(), la, db.data(), lb, da.data(), la);
            cpu_ops::add(s.rows, s.n, a2.data(), la, b.data(), lb, a2.data(), la);
            CHECK(same(da.host(), a2));
        }
        for (bool acc : {false, true}) {  // y = x, y += x (exact)
            std::vector<T> y = rnd<T>(ry);
            device_vector<T> da(a), dy(y);
            gpu_ops::copy(s.rows, s.n, da.data(), la, dy.data(), ly, acc);
            cpu_ops::copy(s.rows, s.n, a.data(), la, y.data(), ly, acc);
            CHECK(same(dy.host(), y));
        }
        {  // y = s·x (exact), and in place
            std::vector<T> y = rnd<T>(ry), a2 = a;
            device_vector<T> da(a), dy(y);
            gpu_ops::scale(s.rows, s.n, da.data(), la, T(-1.7), dy.data(), ly);
            cpu_ops::scale(s.rows, s.n, a.data(), la, T(-1.7), y.data(), ly);
            CHECK(same(dy.host(), y));
            gpu_ops::scale(s.rows, s.n, da.data(), la, T(0.3), da.data(), la);
            cpu_ops::scale(s.rows, s.n, a2.data(), la, T(0.3), a2.data(), la);
            CHECK(same(da.host(), a2));
        }
        {  // y = x∘g + b
            std::vector<T> y = rnd<T>(ry);
            device_vector<T> da(a), dg(g), d_bias(bias), dy(y);
            gpu_ops::scale_shift_rows(s.rows, s.n, da.data(), la, dg.data(), d_bias.data(), dy.data(), ly);
            cpu_ops::scale_shift_rows(s.rows, s.n, a.data(), la, g.data(), bias.data(), y.data(), ly);
            CHECK(norm_err(dy.host(), y) <= 2 * eps<T>);
        }
    }
}

TEST_CASE_TEMPLATE("sum_rows_accumulate against the CPU", T, float, double) {
    for (rows_shape s : row_shapes)
        for (index_t extra_rows : {0, 1000}) {
            const index_t rows = s.rows + (s.rows ? extra_rows : 0), ld = s.n + 3;
            CAPTURE(rows);
            CAPTURE(s.n);
            const std::vector<T> dy = rnd<T>(sz(rows * ld + 1));
            std::vector<T> db = rnd<T>(sz(s.n + 1));
            device_vector<T> d_dy(dy), d_db(db);
            gpu_ops::sum_rows_accumulate(rows, s.n, d_dy.data(), ld, d_db.data());
            cpu_ops::sum_rows_accumulate(rows, s.n, dy.data(), ld, db.data());
            CHECK(norm_err(d_db.host(), db) <= 64 * eps<T>);
        }
}

TEST_CASE_TEMPLATE("gather_rows and scatter_add_rows against the CPU: repeated ids", T, float, double) {
    const index_t vocab = 50;
    for (rows_shape s : row_shapes) {
        CAPTURE(s.rows);
        CAPTURE(s.n);
        const index_t ldt = s.n + 2, ld = s.n + 1;
        std::vector<std::int32_t> ids(sz(s.rows) + 1);
        for (std::size_t i = 0; i < ids.size(); ++i)  // many repeats, and ids 0, 32, 49 (slice boundaries)
            ids[i] = std::int32_t(i % 3 == 0 ? 7 : (i % 5 == 0 ? 32 : (i * 37 + 11) % vocab));
        if (s.rows > 2) ids[1] = 0, ids[2] = vocab - 1;
        const std::vector<T> table = rnd<T>(sz(vocab * ldt));
        device_vector<std::int32_t> d_ids(ids);
        {
            std::vector<T> y = rnd<T>(sz(s.rows * ld + 1));
            device_vector<T> dt(table), dy(y);
            gpu_ops::gather_rows(s.rows, s.n, d_ids.data(), dt.data(), ldt, dy.data(), ld);
            cpu_ops::gather_rows(s.rows, s.n, ids.data(), table.data(), ldt, y.data(), ld);
            CHECK(same(dy.host(), y));
        }
        {
            const std::vector<T> dy = rnd<T>(sz(s.rows * ld + 1));
            std::vector<T> t = table;
            device_vector<T> dt(table), d_dy(dy);
            gpu_ops::scatter_add_rows(s.rows, s.n, d_ids.data(), d_dy.data(), ld, dt.data(), ldt);
            cpu_ops::scatter_add_rows(s.rows, s.n, ids.data(), dy.data(), ld, t.data(), ldt);
            CHECK(same(dt.host(), t));  // the same additions in the same row order
        }
    }
}

TEST_CASE_TEMPLATE("sum_as_double and axpy against the CPU", T, float, double) {
    for (index_t n : {0, 1, 31, 1000, 70001}) {
        CAPTURE(n);
        const std::vector<T> x = rnd<T>(sz(n) + 1);
        device_vector<T> dx(x);
        device_vector<double> dsum(std::vector<double>{12345.0});
        gpu_ops::sum_as_double(n, dx.data(), dsum.data());
        double cpu_sum = -1;
        cpu_ops::sum_as_double(n, x.data(), &cpu_sum);
        double abs_sum = 0;
        for (index_t i = 0; i < n; ++i) abs_sum += std::abs(double(x[sz(i)]));
        CHECK(std::abs(dsum.host()[0] - cpu_sum) <= 1e-12 * std::max(1.0, abs_sum));

        std::vector<T> y = rnd<T>(sz(n) + 1);
        device_vector<T> dy(y);
        gpu_ops::axpy(n, T(-0.6), dx.data(), dy.data());
        cpu_ops::axpy(n, T(-0.6), x.data(), y.data());
        CHECK(norm_err(dy.host(), y) <= 2 * eps<T>);
    }
}

TEST_CASE_TEMPLATE("scale_by_count against the CPU: the factor from a count in device memory", T, float, double) {
    for (double count : {0.0, 1.0, 7.0})
        for (index_t n : {1, 33, 70001}) {
            CAPTURE(count);
            CAPTURE(n);
            const std::vector<T> x0 = rnd<T>(sz(n));
            std::vector<T> x = x0;
            device_vector<T> dx(x0);
            device_vector<double> dcount(std::vector<double>{count, 0.0});
            gpu_ops::scale_by_count(n, dx.data(), dcount.data(), index_t(5), T(2));
            cpu_ops::scale_by_count(n, x.data(), &count, index_t(5), T(2));
            CHECK(same(dx.host(), x));  // one multiplication by the same factor
        }
}

TEST_CASE_TEMPLATE("weighted_sum_rows against the CPU", T, float, double) {
    for (index_t count : {1, 3, 64})
        for (rows_shape s : row_shapes) {
            CAPTURE(count);
            CAPTURE(s.rows);
            CAPTURE(s.n);
            const index_t ldx = s.n + 2, ldy = s.n + 1;
            std::vector<std::vector<T>> xs;
            std::vector<device_vector<T>> dxs;
            std::vector<const T*> hp, dp;
            for (index_t l = 0; l < count; ++l) {
                xs.push_back(rnd<T>(sz(s.rows * ldx + 1)));
                dxs.emplace_back(xs.back());
            }
            for (index_t l = 0; l < count; ++l) {
                hp.push_back(xs[sz(l)].data());
                dp.push_back(dxs[sz(l)].data());
            }
            const std::vector<T> w = rnd<T>(sz(count));
            std::vector<T> y = rnd<T>(sz(s.rows * ldy + 1));
            device_vector<T> dy(y);
            gpu_ops::weighted_sum_rows<T>(s.rows, s.n, std::span<const T* const>(dp), ldx, std::span<const T>(w),
                                          dy.data(), ldy);
            cpu_ops::weighted_sum_rows<T>(s.rows, s.n, std::span<const T* const>(hp), ldx, std::span<const T>(w),
                                          y.data(), ldy);
            CHECK(norm_err(dy.host(), y) <= 32 * eps<T>);
        }
}

TEST_CASE_TEMPLATE("relu and gelu forward and backward against the CPU", T, float, double) {
    for (index_t n : {1, 7, 33, 1000, 100003}) {
        CAPTURE(n);
        std::vector<T> x = rnd<T>(sz(n), -6.0, 6.0), dy = rnd<T>(sz(n));
        x[0] = T(0);  // relu'(0) = 0
        device_vector<T> dx_in(x), d_dy(dy);
        {
            std::vector<T> y(sz(n)), dx(sz(n));
            device_vector<T> d_y(y), d_dx(dx);
            gpu_ops::activation_forward<mnemo::relu>(n, dx_in.data(), d_y.data());
            cpu_ops::activation_forward<mnemo::relu>(n, x.data(), y.data());
            CHECK(same(d_y.host(), y));
            gpu_ops::activation_backward<mnemo::relu>(n, dx_in.data(), d_dy.data(), d_dx.data());
            cpu_ops::activation_backward<mnemo::relu>(n, x.data(), dy.data(), dx.data());
            CHECK(same(d_dx.host(), dx));
        }
        {
            std::vector<T> y(sz(n)), dx(sz(n));
            device_vector<T> d_y(y), d_dx(dx);
            gpu_ops::activation_forward<mnemo::gelu>(n, dx_in.data(), d_y.data());
            cpu_ops::activation_forward<mnemo::gelu>(n, x.data(), y.data());
            CHECK(norm_err(d_y.host(), y) <= 8 * eps<T>);
            gpu_ops::activation_backward<mnemo::gelu>(n, dx_in.data(), d_dy.data(), d_dx.data());
            cpu_ops::activation_backward<mnemo::gelu>(n, x.data(), dy.data(), dx.data());
            CHECK(norm_err(d_dx.host(), dx) <= 16 * eps<T>);
        }
        {  // in place: y = gelu(x) over x
            std::vector<T> xi = x;
            device_vector<T> d_xi(xi);
            gpu_ops::activation_forward<mnemo::gelu>(n, d_xi.data(), d_xi.data());
            cpu_ops::activation_forward<mnemo::gelu>(n, xi.data(), xi.data());
            CHECK(norm_err(d_xi.host(), xi) <= 8 * eps<T>);
        }
    }
}

TEST_CASE_TEMPLATE("dropout forward and backward: the CPU's mask bit for bit", T, float, double) {
    for (index_t n : {1, 5, 1001, 70000})
        for (float p : {0.0f, 0.1f, 0.5f, 1.0f})
            // the last offset makes the counter's high word (index >> 34) nonzero
            for (std::uint64_t offset : {std::uint64_t(0), std::uint64_t(3), (std::uint64_t(1) << 33) + 1,
                                         (std::uint64_t(5) << 34) + 2})
                for (bool in_place : {false, true}) {
                    CAPTURE(n);
                    CAPTURE(p);
                    CAPTURE(offset);
                    CAPTURE(in_place);
                    const std::uint64_t seed = 0x9E3779B97F4A7C15ull + std::uint64_t(n);
                    std::vector<T> x = rnd<T>(sz(n)), y = rnd<T>(sz(n));
                    device_vector<T> dx(x), dy(y);
                    if (in_place) {
                        gpu_ops::dropout_forward(n, dx.data(), dx.data(), p, seed, offset);
                        cpu_ops::dropout_forward(n, x.data(), x.data(), p, seed, offset);
                        CHECK(same(dx.host(), x));
                        gpu_ops::dropout_backward(n, dx.data(), dx.data(), p, seed, offset);
                        cpu_ops::dropout_backward(n, x.data(), x.data(), p, seed, offset);
                        CHECK(same(dx.host(), x));
                    } else {
                        gpu_ops::dropout_forward(n, dx.data(), dy.data(), p, seed, offset);
                        cpu_ops::dropout_forward(n, x.data(), y.data(), p, seed, offset);
                        CHECK(same(dy.host(), y));
                        std::vector<T> g = rnd<T>(sz(n)), dg(sz(n));
                        device_vector<T> d_g(g), d_dg(dg);
                        gpu_ops::dropout_backward(n, d_g.data(), d_dg.data(), p, seed, offset);
                        cpu_ops::dropout_backward(n, g.data(), dg.data(), p, seed, offset);
                        CHECK(same(d_dg.host(), dg));
                    }
                }
}

TEST_CASE_TEMPLATE("gru_gate_forward and backward against the CPU", T, float, double) {
    for (index_t rows : {1, 5, 40})
        for (index_t d : {1, 7, 64}) {
            CAPTURE(rows);
            CAPTURE(d);
            const index_t ldo = d + 2, ldg = d + 3, ldx = d + 1;
            const std::size_t gates = sz(rows * 3 * d);
            std::vector<T> gi = rnd<T>(gates, -2.0, 2.0), gh = rnd<T>(gates, -2.0, 2.0);
            const std::vector<T> b_ih = rnd<T>(sz(3 * d)), b_hh = rnd<T>(sz(3 * d)),
                                 x = rnd<T>(sz(rows * d));
            std::vector<T> out = rnd<T>(sz(rows * ldo));
            device_vector<T> d_gi(gi), d_gh(gh), d_bih(b_ih), d_bhh(b_hh), d_x(x), d_out(out);
            gpu_ops::gru_gate_forward(rows, d, d_gi.data(), d_gh.data(), d_bih.data(), d_bhh.data(), d_x.data(),
                                      d_out.data(), ldo);
            cpu_ops::gru_gate_forward(rows, d, gi.data(), gh.data(), b_ih.data(), b_hh.data(), x.data(), out.data(),
                                      ldo);
            CHECK(norm_err(d_gi.host(), gi) <= 16 * eps<T>);
            CHECK(norm_err(d_gh.host(), gh) <= 16 * eps<T>);
            CHECK(norm_err(d_out.host(), out) <= 16 * eps<T>);

            // backward from the CPU's forward state (the same inputs on both sides)
            const std::vector<T> g = rnd<T>(sz(rows * ldg));
            for (int dx_mode : {0, 1, 2}) {  // none, assigned, accumulated
                CAPTURE(dx_mode);
                std::vector<T> dgi = rnd<T>(gates), dgh = rnd<T>(gates), dx = rnd<T>(sz(rows * ldx));
                device_vector<T> d_act(gi), d_ghs(gh), d_g(g), d_dgi(dgi), d_dgh(dgh), d_dx(dx);
                gpu_ops::gru_gate_backward(rows, d, d_act.data(), d_ghs.data(), d_x.data(), d_g.data(), ldg,
                                           d_dgi.data(), d_dgh.data(), dx_mode ? d_dx.data() : nullptr, ldx,
                                           dx_mode == 2);
                cpu_ops::gru_gate_backward(rows, d, gi.data(), gh.data(), x.data(), g.data(), ldg, dgi.data(),
                                           dgh.data(), dx_mode ? dx.data() : nullptr, ldx, dx_mode == 2);
                CHECK(norm_err(d_dgi.host(), dgi) <= 16 * eps<T>);
                CHECK(norm_err(d_dgh.host(), dgh) <= 16 * eps<T>);
                CHECK(norm_err(d_dx.host(), dx) <= 16 * eps<T>);
            }
        }
}

// ---- grids past the 65535-block cap ----------------------------------------------------------------------------

// blocks_for caps a grid at 65535 blocks; the grid-stride loops must cover the rest. Shapes just past the
// cap of each launch shape: a warp a row (8 rows a block: 524280 rows), a block a row (65535 rows),
// 8 columns a block (column reductions: 524280 columns), 32 columns a block (the scatter: 2097120
// columns), 256 elements a block (16776960 elements).
TEST_CASE_TEMPLATE("launches past the 65535-block cap cover every element", T, float, double) {
    {  // softmax, layer norm: a warp a row
        const index_t rows = 524280 + 77, cols = 3;
        // Columns offset by -2, 0 and +2: no row's variance nearly cancels (with plain values in [-1, 1]
        // some rows' did, and the layer norm's output magnified the rounding: 120 eps on an H200).
        std::vector<T> x = rnd<T>(sz(rows * cols));
        for (std::size_t i = 0; i < x.size(); ++i) x[i] += T(2) * T(int(i % 3) - 1);
        std::vector<T> y(x.size()), mean(sz(rows)), rstd(sz(rows));
        device_vector<T> dx(x), dy(y), dmean(mean), drstd(rstd);
        gpu_ops::softmax_forward(rows, cols, dx.data(), cols, dy.data(), cols, T(1));
        cpu_ops::softmax_forward(rows, cols, x.data(), cols, y.data(), cols, T(1));
        CHECK(ulp(dy.host(), y) <= 32);
        gpu_ops::layer_norm_forward(rows, cols, dx.data(), cols, (const T*)nullptr, (const T*)nullptr, T(1e-5),
                                    dy.data(), cols, dmean.data(), drstd.data());
        cpu_ops::layer_norm_forward(rows, cols, x.data(), cols, (const T*)nullptr, (const T*)nullptr, T(1e-5),
                                    y.data(), cols, mean.data(), rstd.data());
        CHECK(norm_err(dy.host(), y) <= 64 * eps<T>);
        CHECK(norm_err(dmean.host(), mean) <= 64 * eps<T>);
    }
    {  // heads_dot_rows: a warp an output
        const index_t rows = 524280 + 5, dk = 2;
        const std::vector<T> x = rnd<T>(sz(dk)), y = rnd<T>(sz(rows * dk));
        std::vector<T> s = rnd<T>(sz(rows));
        device_vector<T> dx(x), dy(y), ds(s);
        gpu_ops::heads_dot_rows(dk, 1, 0, rows, dx.data(), dy.data(), dk, ds.data(), rows);
        cpu_ops::heads_dot_rows(dk, 1, 0, rows, x.data(), y.data(), dk, s.data(), rows);
        CHECK(norm_err(ds.host(), s) <= gemm_tol<T>);
    }
    {  // cross-entropy: a block a row
        const index_t rows = 65535 + 9, vocab = 3;
        const std::vector<T> logits = rnd<T>(sz(rows * vocab));
        std::vector<std::int32_t> targets(sz(rows));
        for (index_t i = 0; i < rows; ++i) targets[sz(i)] = std::int32_t(i % vocab);
        std::vector<T> losses(sz(rows)), dl(logits.size());
        device_vector<T> d_logits(logits), d_losses(losses), d_dl(dl);
        device_vector<std::int32_t> d_targets(targets);
        gpu_ops::cross_entropy_fused(rows, vocab, d_logits.data(), vocab, d_targets.data(), d_losses.data(), T(1),
                                     d_dl.data(), vocab);
        cpu_ops::cross_entropy_fused(rows, vocab, logits.data(), vocab, targets.data(), losses.data(), T(1), dl.data(),
                                     vocab);
        CHECK(norm_err(d_losses.host(), losses) <= 64 * eps<T>);
        CHECK(norm_err(d_dl.host(), dl) <= 64 * eps<T>);
    }
    {  // column reduction
        const index_t rows = 3, n = 524280 + 13;
        const std::vector<T> dy = rnd<T>(sz(rows * n));
        std::vector<T> db = rnd<T>(sz(n));
        device_vector<T> d_dy(dy), d_db(db);
        gpu_ops::sum_rows_accumulate(rows, n, d_dy.data(), n, d_db.data());
        cpu_ops::sum_rows_accumulate(rows, n, dy.data(), n, db.data());
        CHECK(norm_err(d_db.host(), db) <= 64 * eps<T>);
    }
    {  // the scatter
        const index_t rows = 3, n = 2097120 + 40;
        const std::vector<std::int32_t> ids{0, 1, 0};
        const std::vector<T> dy = rnd<T>(sz(rows * n));
        std::vector<T> table = rnd<T>(sz(2 * n));
        device_vector<std::int32_t> d_ids(ids);
        device_vector<T> d_dy(dy), d_table(table);
        gpu_ops::scatter_add_rows(rows, n, d_ids.data(), d_dy.data(), n, d_table.data(), n);
        cpu_ops::scatter_add_rows(rows, n, ids.data(), dy.data(), n, table.data(), n);
        CHECK(same(d_table.host(), table));
    }
    {  // element-wise
        const index_t rows = 2, n = 16776960 / 2 + 300;
        const std::vector<T> x = rnd<T>(sz(rows * n));
        std::vector<T> y = rnd<T>(sz(rows * n));
        device_vector<T> dx(x), dy(y);
        gpu_ops::copy(rows, n, dx.data(), n, dy.data(), n, true);
        cpu_ops::copy(rows, n, x.data(), n, y.data(), n, true);
        CHECK(same(dy.host(), y));
    }
}

// ---- run to run ------------------------------------------------------------------------------------------------

TEST_CASE_TEMPLATE("the reductions are bitwise the same run to run", T, float, double) {
    const index_t rows = 517, n = 93;
    const std::vector<T> x = rnd<T>(sz(rows * n)), dy = rnd<T>(sz(rows * n)), init = rnd<T>(sz(n));
    std::vector<std::int32_t> targets(sz(rows));
    for (index_t i = 0; i < rows; ++i) targets[sz(i)] = std::int32_t(i % n);
    device_vector<T> d_x(x), d_dy(dy);
    device_vector<std::int32_t> d_t(targets);
    auto once = [&] {
        device_vector<T> db(init), dw(init), mean(rows), rstd(rows), sm(rows * n), dl(rows * n), loss(rows);
        device_vector<double> total(1);
        gpu_ops::sum_rows_accumulate(rows, n, d_dy.data(), n, db.data());
        gpu_ops::layer_norm_forward(rows, n, d_x.data(), n, (const T*)nullptr, (const T*)nullptr, T(1e-5),
                                    (T*)nullptr, 0, mean.data(), rstd.data(), sm.data(), n);
        gpu_ops::layer_norm_backward(rows, n, d_x.data(), n, (const T*)nullptr, mean.data(), rstd.data(), d_dy.data(),
                                     n, (T*)nullptr, 0, dw.data(), (T*)nullptr);
        gpu_ops::softmax_forward(rows, n, d_x.data(), n, sm.data(), n, T(0.7));
        gpu_ops::cross_entropy_fused(rows, n, d_x.data(), n, d_t.data(), loss.data(), T(0.5), dl.data(), n);
        gpu_ops::sum_as_double(rows, loss.data(), total.data());
        std::vector<T> all = db.host();
        for (const auto* v : {&dw, &sm, &dl, &loss}) {
            const std::vector<T> h = v->host();
            all.insert(all.end(), h.begin(), h.end());
        }
        return std::pair{all, total.host()[0]};
    };
    const auto first = once(), second = once();
    CHECK(same(first.first, second.first));
    CHECK(first.second == second.second);
}

}  // namespace
