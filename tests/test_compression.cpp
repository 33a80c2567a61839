// Compression functions f_c (conv, max pool, mean pool): forward against naive loops of the PyTorch
// semantics (Conv1d over mem.permute(1, 2, 0), max_pool1d, avg_pool1d), finite-difference gradient
// checks in double, accumulation into pre-filled parameter gradients, parameter names and shapes,
// shape errors, and no heap allocation once the buffers have grown.
#include <doctest/doctest.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <new>
#include <numeric>
#include <string>
#include <vector>

#include <mnemo/mnemo.hpp>
#include <mnemo/nn/compression.hpp>

#include "allocation_counter.hpp"
#include "gradcheck.hpp"

using mnemo::index_t;
using mnemo::view;
using mnemo::testing::check_accumulates;
using mnemo::testing::check_close;
using mnemo::testing::check_gradients;
using mnemo::testing::parameter_targets;
using mnemo::testing::project;
using mnemo::testing::random_vector;
using mnemo::testing::randomize_parameters;
using mnemo::testing::run_compression_shapes;

namespace {

// ---- references: the PyTorch semantics written out as plain loops over [seq, batch, D] ----

// labml's Conv1dCompression: x = mem.permute(1, 2, 0) [batch, D, L]; y = conv1d(x, W, bias, stride=c)
// [batch, D, n]; out = y.permute(2, 0, 1) [n, batch, D].
std::vector<double> reference_conv(const std::vector<double>& mem, const double* w, const double* bias,
                                   index_t batch, index_t d, index_t rate) {
    const index_t len = static_cast<index_t>(mem.size()) / (batch * d), n = len / rate;
    std::vector<double> x(static_cast<std::size_t>(batch * d * len));
    for (index_t l = 0; l < len; ++l)
        for (index_t b = 0; b < batch; ++b)
            for (index_t i = 0; i < d; ++i) x[(b * d + i) * len + l] = mem[(l * batch + b) * d + i];
    std::vector<double> y(static_cast<std::size_t>(batch * d * n));
    for (index_t b = 0; b < batch; ++b)
        for (index_t o = 0; o < d; ++o)
            for (index_t s = 0; s < n; ++s) {
                double acc = bias[o];
                for (index_t i = 0; i < d; ++i)
                    for (index_t t = 0; t < rate; ++t) acc += w[(o * d + i) * rate + t] * x[(b * d + i) * len + s * rate + t];
                y[(b * d + o) * n + s] = acc;
            }
    std::vector<double> out(static_cast<std::size_t>(n * batch * d));
    for (index_t s = 0; s < n; ++s)
        for (index_t b = 0; b < batch; ++b)
            for (index_t o = 0; o < d; ++o) out[(s * batch + b) * d + o] = y[(b * d + o) * n + s];
    return out;
}

// F.max_pool1d / F.avg_pool1d (kernel = stride = rate) along time, in the same permuted frame.
std::vector<double> reference_pool(const std::vector<double>& mem, index_t batch, index_t d, index_t rate, bool max) {
    const index_t len = static_cast<index_t>(mem.size()) / (batch * d), n = len / rate;
    std::vector<double> out(static_cast<std::size_t>(n * batch * d));
    for (index_t s = 0; s < n; ++s)
        for (index_t b = 0; b < batch; ++b)
            for (index_t i = 0; i < d; ++i) {
                double acc = max ? -std::numeric_limits<double>::infinity() : 0.0;
                for (index_t t = 0; t < rate; ++t) {
                    const double v = mem[((s * rate + t) * batch + b) * d + i];
                    acc = max ? std::max(acc, v) : acc + v;
                }
                out[(s * batch + b) * d + i] = max ? acc : acc / static_cast<double>(rate);
            }
    return out;
}


// Pairwise distinct values, at least 0.05 apart, in random order: max pooling is differentiable there
// and finite differences (eps 1e-6) never cross a tie.
std::vector<double> distinct_values(index_t count, std::uint64_t seed) {
    std::vector<index_t> perm(static_cast<std::size_t>(count));
    std::iota(perm.begin(), perm.end(), index_t(0));
    mnemo::rng r(seed);
    for (index_t i = count - 1; i > 0; --i) std::swap(perm[i], perm[r.next_u32() % static_cast<std::uint32_t>(i + 1)]);
    std::vector<double> v(static_cast<std::size_t>(count));
    for (index_t i = 0; i < count; ++i) v[i] = 0.05 * static_cast<double>(perm[i]) - 0.025 * static_cast<double>(count);
    return v;
}

// ---- the checks, per (D, Rate), for a given batch and number of compressed slots n ----

template <std::size_t D, std::size_t Rate>
void check_conv(index_t batch, index_t n) {
    CAPTURE(D);
    CAPTURE(Rate);
    CAPTURE(batch);
    const index_t mem_rows = n * static_cast<index_t>(Rate) * batch, out_rows = n * batch;
    mnemo::parameter_set<double> ps;
    mnemo::conv_compression<double, D, Rate> comp(ps, "transformer.layers.0.compress");
    ps.allocate();
    randomize_parameters(ps, 1 + D + Rate);
    const double* w = ps.values() + ps.find("transformer.layers.0.compress.conv.weight")->offset;
    const double* bias = ps.values() + ps.find("transformer.layers.0.compress.conv.bias")->offset;

    auto mem = random_vector<double>(mem_rows * static_cast<index_t>(D), 2 + batch);
    auto r = random_vector<double>(out_rows * static_cast<index_t>(D), 3);
    std::vector<double> out(r.size()), d_mem(mem.size());
    auto loss = [&] {
        comp.forward(view<const double, D>(mem.data(), mem_rows), batch, view<double, D>(out.data(), out_rows));
        return project(out, r);
    };

    // forward against the Conv1d reference
    loss();
    check_close("conv out", out, reference_conv(mem, w, bias, batch, D, Rate), 1e-13, 1e-13);

    // gradients: weight, bias and memory, against central differences
    ps.zero_grad();
    std::fill(d_mem.begin(), d_mem.end(), 1e3);  // assigned, so the prefill must vanish
    auto backward = [&] {
        comp.backward(view<const double, D>(mem.data(), mem_rows), batch, view<const double, D>(r.data(), out_rows),
                      view<double, D>(d_mem.data(), mem_rows));
    };
    backward();
    auto targets = parameter_targets(ps);
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
void check_max_pool(index_t batch, index_t n) {
    CAPTURE(D);
    CAPTURE(Rate);
    CAPTURE(batch);
    const index_t mem_rows = n * static_cast<index_t>(Rate) * batch, out_rows = n * batch;
    mnemo::parameter_set<double> ps;
    mnemo::max_pool_compression<double, D, Rate> comp(ps, "compress");
    ps.allocate();
    CHECK(ps.entries().empty());

    auto mem = distinct_values(mem_rows * static_cast<index_t>(D), 4 + batch);
    auto r = random_vector<double>(out_rows * static_cast<index_t>(D), 5);
    std::vector<double> out(r.size()), d_mem(mem.size(), 1e3);
    auto loss = [&] {
        comp.forward(view<const double, D>(mem.data(), mem_rows), batch, view<double, D>(out.data(), out_rows));
        return project(out, r);
    };
    loss();
    check_close("max pool out", out, reference_pool(mem, batch, D, Rate, true), 0, 0);
    comp.backward(view<const double, D>(mem.data(), mem_rows), batch, view<const double, D>(r.data(), out_rows),
                  view<double, D>(d_mem.data(), mem_rows));
    check_gradients(loss, {{"mem", mem.data(), d_mem}});
}

template <std::size_t D, std::size_t Rate>
void check_mean_pool(index_t batch, index_t n) {
    CAPTURE(D);
    CAPTURE(Rate);
    CAPTURE(batch);
    const index_t mem_rows = n * static_cast<index_t>(Rate) * batch, out_rows = n * batch;
    mnemo::parameter_set<double> ps;
    mnemo::mean_pool_compression<double, D, Rate> comp(ps, "compress");
    ps.allocate();
    CHECK(ps.entries().empty());

    auto mem = random_vector<double>(mem_rows * static_cast<index_t>(D), 6 + batch);
    auto r = random_vector<double>(out_rows * static_cast<index_t>(D), 7);
    std::vector<double> out(r.size()), d_mem(mem.size(), 1e3);
    auto loss = [&] {
        comp.forward(view<const double, D>(mem.data(), mem_rows), batch, view<double, D>(out.data(), out_rows));
        return project(out, r);
    };
    loss();
    check_close("mean pool out", out, reference_pool(mem, batch, D, Rate, false), 1e-15, 1e-15);
    comp.backward(view<const double, D>(mem.data(), mem_rows), batch, view<const double, D>(r.data(), out_rows),
                  view<double, D>(d_mem.data(), mem_rows));
    check_gradients(loss, {{"mem", mem.data(), d_mem}});
}

// Every compression function over rates 1, 2, 3, odd and even D, batch 1 and 3.
template <std::size_t D, std::size_t Rate>
struct conv_case {
    static void run(index_t batch, index_t n) { check_conv<D, Rate>(batch, n); }
};
template <std::size_t D, std::size_t Rate>
struct max_case {
    static void run(index_t batch, index_t n) { check_max_pool<D, Rate>(batch, n); }
};
template <std::size_t D, std::size_t Rate>
struct mean_case {
    static void run(index_t batch, index_t n) { check_mean_pool<D, Rate>(batch, n); }
};

}  // namespace

TEST_CASE("conv_compression: forward matches Conv1d over the permuted memory, backward matches finite differences") {
    run_compression_shapes<conv_case>();
}

TEST_CASE("max_pool_compression: forward matches max_pool1d, backward matches finite differences") {
    run_compression_shapes<max_case>();
}

TEST_CASE("mean_pool_compression: forward matches avg_pool1d, backward matches finite differences") {
    run_compression_shapes<mean_case>();
}

TEST_CASE("conv_compression: parameters are named as the PyTorch state_dict, shaped [out, in, kernel]") {
    mnemo::parameter_set<float> ps;
    mnemo::conv_compression<float, 8, 3> comp(ps, "transformer.layers.1.compress");
    using conv_t = decltype(comp);
    static_assert(conv_t::rate == 3 && conv_t::has_parameters);
    static_assert(!mnemo::max_pool_compression<float, 8, 3>::has_parameters);
    static_assert(!mnemo::mean_pool_compression<float, 8, 3>::has_parameters);
    REQUIRE(ps.entries().size() == 2);
    CHECK(ps.entries()[0].name == "transformer.layers.1.compress.conv.weight");
    CHECK(ps.entries()[0].shape == std::vector<index_t>{8, 8, 3});
    CHECK(ps.entries()[1].name == "transformer.layers.1.compress.conv.bias");
    CHECK(ps.entries()[1].shape == std::vector<index_t>{8});
    CHECK(comp.name() == "transformer.layers.1.compress");

    // PyTorch's default initialisation: U(−1/√(in·kernel), 1/√(in·kernel)) for weight and bias
    ps.allocate();
    mnemo::rng r(17);
    comp.reset_parameters(r);
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
        CHECK(hi - lo > bound);  // spread over the range, not a constant
    }
}

