// The compression functions of nn/compression/dilated_conv.hpp and most_used.hpp:
//   dilated_conv_compression: forward against a plain-loop reference of stacked Conv1d(kernel 2,
//     stride 2) with ReLU between, over mem.permute(1, 2, 0); finite-difference checks in double of
//     every parameter and the memory; accumulation into pre-filled gradients; names and shapes; golden
//     parity with PyTorch (tools/golden_dilated.py); shape errors; no allocation in steady state; a
//     compressive_transformer built with it trains.
//   most_used_compression: selection against a naive loop (ties → the oldest slot), the usage errors,
//     backward routing; accumulate_key_usage against a naive loop; the compression_needs_usage trait.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include <mnemo/mnemo.hpp>
#include <mnemo/nn/compression.hpp>

#include "allocation_counter.hpp"
#include "gradcheck.hpp"

using mnemo::index_t;
using mnemo::token_t;
using mnemo::view;
using mnemo::testing::check_accumulates;
using mnemo::testing::check_close;
using mnemo::testing::check_gradients;
using mnemo::testing::meta_int;
using mnemo::testing::parameter_targets;
using mnemo::testing::project;
using mnemo::testing::random_tokens;
using mnemo::testing::random_vector;
using mnemo::testing::randomize_model;
using mnemo::testing::randomize_parameters;

