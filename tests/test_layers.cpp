// Layers: finite-difference gradient checks in double for every parameter and input, and proof that
// backward accumulates into pre-filled parameter gradients.
#include <doctest/doctest.h>

#include <omp.h>

#include <vector>

#include <mnemo/mnemo.hpp>

#include "gradcheck.hpp"

using mnemo::index_t;
using mnemo::view;
using mnemo::testing::check_accumulates;
using mnemo::testing::check_close;
using mnemo::testing::check_gradients;
using mnemo::testing::grad_target;
using mnemo::testing::parameter_targets;
using mnemo::testing::project;
using mnemo::testing::random_vector;
using mnemo::testing::randomize_parameters;

TEST_CASE("linear: backward matches finite differences (with and without bias)") {
    for (bool bias : {true, false}) {
        constexpr std::size_t In = 5, Out = 7;
        const index_t rows = 3;
        mnemo::parameter_set<double> ps;
        mnemo::linear<double, In, Out> lin(ps, "proj", bias);
        ps.allocate();
        randomize_parameters(ps, 1);
        CHECK(ps.entries().size() == (bias ? 2u : 1u));
        CHECK(ps.entries()[0].name == "proj.weight");
        CHECK(ps.entries()[0].shape == std::vector<index_t>{Out, In});

        auto x = random_vector<double>(rows * In, 2);
        auto r = random_vector<double>(rows * Out, 3);
        std::vector<double> y(rows * Out), dx(rows * In);
        auto loss = [&] {
            lin.forward(view<const double, In>(x.data(), rows), view<double, Out>(y.data(), rows));
            return project(y, r);
        };
        loss();
        ps.zero_grad();
        lin.backward(view<const double, In>(x.data(), rows), view<const double, Out>(r.data(), rows),
                     view<double, In>(dx.data(), rows));
        auto targets = parameter_targets(ps);
        targets.push_back({"x", x.data(), dx});
        check_gradients(loss, targets);
        check_accumulates(ps, [&] {
            lin.backward(view<const double, In>(x.data(), rows), view<const double, Out>(r.data(), rows),
                         view<double, In>(dx.data(), rows));
        });
    }
}

TEST_CASE("linear: a dynamic output extent (a vocabulary) works and is checked at run time") {
    constexpr std::size_t In = 4;
    const index_t rows = 2, vocab = 11;
    mnemo::parameter_set<double> ps;
    mnemo::linear<double, In, mnemo::dynamic> gen(ps, "generator", In, vocab, true);
    ps.allocate();
    randomize_parameters(ps, 5);
    auto x = random_vector<double>(rows * In, 6);
    auto r = random_vector<double>(rows * vocab, 7);
    std::vector<double> y(rows * vocab), dx(rows * In);
    auto loss = [&] {
        gen.forward(view<const double, In>(x.data(), rows), view<double>(y.data(), rows, vocab));
        return project(y, r);
    };
    loss();
    ps.zero_grad();
    gen.backward(view<const double, In>(x.data(), rows), view<const double>(r.data(), rows, vocab),
                 view<double, In>(dx.data(), rows));
    auto targets = parameter_targets(ps);
    targets.push_back({"x", x.data(), dx});
    check_gradients(loss, targets);

    std::vector<double> wrong(rows * 10);
    CHECK_THROWS_WITH_AS(gen.forward(view<const double, In>(x.data(), rows), view<double>(wrong.data(), rows, 10)),
                         doctest::Contains("linear: y has 10 features, expected 11"), mnemo::error);
    CHECK_THROWS_WITH_AS(gen.forward(view<const double, In>(x.data(), rows), view<double>(y.data(), 1, vocab)),
                         doctest::Contains("linear: x has 2 rows but y has 1"), mnemo::error);
}

TEST_CASE("linear: backward with accumulate_dx adds into dx") {
    constexpr std::size_t In = 3, Out = 2;
    mnemo::parameter_set<double> ps;
    mnemo::linear<double, In, Out> lin(ps, "l");
    ps.allocate();
    randomize_parameters(ps, 8);
    auto x = random_vector<double>(4 * In, 9);
    auto dy = random_vector<double>(4 * Out, 10);
    std::vector<double> dx(4 * In, 0.0);
    lin.backward(view<const double, In>(x.data(), 4), view<const double, Out>(dy.data(), 4), view<double, In>(dx.data(), 4));
    auto once = dx;
    lin.backward(view<const double, In>(x.data(), 4), view<const double, Out>(dy.data(), 4), view<double, In>(dx.data(), 4),
                 true);
    for (std::size_t i = 0; i < dx.size(); ++i) CHECK(dx[i] == doctest::Approx(2 * once[i]).epsilon(1e-14));
}