TEST_CASE("conv_compression: rate 1 is the per-slot linear map x·Wᵀ + b") {
    constexpr std::size_t D = 5;
    const index_t rows = 6, batch = 2;
    mnemo::parameter_set<double> ps;
    mnemo::conv_compression<double, D, 1> comp(ps, "compress");
    mnemo::linear<double, D, D> lin(ps, "linear");
    ps.allocate();
    randomize_parameters(ps, 21);
    std::memcpy(lin.weight().value(), comp.weight().value(), sizeof(double) * D * D);
    std::memcpy(lin.bias().value(), comp.bias().value(), sizeof(double) * D);
    auto mem = random_vector<double>(rows * D, 22);
    std::vector<double> a(rows * D), b(rows * D);
    comp.forward(view<const double, D>(mem.data(), rows), batch, view<double, D>(a.data(), rows));
    lin.forward(view<const double, D>(mem.data(), rows), view<double, D>(b.data(), rows));
    check_close("rate-1 conv vs linear", a, b, 1e-14, 1e-14);
    CHECK(mnemo::conv_compression<double, D, 1>::compressed_rows(rows, batch) == rows);
}

TEST_CASE("max_pool_compression and mean_pool_compression: rate 1 is the identity") {
    constexpr std::size_t D = 7;
    const index_t rows = 9, batch = 3;
    mnemo::parameter_set<double> ps;
    mnemo::max_pool_compression<double, D, 1> max_pool(ps, "max");
    mnemo::mean_pool_compression<double, D, 1> mean_pool(ps, "mean");
    auto mem = random_vector<double>(rows * D, 23);
    auto dy = random_vector<double>(rows * D, 24);
    std::vector<double> out(rows * D), d_mem(rows * D);
    max_pool.forward(view<const double, D>(mem.data(), rows), batch, view<double, D>(out.data(), rows));
    check_close("max pool, rate 1", out, mem, 0, 0);
    max_pool.backward(view<const double, D>(mem.data(), rows), batch, view<const double, D>(dy.data(), rows),
                      view<double, D>(d_mem.data(), rows));
    check_close("max pool gradient, rate 1", d_mem, dy, 0, 0);
    mean_pool.forward(view<const double, D>(mem.data(), rows), batch, view<double, D>(out.data(), rows));
    check_close("mean pool, rate 1", out, mem, 0, 0);
    mean_pool.backward(view<const double, D>(mem.data(), rows), batch, view<const double, D>(dy.data(), rows),
                       view<double, D>(d_mem.data(), rows));
    check_close("mean pool gradient, rate 1", d_mem, dy, 0, 0);
}

