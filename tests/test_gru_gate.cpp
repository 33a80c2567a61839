// GRU gating (nn/gru_gate.hpp): forward against a plain loop of torch.nn.GRUCell's math, finite-
// difference gradient checks in double for every parameter and both inputs, accumulation into
// pre-filled parameter gradients and the accumulate flags, parity with real PyTorch
// (tools/golden_gru.py), shape errors, and no heap allocation once the buffers have grown.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <type_traits>
#include <vector>

#include <mnemo/nn/gru_gate.hpp>
#include <mnemo/io/safetensors.hpp>

#include "allocation_counter.hpp"
#include "gradcheck.hpp"

using mnemo::index_t;
using mnemo::view;
using mnemo::testing::check_accumulates;
using mnemo::testing::check_close;
using mnemo::testing::check_gradients;
using mnemo::testing::meta_int;
using mnemo::testing::parameter_targets;
using mnemo::testing::project;
using mnemo::testing::random_vector;
using mnemo::testing::randomize_parameters;

namespace {

double sigmoid(double a) { return 1.0 / (1.0 + std::exp(-a)); }

// torch.nn.GRUCell(d, d)(y, x) written out element by element, in double.
std::vector<double> reference_gru(index_t rows, index_t d, const std::vector<double>& x, const std::vector<double>& y,
                                  const double* w_ih, const double* w_hh, const double* b_ih, const double* b_hh) {
    std::vector<double> out(static_cast<std::size_t>(rows * d));
    for (index_t i = 0; i < rows; ++i) {
        for (index_t j = 0; j < d; ++j) {
            double gi[3], gh[3];
            for (index_t g = 0; g < 3; ++g) {
                const index_t row = g * d + j;
                gi[g] = b_ih[row];
                gh[g] = b_hh[row];
                for (index_t k = 0; k < d; ++k) {
                    gi[g] += y[i * d + k] * w_ih[row * d + k];
                    gh[g] += x[i * d + k] * w_hh[row * d + k];
                }
            }
            const double r = sigmoid(gi[0] + gh[0]);
            const double z = sigmoid(gi[1] + gh[1]);
            const double n = std::tanh(gi[2] + r * gh[2]);
            out[i * d + j] = (1 - z) * n + z * x[i * d + j];
        }
    }
    return out;
}

template <std::size_t D>
std::vector<double> reference_of(const mnemo::gru_gate<double, D>& gru, index_t rows, const std::vector<double>& x,
                                 const std::vector<double>& y) {
    return reference_gru(rows, index_t(D), x, y, gru.weight_ih().value(), gru.weight_hh().value(),
                         gru.bias_ih().value(), gru.bias_hh().value());
}

}  // namespace

TEST_CASE("gru_gate: parameters have torch.nn.GRUCell's names, shapes and default range") {
    constexpr std::size_t D = 6;
    mnemo::parameter_set<float> ps;
    mnemo::gru_gate<float, D> gru(ps, "transformer.layers.0.attn_gate.gru");
    ps.allocate();
    const std::string p = "transformer.layers.0.attn_gate.gru.";
    REQUIRE(ps.entries().size() == 4);
    CHECK(ps.find(p + "weight_ih")->shape == std::vector<index_t>{3 * D, D});
    CHECK(ps.find(p + "weight_hh")->shape == std::vector<index_t>{3 * D, D});
    CHECK(ps.find(p + "bias_ih")->shape == std::vector<index_t>{3 * D});
    CHECK(ps.find(p + "bias_hh")->shape == std::vector<index_t>{3 * D});
    mnemo::rng r(1);
    gru.reset_parameters(r);
    const double bound = 1.0 / std::sqrt(double(D));
    for (const auto& e : ps.entries()) {
        double lo = 1, hi = -1;
        for (index_t i = 0; i < e.size; ++i) {
            lo = std::min(lo, double(ps.values()[e.offset + i]));
            hi = std::max(hi, double(ps.values()[e.offset + i]));
        }
        INFO(e.name);
        CHECK(lo >= -bound);
        CHECK(hi <= bound);
        CHECK(hi - lo > bound);  // spread over the range, not constant
    }
}

