// The generation cache of compressive_transformer (cache_memory_projections): with it on, forward
// reuses the keys and values of memory slots projected by the previous call and projects only the new
// ones. The logits must equal those of a model without the cache, through compression, memory
// truncation, segments of varying length, parameter changes (optimizer steps), memory resets and a
// second memory object. The twins run over the CPU and the fenced backend (every number read over the
// host path); built with MNEMO_TEST_CUDA (tests/cuda), over the GPU instead.
#include <doctest/doctest.h>

#include <cmath>
#include <vector>

#include <mnemo/mnemo.hpp>

#ifdef MNEMO_TEST_CUDA
#include <mnemo/cuda.hpp>
#else
#include "fenced_backend.hpp"
#endif
#include "testing.hpp"

using mnemo::testing::max_diff;
using mnemo::testing::random_tokens;

namespace {

template <class T, class B = mnemo::cpu>
using model_t = mnemo::compressive_transformer<T, mnemo::config<16, 2, 2>, mnemo::conv_compression, B>;

/// The largest difference of two logits views of backend B, read over the host path.
template <class B, class View>
double logits_diff(const View& a, const View& b) {
    using T = typename View::value_type;
    REQUIRE(a.rows() == b.rows());
    REQUIRE(a.cols() == b.cols());
    REQUIRE(a.ld() == a.cols());
    REQUIRE(b.ld() == b.cols());
    return max_diff(mnemo::testing::to_host<B>(static_cast<const T*>(a.data()), a.rows() * a.cols()),
                    mnemo::testing::to_host<B>(static_cast<const T*>(b.data()), b.rows() * b.cols()));
}

// no_grad: the cached model generates with gradients disabled (it then normalises only the memory rows
// it does not reuse) and enables them for its training step.
template <class T, class B = mnemo::cpu>
void run_twins(double tolerance, bool no_grad = false) {
    const mnemo::index_t vocab = 11, batch = 2;
    const mnemo::compressive_options o{.vocab = vocab, .n_layers = 3, .d_ff = 24, .n_pos = 64};
    model_t<T, B> cached(o), plain(o);
    cached.reset_parameters(9);
    plain.reset_parameters(9);
    cached.cache_memory_projections(true);
    cached.set_grad_enabled(!no_grad);
    auto mem_c = cached.make_memory(6, 4), mem_p = plain.make_memory(6, 4);
    mem_c.reset(batch, 4);
    mem_p.reset(batch, 4);
    mnemo::adamw<T, B> opt_c(cached.parameters().size(), {.lr = 1e-2}), opt_p(plain.parameters().size(), {.lr = 1e-2});

    // Segment lengths: a prime, then tokens one at a time with a few longer segments in between.
    const std::vector<mnemo::index_t> lengths = {3, 1, 1, 1, 2, 1, 1, 1, 1, 4, 1, 1, 1, 1, 1, 1, 3, 1, 1};
    std::uint64_t seed = 100;
    for (int round = 0; round < 3; ++round) {
        for (mnemo::index_t q : lengths) {
            const auto t = random_tokens(q * batch, vocab, seed++);
            auto lc = cached.forward(t, batch, mem_c);
            auto lp = plain.forward(t, batch, mem_p);
            INFO("round " << round << ", segment of " << q << ", memory " << mem_p.mem_slots() << " + "
                          << mem_p.c_mem_slots() << " compressed");
            CHECK(logits_diff<B>(lc, lp) <= tolerance);
            cached.update_memory(mem_c);
            plain.update_memory(mem_p);
        }
        REQUIRE(mem_p.c_mem_slots() == 4);  // compression and truncation of the compressed memory happened
        if (round == 0) {  // a training step changes every parameter: the cache must not be used after it
            const auto t = random_tokens(2 * batch, vocab, seed++), y = random_tokens(2 * batch, vocab, seed++);
            for (auto* m : {&cached, &plain}) m->parameters().zero_grad();
            cached.set_grad_enabled(true);
            cached.train_segment(t, y, batch, mem_c);
            cached.set_grad_enabled(!no_grad);
            plain.train_segment(t, y, batch, mem_p);
            opt_c.step(cached.parameters());
            opt_p.step(plain.parameters());
        } else {  // a fresh memory
            mem_c.reset(batch, 4);
            mem_p.reset(batch, 4);
        }
    }
}

/// A long stream of single tokens at batch 3 over backend B: the largest logit difference.
template <class B>
double long_stream(int steps) {
    // The attention keeps the cached keys and values in a sliding window of a buffer with slack
    // (reuse_kv): every token moves the window, and every few tokens its rows go back to the front.
    const mnemo::index_t vocab = 13, batch = 3;
    const mnemo::compressive_options o{.vocab = vocab, .n_layers = 2, .d_ff = 20, .n_pos = 64};
    model_t<double, B> cached(o), plain(o);
    cached.reset_parameters(5);
    plain.reset_parameters(5);
    cached.cache_memory_projections(true);
    cached.set_grad_enabled(false);
    auto mem_c = cached.make_memory(5, 6), mem_p = plain.make_memory(5, 6);
    mem_c.reset(batch, 1);
    mem_p.reset(batch, 1);
    double worst = 0;
    for (int step = 0; step < steps; ++step) {
        const auto t = random_tokens(batch, vocab, std::uint64_t(1000 + step));
        auto lc = cached.forward(t, batch, mem_c);
        auto lp = plain.forward(t, batch, mem_p);
        worst = std::max(worst, logits_diff<B>(lc, lp));
        cached.update_memory(mem_c);
        plain.update_memory(mem_p);
    }
    CHECK(mem_p.c_mem_slots() == 6);
    return worst;
}

}  // namespace