TEST_CASE("max_pool_compression: ties route the gradient to the first maximum, a NaN is the maximum (as PyTorch)") {
    constexpr std::size_t D = 2;
    const index_t batch = 2;
    // rows t·batch + b for t = 0..2: feature 0 ties at t = 1 and t = 2 (b = 0) and at all t (b = 1);
    // feature 1 holds a NaN at t = 1 (b = 0) and is distinct (b = 1).
    const double nan = std::numeric_limits<double>::quiet_NaN();
    std::vector<double> mem = {
        1.0, 0.5,  /* t0 b0 */ 2.0, -1.0, /* t0 b1 */
        3.0, nan,  /* t1 b0 */ 2.0, 4.0,  /* t1 b1 */
        3.0, 9.0,  /* t2 b0 */ 2.0, 1.0,  /* t2 b1 */
    };
    std::vector<double> out(batch * D), dy = {10, 20, 30, 40}, d_mem(mem.size(), -7);
    mnemo::parameter_set<double> ps;
    mnemo::max_pool_compression<double, D, 3> comp(ps, "compress");
    comp.forward(view<const double, D>(mem.data(), 6), batch, view<double, D>(out.data(), batch));
    CHECK(out[0] == 3.0);
    CHECK(std::isnan(out[1]));
    CHECK(out[2] == 2.0);
    CHECK(out[3] == 4.0);
    comp.backward(view<const double, D>(mem.data(), 6), batch, view<const double, D>(dy.data(), batch),
                  view<double, D>(d_mem.data(), 6));
    const std::vector<double> expected = {0, 0, 30, 0, 10, 20, 0, 40, 0, 0, 0, 0};
    check_close("max pool gradient with ties and NaN", d_mem, expected, 0, 0);
}