namespace {

// ---- references: the PyTorch semantics written out as plain loops ----

// x = mem.permute(1, 2, 0) [batch, D, len]; for each layer k: x = conv1d(x, W_k, b_k, stride=2) with
// kernel 2, then relu unless k is the last; out = x.permute(2, 0, 1) [len / rate, batch, D].
// weights[k] is [D, D, 2] (PyTorch [out, in, kernel]), biases[k] is [D].
std::vector<double> reference_dilated(const std::vector<double>& mem, const std::vector<const double*>& weights,
                                      const std::vector<const double*>& biases, index_t batch, index_t d) {
    index_t len = static_cast<index_t>(mem.size()) / (batch * d);
    std::vector<double> x(static_cast<std::size_t>(batch * d * len));
    for (index_t l = 0; l < len; ++l)
        for (index_t b = 0; b < batch; ++b)
            for (index_t i = 0; i < d; ++i) x[(b * d + i) * len + l] = mem[(l * batch + b) * d + i];
    for (std::size_t k = 0; k < weights.size(); ++k) {
        const index_t n = len / 2;
        const double* w = weights[k];
        std::vector<double> y(static_cast<std::size_t>(batch * d * n));
        for (index_t b = 0; b < batch; ++b)
            for (index_t o = 0; o < d; ++o)
                for (index_t s = 0; s < n; ++s) {
                    double acc = biases[k][o];
                    for (index_t i = 0; i < d; ++i)
                        for (index_t t = 0; t < 2; ++t) acc += w[(o * d + i) * 2 + t] * x[(b * d + i) * len + 2 * s + t];
                    if (k + 1 < weights.size()) acc = std::max(acc, 0.0);
                    y[(b * d + o) * n + s] = acc;
                }
        x = std::move(y);
        len = n;
    }
    std::vector<double> out(static_cast<std::size_t>(len * batch * d));
    for (index_t s = 0; s < len; ++s)
        for (index_t b = 0; b < batch; ++b)
            for (index_t o = 0; o < d; ++o) out[(s * batch + b) * d + o] = x[(b * d + o) * len + s];
    return out;
}

// The chosen slot of each window: the first t with the largest usage (NaN the least).
std::vector<index_t> reference_most_used_choice(const std::vector<double>& usage, index_t batch, index_t rate) {
    const index_t n = static_cast<index_t>(usage.size()) / (rate * batch);
    std::vector<index_t> arg(static_cast<std::size_t>(n * batch));
    for (index_t s = 0; s < n; ++s)
        for (index_t b = 0; b < batch; ++b) {
            index_t best = -1;
            for (index_t t = 0; t < rate; ++t) {
                const double u = usage[(s * rate + t) * batch + b];
                if (std::isnan(u)) continue;
                if (best < 0 || u > usage[(s * rate + best) * batch + b]) best = t;
            }
            arg[s * batch + b] = best < 0 ? 0 : best;
        }
    return arg;
}

template <class C>
std::vector<const double*> layer_values(mnemo::parameter_set<double>& ps, const std::string& name, bool weight) {
    std::vector<const double*> out;
    for (std::size_t k = 0; k < C::layers; ++k)
        out.push_back(ps.values() +
                      ps.find(name + ".convs." + std::to_string(k) + (weight ? ".weight" : ".bias"))->offset);
    return out;
}

// ---- dilated convolution: every check for one (D, Rate), batch and number of compressed slots n ----

template <std::size_t D, std::size_t Rate>
void check_dilated(index_t batch, index_t n) {
    CAPTURE(D);
    CAPTURE(Rate);
    CAPTURE(batch);
    CAPTURE(n);
    using comp_t = mnemo::dilated_conv_compression<double, D, Rate>;
    const index_t mem_rows = n * static_cast<index_t>(Rate) * batch, out_rows = n * batch;
    const std::string name = "transformer.layers.0.compress";
    mnemo::parameter_set<double> ps;
    comp_t comp(ps, name);
    ps.allocate();
    randomize_parameters(ps, 1 + D + Rate);
    const auto w = layer_values<comp_t>(ps, name, true), bias = layer_values<comp_t>(ps, name, false);

    auto mem = random_vector<double>(mem_rows * static_cast<index_t>(D), 2 + batch);
    auto r = random_vector<double>(out_rows * static_cast<index_t>(D), 3);
    std::vector<double> out(r.size()), d_mem(mem.size());
    auto loss = [&] {
        comp.forward(view<const double, D>(mem.data(), mem_rows), batch, view<double, D>(out.data(), out_rows));
        return project(out, r);
    };

    // forward against the stacked-Conv1d reference
    loss();
    check_close("dilated out", out, reference_dilated(mem, w, bias, batch, D), 1e-13, 1e-13);
    if (Rate > 2) {
        // the first hidden ReLU is exercised: some pre-activations are negative, some positive
        const auto h1 = reference_dilated(mem, {w[0]}, {bias[0]}, batch, D);
        CHECK(std::any_of(h1.begin(), h1.end(), [](double v) { return v < 0; }));
        CHECK(std::any_of(h1.begin(), h1.end(), [](double v) { return v > 0; }));
    }

    // gradients: every layer's weight and bias, and the memory, against central differences
    ps.zero_grad();
    std::fill(d_mem.begin(), d_mem.end(), 1e3);  // assigned, so the prefill must vanish
    auto backward = [&] {
        comp.backward(view<const double, D>(mem.data(), mem_rows), batch, view<const double, D>(r.data(), out_rows),
                      view<double, D>(d_mem.data(), mem_rows));
    };
    backward();
    auto targets = parameter_targets(ps);
    REQUIRE(targets.size() == 2 * comp_t::layers);
    targets.push_back({"mem", mem.data(), d_mem});
    check_gradients(loss, targets);

    // parameter gradients accumulate; d_mem is assigned and an empty d_mem skips only that part
    loss();
    check_accumulates(ps, backward);
    const auto d_mem_once = d_mem;
    ps.zero_grad();
    comp.backward(view<const double, D>(mem.data(), mem_rows), batch, view<const double, D>(r.data(), out_rows),
                  view<double, D>());
    std::vector<double> grads_without_dmem(ps.grads(), ps.grads() + ps.size());
    ps.zero_grad();
    backward();
    check_close("parameter gradients without d_mem", grads_without_dmem.data(), ps.grads(), ps.size(), 0, 0);
    check_close("d_mem (assigned)", d_mem, d_mem_once, 0, 0);
}

template <std::size_t D, std::size_t Rate>
void check_most_used(index_t batch, index_t n, std::uint64_t seed) {
    CAPTURE(D);
    CAPTURE(Rate);
    CAPTURE(batch);
    const index_t mem_rows = n * static_cast<index_t>(Rate) * batch, out_rows = n * batch;
    mnemo::parameter_set<double> ps;
    mnemo::most_used_compression<double, D, Rate> comp(ps, "compress");
    ps.allocate();
    CHECK(ps.entries().empty());

    auto mem = random_vector<double>(mem_rows * static_cast<index_t>(D), seed);
    // usage from {0, 1, 2, 3}: ties are common
    std::vector<double> usage(static_cast<std::size_t>(mem_rows));
    mnemo::rng rr(seed + 1);
    for (auto& u : usage) u = static_cast<double>(rr.next_u32() % 4u);
    comp.set_usage(usage.data(), mem_rows);
    std::vector<double> out(static_cast<std::size_t>(out_rows * index_t(D)));
    comp.forward(view<const double, D>(mem.data(), mem_rows), batch, view<double, D>(out.data(), out_rows));

    const auto arg = reference_most_used_choice(usage, batch, Rate);
    std::vector<double> expected(out.size());
    for (index_t s = 0; s < n; ++s)
        for (index_t b = 0; b < batch; ++b)
            for (index_t i = 0; i < index_t(D); ++i)
                expected[(s * batch + b) * D + i] = mem[((s * index_t(Rate) + arg[s * batch + b]) * batch + b) * D + i];
    check_close("most-used out", out, expected, 0, 0);

    // backward: d_out at the chosen slot of each window, zero elsewhere (assigned over a prefill)
    auto dy = random_vector<double>(out_rows * index_t(D), seed + 2);
    std::vector<double> d_mem(mem.size(), -7.0), d_expected(mem.size(), 0.0);
    comp.backward(view<const double, D>(mem.data(), mem_rows), batch, view<const double, D>(dy.data(), out_rows),
                  view<double, D>(d_mem.data(), mem_rows));
    for (index_t s = 0; s < n; ++s)
        for (index_t b = 0; b < batch; ++b)
            for (index_t i = 0; i < index_t(D); ++i)
                d_expected[((s * index_t(Rate) + arg[s * batch + b]) * batch + b) * D + i] = dy[(s * batch + b) * D + i];
    check_close("most-used d_mem", d_mem, d_expected, 0, 0);
    // and it is the derivative of Σ out ⊙ dy with respect to mem (the selection depends on usage only)
    auto loss = [&] {
        comp.forward(view<const double, D>(mem.data(), mem_rows), batch, view<double, D>(out.data(), out_rows));
        return project(out, dy);
    };
    check_gradients(loss, {{"mem", mem.data(), d_mem}});
}

}  // namespace

// ================================= dilated_conv_compression =================================

TEST_CASE("dilated_conv_compression: forward matches stacked Conv1d (kernel 2, stride 2, ReLU between), "
          "backward matches finite differences") {
    for (index_t batch : {1, 3}) {
        check_dilated<5, 2>(batch, 3);
        check_dilated<3, 2>(batch, 1);
        check_dilated<5, 4>(batch, 2);
        check_dilated<7, 4>(batch, 3);
        check_dilated<3, 8>(batch, 2);
        check_dilated<5, 8>(batch, 1);
    }
}

