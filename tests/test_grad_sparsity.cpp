// Row-sparse gradients (parameter_set::declare(..., grad_sparsity::rows), param::touch_grad_rows): the
// record of touched rows, zero_grad over the live ranges only, and clip_grad_norm / adamw / labml_adam
// over a parameter_set that skip the known-zero ranges with bitwise the dense results; the safe default
// of every accessor that hands out gradients without naming rows.
#include <doctest/doctest.h>

#include <omp.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include <mnemo/core/parameters.hpp>
#include <mnemo/core/rng.hpp>
#include <mnemo/mnemo.hpp>
#include <mnemo/train/clip.hpp>
#include <mnemo/train/optimizer.hpp>

#include "gradcheck.hpp"

using mnemo::flat_range;
using mnemo::grad_sparsity;
using mnemo::index_t;
using mnemo::testing::randomize_parameters;
using mnemo::testing::same_bits;

namespace {

template <class T>
index_t live_elements(const mnemo::parameter_set<T>& ps) {
    index_t n = 0;
    for (const flat_range& r : ps.grad_live_ranges()) n += r.end - r.begin;
    return n;
}

// A set shaped like a small model: dense tensors between positional tables [2P, heads, d] and [2P, heads]
// whose gradient reaches a window of rows. `sparse` declares the tables row-sparse; otherwise everything
// is dense. Large enough for several clipping blocks (4096 elements), many optimizer blocks (1024), and
// the parallel paths (>= 32768 elements).
template <class T>
struct model_like {
    static constexpr index_t P = 512, H = 4, D = 8;
    mnemo::parameter_set<T> ps;
    std::vector<mnemo::param<T>> dense, tables;

    explicit model_like(bool sparse) {
        const grad_sparsity s = sparse ? grad_sparsity::rows : grad_sparsity::dense;
        dense.push_back(ps.declare("emb", {13, 7}));
        for (int l = 0; l < 2; ++l) {
            const std::string n = "layer" + std::to_string(l);
            dense.push_back(ps.declare(n + ".w", {40, 33}));
            tables.push_back(ps.declare(n + ".r", {2 * P, H, D}, s));
            tables.push_back(ps.declare(n + ".s", {2 * P, H}, s));
            dense.push_back(ps.declare(n + ".u", {H, D}));
        }
        dense.push_back(ps.declare("gen", {5, 3}));
        ps.allocate();
        randomize_parameters(ps, 21);
    }

    // One backward pass: random gradient added to every dense tensor and to rows [lo, hi) of every table,
    // which a row-sparse writer records with touch_grad_rows (a dense one writes through grad()).
    void backward(std::uint64_t seed, index_t lo, index_t hi) {
        mnemo::rng r(seed);
        for (auto& p : dense) {
            T* g = p.grad();
            for (index_t i = 0; i < p.size(); ++i) g[i] += T(r.uniform(-1, 1));
        }
        for (auto& p : tables) {
            const index_t row = p.entry().row_size();
            T* g = p.entry().sparsity == grad_sparsity::rows ? p.touch_grad_rows(lo, hi) : p.grad() + lo * row;
            for (index_t i = 0; i < (hi - lo) * row; ++i) g[i] += T(r.uniform(-1, 1));
        }
    }
};

}  // namespace