TEST_CASE("compression: float forward agrees with the double reference; strided views are honoured") {
    constexpr std::size_t D = 7, Rate = 2;
    const index_t batch = 3, n = 4, mem_rows = n * Rate * batch, out_rows = n * batch, ld = 11;
    mnemo::parameter_set<float> ps;
    mnemo::conv_compression<float, D, Rate> conv(ps, "conv");
    mnemo::max_pool_compression<float, D, Rate> max_pool(ps, "max");
    mnemo::mean_pool_compression<float, D, Rate> mean_pool(ps, "mean");
    ps.allocate();
    mnemo::rng r(31);
    conv.reset_parameters(r);
    max_pool.reset_parameters(r);
    mean_pool.reset_parameters(r);

    // mem and out live in the first D columns of wider rows (ld = 11)
    auto wide = random_vector<float>(mem_rows * ld, 32);
    std::vector<double> mem(mem_rows * D);
    for (index_t i = 0; i < mem_rows; ++i)
        for (index_t j = 0; j < static_cast<index_t>(D); ++j) mem[i * D + j] = wide[i * ld + j];
    std::vector<double> w(conv.weight().value(), conv.weight().value() + D * D * Rate),
        b(conv.bias().value(), conv.bias().value() + D);
    view<const float, D> mem_view(wide.data(), mem_rows, D, ld);

    std::vector<float> out_wide(out_rows * ld, 123.f), out(out_rows * D);
    auto dense = [&] {
        for (index_t i = 0; i < out_rows; ++i) {
            for (index_t j = 0; j < static_cast<index_t>(D); ++j) out[i * D + j] = out_wide[i * ld + j];
            for (index_t j = D; j < ld; ++j) CHECK(out_wide[i * ld + j] == 123.f);  // padding untouched
        }
        return out;
    };
    conv.forward(mem_view, batch, view<float, D>(out_wide.data(), out_rows, D, ld));
    check_close("conv out (float)", dense(), reference_conv(mem, w.data(), b.data(), batch, D, Rate), 1e-6, 1e-5);
    max_pool.forward(mem_view, batch, view<float, D>(out_wide.data(), out_rows, D, ld));
    check_close("max pool out (float)", dense(), reference_pool(mem, batch, D, Rate, true), 0, 0);
    mean_pool.forward(mem_view, batch, view<float, D>(out_wide.data(), out_rows, D, ld));
    check_close("mean pool out (float)", dense(), reference_pool(mem, batch, D, Rate, false), 1e-7, 1e-6);

    // a strided d_mem is written only in its first D columns
    std::vector<float> dy = random_vector<float>(out_rows * D, 33), d_wide(mem_rows * ld, 5.f);
    mean_pool.backward(mem_view, batch, view<const float, D>(dy.data(), out_rows),
                       view<float, D>(d_wide.data(), mem_rows, D, ld));
    for (index_t t = 0; t < n * static_cast<index_t>(Rate); ++t)
        for (index_t bb = 0; bb < batch; ++bb)
            for (index_t j = 0; j < ld; ++j) {
                const float expected = j < static_cast<index_t>(D)
                                           ? dy[((t / static_cast<index_t>(Rate)) * batch + bb) * D + j] / 2.f
                                           : 5.f;
                CHECK(d_wide[(t * batch + bb) * ld + j] == expected);
            }
}