TEST_CASE("dilated_conv_compression: parameters convs.<k>.{weight, bias}, shaped [out, in, kernel], PyTorch init") {
    using comp_t = mnemo::dilated_conv_compression<float, 6, 8>;
    static_assert(comp_t::rate == 8 && comp_t::layers == 3 && comp_t::has_parameters && comp_t::features == 6);
    static_assert(mnemo::dilated_conv_compression<float, 6, 2>::layers == 1);
    static_assert(mnemo::dilated_conv_compression<float, 6, 64>::layers == 6);
    mnemo::parameter_set<float> ps;
    comp_t comp(ps, "transformer.layers.1.compress");
    REQUIRE(ps.entries().size() == 6);
    for (index_t k = 0; k < 3; ++k) {
        const std::string p = "transformer.layers.1.compress.convs." + std::to_string(k);
        CHECK(ps.entries()[std::size_t(2 * k)].name == p + ".weight");
        CHECK(ps.entries()[std::size_t(2 * k)].shape == std::vector<index_t>{6, 6, 2});
        CHECK(ps.entries()[std::size_t(2 * k + 1)].name == p + ".bias");
        CHECK(ps.entries()[std::size_t(2 * k + 1)].shape == std::vector<index_t>{6});
    }
    CHECK(comp.name() == "transformer.layers.1.compress");

    ps.allocate();
    CHECK(comp.weight(2).value() == ps.values() + ps.find("transformer.layers.1.compress.convs.2.weight")->offset);
    CHECK(comp.bias(0).grad() == ps.grads() + ps.find("transformer.layers.1.compress.convs.0.bias")->offset);
    CHECK_THROWS_WITH_AS(comp.weight(3),
                         "mnemo: dilated_conv_compression 'transformer.layers.1.compress': layer 3 out of range [0, 3)",
                         mnemo::error);

    // PyTorch's default initialisation: U(−1/√(in·kernel), 1/√(in·kernel)) = U(−1/√12, 1/√12)
    mnemo::rng r(17);
    comp.reset_parameters(r);
    const double bound = 1.0 / std::sqrt(12.0);
    for (const auto& e : ps.entries()) {
        double lo = 1, hi = -1;
        for (index_t i = 0; i < e.size; ++i) {
            lo = std::min(lo, double(ps.values()[e.offset + i]));
            hi = std::max(hi, double(ps.values()[e.offset + i]));
        }
        INFO(e.name << " in [" << lo << ", " << hi << "], bound " << bound);
        CHECK(lo >= -bound);
        CHECK(hi < bound);
        CHECK(hi - lo > bound / 2);  // spread over the range, not a constant
    }
}

TEST_CASE("dilated_conv_compression: rate 2 is conv_compression of rate 2") {
    constexpr std::size_t D = 5;
    const index_t batch = 3, n = 4, mem_rows = n * 2 * batch, out_rows = n * batch;
    mnemo::parameter_set<double> ps;
    mnemo::dilated_conv_compression<double, D, 2> dil(ps, "dil");
    mnemo::conv_compression<double, D, 2> conv(ps, "conv");
    ps.allocate();
    randomize_parameters(ps, 5);
    std::memcpy(conv.weight().value(), dil.weight(0).value(), sizeof(double) * D * D * 2);
    std::memcpy(conv.bias().value(), dil.bias(0).value(), sizeof(double) * D);
    auto mem = random_vector<double>(mem_rows * D, 6);
    auto dy = random_vector<double>(out_rows * D, 7);
    std::vector<double> a(out_rows * D), b(out_rows * D), da(mem_rows * D), db(mem_rows * D);
    view<const double, D> m(mem.data(), mem_rows);
    dil.forward(m, batch, view<double, D>(a.data(), out_rows));
    conv.forward(m, batch, view<double, D>(b.data(), out_rows));
    check_close("rate-2 dilated vs conv", a, b, 0, 0);
    ps.zero_grad();
    dil.backward(m, batch, view<const double, D>(dy.data(), out_rows), view<double, D>(da.data(), mem_rows));
    conv.backward(m, batch, view<const double, D>(dy.data(), out_rows), view<double, D>(db.data(), mem_rows));
    check_close("rate-2 d_mem", da, db, 0, 0);
    check_close("rate-2 d_weight", dil.weight(0).grad(), conv.weight().grad(), D * D * 2, 0, 0);
    check_close("rate-2 d_bias", dil.bias(0).grad(), conv.bias().grad(), D, 0, 0);
}

TEST_CASE("dilated_conv_compression: matches PyTorch (tools/golden_dilated.py) in forward and backward") {
    const auto f = mnemo::read_safetensors(std::string(MNEMO_TEST_DATA_DIR) + "/golden/dilated_compression.safetensors");
    constexpr std::size_t D = 6, Rate = 4;
    REQUIRE(meta_int(f, "d_model") == index_t(D));
    REQUIRE(meta_int(f, "rate") == index_t(Rate));
    const index_t batch = meta_int(f, "batch"), slots = meta_int(f, "slots");
    REQUIRE(batch == 2);
    REQUIRE(slots == 8);
    REQUIRE(f.at("mem").shape == std::vector<std::int64_t>{slots, batch, index_t(D)});
    REQUIRE(f.at("out").shape == std::vector<std::int64_t>{slots / index_t(Rate), batch, index_t(D)});
    const index_t mem_rows = slots * batch, out_rows = mem_rows / index_t(Rate);

    mnemo::parameter_set<double> ps;
    mnemo::dilated_conv_compression<double, D, Rate> comp(ps, "transformer.layers.0.compress");
    ps.allocate();
    const std::string prefix = "transformer.layers.0.compress.";
    for (const auto& e : ps.entries()) {
        const std::string key = e.name.substr(prefix.size());  // convs.<k>.weight / .bias
        INFO(key);
        REQUIRE(f.at(key).shape == std::vector<std::int64_t>(e.shape.begin(), e.shape.end()));
        f.copy_to(key, ps.values() + e.offset, std::size_t(e.size));
    }
    const auto mem = f.to_vector<double>("mem"), out_ref = f.to_vector<double>("out"),
               grad_out = f.to_vector<double>("grad_out"), grad_mem = f.to_vector<double>("grad.mem");
    std::vector<double> out(out_ref.size()), d_mem(mem.size());
    comp.forward(view<const double, D>(mem.data(), mem_rows), batch, view<double, D>(out.data(), out_rows));
    check_close("golden out", out, out_ref, 1e-13, 1e-12);
    ps.zero_grad();
    comp.backward(view<const double, D>(mem.data(), mem_rows), batch,
                  view<const double, D>(grad_out.data(), out_rows), view<double, D>(d_mem.data(), mem_rows));
    check_close("golden grad.mem", d_mem, grad_mem, 1e-13, 1e-12);
    for (const auto& e : ps.entries()) {
        const std::string key = "grad." + e.name.substr(prefix.size());
        const auto g = f.to_vector<double>(key);
        check_close("golden " + key, ps.grads() + e.offset, g.data(), e.size, 1e-13, 1e-12);
    }

    // in float, to float precision
    mnemo::parameter_set<float> psf;
    mnemo::dilated_conv_compression<float, D, Rate> compf(psf, "c");
    psf.allocate();
    for (index_t k = 0; k < 2; ++k) {
        f.copy_to("convs." + std::to_string(k) + ".weight", compf.weight(k).value(), D * D * 2);
        f.copy_to("convs." + std::to_string(k) + ".bias", compf.bias(k).value(), D);
    }
    std::vector<float> memf(mem.begin(), mem.end()), outf(out_ref.size());
    compf.forward(view<const float, D>(memf.data(), mem_rows), batch, view<float, D>(outf.data(), out_rows));
    check_close("golden out (float)", outf, out_ref, 1e-5, 1e-5);
}