TEST_CASE("parameter_set: touch_grad_rows records the hull of the touched rows; grad_live_ranges follows it") {
    mnemo::parameter_set<float> ps;
    auto a = ps.declare("a", {3, 5});                                // 15 elements, then a gap to 16
    auto r = ps.declare("r", {16, 2, 3}, grad_sparsity::rows);        // rows of 6 elements
    auto b = ps.declare("b", {7});
    auto s = ps.declare("s", {16, 2}, grad_sparsity::rows);
    ps.allocate();
    const auto& cps = ps;
    const index_t ro = r.entry().offset, bo = b.entry().offset, so = s.entry().offset;
    CHECK(r.entry().sparsity == grad_sparsity::rows);
    CHECK(a.entry().sparsity == grad_sparsity::dense);
    CHECK(r.entry().row_size() == 6);

    // Nothing touched: only the dense tensors (each with its trailing gap) are live.
    const std::vector<flat_range> start(ps.grad_live_ranges().begin(), ps.grad_live_ranges().end());
    CHECK(start == std::vector<flat_range>{{0, ro}, {bo, so}});
    CHECK(r.touched_grad_rows() == std::pair<index_t, index_t>{0, 0});
    CHECK(a.touched_grad_rows() == std::pair<index_t, index_t>{0, 3});

    // The pointer is row lo's gradient; the record grows to the hull.
    CHECK(r.touch_grad_rows(4, 6) == cps.grads() + ro + 4 * 6);
    CHECK(r.touched_grad_rows() == std::pair<index_t, index_t>{4, 6});
    r.touch_grad_rows(10, 12);
    CHECK(r.touched_grad_rows() == std::pair<index_t, index_t>{4, 12});
    r.touch_grad_rows(5, 5);  // empty: no change
    r.touch_grad_rows(6, 8);  // inside the hull: no change
    CHECK(r.touched_grad_rows() == std::pair<index_t, index_t>{4, 12});
    s.touch_grad_rows(0, 16);  // every row: the table's gap joins, and it meets b's run
    const std::vector<flat_range> touched(ps.grad_live_ranges().begin(), ps.grad_live_ranges().end());
    CHECK(touched == std::vector<flat_range>{{0, ro}, {ro + 4 * 6, ro + 12 * 6}, {bo, ps.size()}});
    CHECK(ps.grad_known_zero(ro, ro + 4 * 6));
    CHECK_FALSE(ps.grad_known_zero(ro, ro + 4 * 6 + 1));
    CHECK(ps.grad_known_zero(ro + 12 * 6, bo));

    // zero_grad empties the records of the sparse tensors only.
    ps.zero_grad();
    CHECK(r.touched_grad_rows() == std::pair<index_t, index_t>{0, 0});
    CHECK(s.touched_grad_rows() == std::pair<index_t, index_t>{0, 0});
    CHECK(std::vector<flat_range>(ps.grad_live_ranges().begin(), ps.grad_live_ranges().end()) == start);

    // A dense tensor's touch_grad_rows only returns the pointer.
    CHECK(a.touch_grad_rows(1, 2) == cps.grads() + 5);
    CHECK(std::vector<flat_range>(ps.grad_live_ranges().begin(), ps.grad_live_ranges().end()) == start);

    CHECK_THROWS_AS(r.touch_grad_rows(3, 17), mnemo::error);
    CHECK_THROWS_AS(r.touch_grad_rows(5, 4), mnemo::error);
    CHECK_THROWS_AS(r.touch_grad_rows(-1, 2), mnemo::error);
    mnemo::parameter_set<float> bad;
    CHECK_THROWS_AS(bad.declare("scalar", {}, grad_sparsity::rows), mnemo::error);
}

TEST_CASE("parameter_set: zero_grad clears the live ranges only, and leaves the buffer as dense zeroing does") {
    model_like<float> m(true);
    auto& ps = m.ps;
    const auto& cps = ps;
    const index_t n = ps.size();
    m.backward(1, 500, 530);
    CHECK(live_elements(cps) < n / 4);  // the tables are mostly known zero
    // A value planted outside every live range, behind the set's back (through the const buffer): the
    // sparse zero_grad does not visit it. This breaks the invariant on purpose, to see where zero_grad
    // writes; nothing else in this test reads it.
    auto& r0 = m.tables[0];
    const index_t planted = r0.entry().offset + 10 * r0.entry().row_size();
    const_cast<float*>(cps.grads())[planted] = 42.0f;
    ps.zero_grad();
    CHECK(cps.grads()[planted] == 42.0f);
    for (index_t i = 0; i < n; ++i)
        if (i != planted) REQUIRE(cps.grads()[i] == 0.0f);
    // grads() counts everything as touched: the next zero_grad clears the whole buffer.
    (void)ps.grads();
    CHECK(live_elements(cps) == n);
    ps.zero_grad();
    CHECK(cps.grads()[planted] == 0.0f);

    // Legitimate use over several steps: after each zero_grad the buffer is +0 everywhere, bit for bit.
    const std::vector<float> zeros(static_cast<std::size_t>(n), 0.0f);
    for (int step = 0; step < 4; ++step) {
        m.backward(10 + step, 480 + 10 * step, 520 + 3 * step);
        ps.zero_grad();
        CHECK(same_bits(cps.grads(), zeros.data(), n));
        CHECK(live_elements(cps) < n / 4);
    }
}

