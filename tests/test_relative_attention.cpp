// Relative multi-head attention: forward against a naive loop over the defining formula (direct
// indexing by δ = L_mem + i − j), backward against finite differences in double.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <vector>

#include <omp.h>

#include <mnemo/core/config.hpp>
#include <mnemo/nn/attention/relative.hpp>

#include "gradcheck.hpp"

using mnemo::index_t;
using mnemo::view;
using mnemo::testing::check_close;
using mnemo::testing::check_gradients;
using mnemo::testing::parameter_targets;
using mnemo::testing::project;
using mnemo::testing::random_vector;
using mnemo::testing::randomize_parameters;

namespace {

using cfg = mnemo::config<8, 2>;
constexpr index_t D = 8, H = 2, Dk = 4;


// Naive forward: out [Q·B, D] from zq [Q·B, D], zkv [K·B, D].
std::vector<double> naive(mnemo::parameter_set<double>& ps, const std::string& n, const std::vector<double>& zq,
                          const std::vector<double>& zkv, index_t Q, index_t Kn, index_t B, index_t P,
                          index_t clamp_len = 0) {
    auto val = [&](const std::string& t) { return ps.values() + ps.find(n + "." + t)->offset; };
    const double *wq = val("query.linear.weight"), *wk = val("key.linear.weight"), *wv = val("value.linear.weight"),
                 *bv = val("value.linear.bias"), *wo = val("output.weight"), *bo = val("output.bias"),
                 *R = val("key_pos_embeddings"), *S = val("key_pos_bias"), *u = val("query_pos_bias");
    auto lin = [&](const std::vector<double>& x, index_t rows, const double* w, const double* b) {
        std::vector<double> y(rows * D);
        for (index_t r = 0; r < rows; ++r)
            for (index_t o = 0; o < D; ++o) {
                double s = b ? b[o] : 0.0;
                for (index_t i = 0; i < D; ++i) s += x[r * D + i] * w[o * D + i];
                y[r * D + o] = s;
            }
        return y;
    };
    auto q = lin(zq, Q * B, wq, nullptr), k = lin(zkv, Kn * B, wk, nullptr), v = lin(zkv, Kn * B, wv, bv);
    const index_t mem = Kn - Q;
    std::vector<double> ctx(Q * B * D, 0.0);
    for (index_t b = 0; b < B; ++b)
        for (index_t h = 0; h < H; ++h)
            for (index_t i = 0; i < Q; ++i) {
                std::vector<double> sc(Kn, -std::numeric_limits<double>::infinity());
                double mx = -1e300;
                for (index_t j = 0; j <= mem + i; ++j) {
                    const index_t delta = clamp_len > 0 ? std::min(mem + i - j, clamp_len) : mem + i - j, row = P - delta;
                    double s = S[row * H + h];
                    for (index_t d = 0; d < Dk; ++d) {
                        const double qd = q[(i * B + b) * D + h * Dk + d];
                        s += (qd + u[h * Dk + d]) * k[(j * B + b) * D + h * Dk + d] + qd * R[(row * H + h) * Dk + d];
                    }
                    sc[j] = s / std::sqrt(double(Dk));
                    mx = std::max(mx, sc[j]);
                }
                double z = 0;
                for (index_t j = 0; j <= mem + i; ++j) z += std::exp(sc[j] - mx);
                for (index_t j = 0; j <= mem + i; ++j) {
                    const double a = std::exp(sc[j] - mx) / z;
                    for (index_t d = 0; d < Dk; ++d)
                        ctx[(i * B + b) * D + h * Dk + d] += a * v[(j * B + b) * D + h * Dk + d];
                }
            }
    return lin(ctx, Q * B, wo, bo);
}

// Forward of attn over (z_q, z_kv) for the loss ⟨out, r⟩, then backward (the parameters' gradients
// into ps, the inputs' into dzq and dzkv); returns the loss as a function of the inputs, for
// check_gradients (each call runs forward again).
template <class Attn>
std::function<double()> loss_and_gradients(Attn& attn, mnemo::parameter_set<double>& ps, const std::vector<double>& zq,
                                           const std::vector<double>& zkv, const std::vector<double>& r, index_t B,
                                           std::vector<double>& out, std::vector<double>& dzq,
                                           std::vector<double>& dzkv) {
    const index_t qb = index_t(zq.size()) / D, kb = index_t(zkv.size()) / D;
    auto loss = [&attn, &zq, &zkv, &r, &out, B, qb, kb] {
        attn.forward(view<const double, D>(zq.data(), qb), view<const double, D>(zkv.data(), kb), B,
                     view<double, D>(out.data(), qb));
        return project(out, r);
    };
    loss();
    ps.zero_grad();
    attn.backward(view<const double, D>(zq.data(), qb), view<const double, D>(zkv.data(), kb),
                  view<const double, D>(r.data(), qb), view<double, D>(dzq.data(), qb), view<double, D>(dzkv.data(), kb));
    return loss;
}

}  // namespace