TEST_CASE("dilated_conv_compression: float forward agrees with the double reference; strided views are honoured") {
    constexpr std::size_t D = 7, Rate = 4;
    const index_t batch = 3, n = 3, mem_rows = n * Rate * batch, out_rows = n * batch, ld = 10;
    mnemo::parameter_set<float> ps;
    mnemo::dilated_conv_compression<float, D, Rate> comp(ps, "dil");
    ps.allocate();
    mnemo::rng r(31);
    comp.reset_parameters(r);
    auto wide = random_vector<float>(mem_rows * ld, 32);
    std::vector<double> mem(mem_rows * D);
    for (index_t i = 0; i < mem_rows; ++i)
        for (index_t j = 0; j < index_t(D); ++j) mem[i * D + j] = wide[i * ld + j];
    std::vector<std::vector<double>> w, b;
    for (index_t k = 0; k < 2; ++k) {
        w.emplace_back(comp.weight(k).value(), comp.weight(k).value() + D * D * 2);
        b.emplace_back(comp.bias(k).value(), comp.bias(k).value() + D);
    }
    view<const float, D> mem_view(wide.data(), mem_rows, D, ld);
    std::vector<float> out_wide(out_rows * ld, 123.f), out(out_rows * D);
    comp.forward(mem_view, batch, view<float, D>(out_wide.data(), out_rows, D, ld));
    for (index_t i = 0; i < out_rows; ++i) {
        for (index_t j = 0; j < index_t(D); ++j) out[i * D + j] = out_wide[i * ld + j];
        for (index_t j = D; j < ld; ++j) CHECK(out_wide[i * ld + j] == 123.f);  // padding untouched
    }
    check_close("dilated out (float, strided)", out,
                reference_dilated(mem, {w[0].data(), w[1].data()}, {b[0].data(), b[1].data()}, batch, D), 1e-6, 1e-5);

    // a strided d_out and d_mem: d_mem written only in its first D columns, and equal to the dense result
    auto dy = random_vector<float>(out_rows * D, 33);
    std::vector<float> dy_wide(out_rows * ld, -9.f), d_wide(mem_rows * ld, 5.f), d_dense(mem_rows * D);
    for (index_t i = 0; i < out_rows; ++i)
        for (index_t j = 0; j < index_t(D); ++j) dy_wide[i * ld + j] = dy[i * D + j];
    ps.zero_grad();
    comp.backward(mem_view, batch, view<const float, D>(dy_wide.data(), out_rows, D, ld),
                  view<float, D>(d_wide.data(), mem_rows, D, ld));
    std::vector<float> g_strided(ps.grads(), ps.grads() + ps.size());
    std::vector<float> mem_dense(mem.begin(), mem.end());
    comp.forward(view<const float, D>(mem_dense.data(), mem_rows), batch, view<float, D>(out.data(), out_rows));
    ps.zero_grad();
    comp.backward(view<const float, D>(mem_dense.data(), mem_rows), batch, view<const float, D>(dy.data(), out_rows),
                  view<float, D>(d_dense.data(), mem_rows));
    check_close("strided parameter gradients", g_strided.data(), ps.grads(), ps.size(), 0, 0);
    for (index_t i = 0; i < mem_rows; ++i)
        for (index_t j = 0; j < ld; ++j) {
            INFO("d_mem row " << i << " column " << j);
            CHECK(d_wide[i * ld + j] == (j < index_t(D) ? d_dense[i * D + j] : 5.f));
        }
}