namespace {

// The same training steps on a row-sparse set, on a dense set and on raw buffers, compared bit for bit
// after each step: gradients after clipping, the norm, parameters and moments. Rows of the window move
// and grow, some steps accumulate two backward passes with disjoint windows, and the first step has no
// table gradient at all (rows [P, P)).
template <class T, class Opt, class Options>
void check_sparse_steps_bitwise(Options options, double max_norm) {
    model_like<T> sparse(true), dense(false);
    const index_t n = sparse.ps.size();
    REQUIRE(dense.ps.size() == n);
    REQUIRE(n >= mnemo::detail::optim::elementwise_parallel_threshold);
    std::vector<T> raw_values(sparse.ps.values(), sparse.ps.values() + n);
    Opt opt_sparse(n, options), opt_dense(n, options), opt_raw(n, options);
    const index_t P = model_like<T>::P;
    struct window {
        index_t lo, hi;
    };
    const std::vector<std::vector<window>> passes = {
        {{P, P}},                      // no table gradient
        {{P - 20, P + 4}},             //
        {{P - 40, P + 4}},             // the window grows: new blocks turn warm
        {{P - 60, P - 50}, {P + 100, P + 110}},  // accumulation over two backward passes, disjoint rows
        {{P - 10, P + 4}},             // it shrinks: the earlier rows are zero again
        {{3, 9}, {2 * P - 5, 2 * P}},  // the first and the last rows: the hull is every row but three
    };
    for (std::size_t step = 0; step < passes.size(); ++step) {
        INFO("step " << step);
        for (auto* m : {&sparse, &dense}) {
            m->ps.zero_grad();
            std::uint64_t seed = 100 * (step + 1);
            for (const window& w : passes[step]) m->backward(seed++, w.lo, w.hi);
        }
        const auto& cs = sparse.ps;
        const auto& cd = dense.ps;
        REQUIRE(same_bits(cs.grads(), cd.grads(), n));
        const bool narrow = step > 0 && step + 1 < passes.size();  // a window of at most 170 of 1024 rows
        if (narrow) CHECK(live_elements(cs) < live_elements(cd) / 4);  // really sparse
        std::vector<T> raw_grads(cs.grads(), cs.grads() + n);

        const double norm_sparse = mnemo::clip_grad_norm(sparse.ps, max_norm);
        const double norm_dense = mnemo::clip_grad_norm(dense.ps, max_norm);
        const double norm_raw = mnemo::clip_grad_norm(raw_grads.data(), n, max_norm);
        CHECK(std::memcmp(&norm_sparse, &norm_dense, sizeof(double)) == 0);
        CHECK(std::memcmp(&norm_sparse, &norm_raw, sizeof(double)) == 0);
        CHECK(mnemo::grad_norm(cs) == mnemo::grad_norm(raw_grads.data(), n));
        CHECK(norm_sparse > max_norm);  // the scaling pass ran
        CHECK(same_bits(cs.grads(), cd.grads(), n));
        CHECK(same_bits(cs.grads(), raw_grads.data(), n));

        const double lr = 1e-2 * double(step + 1);
        opt_sparse.step(sparse.ps, lr);
        opt_dense.step(dense.ps, lr);
        opt_raw.step(raw_values.data(), raw_grads.data(), n, lr);
        CHECK(same_bits(cs.values(), cd.values(), n));
        CHECK(same_bits(cs.values(), raw_values.data(), n));
        CHECK(same_bits(opt_sparse.exp_avg().data(), opt_raw.exp_avg().data(), n));
        CHECK(same_bits(opt_sparse.exp_avg_sq().data(), opt_raw.exp_avg_sq().data(), n));
        CHECK(same_bits(opt_dense.exp_avg_sq().data(), opt_raw.exp_avg_sq().data(), n));
        // Neither clipping nor the step counted the tables as touched.
        if (narrow) CHECK(live_elements(cs) < n / 4);
    }
}

}  // namespace