constexpr mnemo::memory_attention modes[] = {mnemo::memory_attention::projected, mnemo::memory_attention::absorbed};

// One query position over projected keys takes one of two CPU routes by the size of its rows (two
// passes from the caches, one online pass from DRAM): tests that reach it run both, forced.
using route = mnemo::cpu_kernels::one_query_route;
constexpr route one_query_routes[] = {route::two_pass, route::online};
struct forced_route {
    explicit forced_route(route r) { mnemo::cpu_kernels::one_query_override = r; }
    ~forced_route() { mnemo::cpu_kernels::one_query_override = route::automatic; }
    forced_route(const forced_route&) = delete;
    forced_route& operator=(const forced_route&) = delete;
};
const char* route_name(route r) { return r == route::online ? "online" : "two passes"; }

TEST_CASE("relative_attention: forward matches the defining formula, with and without memory") {
    for (route rt : one_query_routes)
    for (auto mode : modes)
    for (index_t mem : {0, 1, 4}) {
        const forced_route forced(rt);
        for (index_t B : {1, 3})
        for (index_t Q : {1, 3}) {  // Q = 1 over projected keys: one_query_forward (a generated token)
            const index_t Kn = mem + Q, P = 8;
            mnemo::parameter_set<double> ps;
            mnemo::relative_attention<double, cfg> attn(ps, "self_attn", P);
            ps.allocate();
            attn.set_memory_attention(mode);
            randomize_parameters(ps, 10 + mem + B, -0.8, 0.8);
            auto zkv = random_vector<double>(Kn * B * D, 20 + mem);
            std::vector<double> zq(zkv.end() - Q * B * D, zkv.end());  // queries: the segment's rows
            std::vector<double> out(Q * B * D);
            attn.forward(view<const double, D>(zq.data(), Q * B), view<const double, D>(zkv.data(), Kn * B), B,
                         view<double, D>(out.data(), Q * B));
            auto ref = naive(ps, "self_attn", zq, zkv, Q, Kn, B, P);
            INFO("mem=" << mem << " batch=" << B << " Q=" << Q << " absorbed=" << (mode == mnemo::memory_attention::absorbed)
                        << " one-query route: " << route_name(rt));
            CHECK(attn.last_forward_absorbed() == (mem > 0 && mode == mnemo::memory_attention::absorbed));
            check_close("relative_attention out", out, ref, 1e-13, 1e-12);
        }
    }
}

TEST_CASE("relative_attention: state_dict names and shapes are the reference's") {
    mnemo::parameter_set<float> ps;
    mnemo::relative_attention<float, mnemo::config<16, 4>> attn(ps, "transformer.layers.0.self_attn");
    ps.allocate();
    auto shape = [&](const char* n) { return ps.find(std::string("transformer.layers.0.self_attn.") + n)->shape; };
    CHECK(shape("query.linear.weight") == std::vector<index_t>{16, 16});
    CHECK(ps.find("transformer.layers.0.self_attn.query.linear.bias") == nullptr);
    CHECK(ps.find("transformer.layers.0.self_attn.key.linear.bias") == nullptr);
    CHECK(shape("value.linear.bias") == std::vector<index_t>{16});
    CHECK(shape("output.weight") == std::vector<index_t>{16, 16});
    CHECK(shape("key_pos_embeddings") == std::vector<index_t>{8192, 4, 4});
    CHECK(shape("key_pos_bias") == std::vector<index_t>{8192, 4});
    CHECK(shape("query_pos_bias") == std::vector<index_t>{4, 4});
}

TEST_CASE("relative_attention: backward matches finite differences") {
  for (route rt : one_query_routes)
  for (auto mode : modes)
  for (index_t Q : {1, 3}) {
    const forced_route forced(rt);
    INFO("absorbed=" << (mode == mnemo::memory_attention::absorbed) << " Q=" << Q << " one-query route: " << route_name(rt));
    const index_t mem = 2, Kn = mem + Q, B = 2, P = 6;
    mnemo::parameter_set<double> ps;
    mnemo::relative_attention<double, cfg> attn(ps, "self_attn", P);
    ps.allocate();
    attn.set_memory_attention(mode);
    randomize_parameters(ps, 31, -0.8, 0.8);
    auto zq = random_vector<double>(Q * B * D, 32);
    auto zkv = random_vector<double>(Kn * B * D, 33);
    auto r = random_vector<double>(Q * B * D, 34);
    std::vector<double> out(Q * B * D), dzq(Q * B * D), dzkv(Kn * B * D);
    auto loss = loss_and_gradients(attn, ps, zq, zkv, r, B, out, dzq, dzkv);
    auto targets = parameter_targets(ps);
    targets.push_back({"z_q", zq.data(), dzq});
    targets.push_back({"z_kv", zkv.data(), dzkv});
    check_gradients(loss, targets);

    // Only table rows P − K + 1 … P can receive gradient (distances K − 1 … 0).
    const auto* e = ps.find("self_attn.key_pos_bias");
    for (index_t row = 0; row < 2 * P; ++row)
        for (index_t h = 0; h < H; ++h) {
            const double g = ps.grads()[e->offset + row * H + h];
            if (row < P - Kn + 1 || row > P) CHECK(g == 0.0);
            else CHECK(g != 0.0);
        }
  }
}