TEST_CASE("dilated_conv_compression: large enough to run threaded, matches the reference in forward and backward") {
    // Layer 0's rows · D · 2 >= 65536 switches the gather/scatter and ReLU loops to OpenMP.
    constexpr std::size_t D = 32, Rate = 8;
    const index_t batch = 4, n = 64, mem_rows = n * Rate * batch, out_rows = n * batch;
    mnemo::parameter_set<double> ps;
    mnemo::dilated_conv_compression<double, D, Rate> comp(ps, "compress");
    ps.allocate();
    mnemo::rng r(41);
    comp.reset_parameters(r);
    auto mem = random_vector<double>(mem_rows * D, 42);
    auto dy = random_vector<double>(out_rows * D, 43);
    std::vector<double> out(out_rows * D), d_mem(mem_rows * D);
    comp.forward(view<const double, D>(mem.data(), mem_rows), batch, view<double, D>(out.data(), out_rows));
    std::vector<const double*> w, b;
    for (index_t k = 0; k < 3; ++k) {
        w.push_back(comp.weight(k).value());
        b.push_back(comp.bias(k).value());
    }
    check_close("dilated out", out, reference_dilated(mem, w, b, batch, D), 1e-12, 1e-12);

    // d_mem by a directional derivative: <d_mem, v> = d/dε Σ out(mem + εv) ⊙ dy (exact up to the ReLU kinks,
    // which a step of 1e-6 does not cross here), and dW of the last layer by direct sums.
    ps.zero_grad();
    comp.backward(view<const double, D>(mem.data(), mem_rows), batch, view<const double, D>(dy.data(), out_rows),
                  view<double, D>(d_mem.data(), mem_rows));
    const auto v = random_vector<double>(mem_rows * D, 44);
    auto f = [&](double eps) {
        std::vector<double> m2(mem);
        for (std::size_t i = 0; i < m2.size(); ++i) m2[i] += eps * v[i];
        return project(reference_dilated(m2, w, b, batch, D), dy);
    };
    const double numeric = (f(1e-6) - f(-1e-6)) / 2e-6, analytic = project(d_mem, v);
    CHECK(std::abs(numeric - analytic) <= 1e-6 * std::max(1.0, std::abs(analytic)));
    std::vector<double> db_ref(D, 0.0);
    for (index_t row = 0; row < out_rows; ++row)
        for (index_t o = 0; o < index_t(D); ++o) db_ref[o] += dy[row * D + o];
    check_close("d_bias of the last layer", comp.bias(2).grad(), db_ref.data(), D, 1e-12, 1e-12);
}

TEST_CASE("dilated_conv_compression: bad row counts and shapes throw mnemo::error naming the module") {
    constexpr std::size_t D = 5;
    mnemo::parameter_set<double> ps;
    mnemo::dilated_conv_compression<double, D, 4> comp(ps, "transformer.layers.0.compress");
    ps.allocate();
    std::vector<double> mem(24 * D), out(6 * D), d_mem(24 * D);
    auto m = [&](index_t rows) { return view<const double, D>(mem.data(), rows); };
    auto o = [&](index_t rows) { return view<double, D>(out.data(), rows); };
    const std::string who = "mnemo: dilated_conv_compression 'transformer.layers.0.compress': ";
    CHECK_THROWS_WITH_AS(comp.forward(m(14), 3, o(3)),
                         (who + "memory has 14 rows, not a multiple of compression rate 4 x batch 3 = 12").c_str(),
                         mnemo::error);
    CHECK_THROWS_WITH_AS(comp.forward(m(12), 0, o(3)), (who + "batch must be positive, got 0").c_str(), mnemo::error);
    CHECK_THROWS_WITH_AS(comp.forward(m(24), 3, o(3)),
                         (who + "out has 3 rows, expected memory rows 24 / compression rate 4 = 6").c_str(),
                         mnemo::error);
    CHECK_THROWS_WITH_AS(comp.backward(m(24), 3, view<const double, D>(out.data(), 6), view<double, D>()),
                         (who + "backward called before forward").c_str(), mnemo::error);
    comp.forward(m(24), 3, o(6));
    CHECK_THROWS_WITH_AS(comp.backward(m(12), 3, view<const double, D>(out.data(), 3), view<double, D>()),
                         (who + "backward over 12 memory rows with batch 3 but the last forward saw 24 rows with "
                                "batch 3").c_str(),
                         mnemo::error);
    CHECK_THROWS_WITH_AS(comp.backward(m(24), 3, view<const double, D>(out.data(), 6), view<double, D>(d_mem.data(), 12)),
                         (who + "d_mem has 12 rows but mem has 24").c_str(), mnemo::error);
    CHECK_THROWS_WITH_AS(comp.forward(view<const double>(mem.data(), 24, 4), 3, o(6)),
                         doctest::Contains("dilated_conv_compression 'transformer.layers.0.compress': mem has 4 "
                                           "features, expected 5"),
                         mnemo::error);
    using dil8 = mnemo::dilated_conv_compression<double, D, 8>;
    CHECK(dil8::compressed_rows(32, 2) == 4);
    CHECK_THROWS_WITH_AS(dil8::compressed_rows(8, 2),
                         "mnemo: dilated_conv_compression: memory has 8 rows, not a multiple of compression rate 8 x "
                         "batch 2 = 16",
                         mnemo::error);

    // an empty memory: empty output, zero parameter gradients
    randomize_parameters(ps, 3);
    ps.zero_grad();
    comp.forward(view<const double, D>(nullptr, 0), 2, view<double, D>(nullptr, 0));
    comp.backward(view<const double, D>(nullptr, 0), 2, view<const double, D>(nullptr, 0), view<double, D>());
    for (index_t i = 0; i < ps.size(); ++i) CHECK(ps.grads()[i] == 0.0);
}

TEST_CASE("dilated_conv_compression and most_used_compression: no heap allocation in steady state") {
    constexpr std::size_t D = 16, Rate = 4;
    const index_t batch = 2, n = 5, mem_rows = n * Rate * batch, out_rows = n * batch;
    mnemo::parameter_set<float> ps;
    mnemo::dilated_conv_compression<float, D, Rate> dil(ps, "dil");
    mnemo::dilated_conv_compression<float, D, 8> dil8(ps, "dil8");
    mnemo::most_used_compression<float, D, Rate> most(ps, "most");
    ps.allocate();
    mnemo::rng r(61);
    dil.reset_parameters(r);
    dil8.reset_parameters(r);
    auto mem = random_vector<float>(mem_rows * 2 * D, 62);  // room for rate 8 too
    auto dy = random_vector<float>(out_rows * D, 63);
    auto usage = random_vector<float>(mem_rows, 64);
    std::vector<float> out(out_rows * D), d_mem(mem_rows * 2 * D);
    auto step = [&](index_t slots) {
        const index_t mr = slots * Rate * batch, orr = slots * batch;
        view<const float, D> m(mem.data(), mr);
        view<const float, D> g(dy.data(), orr);
        view<float, D> o(out.data(), orr), dm(d_mem.data(), mr);
        dil.forward(m, batch, o);
        dil.backward(m, batch, g, dm);
        dil.backward(m, batch, g, view<float, D>());
        most.set_usage(usage.data(), mr);
        most.forward(m, batch, o);
        most.backward(m, batch, g, dm);
        // rate 8 over twice the slots: the same output rows
        view<const float, D> m8(mem.data(), 2 * mr);
        dil8.forward(m8, batch, o);
        dil8.backward(m8, batch, g, view<float, D>(d_mem.data(), 2 * mr));
    };
    step(n);  // buffers grow to the largest shape
    CHECK(mnemo::testing::count_allocations([&] {
              step(n);
              step(n - 2);  // a shorter memory reuses the same buffers
          }) == 0);
}