TEST_CASE_TEMPLATE("clip_grad_norm, adamw: row-sparse gradients give bitwise the dense results over changing rows", T,
                   float, double) {
    check_sparse_steps_bitwise<T, mnemo::adamw<T>>(mnemo::adamw_options{.lr = 1e-2, .weight_decay = 0.1}, 1.0);
}

TEST_CASE_TEMPLATE("clip_grad_norm, labml_adam: row-sparse gradients give bitwise the dense results over changing rows",
                   T, float, double) {
    check_sparse_steps_bitwise<T, mnemo::labml_adam<T>>(mnemo::labml_adam_options{.lr = 1e-2, .weight_decay = 0.05},
                                                        0.5);
}

TEST_CASE("clip_grad_norm, adamw: the same bits on one thread and on two with row-sparse gradients") {
    auto run = [](int threads) {
        const int saved = omp_get_max_threads();
        omp_set_num_threads(threads);
        model_like<float> m(true);
        mnemo::adamw<float> opt(m.ps.size(), {.lr = 1e-2});
        double norms = 0;
        for (int step = 0; step < 3; ++step) {
            m.ps.zero_grad();
            m.backward(7 + step, 490 - 5 * step, 516);
            norms += mnemo::clip_grad_norm(m.ps, 1.0);
            opt.step(m.ps);
        }
        omp_set_num_threads(saved);
        const auto& c = m.ps;
        return std::pair{norms, std::vector<float>(c.values(), c.values() + c.size())};
    };
    const auto one = run(1), two = run(2);
    CHECK(one.first == two.first);
    CHECK(one.second == two.second);
}

// The sum of squares keeps eight interleaved partial sums per block, element j of the block in sum
// j % 8. Here a run starts off that grid (at 11), and the data make the grid visible: 2^60 in sum 0,
// then 256 squares of 16 at j ≡ 0 (mod 8), each absorbed by 2^60 in the dense order (16 is below half
// an ulp of 2^60) but adding up to 2^12 first if they land in another partial sum.
TEST_CASE("clip_grad_norm: a live run that starts off the 8-lane grid adds into the dense partial sums") {
    mnemo::parameter_set<double> ps;
    auto w = ps.declare("w", {8});
    auto r = ps.declare("r", {4096}, grad_sparsity::rows);  // one element per row
    ps.allocate();
    REQUIRE(r.entry().offset == 8);
    w.grad()[0] = std::ldexp(1.0, 30);
    double* g = r.touch_grad_rows(3, 2049) - 3;  // flat [11, 2057)
    index_t ones = 0;
    for (index_t j = 16; j < 2057; j += 8, ++ones) g[j - 8] = 4.0;
    REQUIRE(ones == 256);
    const auto& cps = ps;
    std::vector<double> dense(cps.grads(), cps.grads() + ps.size());
    CHECK(mnemo::grad_norm(cps) == std::ldexp(1.0, 30));
    const double sparse_norm = mnemo::clip_grad_norm(ps, 1.0);
    const double dense_norm = mnemo::clip_grad_norm(dense.data(), ps.size(), 1.0);
    CHECK(sparse_norm == dense_norm);
    CHECK(same_bits(cps.grads(), dense.data(), ps.size()));
}

TEST_CASE("row-sparse gradients: accumulation over two backward passes keeps both windows until zero_grad") {
    model_like<double> sparse(true), dense(false);
    const index_t P = model_like<double>::P;
    for (auto* m : {&sparse, &dense}) {
        m->ps.zero_grad();
        m->backward(1, P - 30, P - 20);  // first segment
        m->backward(2, P + 50, P + 60);  // second segment, other rows
        m->backward(3, P - 25, P - 22);  // third, inside the first
    }
    CHECK(sparse.tables[0].touched_grad_rows() == std::pair<index_t, index_t>{P - 30, P + 60});
    const auto& cs = sparse.ps;
    const auto& cd = dense.ps;
    CHECK(same_bits(cs.grads(), cd.grads(), cs.size()));
    CHECK(mnemo::grad_norm(cs) == mnemo::grad_norm(cd));
    // Both windows are non-zero and both are cleared by zero_grad.
    const auto& r = sparse.tables[1];
    const double* g = cs.grads() + r.entry().offset;
    const index_t row = r.entry().row_size();
    CHECK(g[(P - 30) * row] != 0.0);
    CHECK(g[(P + 59) * row] != 0.0);
    sparse.ps.zero_grad();
    for (index_t i = 0; i < cs.size(); ++i) REQUIRE(cs.grads()[i] == 0.0);
}