TEST_CASE("layer_norm: backward matches finite differences") {
    constexpr std::size_t D = 6;
    const index_t rows = 4;
    mnemo::parameter_set<double> ps;
    mnemo::layer_norm<double, D> ln(ps, "norm");
    ps.allocate();
    randomize_parameters(ps, 11, 0.5, 1.5);
    auto x = random_vector<double>(rows * D, 12, -2, 2);
    auto r = random_vector<double>(rows * D, 13);
    std::vector<double> y(rows * D), dx(rows * D);
    auto loss = [&] {
        ln.forward(view<const double, D>(x.data(), rows), view<double, D>(y.data(), rows));
        return project(y, r);
    };
    loss();
    ps.zero_grad();
    ln.backward(view<const double, D>(x.data(), rows), view<const double, D>(r.data(), rows), view<double, D>(dx.data(), rows));
    auto targets = parameter_targets(ps);
    targets.push_back({"x", x.data(), dx});
    check_gradients(loss, targets);
    check_accumulates(ps, [&] {
        ln.backward(view<const double, D>(x.data(), rows), view<const double, D>(r.data(), rows),
                    view<double, D>(dx.data(), rows));
    });
}

TEST_CASE("layer_norm: default parameters give zero mean and unit variance rows") {
    constexpr std::size_t D = 33;
    mnemo::parameter_set<float> ps;
    mnemo::layer_norm<float, D> ln(ps, "norm");
    ps.allocate();
    ln.reset_parameters();
    auto x = random_vector<float>(5 * D, 14, -3, 7);
    std::vector<float> y(5 * D);
    ln.forward(view<const float, D>(x.data(), 5), view<float, D>(y.data(), 5));
    for (index_t i = 0; i < 5; ++i) {
        double m = 0, v = 0;
        for (index_t j = 0; j < index_t(D); ++j) m += y[i * D + j];
        m /= D;
        for (index_t j = 0; j < index_t(D); ++j) v += (y[i * D + j] - m) * (y[i * D + j] - m);
        CHECK(std::abs(m) < 1e-6);
        CHECK(v / D == doctest::Approx(1.0).epsilon(1e-3));  // eps = 1e-5 shrinks the variance slightly
    }
}

TEST_CASE("embedding: backward matches finite differences with repeated tokens") {
    constexpr std::size_t D = 4;
    const index_t vocab = 5;
    mnemo::parameter_set<double> ps;
    mnemo::embedding<double, D> emb(ps, "src_embed", vocab);
    ps.allocate();
    randomize_parameters(ps, 15);
    std::vector<mnemo::token_t> tokens = {3, 1, 3, 0, 4, 3, 1};
    const index_t rows = static_cast<index_t>(tokens.size());
    auto r = random_vector<double>(rows * D, 16);
    std::vector<double> y(rows * D);
    auto loss = [&] {
        emb.forward(tokens, view<double, D>(y.data(), rows));
        return project(y, r);
    };
    loss();
    ps.zero_grad();
    emb.backward(tokens, view<const double, D>(r.data(), rows));
    // Token 2 never appears: its rows of the gradient are zero; check the gradient over all entries.
    check_gradients(loss, parameter_targets(ps));
    check_accumulates(ps, [&] { emb.backward(tokens, view<const double, D>(r.data(), rows)); });
}

TEST_CASE("embedding: a token outside the vocabulary is a clear error") {
    mnemo::parameter_set<float> ps;
    mnemo::embedding<float, 8> emb(ps, "src_embed", 10);
    ps.allocate();
    std::vector<mnemo::token_t> tokens = {1, 10};
    std::vector<float> y(2 * 8);
    CHECK_THROWS_WITH_AS(emb.forward(tokens, view<float, 8>(y.data(), 2)),
                         doctest::Contains("embedding 'src_embed': token 10 at position 1 is outside the vocabulary [0, 10)"),
                         mnemo::error);
    tokens = {-1, 0};
    CHECK_THROWS_AS(emb.forward(tokens, view<float, 8>(y.data(), 2)), mnemo::error);
}

TEST_CASE_TEMPLATE("feed_forward: backward matches finite differences", Act, mnemo::relu, mnemo::gelu) {
    constexpr std::size_t D = 4, Dff = 9;
    const index_t rows = 3;
    mnemo::parameter_set<double> ps;
    mnemo::feed_forward<double, D, Dff, Act> ff(ps, "feed_forward");
    ps.allocate();
    randomize_parameters(ps, 17);
    CHECK(ps.find("feed_forward.layer1.weight") != nullptr);
    CHECK(ps.find("feed_forward.layer2.bias") != nullptr);
    auto x = random_vector<double>(rows * D, 18);
    auto r = random_vector<double>(rows * D, 19);
    std::vector<double> y(rows * D), dx(rows * D);
    auto loss = [&] {
        ff.forward(view<const double, D>(x.data(), rows), view<double, D>(y.data(), rows));
        return project(y, r);
    };
    loss();
    ps.zero_grad();
    ff.backward(view<const double, D>(x.data(), rows), view<const double, D>(r.data(), rows), view<double, D>(dx.data(), rows));
    auto targets = parameter_targets(ps);
    targets.push_back({"x", x.data(), dx});
    check_gradients(loss, targets);
    check_accumulates(ps, [&] {
        ff.backward(view<const double, D>(x.data(), rows), view<const double, D>(r.data(), rows),
                    view<double, D>(dx.data(), rows));
    });
}

