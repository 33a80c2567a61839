// The auto-encoding loss (losses/autoencoding_reconstruction.hpp): the ConvTranspose1d decoder against
// a plain loop of the PyTorch semantics, its backward and the whole loss against finite differences
// in double (conv and max-pool compression), gradients reaching only f_c and the decoder, gradient
// accumulation, no heap allocation once the buffers have grown, and golden values from PyTorch
// (tools/golden_autoencoding.py).
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include <mnemo/mnemo.hpp>
#include <mnemo/losses/autoencoding_reconstruction.hpp>

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
using mnemo::testing::run_compression_shapes;

namespace {

// ConvTranspose1d(D, D, rate, stride=rate) over cm.permute(1, 2, 0) [batch, D, n], weight [in, out,
// rate], permuted back to [n·rate, batch, D]: y[b, o, s·rate + t] = bias[o] + Σ_i x[b, i, s]·W[i, o, t].
std::vector<double> reference_decoder(const std::vector<double>& cm, const double* w, const double* bias,
                                      index_t batch, index_t d, index_t rate) {
    const index_t n = static_cast<index_t>(cm.size()) / (batch * d), len = n * rate;
    std::vector<double> x(static_cast<std::size_t>(batch * d * n));
    for (index_t s = 0; s < n; ++s)
        for (index_t b = 0; b < batch; ++b)
            for (index_t i = 0; i < d; ++i) x[(b * d + i) * n + s] = cm[(s * batch + b) * d + i];
    std::vector<double> y(static_cast<std::size_t>(batch * d * len));
    for (index_t b = 0; b < batch; ++b)
        for (index_t o = 0; o < d; ++o)
            for (index_t s = 0; s < n; ++s)
                for (index_t t = 0; t < rate; ++t) {
                    double acc = bias[o];
                    for (index_t i = 0; i < d; ++i) acc += x[(b * d + i) * n + s] * w[(i * d + o) * rate + t];
                    y[(b * d + o) * len + s * rate + t] = acc;
                }
    std::vector<double> out(static_cast<std::size_t>(len * batch * d));
    for (index_t l = 0; l < len; ++l)
        for (index_t b = 0; b < batch; ++b)
            for (index_t o = 0; o < d; ++o) out[(l * batch + b) * d + o] = y[(b * d + o) * len + l];
    return out;
}

// Decoder forward against the reference; its backward (parameters and d_cm) against finite differences.
template <std::size_t D, std::size_t Rate>
void check_decoder(index_t batch, index_t n) {
    CAPTURE(D);
    CAPTURE(Rate);
    CAPTURE(batch);
    const index_t cm_rows = n * batch, out_rows = n * static_cast<index_t>(Rate) * batch;
    mnemo::parameter_set<double> ps;
    mnemo::conv_transpose_decoder<double, D, Rate> dec(ps, "decoder");
    ps.allocate();
    randomize_parameters(ps, 3 + D + Rate);
    CHECK(dec.decoded_rows(cm_rows) == out_rows);

    auto cm = random_vector<double>(cm_rows * static_cast<index_t>(D), 4 + batch);
    auto r = random_vector<double>(out_rows * static_cast<index_t>(D), 5);
    std::vector<double> out(r.size(), 1e3), d_cm(cm.size(), 1e3);  // both assigned: the prefill must vanish
    auto loss = [&] {
        dec.forward(view<const double, D>(cm.data(), cm_rows), batch, view<double, D>(out.data(), out_rows));
        return project(out, r);
    };
    loss();
    check_close("decoder out", out, reference_decoder(cm, dec.weight().value(), dec.bias().value(), batch, D, Rate),
                1e-13, 1e-13);

    auto backward = [&] {
        dec.backward(view<const double, D>(cm.data(), cm_rows), batch, view<const double, D>(r.data(), out_rows),
                     view<double, D>(d_cm.data(), cm_rows));
    };
    ps.zero_grad();
    backward();
    auto targets = parameter_targets(ps);
    targets.push_back({"cm", cm.data(), d_cm});
    check_gradients(loss, targets);
    check_accumulates(ps, backward);

    // an empty d_cm skips only that part
    const auto d_cm_once = d_cm;
    ps.zero_grad();
    dec.backward(view<const double, D>(cm.data(), cm_rows), batch, view<const double, D>(r.data(), out_rows),
                 view<double, D>());
    std::vector<double> without(ps.grads(), ps.grads() + ps.size());
    ps.zero_grad();
    backward();
    check_close("decoder parameter gradients without d_cm", without.data(), ps.grads(), ps.size(), 0, 0);
    check_close("d_cm (assigned)", d_cm, d_cm_once, 0, 0);
}

// The whole loss against finite differences in every parameter of f_c and the decoder.
template <template <class, std::size_t, std::size_t, class> class Compression, std::size_t D, std::size_t Rate>
void check_loss_gradients(index_t batch, index_t n) {
    CAPTURE(D);
    CAPTURE(Rate);
    CAPTURE(batch);
    const index_t mem_rows = n * static_cast<index_t>(Rate) * batch;
    mnemo::parameter_set<double> ps;
    Compression<double, D, Rate, mnemo::cpu> comp(ps, "transformer.layers.0.compress");
    mnemo::conv_transpose_decoder<double, D, Rate> dec(ps, "transformer.layers.0.decoder");
    ps.allocate();
    randomize_parameters(ps, 11 + D + Rate, -0.6, 0.6);
    mnemo::autoencoding_reconstruction<double, D, Rate> ae;
    auto m = random_vector<double>(mem_rows * static_cast<index_t>(D), 12 + batch);
    const view<const double, D> mv(m.data(), mem_rows);

    ps.zero_grad();
    const double with = ae.compute(comp, dec, mv, batch, true);
    auto targets = parameter_targets(ps);
    CHECK(targets.size() == (Compression<double, D, Rate, mnemo::cpu>::has_parameters ? 4u : 2u));
    auto loss = [&] { return ae.compute(comp, dec, mv, batch, false); };
    CHECK(loss() == with);
    check_gradients(loss, targets);
    check_accumulates(ps, [&] { ae.compute(comp, dec, mv, batch, true); });
}

template <std::size_t D, std::size_t Rate>
struct decoder_case {
    static void run(index_t batch, index_t n) { check_decoder<D, Rate>(batch, n); }
};
template <std::size_t D, std::size_t Rate>
struct conv_loss_case {
    static void run(index_t batch, index_t n) { check_loss_gradients<mnemo::conv_compression, D, Rate>(batch, n); }
};
template <std::size_t D, std::size_t Rate>
struct max_loss_case {
    static void run(index_t batch, index_t n) { check_loss_gradients<mnemo::max_pool_compression, D, Rate>(batch, n); }
};
template <std::size_t D, std::size_t Rate>
struct mean_loss_case {
    static void run(index_t batch, index_t n) { check_loss_gradients<mnemo::mean_pool_compression, D, Rate>(batch, n); }
};

template <class T>
void check_golden(double atol, double rtol) {
    constexpr std::size_t D = 6, Rate = 3;
    const auto f = mnemo::read_safetensors(std::string(MNEMO_TEST_DATA_DIR) + "/golden/autoencoding.safetensors");
    REQUIRE(meta_int(f, "d_model") == index_t(D));
    REQUIRE(meta_int(f, "compression_rate") == index_t(Rate));
    const index_t batch = meta_int(f, "batch"), slots = meta_int(f, "compressed_slots");
    const index_t mem_rows = slots * index_t(Rate) * batch;

    mnemo::parameter_set<T> ps;
    mnemo::conv_compression<T, D, Rate> conv(ps, "compress");
    mnemo::max_pool_compression<T, D, Rate> max_pool(ps, "max");
    mnemo::conv_transpose_decoder<T, D, Rate> dec(ps, "decoder");
    ps.allocate();
    for (const auto& e : ps.entries()) f.copy_to(e.name, ps.values() + e.offset, std::size_t(e.size));
    std::vector<T> m(std::size_t(mem_rows * index_t(D)));
    f.copy_to("m", m.data(), m.size());
    const view<const T, D> mv(m.data(), mem_rows);
    mnemo::autoencoding_reconstruction<T, D, Rate> ae;

    // the decoder alone reproduces ConvTranspose1d on the reference's compressed memory
    {
        const auto cm = f.to_vector<T>("conv.cm");
        const auto rec = f.to_vector<double>("conv.reconstruction");
        std::vector<T> out(rec.size());
        dec.forward(view<const T, D>(cm.data(), slots * batch), batch, view<T, D>(out.data(), mem_rows));
        check_close("conv.reconstruction", out.data(), rec.data(), index_t(rec.size()), atol, rtol);
    }

    ps.zero_grad();
    const double loss = ae.compute(conv, dec, mv, batch, true);
    const double ref = f.to_vector<double>("conv.loss").at(0);
    check_close("conv.loss", &loss, &ref, 1, atol, rtol);
    for (const auto& e : ps.entries()) {
        const auto g = f.to_vector<double>("conv.grad." + e.name);
        check_close("conv.grad." + e.name, ps.grads() + e.offset, g.data(), e.size, atol, rtol);
    }

    ps.zero_grad();
    const double loss_max = ae.compute(max_pool, dec, mv, batch, true);
    const double ref_max = f.to_vector<double>("max.loss").at(0);
    check_close("max.loss", &loss_max, &ref_max, 1, atol, rtol);
    for (const auto& e : ps.entries()) {
        if (e.name.starts_with("compress.")) {
            for (index_t i = 0; i < e.size; ++i) CHECK(ps.grads()[e.offset + i] == T(0));
            continue;
        }
        const auto g = f.to_vector<double>("max.grad." + e.name);
        check_close("max.grad." + e.name, ps.grads() + e.offset, g.data(), e.size, atol, rtol);
    }
}

}  // namespace