TEST_CASE("row-sparse gradients: accessors that do not name rows count everything they hand out as touched") {
    mnemo::parameter_set<double> ps;
    auto w = ps.declare("w", {4, 4});
    auto r = ps.declare("r", {2048, 4}, grad_sparsity::rows);  // 8 optimizer blocks
    ps.allocate();
    const auto& cps = ps;
    const index_t n = ps.size(), ro = r.entry().offset;
    for (index_t i = 0; i < n; ++i) ps.values()[i] = 0.5;
    for (index_t i = 0; i < w.size(); ++i) w.grad()[i] = 0.25;
    r.touch_grad_rows(1000, 1010)[0] = 1.0;

    // The reference: the same gradient, handled as a dense buffer.
    auto dense_result = [&](std::vector<double> grads, std::vector<double> values) {
        mnemo::clip_grad_norm(grads.data(), n, 1.0);
        mnemo::adamw<double> opt(n, {.lr = 0.1, .weight_decay = 0.1});
        opt.step(values.data(), grads.data(), n);
        return std::pair{grads, values};
    };
    auto sparse_result = [&] {
        mnemo::clip_grad_norm(ps, 1.0);
        mnemo::adamw<double> opt(n, {.lr = 0.1, .weight_decay = 0.1});
        opt.step(ps);
        return std::pair{std::vector<double>(cps.grads(), cps.grads() + n),
                         std::vector<double>(cps.values(), cps.values() + n)};
    };
    const std::vector<double> values0(cps.values(), cps.values() + n);

    SUBCASE("the mutable grads(): a write anywhere is seen by clipping, the optimizer and zero_grad") {
        double* g = ps.grads();
        g[ro + 5 * 4] = 3.0;  // row 5, far from the touched rows
        CHECK(r.touched_grad_rows() == std::pair<index_t, index_t>{0, 2048});
        CHECK(live_elements(cps) == n);
        const auto want = dense_result(std::vector<double>(cps.grads(), cps.grads() + n), values0);
        const auto got = sparse_result();
        CHECK(got.first == want.first);
        CHECK(got.second == want.second);
        CHECK(got.second[std::size_t(ro + 5 * 4)] != want.second[std::size_t(ro + 6 * 4)]);  // row 5 had gradient
        ps.zero_grad();
        CHECK(cps.grads()[ro + 5 * 4] == 0.0);
        CHECK(r.touched_grad_rows() == std::pair<index_t, index_t>{0, 0});  // sparse again
    }
    SUBCASE("param::grad() of a row-sparse tensor") {
        r.grad()[7 * 4 + 1] = -2.0;
        CHECK(r.touched_grad_rows() == std::pair<index_t, index_t>{0, 2048});
        CHECK_FALSE(ps.grad_known_zero(ro + 7 * 4, ro + 8 * 4));
        const auto want = dense_result(std::vector<double>(cps.grads(), cps.grads() + n), values0);
        const auto got = sparse_result();
        CHECK(got.first == want.first);
        CHECK(got.second == want.second);
        ps.zero_grad();
        CHECK(cps.grads()[ro + 7 * 4 + 1] == 0.0);
    }
    SUBCASE("parameter_set::grad_ptr of a row-sparse tensor") {
        ps.grad_ptr(1)[2047 * 4 + 3] = 5.0;
        CHECK(r.touched_grad_rows() == std::pair<index_t, index_t>{0, 2048});
        const auto want = dense_result(std::vector<double>(cps.grads(), cps.grads() + n), values0);
        const auto got = sparse_result();
        CHECK(got.first == want.first);
        CHECK(got.second == want.second);
        ps.zero_grad();
        CHECK(cps.grads()[ro + 2047 * 4 + 3] == 0.0);
    }
    SUBCASE("reading through the const buffer changes nothing") {
        double sum = 0;
        for (index_t i = 0; i < n; ++i) sum += cps.grads()[i];
        CHECK(sum == 5.0);
        CHECK(r.touched_grad_rows() == std::pair<index_t, index_t>{1000, 1010});
        const auto want = dense_result(std::vector<double>(cps.grads(), cps.grads() + n), values0);
        const auto got = sparse_result();
        CHECK(got.first == want.first);
        CHECK(got.second == want.second);
    }
}