TEST_CASE("residual: a pre-LN block (x + FFN(LN(x))) matches finite differences") {
    // The residual add on its own has the identity as gradient; compose it into the block the models
    // use so the check exercises dx accumulation from both paths.
    constexpr std::size_t D = 5, Dff = 7;
    const index_t rows = 3;
    mnemo::parameter_set<double> ps;
    mnemo::layer_norm<double, D> ln(ps, "norm_ff");
    mnemo::feed_forward<double, D, Dff> ff(ps, "feed_forward");
    ps.allocate();
    randomize_parameters(ps, 20);
    auto x = random_vector<double>(rows * D, 21);
    auto r = random_vector<double>(rows * D, 22);
    std::vector<double> z(rows * D), f(rows * D), y(rows * D), dx(rows * D), df(rows * D), dz(rows * D);
    using V = view<double, D>;
    using CV = view<const double, D>;
    auto loss = [&] {
        ln.forward(CV(x.data(), rows), V(z.data(), rows));
        ff.forward(CV(z.data(), rows), V(f.data(), rows));
        mnemo::residual<double, D>::forward(CV(x.data(), rows), CV(f.data(), rows), V(y.data(), rows));
        return project(y, r);
    };
    auto backward = [&] {
        mnemo::residual<double, D>::backward(CV(r.data(), rows), V(dx.data(), rows), V(df.data(), rows));
        ff.backward(CV(z.data(), rows), CV(df.data(), rows), V(dz.data(), rows));
        ln.backward(CV(x.data(), rows), CV(dz.data(), rows), V(dx.data(), rows), /*accumulate_dx=*/true);
    };
    loss();
    ps.zero_grad();
    backward();
    auto targets = parameter_targets(ps);
    targets.push_back({"x", x.data(), dx});
    check_gradients(loss, targets);
    loss();
    check_accumulates(ps, backward);
}

TEST_CASE("residual: backward assigns or accumulates") {
    constexpr std::size_t D = 3;
    std::vector<double> dy = {1, 2, 3, 4, 5, 6}, dx(6, 10.0), df(6, -1.0);
    mnemo::residual<double, D>::backward(view<const double, D>(dy.data(), 2), view<double, D>(dx.data(), 2),
                                         view<double, D>(df.data(), 2));
    CHECK(dx == dy);
    CHECK(df == dy);
    mnemo::residual<double, D>::backward(view<const double, D>(dy.data(), 2), view<double, D>(dx.data(), 2),
                                         view<double, D>(), true);
    for (std::size_t i = 0; i < 6; ++i) CHECK(dx[i] == 2 * dy[i]);
}

TEST_CASE("feed_forward: a runtime d_ff (dynamic extent) matches finite differences") {
    constexpr std::size_t D = 4;
    const index_t rows = 2, d_ff = 6;
    mnemo::parameter_set<double> ps;
    mnemo::feed_forward<double, D, mnemo::dynamic> ff(ps, "feed_forward", d_ff);
    ps.allocate();
    randomize_parameters(ps, 23);
    CHECK(ps.find("feed_forward.layer1.weight")->shape == std::vector<index_t>{d_ff, index_t(D)});
    auto x = random_vector<double>(rows * D, 24);
    auto r = random_vector<double>(rows * D, 25);
    std::vector<double> y(rows * D), dx(rows * D);
    auto loss = [&] {
        ff.forward(view<const double, D>(x.data(), rows), view<double, D>(y.data(), rows));
        return project(y, r);
    };
    loss();
    ps.zero_grad();
    ff.backward(view<const double, D>(x.data(), rows), view<const double, D>(r.data(), rows), view<double, D>(dx.data(), rows));
    auto targets = parameter_targets(ps);
    targets.push_back({"x", x.data(), dx});
    check_gradients(loss, targets);
}