// The positional terms are computed per block of query positions, each over its band of the window:
// for all heads at once, about 128 rows of [Q·B, W] a block (with 32 batch elements a block is 4
// positions, so Q = 9 runs three blocks, the last of one position), or with 16 queries or more over
// projected keys, head by head in blocks of at most 36 positions (Q = 40: two blocks of 20). Forward
// against the formula (with distances clamped) and backward against finite differences, on both
// memory routes.
TEST_CASE("relative_attention: positional terms over several blocks of query positions, with clamp_len") {
    struct shape {
        index_t mem, Q, B, P;
    };
    for (const shape sh : {shape{3, 9, 32, 16}, shape{5, 40, 2, 48}})
    for (auto mode : modes)
    for (index_t clamp : {0, 5}) {
        const index_t mem = sh.mem, Q = sh.Q, Kn = mem + Q, B = sh.B, P = sh.P;
        INFO("Q=" << Q << " absorbed=" << (mode == mnemo::memory_attention::absorbed) << " clamp_len=" << clamp);
        mnemo::parameter_set<double> ps;
        mnemo::relative_attention<double, cfg> attn(ps, "self_attn", P);
        ps.allocate();
        attn.set_memory_attention(mode);
        if (clamp > 0) attn.set_clamp_len(clamp);
        randomize_parameters(ps, 51 + clamp, -0.8, 0.8);
        auto zkv = random_vector<double>(Kn * B * D, 52);
        std::vector<double> zq(zkv.end() - Q * B * D, zkv.end());
        auto r = random_vector<double>(Q * B * D, 53);
        std::vector<double> out(Q * B * D), dzq(Q * B * D), dzkv(Kn * B * D);
        auto loss = loss_and_gradients(attn, ps, zq, zkv, r, B, out, dzq, dzkv);
        check_close("relative_attention out", out, naive(ps, "self_attn", zq, zkv, Q, Kn, B, P, clamp), 1e-13, 1e-12);
        auto targets = parameter_targets(ps);
        targets.push_back({"z_q", zq.data(), dzq});
        check_gradients(loss, targets, 1e-6, 1e-6, 160);  // the 160 largest gradients of each tensor and a sample
    }
}