TEST_CASE("conv_transpose_decoder: forward matches ConvTranspose1d over the permuted memory, backward matches "
          "finite differences") {
    run_compression_shapes<decoder_case>();
}

TEST_CASE("conv_transpose_decoder: parameters named <prefix>.weight [in, out, kernel] and <prefix>.bias, PyTorch "
          "default initialisation") {
    mnemo::parameter_set<float> ps;
    mnemo::conv_transpose_decoder<float, 8, 3> dec(ps, "transformer.layers.1.decoder");
    static_assert(decltype(dec)::rate == 3 && decltype(dec)::features == 8);
    REQUIRE(ps.entries().size() == 2);
    CHECK(ps.entries()[0].name == "transformer.layers.1.decoder.weight");
    CHECK(ps.entries()[0].shape == std::vector<index_t>{8, 8, 3});
    CHECK(ps.entries()[1].name == "transformer.layers.1.decoder.bias");
    CHECK(ps.entries()[1].shape == std::vector<index_t>{8});
    CHECK(dec.name() == "transformer.layers.1.decoder");

    // U(−1/√fan_in, 1/√fan_in), fan_in = weight.size(1) · kernel = 8 · 3, for weight and bias
    ps.allocate();
    mnemo::rng r(17);
    dec.reset_parameters(r);
    const double bound = 1.0 / std::sqrt(24.0);
    for (const auto& e : ps.entries()) {
        double lo = 1, hi = -1;
        for (index_t i = 0; i < e.size; ++i) {
            lo = std::min(lo, double(ps.values()[e.offset + i]));
            hi = std::max(hi, double(ps.values()[e.offset + i]));
        }
        INFO(e.name << " in [" << lo << ", " << hi << "], bound " << bound);
        CHECK(lo >= -bound);
        CHECK(hi < bound);
        CHECK(hi - lo > bound);
    }
}