TEST_CASE("conv_compression: large enough to run threaded, matches the reference in forward and backward") {
    // out_rows · D · Rate >= 65536 switches the gather/scatter loops to OpenMP.
    constexpr std::size_t D = 64, Rate = 4;
    const index_t batch = 4, n = 64, mem_rows = n * Rate * batch, out_rows = n * batch;
    mnemo::parameter_set<double> ps;
    mnemo::conv_compression<double, D, Rate> comp(ps, "compress");
    mnemo::max_pool_compression<double, D, Rate> max_pool(ps, "max");
    ps.allocate();
    mnemo::rng r(41);
    comp.reset_parameters(r);
    auto mem = random_vector<double>(mem_rows * D, 42);
    auto dy = random_vector<double>(out_rows * D, 43);
    std::vector<double> out(out_rows * D), d_mem(mem_rows * D);
    comp.forward(view<const double, D>(mem.data(), mem_rows), batch, view<double, D>(out.data(), out_rows));
    check_close("conv out", out, reference_conv(mem, comp.weight().value(), comp.bias().value(), batch, D, Rate),
                1e-12, 1e-12);

    // d_mem[(s·Rate + t)·batch + b, i] = Σ_o dy[s·batch + b, o] · W[o, i, t]; dW and db by direct sums.
    comp.backward(view<const double, D>(mem.data(), mem_rows), batch, view<const double, D>(dy.data(), out_rows),
                  view<double, D>(d_mem.data(), mem_rows));
    const double* w = comp.weight().value();
    std::vector<double> d_mem_ref(mem.size()), dw_ref(D * D * Rate, 0.0), db_ref(D, 0.0);
    for (index_t s = 0; s < n; ++s)
        for (index_t b = 0; b < batch; ++b)
            for (index_t t = 0; t < static_cast<index_t>(Rate); ++t)
                for (index_t i = 0; i < static_cast<index_t>(D); ++i) {
                    double acc = 0;
                    const index_t m = ((s * Rate + t) * batch + b) * D + i;
                    for (index_t o = 0; o < static_cast<index_t>(D); ++o) {
                        acc += dy[(s * batch + b) * D + o] * w[(o * D + i) * Rate + t];
                        dw_ref[(o * D + i) * Rate + t] += dy[(s * batch + b) * D + o] * mem[m];
                    }
                    d_mem_ref[m] = acc;
                }
    for (index_t row = 0; row < out_rows; ++row)
        for (index_t o = 0; o < static_cast<index_t>(D); ++o) db_ref[o] += dy[row * D + o];
    check_close("d_mem", d_mem, d_mem_ref, 1e-12, 1e-12);
    check_close("d_weight", comp.weight().grad(), dw_ref.data(), D * D * Rate, 1e-12, 1e-12);
    check_close("d_bias", comp.bias().grad(), db_ref.data(), D, 1e-12, 1e-12);

    max_pool.forward(view<const double, D>(mem.data(), mem_rows), batch, view<double, D>(out.data(), out_rows));
    check_close("max pool out", out, reference_pool(mem, batch, D, Rate, true), 0, 0);
}