TEST_CASE("linear and layer_norm: backward_input gives dx and leaves parameter gradients untouched") {
    constexpr std::size_t D = 5;
    const index_t rows = 3;
    mnemo::parameter_set<double> ps;
    mnemo::linear<double, D, D> lin(ps, "lin");
    mnemo::layer_norm<double, D> ln(ps, "ln");
    ps.allocate();
    randomize_parameters(ps, 26);
    auto x = random_vector<double>(rows * D, 27);
    auto dy = random_vector<double>(rows * D, 28);
    std::vector<double> y(rows * D), dx_full(rows * D), dx_input(rows * D), mean(rows), rstd(rows);
    using V = view<double, D>;
    lin.backward(V(x.data(), rows), V(dy.data(), rows), V(dx_full.data(), rows));
    ps.zero_grad();
    lin.backward_input(V(dy.data(), rows), V(dx_input.data(), rows));
    check_close("linear backward_input", dx_input, dx_full, 1e-15, 1e-14);  // buffer alignment may change the summation order
    mnemo::norm_stats<double> st{mean.data(), rstd.data()};
    ln.forward(V(x.data(), rows), V(y.data(), rows), st);
    ln.backward(V(x.data(), rows), V(dy.data(), rows), V(dx_full.data(), rows), st);
    ps.zero_grad();
    ln.backward_input(V(x.data(), rows), V(dy.data(), rows), V(dx_input.data(), rows), st);
    check_close("layer_norm backward_input", dx_input, dx_full, 1e-15, 1e-14);
    for (index_t i = 0; i < ps.size(); ++i) REQUIRE(ps.grads()[i] == 0.0);
}

TEST_CASE("parallel_invoke: runs both calls once, concurrently on two threads or in order on one") {
    const int saved = omp_get_max_threads();
    for (int threads : {1, 2, 3}) {
        omp_set_num_threads(threads);
        for (bool worth : {false, true}) {
            int f_runs = 0, g_runs = 0, f_thread = -1, g_thread = -1;
            mnemo::parallel_invoke(
                worth, [&] { ++f_runs, f_thread = omp_get_thread_num(); }, [&] { ++g_runs, g_thread = omp_get_thread_num(); });
            CHECK(f_runs == 1);
            CHECK(g_runs == 1);
            CHECK(f_thread == 0);
            CHECK(g_thread == (worth && threads >= 2 ? 1 : 0));
        }
    }
    omp_set_num_threads(saved);
    int both_here = 0, team = 0;  // inside a parallel region: both on the calling thread, no nested team
#pragma omp parallel num_threads(2)
    {
        int f_thread = -1, g_thread = -1;
        mnemo::parallel_invoke(true, [&] { f_thread = omp_get_thread_num(); }, [&] { g_thread = omp_get_thread_num(); });
#pragma omp critical
        {
            both_here += int(f_thread == omp_get_thread_num() && g_thread == omp_get_thread_num());
            team = omp_get_num_threads();
        }
    }
    CHECK(both_here == team);
}

TEST_CASE("linear: backward is bitwise the same on one thread and with dW and dx on two threads at once") {
    // 256×128×128 products: gemm::concurrent_pair runs dW = dyᵀ·x and dx = dy·W one per thread.
    constexpr std::size_t In = 128, Out = 128;
    const index_t rows = 256;
    REQUIRE(mnemo::ops<mnemo::cpu>::concurrent_pair(rows, In, Out) == (omp_get_max_threads() >= 2));
    auto x = random_vector<float>(rows * index_t(In), 21);
    auto dy = random_vector<float>(rows * index_t(Out), 22);
    std::vector<float> dx[2], grads[2];
    const int saved = omp_get_max_threads();
    for (int threads = 1; threads <= 2; ++threads) {
        omp_set_num_threads(threads);
        mnemo::parameter_set<float> ps;
        mnemo::linear<float, In, Out> lin(ps, "l");
        ps.allocate();
        randomize_parameters(ps, 23);
        ps.zero_grad();
        dx[threads - 1].assign(std::size_t(rows) * In, 0.5f);
        lin.backward(view<const float, In>(x.data(), rows), view<const float, Out>(dy.data(), rows),
                     view<float, In>(dx[threads - 1].data(), rows), true);
        grads[threads - 1].assign(ps.grads(), ps.grads() + ps.size());
    }
    omp_set_num_threads(saved);
    CHECK(dx[0] == dx[1]);
    CHECK(grads[0] == grads[1]);
}

TEST_CASE("check_targets: a target outside the vocabulary is a clear error; negative targets are ignored rows") {
    const std::vector<int> t = {0, 7, 2};
    CHECK_THROWS_WITH_AS(mnemo::check_targets(std::span<const int>(t), 5),
                         doctest::Contains("target 7 at row 1 is outside the vocabulary of 5"), mnemo::error);
    const std::vector<int> ok = {0, -100, 4};
    CHECK_NOTHROW(mnemo::check_targets(std::span<const int>(ok), 5));
}