TEST_CASE("conv_transpose_decoder: rate 1 is the per-slot map x·W + b (W as [in, out])") {
    constexpr std::size_t D = 5;
    const index_t rows = 6, batch = 2;
    mnemo::parameter_set<double> ps;
    mnemo::conv_transpose_decoder<double, D, 1> dec(ps, "decoder");
    ps.allocate();
    randomize_parameters(ps, 21);
    auto cm = random_vector<double>(rows * D, 22);
    std::vector<double> out(rows * D), expected(rows * D);
    dec.forward(view<const double, D>(cm.data(), rows), batch, view<double, D>(out.data(), rows));
    const double* w = dec.weight().value();
    for (index_t r = 0; r < rows; ++r)
        for (index_t o = 0; o < index_t(D); ++o) {
            double acc = dec.bias().value()[o];
            for (index_t i = 0; i < index_t(D); ++i) acc += cm[r * D + i] * w[i * D + o];
            expected[r * D + o] = acc;
        }
    check_close("rate-1 decoder", out, expected, 1e-14, 1e-14);
}

TEST_CASE("conv_transpose_decoder: strided views are honoured; large enough to run threaded") {
    // cm_rows · D · Rate >= 65536 switches the gather/scatter loops to OpenMP.
    constexpr std::size_t D = 64, Rate = 4;
    const index_t batch = 4, n = 64, cm_rows = n * batch, out_rows = n * Rate * batch, ld = 70;
    mnemo::parameter_set<double> ps;
    mnemo::conv_transpose_decoder<double, D, Rate> dec(ps, "decoder");
    ps.allocate();
    mnemo::rng r(41);
    dec.reset_parameters(r);
    auto cm_wide = random_vector<double>(cm_rows * ld, 42);
    auto dy = random_vector<double>(out_rows * D, 43);
    std::vector<double> cm(cm_rows * D);
    for (index_t i = 0; i < cm_rows; ++i)
        for (index_t j = 0; j < index_t(D); ++j) cm[i * D + j] = cm_wide[i * ld + j];
    const view<const double, D> cmv(cm_wide.data(), cm_rows, D, ld);

    std::vector<double> out_wide(out_rows * ld, 123.0), out(out_rows * D);
    dec.forward(cmv, batch, view<double, D>(out_wide.data(), out_rows, D, ld));
    for (index_t i = 0; i < out_rows; ++i) {
        for (index_t j = 0; j < index_t(D); ++j) out[i * D + j] = out_wide[i * ld + j];
        for (index_t j = D; j < ld; ++j) CHECK(out_wide[i * ld + j] == 123.0);
    }
    check_close("decoder out", out, reference_decoder(cm, dec.weight().value(), dec.bias().value(), batch, D, Rate),
                1e-12, 1e-12);

    // d_cm[s·batch + b, i] = Σ_{o,t} dy[(s·Rate + t)·batch + b, o] · W[i, o, t]; dW and db by direct sums.
    std::vector<double> d_cm_wide(cm_rows * ld, 7.0);
    dec.backward(cmv, batch, view<const double, D>(dy.data(), out_rows),
                 view<double, D>(d_cm_wide.data(), cm_rows, D, ld));
    const double* w = dec.weight().value();
    std::vector<double> d_cm_ref(cm.size(), 0.0), dw_ref(D * D * Rate, 0.0), db_ref(D, 0.0);
    for (index_t s = 0; s < n; ++s)
        for (index_t b = 0; b < batch; ++b)
            for (index_t t = 0; t < index_t(Rate); ++t)
                for (index_t o = 0; o < index_t(D); ++o) {
                    const double g = dy[((s * Rate + t) * batch + b) * D + o];
                    db_ref[o] += g;
                    for (index_t i = 0; i < index_t(D); ++i) {
                        d_cm_ref[(s * batch + b) * D + i] += g * w[(i * D + o) * Rate + t];
                        dw_ref[(i * D + o) * Rate + t] += g * cm[(s * batch + b) * D + i];
                    }
                }
    std::vector<double> d_cm(cm.size());
    for (index_t i = 0; i < cm_rows; ++i) {
        for (index_t j = 0; j < index_t(D); ++j) d_cm[i * D + j] = d_cm_wide[i * ld + j];
        for (index_t j = D; j < ld; ++j) CHECK(d_cm_wide[i * ld + j] == 7.0);
    }
    check_close("d_cm", d_cm, d_cm_ref, 1e-12, 1e-12);
    check_close("d_weight", dec.weight().grad(), dw_ref.data(), D * D * Rate, 1e-12, 1e-12);
    check_close("d_bias", dec.bias().grad(), db_ref.data(), D, 1e-12, 1e-12);
}