TEST_CASE("compressive_transformer with dilated_conv_compression: forward, train_segment, AR gradient") {
    using cfg = mnemo::config<8, 2, 4>;
    using model_t = mnemo::compressive_transformer<double, cfg, mnemo::dilated_conv_compression>;
    static_assert(std::is_same_v<model_t::layer_type::compression_type,
                                 mnemo::dilated_conv_compression<double, 8, 4, mnemo::cpu>>);
    static_assert(model_t::can_compress);
    const index_t B = 2, Q = 3, vocab = 7;
    model_t model({.vocab = vocab, .n_layers = 2, .d_ff = 6, .n_pos = 32});
    model.reset_parameters(5);
    auto& ps = model.parameters();
    for (index_t l = 0; l < 2; ++l)
        for (index_t k = 0; k < 2; ++k) {
            const std::string p = "transformer.layers." + std::to_string(l) + ".compress.convs." + std::to_string(k);
            REQUIRE(ps.find(p + ".weight") != nullptr);
            CHECK(ps.find(p + ".weight")->shape == std::vector<index_t>{8, 8, 2});
            REQUIRE(ps.find(p + ".bias") != nullptr);
        }
    auto mem = model.make_memory(/*mem_len=*/4, /*c_mem_len=*/3);
    mem.reset(B, Q);
    index_t compressed = 0;
    for (int s = 0; s < 4; ++s) {
        auto tokens = random_tokens(Q * B, vocab, 10 + s), targets = random_tokens(Q * B, vocab, 20 + s);
        ps.zero_grad();
        const auto losses = model.train_segment(tokens, targets, B, mem);
        CHECK(std::isfinite(losses.ce));
        CHECK(std::isfinite(losses.ar));
        CHECK((losses.compressed > 0) == (losses.ar > 0));
        compressed += losses.compressed;
        for (index_t i = 0; i < ps.size(); ++i) REQUIRE(std::isfinite(ps.grads()[i]));
    }
    CHECK(compressed > 0);
    CHECK(mem.c_mem_slots() > 0);

    // The attention-reconstruction loss reaches only the compression parameters, and its gradient
    // through the dilated stack matches finite differences.
    randomize_model(ps, 41);
    mem.reset(B, Q);
    auto t0 = random_tokens(Q * B, vocab, 42), t1 = random_tokens(Q * B, vocab, 43);
    model.forward(t0, B, mem);
    REQUIRE(model.update_memory(mem) == 0);  // 3 slots fit in 4
    model.forward(t1, B, mem);
    REQUIRE(model.update_memory(mem) == 4);  // 6 > 4: ceil(2/4)·4 = 4 oldest slots into 1
    ps.zero_grad();
    CHECK(model.reconstruction_loss(mem, true) > 0);
    auto loss = [&] { return model.reconstruction_loss(mem, false); };
    auto targets = parameter_targets(ps);
    for (const auto& t : targets) {
        if (t.name.find(".compress.") != std::string::npos) continue;
        double norm = 0;
        for (double g : t.analytic) norm += std::abs(g);
        INFO(t.name);
        CHECK(norm == 0.0);
    }
    std::erase_if(targets, [](const auto& t) { return t.name.find(".compress.") == std::string::npos; });
    REQUIRE(targets.size() == 8);  // 2 layers x 2 convs x {weight, bias}
    check_gradients(loss, targets);
}

// ================================= most_used_compression =================================

TEST_CASE("most_used_compression: keeps the most-attended slot of each window (ties: the oldest), routes d_out") {
    for (index_t batch : {1, 3}) {
        check_most_used<5, 1>(batch, 3, 100 + batch);
        check_most_used<5, 2>(batch, 4, 200 + batch);
        check_most_used<7, 3>(batch, 3, 300 + batch);
        check_most_used<3, 4>(batch, 5, 400 + batch);
    }
}

TEST_CASE("most_used_compression: explicit ties and NaN usage") {
    constexpr std::size_t D = 2;
    const index_t batch = 2;
    // rows t·batch + b, t = 0..2 (one window of 3). b = 0: usage 1, 5, 5 → t = 1 (the first of the tie);
    // b = 1: usage NaN, 2, 2 → t = 1 (a NaN counts as the least).
    const double nan = std::numeric_limits<double>::quiet_NaN();
    const std::vector<double> usage = {1, nan, 5, 2, 5, 2};
    const std::vector<double> mem = {10, 11, 20, 21, 30, 31, 40, 41, 50, 51, 60, 61};
    std::vector<double> out(batch * D), d_mem(mem.size(), -1);
    const std::vector<double> dy = {1, 2, 3, 4};
    mnemo::parameter_set<double> ps;
    mnemo::most_used_compression<double, D, 3> comp(ps, "compress");
    comp.set_usage(usage.data(), 6);
    comp.forward(view<const double, D>(mem.data(), 6), batch, view<double, D>(out.data(), batch));
    check_close("ties and NaN", out, std::vector<double>{30, 31, 40, 41}, 0, 0);
    comp.backward(view<const double, D>(mem.data(), 6), batch, view<const double, D>(dy.data(), batch),
                  view<double, D>(d_mem.data(), 6));
    check_close("ties and NaN: d_mem", d_mem, std::vector<double>{0, 0, 0, 0, 1, 2, 3, 4, 0, 0, 0, 0}, 0, 0);

    // all equal: the oldest slot; all NaN: the oldest slot
    const std::vector<double> flat = {7, nan, 7, nan, 7, nan};
    comp.set_usage(flat.data(), 6);
    comp.forward(view<const double, D>(mem.data(), 6), batch, view<double, D>(out.data(), batch));
    check_close("all tied", out, std::vector<double>{10, 11, 20, 21}, 0, 0);

    // set_usage copies: changing the caller's array afterwards changes nothing
    std::vector<double> u2 = {0, 0, 0, 0, 9, 9};
    comp.set_usage(u2.data(), 6);
    u2 = {9, 9, 0, 0, 0, 0};
    comp.forward(view<const double, D>(mem.data(), 6), batch, view<double, D>(out.data(), batch));
    check_close("usage copied", out, std::vector<double>{50, 51, 60, 61}, 0, 0);
}