TEST_CASE("gru_gate: forward matches a plain loop of torch.nn.GRUCell's math") {
    SUBCASE("small, contiguous and in place") {
        constexpr std::size_t D = 5;
        const index_t rows = 7;
        mnemo::parameter_set<double> ps;
        mnemo::gru_gate<double, D> gru(ps, "gru");
        ps.allocate();
        randomize_parameters(ps, 1);
        auto x = random_vector<double>(rows * D, 2, -2, 2);
        auto y = random_vector<double>(rows * D, 3, -2, 2);
        std::vector<double> out(rows * D);
        gru.forward(view<const double, D>(x.data(), rows), view<const double, D>(y.data(), rows),
                    view<double, D>(out.data(), rows));
        const auto ref = reference_of(gru, rows, x, y);
        check_close("out", out, ref, 1e-14, 1e-13);

        // out may be the stream itself (x), or the sub-layer output (y).
        auto stream = x;
        gru.forward(view<const double, D>(stream.data(), rows), view<const double, D>(y.data(), rows),
                    view<double, D>(stream.data(), rows));
        check_close("out written over x", stream, out, 0, 0);
        auto sub = y;
        gru.forward(view<const double, D>(x.data(), rows), view<const double, D>(sub.data(), rows),
                    view<double, D>(sub.data(), rows));
        check_close("out written over y", sub, out, 0, 0);
    }
    SUBCASE("strided column blocks of wider views") {
        constexpr std::size_t D = 4;
        const index_t rows = 3, ld = 11;
        mnemo::parameter_set<double> ps;
        mnemo::gru_gate<double, D> gru(ps, "gru");
        ps.allocate();
        randomize_parameters(ps, 4);
        auto wide = random_vector<double>(rows * ld, 5, -2, 2);
        std::vector<double> out_wide(rows * ld, 123.0);
        view<double> w(wide.data(), rows, ld), o(out_wide.data(), rows, ld);
        gru.forward(w.col_block<D>(1), w.col_block<D>(6), o.col_block<D>(3));
        std::vector<double> x(rows * D), y(rows * D);
        for (index_t i = 0; i < rows; ++i)
            for (index_t j = 0; j < index_t(D); ++j) {
                x[i * D + j] = wide[i * ld + 1 + j];
                y[i * D + j] = wide[i * ld + 6 + j];
            }
        const auto ref = reference_of(gru, rows, x, y);
        for (index_t i = 0; i < rows; ++i)
            for (index_t j = 0; j < ld; ++j) {
                if (j >= 3 && j < 3 + index_t(D)) CHECK(out_wide[i * ld + j] == doctest::Approx(ref[i * D + j - 3]).epsilon(1e-13));
                else CHECK(out_wide[i * ld + j] == 123.0);  // the other columns are left alone
            }
    }
    SUBCASE("large enough for the OpenMP path") {
        constexpr std::size_t D = 64;
        const index_t rows = 1100;  // rows·D >= 65536
        mnemo::parameter_set<double> ps;
        mnemo::gru_gate<double, D> gru(ps, "gru");
        ps.allocate();
        mnemo::rng r(6);
        gru.reset_parameters(r);
        auto x = random_vector<double>(rows * D, 7, -2, 2);
        auto y = random_vector<double>(rows * D, 8, -2, 2);
        std::vector<double> out(rows * D);
        gru.forward(view<const double, D>(x.data(), rows), view<const double, D>(y.data(), rows),
                    view<double, D>(out.data(), rows));
        check_close("out", out, reference_of(gru, rows, x, y), 1e-13, 1e-12);
    }
}

TEST_CASE("gru_gate: backward matches finite differences for every parameter and both inputs") {
    constexpr std::size_t D = 5;
    const index_t rows = 4;
    mnemo::parameter_set<double> ps;
    mnemo::gru_gate<double, D> gru(ps, "gru");
    ps.allocate();
    randomize_parameters(ps, 11);
    auto x = random_vector<double>(rows * D, 12, -1.5, 1.5);
    auto y = random_vector<double>(rows * D, 13, -1.5, 1.5);
    auto r = random_vector<double>(rows * D, 14);
    std::vector<double> out(rows * D), dx(rows * D), dy(rows * D);
    auto loss = [&] {
        gru.forward(view<const double, D>(x.data(), rows), view<const double, D>(y.data(), rows),
                    view<double, D>(out.data(), rows));
        return project(out, r);
    };
    loss();
    ps.zero_grad();
    gru.backward(view<const double, D>(r.data(), rows), view<double, D>(dx.data(), rows),
                 view<double, D>(dy.data(), rows));
    auto targets = parameter_targets(ps);
    REQUIRE(targets.size() == 4);
    targets.push_back({"x (stream / hidden)", x.data(), dx});
    targets.push_back({"y (sub-layer output / input)", y.data(), dy});
    check_gradients(loss, targets);
}