TEST_CASE("clip_grad_norm: a NaN norm turns every gradient NaN, as the dense loop does, and zero_grad clears them") {
    mnemo::parameter_set<float> ps;
    auto w = ps.declare("w", {3});
    auto r = ps.declare("r", {64, 2}, grad_sparsity::rows);
    ps.allocate();
    const auto& cps = ps;
    w.grad()[0] = 1.0f;
    r.touch_grad_rows(3, 4)[0] = std::numeric_limits<float>::quiet_NaN();
    std::vector<float> dense(cps.grads(), cps.grads() + ps.size());
    CHECK(std::isnan(mnemo::clip_grad_norm(ps, 1.0)));
    CHECK(std::isnan(mnemo::clip_grad_norm(dense.data(), ps.size(), 1.0)));
    for (index_t i = 0; i < ps.size(); ++i) {
        REQUIRE(std::isnan(dense[std::size_t(i)]));
        REQUIRE(std::isnan(cps.grads()[i]));  // rows nobody touched and the gaps too
    }
    CHECK(live_elements(cps) == ps.size());
    ps.zero_grad();
    for (index_t i = 0; i < ps.size(); ++i) REQUIRE(cps.grads()[i] == 0.0f);
}

TEST_CASE("optimizers: step(set) leaves the record of touched rows alone; adam and sgd stay dense and agree") {
    model_like<float> m(true);
    const index_t n = m.ps.size();
    m.backward(3, 500, 520);
    const auto& c = m.ps;
    const index_t live = live_elements(c);
    std::vector<float> values(c.values(), c.values() + n);
    const std::vector<float> grads(c.grads(), c.grads() + n);
    mnemo::adam<float> a_set(n, {.lr = 1e-2, .weight_decay = 0.1}), a_raw(n, {.lr = 1e-2, .weight_decay = 0.1});
    mnemo::sgd<float> s_set(n, {.lr = 1e-2, .momentum = 0.9}), s_raw(n, {.lr = 1e-2, .momentum = 0.9});
    a_set.step(m.ps);
    s_set.step(m.ps, 0.5e-2);
    a_raw.step(values.data(), grads.data(), n);
    s_raw.step(values.data(), grads.data(), n, 0.5e-2);
    CHECK(same_bits(c.values(), values.data(), n));
    CHECK(live_elements(c) == live);
}

TEST_CASE("adamw: the live ranges given to step() must be sorted, disjoint and inside the buffer") {
    std::vector<float> p(100, 1.0f), g(100, 0.0f);
    mnemo::adamw<float> opt(100);
    const std::vector<flat_range> unsorted{{50, 60}, {10, 20}}, outside{{90, 101}}, inverted{{30, 20}};
    for (const auto* live : {&unsorted, &outside, &inverted}) {
        bool thrown = false;
        try {
            opt.step(p.data(), g.data(), 100, 1e-3, std::span<const flat_range>(*live));
        } catch (const mnemo::error& e) {
            thrown = true;
            CHECK(std::string(e.what()).find("live ranges") != std::string::npos);
        }
        CHECK(thrown);
    }
}