TEST_CASE("autoencoding_reconstruction: the loss gradient matches finite differences (conv compression)") {
    run_compression_shapes<conv_loss_case>();
}

TEST_CASE("autoencoding_reconstruction: with max or mean pooling only the decoder has gradient, matching finite "
          "differences") {
    run_compression_shapes<max_loss_case>();
    run_compression_shapes<mean_loss_case>();
}

TEST_CASE("autoencoding_reconstruction: the loss is the mean squared error of the decoded compression") {
    constexpr std::size_t D = 5, Rate = 2;
    const index_t batch = 3, n = 2, mem_rows = n * Rate * batch, cm_rows = n * batch;
    mnemo::parameter_set<double> ps;
    mnemo::conv_compression<double, D, Rate> comp(ps, "compress");
    mnemo::conv_transpose_decoder<double, D, Rate> dec(ps, "decoder");
    ps.allocate();
    randomize_parameters(ps, 71);
    auto m = random_vector<double>(mem_rows * D, 72);
    std::vector<double> cm(cm_rows * D), rec(mem_rows * D);
    comp.forward(view<const double, D>(m.data(), mem_rows), batch, view<double, D>(cm.data(), cm_rows));
    dec.forward(view<const double, D>(cm.data(), cm_rows), batch, view<double, D>(rec.data(), mem_rows));
    double expected = 0;
    for (std::size_t i = 0; i < m.size(); ++i) expected += (rec[i] - m[i]) * (rec[i] - m[i]);
    expected /= double(m.size());
    mnemo::autoencoding_reconstruction<double, D, Rate> ae;
    const double loss = ae.compute(comp, dec, view<const double, D>(m.data(), mem_rows), batch, false);
    check_close("loss", &loss, &expected, 1, 1e-15, 1e-14);
    for (index_t i = 0; i < ps.size(); ++i) CHECK(ps.grads()[i] == 0.0);  // with_grad = false touches nothing

    // an empty memory: loss 0, no gradient
    CHECK(ae.compute(comp, dec, view<const double, D>(nullptr, 0), batch, true) == 0.0);
    for (index_t i = 0; i < ps.size(); ++i) CHECK(ps.grads()[i] == 0.0);
}