TEST_CASE("gru_gate: backward accumulates parameter gradients and honours the accumulate flags") {
    constexpr std::size_t D = 6;
    const index_t rows = 5;
    mnemo::parameter_set<double> ps;
    mnemo::gru_gate<double, D> gru(ps, "gru");
    ps.allocate();
    randomize_parameters(ps, 21);
    auto x = random_vector<double>(rows * D, 22);
    auto y = random_vector<double>(rows * D, 23);
    auto g = random_vector<double>(rows * D, 24);
    std::vector<double> out(rows * D), dx(rows * D), dy(rows * D);
    using V = view<double, D>;
    using CV = view<const double, D>;
    gru.forward(CV(x.data(), rows), CV(y.data(), rows), V(out.data(), rows));

    // Parameter gradients add up, over repeated backward calls after one forward.
    check_accumulates(ps, [&] { gru.backward(CV(g.data(), rows), V(dx.data(), rows), V(dy.data(), rows)); });

    ps.zero_grad();
    gru.backward(CV(g.data(), rows), V(dx.data(), rows), V(dy.data(), rows));
    const auto dx_clean = dx, dy_clean = dy;
    const std::vector<double> pgrad_clean(ps.grads(), ps.grads() + ps.size());

    SUBCASE("dx and dy are assigned by default, whatever they held") {
        std::fill(dx.begin(), dx.end(), 1e6);
        std::fill(dy.begin(), dy.end(), -1e6);
        gru.backward(CV(g.data(), rows), V(dx.data(), rows), V(dy.data(), rows));
        check_close("dx", dx, dx_clean, 0, 0);
        check_close("dy", dy, dy_clean, 0, 0);
    }
    SUBCASE("accumulate_dx and accumulate_dy add, each on its own") {
        for (int mask = 1; mask < 4; ++mask) {
            const bool acc_dx = mask & 1, acc_dy = mask & 2;
            auto pre_dx = random_vector<double>(rows * D, 30 + mask), pre_dy = random_vector<double>(rows * D, 40 + mask);
            dx = pre_dx;
            dy = pre_dy;
            gru.backward(CV(g.data(), rows), V(dx.data(), rows), V(dy.data(), rows), acc_dx, acc_dy);
            std::vector<double> want_dx(dx.size()), want_dy(dy.size());
            for (std::size_t i = 0; i < dx.size(); ++i) {
                want_dx[i] = acc_dx ? pre_dx[i] + dx_clean[i] : dx_clean[i];
                want_dy[i] = acc_dy ? pre_dy[i] + dy_clean[i] : dy_clean[i];
            }
            INFO("accumulate_dx " << acc_dx << ", accumulate_dy " << acc_dy);
            check_close("dx", dx, want_dx, 1e-14, 1e-13);
            check_close("dy", dy, want_dy, 1e-14, 1e-13);
        }
    }
    SUBCASE("empty views skip dx and dy; parameter gradients are the same") {
        ps.zero_grad();
        gru.backward(CV(g.data(), rows), V(), V());
        check_close("parameter gradients without dx, dy", ps.grads(), pgrad_clean.data(), ps.size(), 0, 0);
        ps.zero_grad();
        std::fill(dy.begin(), dy.end(), 7.0);
        gru.backward(CV(g.data(), rows), V(dx.data(), rows), V());
        check_close("dx alone", dx, dx_clean, 0, 0);
        for (double v : dy) REQUIRE(v == 7.0);
        std::fill(dx.begin(), dx.end(), 7.0);
        gru.backward(CV(g.data(), rows), V(), V(dy.data(), rows));
        check_close("dy alone", dy, dy_clean, 0, 0);
        for (double v : dx) REQUIRE(v == 7.0);
    }
    SUBCASE("dx or dy may be d_out's own memory") {
        auto inplace = g;
        gru.backward(CV(inplace.data(), rows), V(inplace.data(), rows), V(dy.data(), rows));
        check_close("dx over d_out", inplace, dx_clean, 0, 0);
        inplace = g;
        gru.backward(CV(inplace.data(), rows), V(dx.data(), rows), V(inplace.data(), rows));
        check_close("dy over d_out", inplace, dy_clean, 0, 0);
        // Accumulating into the stream's gradient that is d_out itself: dx = d_out + ∂/∂x.
        inplace = g;
        gru.backward(CV(inplace.data(), rows), V(inplace.data(), rows), V(), true);
        std::vector<double> want(g.size());
        for (std::size_t i = 0; i < g.size(); ++i) want[i] = g[i] + dx_clean[i];
        check_close("dx += over d_out", inplace, want, 1e-14, 1e-13);
    }
}