TEST_CASE("most_used_compression: forward without usage, or with usage of the wrong size, throws mnemo::error") {
    constexpr std::size_t D = 3;
    mnemo::parameter_set<double> ps;
    mnemo::most_used_compression<double, D, 2> comp(ps, "transformer.layers.2.compress");
    const std::string who = "mnemo: most_used_compression 'transformer.layers.2.compress': ";
    std::vector<double> mem(8 * D), out(4 * D), usage(8, 1.0);
    auto m = [&](index_t rows) { return view<const double, D>(mem.data(), rows); };
    auto o = [&](index_t rows) { return view<double, D>(out.data(), rows); };
    CHECK_FALSE(comp.has_usage());
    CHECK_THROWS_WITH_AS(comp.forward(m(8), 2, o(4)),
                         (who + "no usage was set: call set_usage(usage, 8) with the attention mass of each memory "
                                "row before forward").c_str(),
                         mnemo::error);
    comp.set_usage(usage.data(), 6);
    CHECK(comp.usage_rows() == 6);
    CHECK_THROWS_WITH_AS(comp.forward(m(8), 2, o(4)),
                         (who + "the usage was set for 6 memory rows but forward got 8 memory rows").c_str(),
                         mnemo::error);
    comp.set_usage(usage.data(), 8);
    CHECK_NOTHROW(comp.forward(m(8), 2, o(4)));
    CHECK_NOTHROW(comp.forward(m(8), 2, o(4)));  // the usage stays in effect
    comp.clear_usage();
    CHECK_FALSE(comp.has_usage());
    CHECK_THROWS_WITH_AS(comp.forward(m(8), 2, o(4)), doctest::Contains("no usage was set"), mnemo::error);
    CHECK_THROWS_WITH_AS(comp.set_usage(usage.data(), -1), (who + "set_usage with a negative row count -1").c_str(),
                         mnemo::error);
    CHECK_THROWS_WITH_AS(comp.set_usage(nullptr, 4), (who + "set_usage with no data for 4 rows").c_str(), mnemo::error);

    // the shape rules of the other compression functions
    comp.set_usage(usage.data(), 8);
    CHECK_THROWS_WITH_AS(comp.forward(m(8), 3, o(4)),
                         (who + "memory has 8 rows, not a multiple of compression rate 2 x batch 3 = 6").c_str(),
                         mnemo::error);
    CHECK_THROWS_WITH_AS(comp.forward(m(8), 2, o(3)),
                         (who + "out has 3 rows, expected memory rows 8 / compression rate 2 = 4").c_str(), mnemo::error);
    mnemo::most_used_compression<double, D, 2> fresh(ps, "fresh");
    CHECK_THROWS_WITH_AS(fresh.backward(m(8), 2, view<const double, D>(out.data(), 4), view<double, D>()),
                         "mnemo: most_used_compression 'fresh': backward called before forward", mnemo::error);
    // an empty memory with an empty usage
    comp.set_usage(nullptr, 0);
    CHECK_NOTHROW(comp.forward(m(0), 2, o(0)));
    CHECK(mnemo::most_used_compression<double, D, 4>::compressed_rows(16, 2) == 4);
}

TEST_CASE("most_used_compression: strided views") {
    constexpr std::size_t D = 3, Rate = 2;
    const index_t batch = 2, n = 3, mem_rows = n * Rate * batch, out_rows = n * batch, ld = 5;
    mnemo::parameter_set<float> ps;
    mnemo::most_used_compression<float, D, Rate> comp(ps, "m");
    auto wide = random_vector<float>(mem_rows * ld, 71);
    auto usage = random_vector<float>(mem_rows, 72);
    comp.set_usage(usage.data(), mem_rows);
    std::vector<float> out_wide(out_rows * ld, 8.f), dy = random_vector<float>(out_rows * D, 73),
                                                     d_wide(mem_rows * ld, 6.f);
    comp.forward(view<const float, D>(wide.data(), mem_rows, D, ld), batch,
                 view<float, D>(out_wide.data(), out_rows, D, ld));
    comp.backward(view<const float, D>(wide.data(), mem_rows, D, ld), batch, view<const float, D>(dy.data(), out_rows),
                  view<float, D>(d_wide.data(), mem_rows, D, ld));
    std::vector<double> ud(usage.begin(), usage.end());
    const auto arg = reference_most_used_choice(ud, batch, Rate);
    for (index_t s = 0; s < n; ++s)
        for (index_t b = 0; b < batch; ++b) {
            const index_t r = s * batch + b;
            for (index_t j = 0; j < ld; ++j) {
                const index_t src = (s * index_t(Rate) + arg[r]) * batch + b;
                CHECK(out_wide[r * ld + j] == (j < index_t(D) ? wide[src * ld + j] : 8.f));
                for (index_t t = 0; t < index_t(Rate); ++t) {
                    const index_t row = (s * index_t(Rate) + t) * batch + b;
                    const float expected = j >= index_t(D) ? 6.f : (t == arg[r] ? dy[r * D + j] : 0.f);
                    CHECK(d_wide[row * ld + j] == expected);
                }
            }
        }
}