TEST_CASE("compression: bad row counts and shapes throw mnemo::error naming the module") {
    constexpr std::size_t D = 5;
    mnemo::parameter_set<double> ps;
    mnemo::conv_compression<double, D, 2> conv(ps, "transformer.layers.0.compress");
    mnemo::max_pool_compression<double, D, 2> max_pool(ps, "transformer.layers.1.compress");
    mnemo::mean_pool_compression<double, D, 2> mean_pool(ps, "transformer.layers.2.compress");
    ps.allocate();
    std::vector<double> mem(14 * D), out(7 * D), d_mem(14 * D);
    auto m = [&](index_t rows) { return view<const double, D>(mem.data(), rows); };
    auto o = [&](index_t rows) { return view<double, D>(out.data(), rows); };
    const std::string conv_who = "mnemo: conv_compression 'transformer.layers.0.compress': ";

    CHECK_THROWS_WITH_AS(conv.forward(m(7), 3, o(3)),
                         (conv_who + "memory has 7 rows, not a multiple of compression rate 2 x batch 3 = 6").c_str(),
                         mnemo::error);
    CHECK_THROWS_WITH_AS(conv.forward(m(12), 0, o(6)), (conv_who + "batch must be positive, got 0").c_str(), mnemo::error);
    CHECK_THROWS_WITH_AS(conv.forward(m(12), 3, o(3)),
                         (conv_who + "out has 3 rows, expected memory rows 12 / compression rate 2 = 6").c_str(),
                         mnemo::error);
    CHECK_THROWS_WITH_AS(conv.backward(m(12), 3, view<const double, D>(out.data(), 6), view<double, D>()),
                         (conv_who + "backward called before forward").c_str(), mnemo::error);
    conv.forward(m(12), 3, o(6));
    CHECK_THROWS_WITH_AS(conv.backward(m(6), 3, view<const double, D>(out.data(), 3), view<double, D>()),
                         (conv_who + "backward over 6 memory rows with batch 3 but the last forward saw 12 rows "
                                     "with batch 3").c_str(),
                         mnemo::error);
    CHECK_THROWS_WITH_AS(conv.backward(m(12), 3, view<const double, D>(out.data(), 6), view<double, D>(d_mem.data(), 6)),
                         (conv_who + "d_mem has 6 rows but mem has 12").c_str(), mnemo::error);
    CHECK_THROWS_WITH_AS(conv.backward(m(12), 3, view<const double, D>(out.data(), 5), view<double, D>()),
                         (conv_who + "d_out has 5 rows, expected memory rows 12 / compression rate 2 = 6").c_str(),
                         mnemo::error);
    // a dynamic-feature view is checked at run time
    CHECK_THROWS_WITH_AS(conv.forward(view<const double>(mem.data(), 12, 4), 3, o(6)),
                         doctest::Contains("conv_compression 'transformer.layers.0.compress': mem has 4 features, "
                                           "expected 5"),
                         mnemo::error);

    CHECK_THROWS_WITH_AS(max_pool.forward(m(14), 2, o(7)),
                         "mnemo: max_pool_compression 'transformer.layers.1.compress': memory has 14 rows, not a "
                         "multiple of compression rate 2 x batch 2 = 4",
                         mnemo::error);
    CHECK_THROWS_WITH_AS(max_pool.backward(m(4), 2, view<const double, D>(out.data(), 2), view<double, D>()),
                         "mnemo: max_pool_compression 'transformer.layers.1.compress': backward called before forward",
                         mnemo::error);
    CHECK_THROWS_WITH_AS(mean_pool.forward(m(12), 2, o(5)),
                         "mnemo: mean_pool_compression 'transformer.layers.2.compress': out has 5 rows, expected "
                         "memory rows 12 / compression rate 2 = 6",
                         mnemo::error);
    using mean3 = mnemo::mean_pool_compression<double, D, 3>;
    CHECK_THROWS_WITH_AS(mean3::compressed_rows(10, 1),
                         "mnemo: mean_pool_compression: memory has 10 rows, not a multiple of compression rate 3 x "
                         "batch 1 = 3",
                         mnemo::error);
    CHECK(mnemo::conv_compression<double, D, 3>::compressed_rows(18, 2) == 6);
    CHECK(mnemo::max_pool_compression<double, D, 3>::compressed_rows(0, 2) == 0);
}