// The absorbed route against the projected one (which the tests above tie to the formula and to
// finite differences), with key padding, clamp_len, frozen memory rows that are a layer norm's output
// (the norm's parameter gradients from ẑ), frozen raw rows, and some memory rows not frozen.
TEST_CASE("relative_attention: absorbed memory equals projected memory, forward and backward") {
  for (index_t Q : {1, 3}) {  // Q = 1: the projected route is one_query_forward
    INFO("Q=" << Q);
    const index_t mem = 5, Kn = mem + Q, B = 3, P = 10;
    struct run {
        std::vector<double> out, dzq, dzkv, grads, dgamma, dbeta;
    };
    // Variants 4 and 5 are 0 and 1 with the norm's rows also given to forward (the absorbed route
    // then works from ẑ and forms no d z for the memory rows); 6 and 7 the same with the absorbed
    // route's ẑ laid out by batch element (frozen_key_rows::ld_batch).
    for (int v = 0; v < 8; ++v) {
        INFO("variant " << v);
        const int variant = v < 4 ? v : v % 2;
        const bool forward_norm = v >= 4, by_batch = v >= 6;
        auto go = [&](mnemo::memory_attention mode) {
            mnemo::parameter_set<double> ps;
            mnemo::relative_attention<double, cfg> attn(ps, "self_attn", P);
            ps.allocate();
            attn.set_memory_attention(mode);
            randomize_parameters(ps, 41, -0.8, 0.8);
            auto zkv = random_vector<double>(Kn * B * D, 42);
            std::vector<double> zq(zkv.end() - Q * B * D, zkv.end());
            auto zhat = random_vector<double>(mem * B * D, 43);
            auto gamma = random_vector<double>(D, 44), beta = random_vector<double>(D, 45);
            for (index_t r = 0; r < mem * B; ++r)  // the memory rows are the norm's output ẑ∘γ + β
                for (index_t i = 0; i < D; ++i) zkv[r * D + i] = zhat[r * D + i] * gamma[i] + beta[i];
            auto r = random_vector<double>(Q * B * D, 46);
            std::vector<std::uint8_t> pad(std::size_t(Kn * B), 0);
            if (variant == 1) {
                pad[0 * B + 1] = pad[3 * B + 1] = pad[2 * B + 2] = 1;  // some memory keys of elements 1, 2
                attn.set_key_padding(pad.data());
            }
            if (variant == 2) attn.set_clamp_len(3);
            run out;
            out.out.resize(Q * B * D);
            out.dzq.resize(Q * B * D);
            out.dzkv.assign(Kn * B * D, -7.0);  // frozen rows must stay untouched
            out.dgamma.assign(D, 0.5);
            out.dbeta.assign(D, -0.25);
            mnemo::frozen_key_rows<double> frozen;
            if (variant == 0 || variant == 1)
                frozen = {mem * B, zhat.data(), D, gamma.data(), beta.data(), out.dgamma.data(), out.dbeta.data()};
            std::vector<double> zhat_by_batch(zhat.size());  // [B, mem, D]
            if (by_batch && mode == mnemo::memory_attention::absorbed) {
                for (index_t j = 0; j < mem; ++j)
                    for (index_t b = 0; b < B; ++b)
                        for (index_t i = 0; i < D; ++i) zhat_by_batch[(b * mem + j) * D + i] = zhat[(j * B + b) * D + i];
                frozen.zhat = zhat_by_batch.data();
                frozen.ld_batch = mem * D;
            }
            if (variant == 2) frozen = {2 * B};  // raw rows, the first two positions only
            // Absorbed with the norm's rows: the memory rows of z_kv are NaN and marked unwritten (never read).
            mnemo::frozen_key_rows<double> norm_rows = forward_norm ? frozen : mnemo::frozen_key_rows<double>{};
            auto zkv_seen = zkv;
            if (forward_norm && mode == mnemo::memory_attention::absorbed) {
                norm_rows.z_unwritten = true;
                std::fill(zkv_seen.begin(), zkv_seen.begin() + mem * B * D, std::nan(""));
            }
            attn.forward(view<const double, D>(zq.data(), Q * B), view<const double, D>(zkv_seen.data(), Kn * B), B,
                         view<double, D>(out.out.data(), Q * B), {}, norm_rows);
            CHECK(attn.last_forward_absorbed() == (mode == mnemo::memory_attention::absorbed));
            ps.zero_grad();
            attn.backward(view<const double, D>(zq.data(), Q * B), view<const double, D>(zkv_seen.data(), Kn * B),
                          view<const double, D>(r.data(), Q * B), view<double, D>(out.dzq.data(), Q * B),
                          view<double, D>(out.dzkv.data(), Kn * B), false, frozen);
            out.grads.assign(ps.grads(), ps.grads() + ps.size());
            return out;
        };
        const run p = go(mnemo::memory_attention::projected), a = go(mnemo::memory_attention::absorbed);
        check_close("out", a.out, p.out, 1e-13, 1e-12);
        check_close("d z_q", a.dzq, p.dzq, 1e-12, 1e-12);
        check_close("d z_kv", a.dzkv, p.dzkv, 1e-12, 1e-12);
        check_close("parameter gradients", a.grads, p.grads, 1e-12, 1e-12);
        check_close("d gamma", a.dgamma, p.dgamma, 1e-12, 1e-12);
        check_close("d beta", a.dbeta, p.dbeta, 1e-12, 1e-12);
    }
  }
}

TEST_CASE("relative_attention: more keys than relative positions is a clear error") {
    mnemo::parameter_set<float> ps;
    mnemo::relative_attention<float, cfg> attn(ps, "self_attn", 4);
    ps.allocate();
    std::vector<float> zkv(5 * D), out(2 * D);
    CHECK_THROWS_WITH_AS(attn.forward(view<const float, D>(zkv.data() + 3 * D, 2), view<const float, D>(zkv.data(), 5), 1,
                                      view<float, D>(out.data(), 2)),
                         doctest::Contains("5 key positions (memory 3 + segment 2) need more relative positions than n_pos = 4"),
                         mnemo::error);
    using attention = mnemo::relative_attention<float, cfg>;
    mnemo::parameter_set<float> fresh;
    CHECK_THROWS_WITH_AS(attention(fresh, "x", 0), doctest::Contains("n_pos"), mnemo::error);
}