TEST_CASE("autoencoding_reconstruction: other parameters of the same set get exactly zero gradient") {
    constexpr std::size_t D = 6, Rate = 3;
    const index_t batch = 2, n = 3, mem_rows = n * Rate * batch;
    mnemo::parameter_set<double> ps;
    mnemo::linear<double, D, D> before(ps, "linear_before");
    mnemo::conv_compression<double, D, Rate> comp(ps, "compress");
    mnemo::layer_norm<double, D> norm(ps, "norm");
    mnemo::conv_transpose_decoder<double, D, Rate> dec(ps, "decoder");
    mnemo::linear<double, D, D> after(ps, "linear_after");
    ps.allocate();
    randomize_parameters(ps, 81);
    auto m = random_vector<double>(mem_rows * D, 82);
    mnemo::autoencoding_reconstruction<double, D, Rate> ae;
    const auto owned = [](const std::string& name) {
        return name.starts_with("compress.") || name.starts_with("decoder.");
    };

    ps.zero_grad();
    ae.compute(comp, dec, view<const double, D>(m.data(), mem_rows), batch, true);
    for (const auto& e : ps.entries()) {
        double norm2 = 0;
        for (index_t i = 0; i < e.size; ++i) norm2 += ps.grads()[e.offset + i] * ps.grads()[e.offset + i];
        INFO(e.name << ": |grad|^2 = " << norm2);
        if (owned(e.name)) CHECK(norm2 > 0);
        else CHECK(norm2 == 0.0);
    }
    // pre-filled gradients of the other parameters stay bitwise as they were, and no value moves
    auto prefill = random_vector<double>(ps.size(), 83);
    std::memcpy(ps.grads(), prefill.data(), sizeof(double) * prefill.size());
    const std::vector<double> values(ps.values(), ps.values() + ps.size());
    ae.compute(comp, dec, view<const double, D>(m.data(), mem_rows), batch, true);
    for (const auto& e : ps.entries())
        if (!owned(e.name)) check_close("untouched " + e.name, ps.grads() + e.offset, prefill.data() + e.offset, e.size, 0, 0);
    check_close("parameter values", ps.values(), values.data(), ps.size(), 0, 0);
}