TEST_CASE("compression: an empty memory gives an empty output and zero parameter gradients") {
    constexpr std::size_t D = 3;
    mnemo::parameter_set<double> ps;
    mnemo::conv_compression<double, D, 2> conv(ps, "c");
    ps.allocate();
    randomize_parameters(ps, 51);
    conv.forward(view<const double, D>(nullptr, 0), 2, view<double, D>(nullptr, 0));
    conv.backward(view<const double, D>(nullptr, 0), 2, view<const double, D>(nullptr, 0), view<double, D>());
    for (index_t i = 0; i < ps.size(); ++i) CHECK(ps.grads()[i] == 0.0);
}

TEST_CASE("compression: a steady-state forward and backward performs no heap allocation") {
    constexpr std::size_t D = 16, Rate = 3;
    const index_t batch = 2, n = 5, mem_rows = n * Rate * batch, out_rows = n * batch;
    mnemo::parameter_set<float> ps;
    mnemo::conv_compression<float, D, Rate> conv(ps, "conv");
    mnemo::max_pool_compression<float, D, Rate> max_pool(ps, "max");
    mnemo::mean_pool_compression<float, D, Rate> mean_pool(ps, "mean");
    ps.allocate();
    mnemo::rng r(61);
    conv.reset_parameters(r);
    auto mem = random_vector<float>(mem_rows * D, 62);
    auto dy = random_vector<float>(out_rows * D, 63);
    std::vector<float> out(out_rows * D), d_mem(mem_rows * D);
    auto step = [&](index_t slots) {
        const index_t mr = slots * Rate * batch, orr = slots * batch;
        view<const float, D> m(mem.data(), mr);
        view<const float, D> g(dy.data(), orr);
        view<float, D> o(out.data(), orr), dm(d_mem.data(), mr);
        conv.forward(m, batch, o);
        conv.backward(m, batch, g, dm);
        max_pool.forward(m, batch, o);
        max_pool.backward(m, batch, g, dm);
        mean_pool.forward(m, batch, o);
        mean_pool.backward(m, batch, g, dm);
    };
    step(n);  // buffers grow to the largest shape
    CHECK(mnemo::testing::count_allocations([&] {
              step(n);
              step(n - 2);  // a shorter memory reuses the same buffers
          }) == 0);
}