TEST_CASE("gru_gate: shapes are checked at run time") {
    constexpr std::size_t D = 3;
    mnemo::parameter_set<float> ps;
    mnemo::gru_gate<float, D> gru(ps, "gru");
    ps.allocate();
    std::vector<float> a(4 * D), b(4 * D), c(4 * D);
    using V = view<float, D>;
    CHECK_THROWS_WITH_AS(gru.backward(V(a.data(), 4), V(b.data(), 4), V(c.data(), 4)),
                         doctest::Contains("gru_gate: backward called before forward"), mnemo::error);
    CHECK_THROWS_WITH_AS(gru.forward(V(a.data(), 4), V(b.data(), 3), V(c.data(), 4)),
                         doctest::Contains("gru_gate: x has 4 rows but y has 3"), mnemo::error);
    CHECK_THROWS_WITH_AS(gru.forward(view<float>(a.data(), 3, 4), V(b.data(), 3), V(c.data(), 3)),
                         doctest::Contains("gru_gate: x has 4 features, expected 3"), mnemo::error);
    gru.forward(V(a.data(), 4), V(b.data(), 4), V(c.data(), 4));
    CHECK_THROWS_WITH_AS(gru.backward(V(a.data(), 2), V(b.data(), 2), V(c.data(), 2)),
                         doctest::Contains("gru_gate: backward over 2 rows but the last forward saw 4"), mnemo::error);
    CHECK_THROWS_WITH_AS(gru.backward(V(a.data(), 4), V(b.data(), 3), V()),
                         doctest::Contains("gru_gate: d_out has 4 rows but dx has 3"), mnemo::error);
}

namespace {

template <class T>
void check_golden(double atol, double rtol) {
    const auto f = mnemo::read_safetensors(std::string(MNEMO_TEST_DATA_DIR) + "/golden/gru_gate.safetensors");
    constexpr std::size_t D = 8;
    REQUIRE(meta_int(f, "d_model") == index_t(D));
    const index_t rows = meta_int(f, "rows");
    mnemo::parameter_set<T> ps;
    mnemo::gru_gate<T, D> gru(ps, "gru");
    ps.allocate();
    for (const auto& e : ps.entries()) f.copy_to(e.name, ps.values() + e.offset, std::size_t(e.size));
    const auto x = f.to_vector<T>("x"), y = f.to_vector<T>("y"), r = f.to_vector<T>("r");
    REQUIRE(x.size() == std::size_t(rows * D));
    std::vector<T> out(rows * D), dx(rows * D), dy(rows * D);
    gru.forward(view<const T, D>(x.data(), rows), view<const T, D>(y.data(), rows), view<T, D>(out.data(), rows));
    check_close("out", out, f.to_vector<double>("out"), atol, rtol);
    ps.zero_grad();
    gru.backward(view<const T, D>(r.data(), rows), view<T, D>(dx.data(), rows), view<T, D>(dy.data(), rows));
    check_close("grad.x", dx, f.to_vector<double>("grad.x"), atol, rtol);
    check_close("grad.y", dy, f.to_vector<double>("grad.y"), atol, rtol);
    for (const auto& e : ps.entries()) {
        const auto g = f.to_vector<double>("grad." + e.name);
        REQUIRE(g.size() == std::size_t(e.size));
        check_close("grad." + e.name, ps.grads() + e.offset, g.data(), e.size, atol, rtol);
    }
}

}  // namespace

TEST_CASE("golden: gru_gate matches torch.nn.GRUCell (tools/golden_gru.py)") {
    SUBCASE("double") { check_golden<double>(1e-12, 1e-12); }
    SUBCASE("float") { check_golden<float>(1e-5, 1e-5); }
}

TEST_CASE("gru_gate: a steady-state forward and backward performs no heap allocation") {
    auto run = [](auto d_tag, index_t rows, index_t fewer) {
        constexpr std::size_t D = decltype(d_tag)::value;
        INFO("D = " << D << ", rows = " << rows);
        mnemo::parameter_set<float> ps;
        mnemo::gru_gate<float, D> gru(ps, "gru");
        ps.allocate();
        mnemo::rng r(61);
        gru.reset_parameters(r);
        auto x = random_vector<float>(rows * index_t(D), 62);
        auto y = random_vector<float>(rows * index_t(D), 63);
        auto g = random_vector<float>(rows * index_t(D), 64);
        std::vector<float> out(x.size()), dx(x.size()), dy(x.size());
        auto step = [&](index_t n) {
            gru.forward(view<const float, D>(x.data(), n), view<const float, D>(y.data(), n),
                        view<float, D>(out.data(), n));
            gru.backward(view<const float, D>(g.data(), n), view<float, D>(dx.data(), n), view<float, D>(dy.data(), n),
                         true, false);
        };
        step(rows);  // buffers grow to the largest shape
        step(fewer);
        CHECK(mnemo::testing::count_allocations([&] {
                  step(rows);
                  step(fewer);  // fewer rows reuse the same buffers
                  step(rows);
              }) == 0);
    };
    run(std::integral_constant<std::size_t, 16>{}, 24, 17);
    run(std::integral_constant<std::size_t, 64>{}, 1100, 700);  // threaded element-wise passes and GEMMs
}