TEST_CASE("autoencoding_reconstruction: bad shapes throw mnemo::error naming the module") {
    constexpr std::size_t D = 5;
    mnemo::parameter_set<double> ps;
    mnemo::conv_compression<double, D, 2> comp(ps, "transformer.layers.0.compress");
    mnemo::conv_transpose_decoder<double, D, 2> dec(ps, "transformer.layers.0.decoder");
    ps.allocate();
    std::vector<double> mem(14 * D), out(14 * D);
    mnemo::autoencoding_reconstruction<double, D, 2> ae;
    CHECK_THROWS_WITH_AS(ae.compute(comp, dec, view<const double, D>(mem.data(), 7), 3, true),
                         "mnemo: autoencoding_reconstruction: memory has 7 rows, not a multiple of compression rate "
                         "2 x batch 3 = 6",
                         mnemo::error);
    CHECK_THROWS_WITH_AS(ae.compute(comp, dec, view<const double, D>(mem.data(), 6), 0, true),
                         "mnemo: autoencoding_reconstruction: batch must be positive, got 0", mnemo::error);
    const std::string who = "mnemo: conv_transpose_decoder 'transformer.layers.0.decoder': ";
    CHECK_THROWS_WITH_AS(dec.forward(view<const double, D>(mem.data(), 6), 4, view<double, D>(out.data(), 12)),
                         (who + "cm has 6 rows, not a multiple of batch 4").c_str(), mnemo::error);
    CHECK_THROWS_WITH_AS(dec.forward(view<const double, D>(mem.data(), 6), 0, view<double, D>(out.data(), 12)),
                         (who + "batch must be positive, got 0").c_str(), mnemo::error);
    CHECK_THROWS_WITH_AS(dec.forward(view<const double, D>(mem.data(), 6), 3, view<double, D>(out.data(), 11)),
                         (who + "out has 11 rows, expected cm rows 6 x rate 2 = 12").c_str(), mnemo::error);
    CHECK_THROWS_WITH_AS(dec.backward(view<const double, D>(mem.data(), 6), 3, view<const double, D>(out.data(), 12),
                                      view<double, D>(mem.data(), 3)),
                         (who + "d_cm has 3 rows but cm has 6").c_str(), mnemo::error);
    CHECK_THROWS_WITH_AS(dec.forward(view<const double>(mem.data(), 6, 4), 3, view<double, D>(out.data(), 12)),
                         doctest::Contains("conv_transpose_decoder 'transformer.layers.0.decoder': cm has 4 features, "
                                           "expected 5"),
                         mnemo::error);
}

TEST_CASE("autoencoding_reconstruction: a steady-state compute performs no heap allocation") {
    constexpr std::size_t D = 16, Rate = 3;
    const index_t batch = 2, n = 5, mem_rows = n * Rate * batch;
    mnemo::parameter_set<float> ps;
    mnemo::conv_compression<float, D, Rate> conv(ps, "conv");
    mnemo::max_pool_compression<float, D, Rate> max_pool(ps, "max");
    mnemo::conv_transpose_decoder<float, D, Rate> dec(ps, "decoder");
    ps.allocate();
    mnemo::rng r(61);
    conv.reset_parameters(r);
    dec.reset_parameters(r);
    auto m = random_vector<float>(mem_rows * D, 62);
    mnemo::autoencoding_reconstruction<float, D, Rate> ae;
    double sink = 0;
    auto step = [&](index_t slots) {
        const view<const float, D> mv(m.data(), slots * index_t(Rate) * batch);
        sink += ae.compute(conv, dec, mv, batch, true);
        sink += ae.compute(conv, dec, mv, batch, false);
        sink += ae.compute(max_pool, dec, mv, batch, true);
    };
    step(n);  // buffers grow to the largest shape
    CHECK(mnemo::testing::count_allocations([&] {
              step(n);
              step(n - 2);  // a shorter memory reuses the same buffers
          }) == 0);
    CHECK(std::isfinite(sink));
}

TEST_CASE("autoencoding_reconstruction: golden values from PyTorch (Conv1d + ConvTranspose1d, float64 reference)") {
    SUBCASE("double") { check_golden<double>(1e-12, 1e-12); }
    SUBCASE("float") { check_golden<float>(1e-5, 1e-5); }
}