// The model end to end: training that relies on the set's record of touched rows (zero_grad, clipping
// and AdamW over the live ranges only) against the same training with every gradient counted as touched
// after each backward pass (the dense path). Bitwise equal, step after step, with memory and compressed
// memory filling up so that the positional window grows. Where the attention layers declare their
// positional tables row-sparse this checks the rows their backward pass records: a row written but not
// recorded would survive zero_grad (or escape clipping) and the two runs would part.
TEST_CASE("compressive transformer: training over the recorded rows is bitwise training with dense gradients") {
    using model_t = mnemo::compressive_transformer<double, mnemo::config<16, 2, 2>>;
    const index_t seq = 4, batch = 2, vocab = 11;
    auto run = [&](bool dense) {
        model_t model({.vocab = vocab, .n_layers = 2, .d_ff = 32, .n_pos = 256});
        model.reset_parameters(5);
        auto mem = model.make_memory(6, 4);
        mem.reset(batch, seq);
        auto& ps = model.parameters();
        const auto& cps = ps;
        mnemo::adamw<double> opt(ps.size(), {.lr = 1e-2, .weight_decay = 0.1});
        std::vector<double> norms;
        index_t sparse_tensors = 0, live = 0;
        for (const auto& e : cps.entries()) sparse_tensors += e.sparsity == grad_sparsity::rows;
        for (int step = 0; step < 8; ++step) {
            ps.zero_grad();
            const auto tokens = mnemo::testing::random_tokens(seq * batch, vocab, 100 + std::uint64_t(step));
            const auto targets = mnemo::testing::random_tokens(seq * batch, vocab, 200 + std::uint64_t(step));
            model.train_segment(tokens, targets, batch, mem);
            if (dense) ps.touch_all_grads();
            live = live_elements(cps);
            norms.push_back(mnemo::clip_grad_norm(ps, 0.5));
            opt.step(ps);
        }
        if (!dense && sparse_tensors > 0) CHECK(live < cps.size() / 2);
        MESSAGE("row-sparse tensors in the model: " << sparse_tensors << ", live gradient elements at the last step: "
                                                    << live << " of " << cps.size());
        return std::pair{norms, std::vector<double>(cps.values(), cps.values() + cps.size())};
    };
    const auto sparse = run(false), dense = run(true);
    CHECK(sparse.first == dense.first);
    REQUIRE(sparse.second.size() == dense.second.size());
    CHECK(same_bits(sparse.second.data(), dense.second.data(), index_t(sparse.second.size())));
}

namespace {

// Deferred weight decay (parameters.hpp), with the cold blocks and live ranges: many steps of a
// decoupled-decay optimizer over a set whose tables only get gradient in a window that moves now and
// then (onto rows that owe many factors), the window paid (pay_rows) and read through value_rows()
// as the attention does, at a few steps one whole table downloaded or values() read; compared bit for
// bit with the same steps on raw buffers, which decay every element eagerly. More steps than the log
// holds (its pay-off), and a rate that changes every step (the factors differ).
template <class T, class Opt, class Options>
void check_sparse_steps_bitwise(Options options) {
    model_like<T> sparse(true);
    const index_t n = sparse.ps.size(), P = model_like<T>::P;
    const mnemo::parameter_set<T>& cs = sparse.ps;
    std::vector<T> raw_values(cs.values(), cs.values() + n);
    Opt opt(n, options), opt_raw(n, options);
    const int steps = int(mnemo::parameter_set<T>::max_deferred) + 40;
    for (int step = 0; step < steps; ++step) {
        INFO("step " << step);
        const index_t lo = P - 30 - 17 * ((step / 50) % 4), hi = lo + 24;  // moves every 50 steps
        sparse.ps.zero_grad();
        sparse.backward(std::uint64_t(step + 1), lo, hi);
        std::vector<T> raw_grads(cs.grads(), cs.grads() + n);
        const double lr = 1e-2 * (1.0 + 0.5 * std::sin(0.1 * step));
        opt.step(sparse.ps, lr);
        opt_raw.step(raw_values.data(), raw_grads.data(), n, lr);
        for (const auto& p : sparse.tables) {  // the window, as forward reads it
            const index_t row = p.entry().row_size(), at = p.entry().offset + lo * row;
            p.pay_rows(lo, hi);
            CHECK(same_bits(p.value_rows(lo, hi), raw_values.data() + at, (hi - lo) * row));
        }
        if (step % 97 == 50) {  // one whole table over the host path, and later everything
            const auto& p = sparse.tables[std::size_t(step % 2)];
            std::vector<T> host(std::size_t(p.size()));
            p.download(host);
            CHECK(same_bits(host.data(), raw_values.data() + p.entry().offset, p.size()));
        }
        if (step == steps / 2 || step == steps - 1) {
            CHECK(same_bits(cs.values(), raw_values.data(), n));
            CHECK_FALSE(cs.decay_owed());
        }
    }
    CHECK(same_bits(opt.exp_avg().data(), opt_raw.exp_avg().data(), n));
    CHECK(same_bits(opt.exp_avg_sq().data(), opt_raw.exp_avg_sq().data(), n));
}

}  // namespace