// ẑ given to forward with the memory rows of z_kv left unwritten, or laid out by batch element: both
// need the absorbed route (forward and backward), and backward's rows must be forward's.
TEST_CASE("relative_attention: memory rows left unwritten or ẑ by batch element need the absorbed route") {
    const index_t Q = 2, mem = 3, B = 2;
    mnemo::parameter_set<float> ps;
    mnemo::relative_attention<float, cfg> attn(ps, "self_attn", 8);
    ps.allocate();
    std::vector<float> zkv((mem + Q) * B * D, 0.5f), zhat(mem * B * D, 0.25f), gamma(D, 1.0f), beta(D, 0.0f),
        out(Q * B * D), dzq(Q * B * D), dzkv((mem + Q) * B * D), dout(Q * B * D, 1.0f), dg(D), db(D);
    const mnemo::frozen_key_rows<float> rows{mem * B, zhat.data(), D, gamma.data(), beta.data(), dg.data(), db.data()};
    auto forward = [&](const mnemo::frozen_key_rows<float>& r) {
        attn.forward(view<const float, D>(zkv.data() + mem * B * D, Q * B), view<const float, D>(zkv.data(), (mem + Q) * B),
                     B, view<float, D>(out.data(), Q * B), {}, r);
    };
    auto backward = [&](const mnemo::frozen_key_rows<float>& r) {
        attn.backward(view<const float, D>(zkv.data() + mem * B * D, Q * B), view<const float, D>(zkv.data(), (mem + Q) * B),
                      view<const float, D>(dout.data(), Q * B), view<float, D>(dzq.data(), Q * B),
                      view<float, D>(dzkv.data(), (mem + Q) * B), false, r);
    };
    SUBCASE("memory rows left unwritten") {
        auto unwritten = rows;
        unwritten.z_unwritten = true;
        attn.set_memory_attention(mnemo::memory_attention::projected);
        CHECK_FALSE(attn.would_absorb(Q, mem + Q));
        CHECK_THROWS_WITH_AS(forward(unwritten), doctest::Contains("left unwritten"), mnemo::error);
        attn.set_memory_attention(mnemo::memory_attention::absorbed);
        CHECK(attn.would_absorb(Q, mem + Q));
        CHECK_NOTHROW(forward(unwritten));
    }
    SUBCASE("ẑ by batch element") {
        auto by_batch = rows;
        by_batch.ld_batch = mem * D;
        attn.set_memory_attention(mnemo::memory_attention::projected);
        CHECK_THROWS_WITH_AS(forward(by_batch), doctest::Contains("by batch element"), mnemo::error);
        forward({});
        CHECK_THROWS_WITH_AS(backward(by_batch), doctest::Contains("by batch element"), mnemo::error);
        attn.set_memory_attention(mnemo::memory_attention::absorbed);
        forward({});  // absorbed, but backward's rows are not forward's
        CHECK_THROWS_WITH_AS(backward(by_batch), doctest::Contains("by batch element"), mnemo::error);
        forward(by_batch);
        CHECK_NOTHROW(backward(by_batch));
    }
}

// One query position (a generated token) over enough keys that one_query_forward splits its rows and
// heads over the threads: the same bits on 1, 2 and 3 threads, batch 1 and 3, and the per-head
// route's result (a forward of two query positions whose last row is the same token) to float
// precision.
TEST_CASE("relative_attention: one query position gives the same bits on 1, 2 and 3 threads") {
    using big = mnemo::config<128, 4>;  // d_k 32; 4 heads × 601 keys × 32: past one_query_worth_threads()
    constexpr index_t Db = 128;
    const index_t mem = 600, P = 1024;
    for (route rt : one_query_routes)
    for (index_t B : {1, 3}) {
        const forced_route forced(rt);
        INFO("batch " << B << ", one-query route: " << route_name(rt));
        mnemo::parameter_set<float> ps;
        mnemo::relative_attention<float, big> attn(ps, "self_attn", P);
        ps.allocate();
        attn.set_memory_attention(mnemo::memory_attention::projected);
        randomize_parameters(ps, 51, -0.3f, 0.3f);
        auto zkv = random_vector<float>((mem + 2) * B * Db, 52);
        std::vector<float> out[3];
        const int saved = omp_get_max_threads();
        for (int threads = 1; threads <= 3; ++threads) {
            omp_set_num_threads(threads);
            out[threads - 1].assign(std::size_t(B * Db), 0.0f);
            attn.forward(view<const float, Db>(zkv.data() + (mem + 1) * B * Db, B),
                         view<const float, Db>(zkv.data(), (mem + 2) * B), B,
                         view<float, Db>(out[threads - 1].data(), B));
        }
        omp_set_num_threads(saved);
        CHECK(out[0] == out[1]);
        CHECK(out[0] == out[2]);
        // Two query positions (the per-head products): the last one sees the same keys.
        std::vector<float> two(std::size_t(2 * B * Db));
        attn.forward(view<const float, Db>(zkv.data() + mem * B * Db, 2 * B), view<const float, Db>(zkv.data(), (mem + 2) * B),
                     B, view<float, Db>(two.data(), 2 * B));
        std::vector<double> last(two.begin() + B * Db, two.end()), one(out[0].begin(), out[0].end());
        check_close("one query vs per-head route", one, last, 1e-5, 1e-5);
    }
}