#ifdef MNEMO_TEST_CUDA  // tests/cuda: the twins on the GPU
TEST_CASE("generation cache on the GPU: logits equal the uncached model's (double, float, gradients disabled)") {
    run_twins<double, mnemo::cuda>(1e-12);
    run_twins<float, mnemo::cuda>(2e-5);
    run_twins<double, mnemo::cuda>(1e-12, true);
}
TEST_CASE("generation cache on the GPU: a long stream of single tokens") { CHECK(long_stream<mnemo::cuda>(300) <= 1e-12); }
#else
TEST_CASE("generation cache: logits equal the uncached model's (double)") { run_twins<double>(1e-12); }
TEST_CASE("generation cache: logits equal the uncached model's (float)") { run_twins<float>(2e-5); }

TEST_CASE("generation cache: a long stream of single tokens (the cached rows' window slides and wraps)") {
    // Hundreds of tokens at batch 3 must give the uncached model's logits at every step.
    CHECK(long_stream<mnemo::cpu>(300) <= 1e-12);
}

TEST_CASE("generation cache over the fenced backend: the twins and a stream of single tokens") {
    run_twins<double, mnemo::fenced>(1e-12);
    CHECK(long_stream<mnemo::fenced>(40) <= 1e-12);
}

TEST_CASE("generation cache: with gradients disabled, logits equal the uncached model's") {
    run_twins<double>(1e-12, true);
    run_twins<float>(2e-5, true);
}

TEST_CASE("set_grad_enabled(false): backward and train_segment after such a forward are errors") {
    const mnemo::index_t vocab = 7, batch = 2;
    const mnemo::compressive_options o{.vocab = vocab, .n_layers = 2, .d_ff = 8, .n_pos = 32};
    model_t<double> model(o);
    model.reset_parameters(4);
    auto mem = model.make_memory(4, 2);
    mem.reset(batch, 2);
    const auto t = random_tokens(2 * batch, vocab, 5), y = random_tokens(2 * batch, vocab, 6);
    model.set_grad_enabled(false);
    CHECK_FALSE(model.grad_enabled());
    model.forward(t, batch, mem);
    model.cross_entropy(y, true);
    CHECK_THROWS_WITH_AS(model.backward(t), doctest::Contains("gradients disabled"), mnemo::error);
    CHECK_THROWS_WITH_AS(model.train_segment(t, y, batch, mem), doctest::Contains("gradients disabled"), mnemo::error);
    model.set_grad_enabled(true);
    model.parameters().zero_grad();
    const auto losses = model.train_segment(t, y, batch, mem);
    CHECK(std::isfinite(losses.ce));
}

TEST_CASE("generation cache: a parameter written through values() is seen") {
    const mnemo::index_t vocab = 7;
    const mnemo::compressive_options o{.vocab = vocab, .n_layers = 2, .d_ff = 8, .n_pos = 32};
    model_t<double> cached(o), plain(o);
    cached.reset_parameters(3);
    plain.reset_parameters(3);
    cached.cache_memory_projections(true);
    auto mem_c = cached.make_memory(4, 2), mem_p = plain.make_memory(4, 2);
    for (int i = 0; i < 6; ++i) {
        const auto t = random_tokens(1, vocab, std::uint64_t(i));
        cached.forward(t, 1, mem_c);
        plain.forward(t, 1, mem_p);
        cached.update_memory(mem_c);
        plain.update_memory(mem_p);
    }
    // Change the key weights of layer 0 in both models.
    for (auto* m : {&cached, &plain}) {
        const auto* e = m->parameters().find("transformer.layers.0.self_attn.key.linear.weight");
        REQUIRE(e);
        double* v = m->parameters().values() + e->offset;
        for (mnemo::index_t i = 0; i < e->size; ++i) v[i] *= 1.5;
    }
    const auto t = random_tokens(1, vocab, 77);
    CHECK(max_diff(cached.forward(t, 1, mem_c), plain.forward(t, 1, mem_p)) <= 1e-12);
}
#endif