TEST_CASE_TEMPLATE("adamw, labml_adam: deferred decay of the rows without gradient gives bitwise the eager values", T,
                   float, double) {
    check_sparse_steps_bitwise<T, mnemo::adamw<T>>(mnemo::adamw_options{.lr = 1e-2, .weight_decay = 0.1});
    check_sparse_steps_bitwise<T, mnemo::labml_adam<T>>(mnemo::labml_adam_options{.lr = 1e-2, .weight_decay = 0.05});
}

// A backend whose optimizers decay every element at every step (defers_weight_decay false, as
// ops<cuda>): the CPU's memory and kernels otherwise.
namespace mnemo {
struct eager_decay_cpu {
    static constexpr const char* name = "eager_decay_cpu";
};
template <>
struct device_memory<eager_decay_cpu> : device_memory<cpu> {};
template <>
struct ops<eager_decay_cpu> : ops<cpu> {
    static constexpr bool defers_weight_decay = false;
};
}  // namespace mnemo

TEST_CASE("a decoupled step on a backend that never defers the decay is a change too (version() moves on)") {
    // The generation cache of compressive_transformer rebuilds when version() moves; a step that decays
    // eagerly once left it unchanged, so the GPU reused keys and values of the old weights.
    using B = mnemo::eager_decay_cpu;
    mnemo::parameter_set<float, B> ps;
    ps.declare("w", {4, 6});
    ps.allocate();
    std::vector<float> values(std::size_t(ps.size()));
    for (std::size_t i = 0; i < values.size(); ++i) values[i] = 0.1f * float(i) - 1.0f;
    ps.upload_all_values(values);
    mnemo::parameter_set<float> cpu_ps;
    cpu_ps.declare("w", {4, 6});
    cpu_ps.allocate();
    cpu_ps.upload_all_values(values);
    for (float* g : {ps.grads(), cpu_ps.grads()})  // host memory on both backends
        for (index_t i = 0; i < ps.size(); ++i) g[i] = 0.01f * float(i % 5) - 0.02f;
    mnemo::adamw<float, B> opt(ps.size(), {.lr = 1e-2, .weight_decay = 0.1});
    mnemo::adamw<float> cpu_opt(cpu_ps.size(), {.lr = 1e-2, .weight_decay = 0.1});
    for (int step = 0; step < 3; ++step) {
        const auto before = ps.version();
        opt.step(ps);
        cpu_opt.step(cpu_ps);
        CHECK(ps.version() != before);
        CHECK_FALSE(ps.decay_owed());
    }
    std::vector<float> eager(values.size()), deferred(values.size());
    ps.download_all_values(eager);
    cpu_ps.download_all_values(deferred);
    for (std::size_t i = 0; i < eager.size(); ++i) CHECK(eager[i] == doctest::Approx(deferred[i]).epsilon(1e-6));
}

TEST_CASE("deferred decay: a step leaves the rows without gradient owing, and paying them settles") {
    model_like<float> sparse(true);
    const index_t P = model_like<float>::P;
    mnemo::adamw<float> opt(sparse.ps.size(), {.lr = 1e-2, .weight_decay = 0.1});
    const auto version = sparse.ps.version();
    sparse.ps.zero_grad();
    sparse.backward(1, P - 8, P + 8);
    opt.step(sparse.ps);
    CHECK(sparse.ps.version() != version);  // a step is a change, deferred or not
    CHECK(sparse.ps.decay_owed());
    sparse.tables[0].pay_rows(P - 8, P + 8);
    CHECK(sparse.ps.decay_owed());  // the window only
    std::vector<float> host;
    for (const auto& p : sparse.tables) {
        host.resize(std::size_t(p.size()));
        p.download(host);  // the host path pays what it copies
    }
    CHECK_FALSE(sparse.ps.decay_owed());
}