// One query position over projected keys, both routes (the online one reads each key's window row
// and [k, v] row once, its softmax online by blocks of 64 keys): with key padding (element 1 loses
// keys in every block and the whole first block, element 2 every key) and clamp_len (the keys past
// 25 positions take the clamped distance), the context and the attention weights against the
// per-head route's last query (two query positions over the same keys), and the same bits on 1, 2
// and 3 threads. Large scores (parameters ×4) make the running maxima rise inside blocks, which
// rescales the online route's partial sums.
TEST_CASE("relative_attention: one query position with key padding and clamp_len matches the per-head route") {
    using big = mnemo::config<128, 4>;  // d_k 32
    constexpr index_t Db = 128, Hb = 4;
    const index_t B = 3, P = 256;
    for (route rt : one_query_routes)
    for (index_t mem : {40, 149})
    for (float range : {0.3f, 1.2f})
    for (index_t clamp : {0, 25}) {
        const forced_route forced(rt);
        const index_t Kn = mem + 2;
        INFO("mem " << mem << ", clamp_len " << clamp << ", parameters in ±" << range << ", one-query route: " << route_name(rt));
        mnemo::parameter_set<float> ps;
        mnemo::relative_attention<float, big> attn(ps, "self_attn", P);
        ps.allocate();
        attn.set_memory_attention(mnemo::memory_attention::projected);
        if (clamp > 0) attn.set_clamp_len(clamp);
        randomize_parameters(ps, 91, -range, range);
        auto zkv = random_vector<float>(Kn * B * Db, 92);
        std::vector<std::uint8_t> pad(std::size_t(Kn * B), 0);
        for (index_t j = 0; j < Kn; ++j) {
            pad[j * B + 1] = j < (Kn > 64 ? 64 : 10) || j % 5 == 2;  // element 1: the first block (or 10) and a fifth
            pad[j * B + 2] = 1;                      // element 2: every key
        }
        attn.set_key_padding(pad.data());
        std::vector<float> out[3], weights[3];
        const int saved = omp_get_max_threads();
        for (int threads = 1; threads <= 3; ++threads) {
            omp_set_num_threads(threads);
            out[threads - 1].assign(std::size_t(B * Db), 0.0f);
            attn.forward(view<const float, Db>(zkv.data() + (mem + 1) * B * Db, B), view<const float, Db>(zkv.data(), Kn * B),
                         B, view<float, Db>(out[threads - 1].data(), B));
            weights[threads - 1].assign(attn.attention_weights(), attn.attention_weights() + B * Hb * Kn);
        }
        omp_set_num_threads(saved);
        CHECK(out[0] == out[1]);
        CHECK(out[0] == out[2]);
        CHECK(weights[0] == weights[1]);
        CHECK(weights[0] == weights[2]);
        for (index_t b = 0; b < B; ++b)
            for (index_t h = 0; h < Hb; ++h) {
                double sum = 0;
                for (index_t j = 0; j < Kn; ++j) {
                    const float a = weights[0][std::size_t((b * Hb + h) * Kn + j)];
                    if (pad[j * B + b]) CHECK(a == 0.0f);
                    sum += a;
                }
                CHECK(sum == doctest::Approx(b == 2 ? 0.0 : 1.0).epsilon(1e-5));
            }
        std::vector<float> two(std::size_t(2 * B * Db));
        attn.forward(view<const float, Db>(zkv.data() + mem * B * Db, 2 * B), view<const float, Db>(zkv.data(), Kn * B), B,
                     view<float, Db>(two.data(), 2 * B));
        std::vector<double> last(two.begin() + B * Db, two.end()), one(out[0].begin(), out[0].end());
        // Float's rounding of scores as large as these (±1.2: the two routes' contexts differ by 4e-5
        // at 2.7, the same with the two passes one_query_forward made before its online softmax).
        const double tol = range > 1.0f ? 1e-4 : 1e-5;
        check_close("one query vs per-head route", one, last, tol, tol);
        std::vector<double> w_one(weights[0].begin(), weights[0].end()), w_two;  // [B, H, 1, K] vs row 1 of [B, H, 2, K]
        for (index_t bh = 0; bh < B * Hb; ++bh)
            w_two.insert(w_two.end(), attn.attention_weights() + (bh * 2 + 1) * Kn, attn.attention_weights() + (bh * 2 + 2) * Kn);
        check_close("one query's weights vs per-head route", w_one, w_two, tol, tol / 10);
    }
}

