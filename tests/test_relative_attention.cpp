// Relative multi-head attention: forward against a naive loop over the defining formula (direct
// indexing by δ = L_mem + i − j), backward against finite differences in double.
#include <doctest/doctest.h>

#include <cmath>
#include <limits>
#include <vector>

#include <mnemo/core/config.hpp>
#include <mnemo/nn/relative_attention.hpp>

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
                          const std::vector<double>& zkv, index_t Q, index_t Kn, index_t B, index_t P) {
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
                    const index_t delta = mem + i - j, row = P - delta;
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

}  // namespace

TEST_CASE("relative_attention: forward matches the defining formula, with and without memory") {
    for (index_t mem : {0, 1, 4}) {
        for (index_t B : {1, 3}) {
            const index_t Q = 3, Kn = mem + Q, P = 8;
            mnemo::parameter_set<double> ps;
            mnemo::relative_attention<double, cfg> attn(ps, "self_attn", P);
            ps.allocate();
            randomize_parameters(ps, 10 + mem + B, -0.8, 0.8);
            auto zkv = random_vector<double>(Kn * B * D, 20 + mem);
            std::vector<double> zq(zkv.end() - Q * B * D, zkv.end());  // queries: the segment's rows
            std::vector<double> out(Q * B * D);
            attn.forward(view<const double, D>(zq.data(), Q * B), view<const double, D>(zkv.data(), Kn * B), B,
                         view<double, D>(out.data(), Q * B));
            auto ref = naive(ps, "self_attn", zq, zkv, Q, Kn, B, P);
            INFO("mem=" << mem << " batch=" << B);
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
    const index_t Q = 3, mem = 2, Kn = mem + Q, B = 2, P = 6;
    mnemo::parameter_set<double> ps;
    mnemo::relative_attention<double, cfg> attn(ps, "self_attn", P);
    ps.allocate();
    randomize_parameters(ps, 31, -0.8, 0.8);
    auto zq = random_vector<double>(Q * B * D, 32);
    auto zkv = random_vector<double>(Kn * B * D, 33);
    auto r = random_vector<double>(Q * B * D, 34);
    std::vector<double> out(Q * B * D), dzq(Q * B * D), dzkv(Kn * B * D);
    auto loss = [&] {
        attn.forward(view<const double, D>(zq.data(), Q * B), view<const double, D>(zkv.data(), Kn * B), B,
                     view<double, D>(out.data(), Q * B));
        return project(out, r);
    };
    loss();
    ps.zero_grad();
    attn.backward(view<const double, D>(zq.data(), Q * B), view<const double, D>(zkv.data(), Kn * B),
                  view<const double, D>(r.data(), Q * B), view<double, D>(dzq.data(), Q * B),
                  view<double, D>(dzkv.data(), Kn * B));
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