TEST_CASE("compression_needs_usage: true only for most_used_compression") {
    static_assert(mnemo::compression_needs_usage<mnemo::most_used_compression<float, 4, 2>>);
    static_assert(mnemo::compression_needs_usage<const mnemo::most_used_compression<double, 4, 3>&>);
    static_assert(!mnemo::compression_needs_usage<mnemo::dilated_conv_compression<float, 4, 2>>);
    static_assert(!mnemo::compression_needs_usage<mnemo::conv_compression<float, 4, 2>>);
    static_assert(!mnemo::compression_needs_usage<mnemo::max_pool_compression<float, 4, 2>>);
    static_assert(!mnemo::compression_needs_usage<mnemo::mean_pool_compression<float, 4, 2>>);
    static_assert(!mnemo::compression_needs_usage<mnemo::no_compression<float, 4, 2>>);
    static_assert(!mnemo::compression_needs_usage<int>);
    static_assert(!mnemo::most_used_compression<float, 4, 2>::has_parameters);
    CHECK(true);
}

// ================================= accumulate_key_usage =================================

TEST_CASE("accumulate_key_usage: adds the per-key attention mass, summed over heads and queries") {
    auto naive = [](index_t batch, index_t heads, index_t q, index_t k, const std::vector<double>& p,
                    std::vector<double> usage) {
        for (index_t b = 0; b < batch; ++b)
            for (index_t j = 0; j < k; ++j)
                for (index_t h = 0; h < heads; ++h)
                    for (index_t i = 0; i < q; ++i) usage[j * batch + b] += p[((b * heads + h) * q + i) * k + j];
        return usage;
    };
    struct shape {
        index_t batch, heads, q, k;
    };
    for (const shape s : {shape{1, 1, 1, 1}, shape{3, 2, 4, 7}, shape{2, 3, 5, 9}, shape{4, 4, 32, 160}}) {
        CAPTURE(s.batch);
        CAPTURE(s.k);
        const index_t rows = s.batch * s.heads * s.q;
        // probabilities: rows of a softmax (non-negative, summing to 1), zero on masked keys
        auto p = random_vector<double>(rows * s.k, 81, 0.0, 1.0);
        for (index_t r = 0; r < rows; ++r) {
            const index_t i = r % s.q, visible = s.k - s.q + i + 1;
            double sum = 0;
            for (index_t j = 0; j < s.k; ++j) {
                if (j >= visible) p[r * s.k + j] = 0;
                sum += p[r * s.k + j];
            }
            for (index_t j = 0; j < s.k; ++j) p[r * s.k + j] /= sum;
        }
        const auto prefill = random_vector<double>(s.k * s.batch, 82);
        auto usage = prefill;
        mnemo::accumulate_key_usage(s.batch, s.heads, s.q, s.k, p.data(), usage.data());
        check_close("usage", usage, naive(s.batch, s.heads, s.q, s.k, p, prefill), 1e-13, 1e-13);
        // every query row carries mass 1: per batch element the added mass is heads·q
        for (index_t b = 0; b < s.batch; ++b) {
            double added = 0;
            for (index_t j = 0; j < s.k; ++j) added += usage[j * s.batch + b] - prefill[j * s.batch + b];
            CHECK(added == doctest::Approx(double(s.heads * s.q)).epsilon(1e-12));
        }
        // the kernel through the seam, in float
        std::vector<float> pf(p.begin(), p.end()), uf(prefill.begin(), prefill.end());
        mnemo::ops<mnemo::cpu>::accumulate_key_usage(s.batch, s.heads, s.q, s.k, pf.data(), uf.data());
        check_close("usage (float)", uf, naive(s.batch, s.heads, s.q, s.k, p, prefill), 1e-4, 1e-5);
    }
    CHECK_THROWS_AS(mnemo::accumulate_key_usage<double>(1, -1, 1, 1, nullptr, nullptr), mnemo::error);
}

TEST_CASE("accumulate_key_usage feeds most_used_compression: the slot that got the most attention is kept") {
    constexpr std::size_t D = 4, Rate = 2;
    const index_t batch = 2, heads = 1, q = 1, k = 4;  // 4 memory slots, one query
    // attention of b = 0: slots 0..3 get .1 .6 .2 .1 → keeps slot 1 then slot 2; b = 1: .4 .1 .1 .4 → 0, 3
    const std::vector<double> probs = {0.1, 0.6, 0.2, 0.1, 0.4, 0.1, 0.1, 0.4};
    std::vector<double> usage(std::size_t(k * batch), 0.0);
    mnemo::accumulate_key_usage(batch, heads, q, k, probs.data(), usage.data());
    std::vector<double> mem(std::size_t(k * batch) * D);
    for (index_t r = 0; r < k * batch; ++r)
        for (index_t i = 0; i < index_t(D); ++i) mem[r * D + i] = double(r);  // row id
    mnemo::parameter_set<double> ps;
    mnemo::most_used_compression<double, D, Rate> comp(ps, "m");
    comp.set_usage(usage.data(), k * batch);
    std::vector<double> out(std::size_t(2 * batch) * D);
    comp.forward(view<const double, D>(mem.data(), k * batch), batch, view<double, D>(out.data(), 2 * batch));
    // output rows s·batch + b hold memory row (slot)·batch + b
    CHECK(out[0 * D] == 1 * batch + 0);
    CHECK(out[1 * D] == 0 * batch + 1);
    CHECK(out[2 * D] == 2 * batch + 0);
    CHECK(out[3 * D] == 3 * batch + 1);
}