// With 16 queries or more over projected keys, backward runs each head on one thread (its batch
// elements in order: R's and S's window gradients sum over them) and the positional gradient block
// by block after each (batch element, head)'s d scores: the same bits on 1, 2 and 3 threads (4 heads:
// 3 threads take 2, 1 and 1), over two blocks of query positions, with and without clamp_len.
TEST_CASE("relative_attention: backward over 16 or more queries gives the same bits on 1, 2 and 3 threads") {
    using big = mnemo::config<128, 4>;  // d_k 32
    constexpr index_t Db = 128;
    const index_t mem = 30, Q = 40, Kn = mem + Q, B = 3, P = 128;
    for (index_t clamp : {0, 20}) {
        INFO("clamp_len " << clamp);
        mnemo::parameter_set<float> ps;
        mnemo::relative_attention<float, big> attn(ps, "self_attn", P);
        ps.allocate();
        attn.set_memory_attention(mnemo::memory_attention::projected);
        if (clamp > 0) attn.set_clamp_len(clamp);
        randomize_parameters(ps, 71, -0.3f, 0.3f);
        auto zkv = random_vector<float>(Kn * B * Db, 72);
        auto r = random_vector<float>(Q * B * Db, 73);
        const float* zq = zkv.data() + mem * B * Db;
        std::vector<float> out[3], dzq[3], dzkv[3], grads[3];
        const int saved = omp_get_max_threads();
        for (int t = 0; t < 3; ++t) {
            omp_set_num_threads(t + 1);
            out[t].assign(std::size_t(Q * B * Db), 0.0f);
            dzq[t].assign(std::size_t(Q * B * Db), 0.0f);
            dzkv[t].assign(std::size_t(Kn * B * Db), 0.0f);
            attn.forward(view<const float, Db>(zq, Q * B), view<const float, Db>(zkv.data(), Kn * B), B,
                         view<float, Db>(out[t].data(), Q * B));
            ps.zero_grad();
            attn.backward(view<const float, Db>(zq, Q * B), view<const float, Db>(zkv.data(), Kn * B),
                          view<const float, Db>(r.data(), Q * B), view<float, Db>(dzq[t].data(), Q * B),
                          view<float, Db>(dzkv[t].data(), Kn * B));
            grads[t].assign(ps.grads(), ps.grads() + ps.size());
        }
        omp_set_num_threads(saved);
        REQUIRE(!attn.last_forward_absorbed());
        for (int t = 1; t < 3; ++t) {
            INFO("threads: " << t + 1);
            CHECK(out[t] == out[0]);
            CHECK(dzq[t] == dzq[0]);
            CHECK(dzkv[t] == dzkv[0]);
            CHECK(grads[t] == grads[0]);
        }
        const auto* e = ps.find("self_attn.key_pos_embeddings");
        CHECK(std::any_of(grads[0].begin() + e->offset, grads[0].begin() + e->offset + e->size,
                          [](float g) { return g != 0.0f; }));
    }
}

TEST_CASE("relative_attention: a generated token's q, k and v from one product give the bits of three") {
    // z_q the last rows of z_kv (the same memory): [W_q; W_k; W_v] in one product; z_q a copy of
    // those rows: three. Over the memory's routes a generated token takes (absorbed, none, reused
    // keys and values), batch 1 and 3.
    using big = mnemo::config<128, 4>;
    constexpr index_t Db = 128;
    const index_t mem = 40, P = 128;
    for (index_t B : {1, 3})
        for (int route = 0; route < 3; ++route) {
            INFO("batch " << B << ", route " << route);
            mnemo::parameter_set<float> ps;
            mnemo::relative_attention<float, big> attn(ps, "self_attn", P);
            ps.allocate();
            randomize_parameters(ps, 61, -0.3f, 0.3f);
            const index_t m = route == 1 ? 0 : mem;  // memory positions
            auto zkv = random_vector<float>((m + 1) * B * Db, 62);
            const float* last = zkv.data() + m * B * Db;
            const std::vector<float> copy(last, last + B * Db);
            std::vector<float> out[2];
            for (int aliased = 0; aliased < 2; ++aliased) {
                mnemo::kv_reuse reuse;
                if (route == 2) {  // a first forward projects every position; the second reuses all but the last
                    attn.keep_projections(true);
                    std::vector<float> first(std::size_t(B * Db));
                    attn.forward(view<const float, Db>(copy.data(), B), view<const float, Db>(zkv.data(), (m + 1) * B), B,
                                 view<float, Db>(first.data(), B));
                    reuse.add(0, 0, m);
                } else {
                    attn.set_memory_attention(mnemo::memory_attention::absorbed);
                }
                out[aliased].assign(std::size_t(B * Db), 0.0f);
                attn.forward(view<const float, Db>(aliased ? last : copy.data(), B),
                             view<const float, Db>(zkv.data(), (m + 1) * B), B, view<float, Db>(out[aliased].data(), B),
                             reuse);
                if (route == 0) CHECK(attn.last_forward_absorbed());
                CHECK(attn.last_forward_fused() == bool(aliased));
            }
            CHECK(out[0] == out[1]);
        }
}

TEST_CASE("relative_attention: the compressed memory's keys kept apart (kv_reuse::split) give the bits of one buffer") {
    // A stream of generated tokens over [compressed slots | memory slots | token], as the compressive
    // model's cache: each token joins the memory; every third token the memory's three oldest slots
    // become one compressed slot (the oldest dropped past C), and every seventh step is two tokens at
    // once (no split then: the buffers join and part again). One attention keeps positions [0, cc)
    // in their own buffer, one keeps every row in one buffer, one projects every row afresh: the
    // first two give the same bits, the third the same numbers.
    using c16 = mnemo::config<16, 2>;
    constexpr index_t Dm = 16;
    const index_t P = 160, M = 40, C = 75;
    for (route rt : one_query_routes)
    for (index_t B : {1, 2}) {
        const forced_route forced(rt);
        INFO("batch " << B << ", one-query route: " << route_name(rt));
        mnemo::parameter_set<float> ps[3];
        std::vector<mnemo::relative_attention<float, c16>> attn;
        for (auto& p : ps) attn.emplace_back(p, "a", P);
        for (int i = 0; i < 3; ++i) {
            ps[i].allocate();
            randomize_parameters(ps[i], 71, -0.3f, 0.3f);
            attn[std::size_t(i)].keep_projections(true);
        }
        // Slot ids; id k's input row (B rows of Dm) is a function of k alone.
        auto row_of = [&](std::int64_t id) { return random_vector<float>(B * Dm, std::uint64_t(1000 + id)); };
        std::vector<std::int64_t> comp, memo, last_comp, last_keys;  // last_keys: the last call's memory + tokens
        for (std::int64_t id = 0; id < 60; ++id) comp.push_back(id);  // start with 60 compressed slots
        std::int64_t next = 1000;
        for (std::int64_t id = 0; id < 10; ++id) memo.push_back(next++);
        bool first = true;
        index_t splits = 0, last_k = 0;
        for (int step = 0; step < 90; ++step) {
            const index_t q = step % 7 == 3 ? 2 : 1;
            std::vector<std::int64_t> keys = memo;
            for (index_t i = 0; i < q; ++i) keys.push_back(next++);
            const index_t cc = index_t(comp.size()), K = cc + index_t(keys.size());
            std::vector<float> zkv;
            for (auto id : comp) for (float v : row_of(id)) zkv.push_back(v);
            for (auto id : keys) for (float v : row_of(id)) zkv.push_back(v);
            mnemo::kv_reuse reuse;
            if (!first) {  // the spans the model's memory_reuse gives: compressed slots, then memory slots
                auto span = [&](const std::vector<std::int64_t>& now, index_t now_at, const std::vector<std::int64_t>& then,
                                index_t then_at, index_t now_len) {
                    for (index_t i = 0; i < now_len; ++i) {
                        auto it = std::find(then.begin(), then.end(), now[std::size_t(i)]);
                        if (it == then.end()) continue;
                        index_t len = 0;
                        const index_t j = index_t(it - then.begin());
                        while (i + len < now_len && j + len < index_t(then.size()) &&
                               now[std::size_t(i + len)] == then[std::size_t(j + len)])
                            ++len;
                        reuse.add(now_at + i, then_at + j, len);
                        return;
                    }
                };
                span(comp, 0, last_comp, 0, cc);
                span(keys, cc, last_keys, index_t(last_comp.size()), index_t(memo.size()));
            }
            std::vector<float> out[3];
            for (int i = 0; i < 3; ++i) {
                mnemo::kv_reuse r = i == 2 ? mnemo::kv_reuse{} : reuse;
                if (i == 0) r.split = cc;
                out[i].assign(std::size_t(q * B * Dm), 0.0f);
                attn[std::size_t(i)].forward(view<const float, Dm>(zkv.data() + (K - q) * B * Dm, q * B),
                                             view<const float, Dm>(zkv.data(), K * B), B,
                                             view<float, Dm>(out[i].data(), q * B), r);
            }
            splits += q == 1 && !first;
            last_k = K;
            CHECK(out[0] == out[1]);
            for (std::size_t k = 0; k < out[0].size(); ++k) CHECK(out[0][k] == doctest::Approx(out[2][k]).epsilon(1e-4));
            first = false;
            last_comp = comp;
            last_keys = keys;
            for (auto id : std::vector<std::int64_t>(keys.end() - q, keys.end())) memo.push_back(id);
            if (step % 3 == 2) {  // compress the three oldest memory slots into a new compressed slot
                memo.erase(memo.begin(), memo.begin() + 3);
                comp.push_back(next++);
                if (index_t(comp.size()) > C) comp.erase(comp.begin());
            }
            if (index_t(memo.size()) > M) memo.erase(memo.begin(), memo.begin() + (index_t(memo.size()) - M));
        }
        CHECK(splits > 60);
        // Backward reads the keys from one buffer: after a forward that kept them apart, an error.
        const std::vector<float> d(std::size_t(B * Dm), 1.0f);
        std::vector<float> dzq(std::size_t(B * Dm)), dzkv(std::size_t(200 * B * Dm));
        const index_t K = last_k;  // the last step: one token
        std::vector<float> zkv(std::size_t(K * B * Dm), 0.5f);
        CHECK_THROWS_WITH_AS(attn[0].backward(view<const float, Dm>(zkv.data() + (K - 1) * B * Dm, B),
                                              view<const float, Dm>(zkv.data(), K * B), view<const float, Dm>(d.data(), B),
                                              view<float, Dm>(dzq.data(), B), view<float, Dm>(dzkv.data(), K * B)),
                             doctest::Contains("apart"), mnemo::error);
    }
}
