// The runtime-shape models (config<dynamic, dynamic, dynamic>, mnemo::runtime_config): built with
// d_model, heads and the compression rate given in their options, they must declare the same
// parameters as the compiled-in model of that shape and, from the same seed, compute the same
// logits, losses, parameter gradients, memories and generated logits: the same kernels in the same
// order, with the extents at run time (the per-head products take their runtime-width twins, which
// sum in the same order). Covered: every compression function, Transformer-XL, the runtime variants
// (GRU residuals, post-LN, memory layers, the auto-encoding loss), both memory-attention routes, the
// generation cache, the Feedback Transformer and its shared-KV variant with their generators, over
// shapes whose d_head is one SIMD vector (16/2), several (64/2), and not a whole number of them (12/3:
// the general GEMMs). And the options' checks: one-line errors naming the option.
//
// Built twice (tests/CMakeLists.txt):
//   test_dynamic_shape_bitwise  with -ffp-contract=off: everything BITWISE equal. This is the claim
//                               that the two models perform the same floating-point operations in
//                               the same order.
//   test_dynamic_shape          with the suite's flags (g++: -ffp-contract=fast): within 1e-5
//                               relative. There the compiler fuses a·b + c into one FMA where it
//                               sees fit, and where a loop's trip count is a compile-time constant
//                               (d_head 8 in the compiled-in model, a runtime value in the other) it
//                               may vectorise the loop differently and fuse a different product, or
//                               none, in a dot product or a sum of two products: a rounding
//                               difference of an ulp, which training then carries along.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <span>
#include <string>
#include <vector>

#include <mnemo/models/compressive_transformer.hpp>
#include <mnemo/models/feedback_transformer.hpp>

#include "testing.hpp"

using mnemo::index_t;
using mnemo::runtime_config;
using mnemo::token_t;

namespace {

/// Equality of n values: bitwise in the -ffp-contract=off build (MNEMO_TEST_BITWISE), else within
/// 1e-5 relative (1e-6 absolute near zero), reporting the first difference and the largest.
template <class T>
void check_same(const std::string& what, const T* a, const T* b, index_t n) {
    index_t first = -1;
    double worst = 0;
    for (index_t i = 0; i < n; ++i) {
        if (std::memcmp(a + i, b + i, sizeof(T)) == 0) continue;
        const double d = std::fabs(double(a[i]) - double(b[i])), scale = 1e-6 + 1e-5 * std::fabs(double(b[i]));
#ifdef MNEMO_TEST_BITWISE
        (void)scale;
        worst = std::max(worst, d);
        if (first < 0) first = i;
#else
        worst = std::max(worst, d / scale);
        if (first < 0 && d > scale) first = i;
#endif
    }
    INFO(what << ": first difference at " << first << " of " << n << " ("
              << (first >= 0 ? double(a[first]) : 0.0) << " vs " << (first >= 0 ? double(b[first]) : 0.0)
              << "), largest " << worst);
    CHECK(first < 0);
}

/// The same parameters (names, shapes, offsets) in both sets.
template <class T>
void check_same_parameters(const mnemo::parameter_set<T>& a, const mnemo::parameter_set<T>& b) {
    REQUIRE(a.entries().size() == b.entries().size());
    REQUIRE(a.size() == b.size());
    for (std::size_t i = 0; i < a.entries().size(); ++i) {
        CHECK(a.entries()[i].name == b.entries()[i].name);
        CHECK(a.entries()[i].shape == b.entries()[i].shape);
        CHECK(a.entries()[i].offset == b.entries()[i].offset);
    }
}

struct compressive_run {
    index_t batch = 2, seq = 4, mem_len = 4, c_mem_len = 3, segments = 5, vocab = 11;
    mnemo::compressive_options options{.vocab = 11, .n_layers = 2, .d_ff = 24, .n_pos = 32};
    mnemo::memory_attention route = mnemo::memory_attention::automatic;
};

/// Trains `run.segments` segments of the static model Static and of its runtime-shape twin, from the
/// same seed, comparing everything bitwise; then generates a few tokens with the generation cache.
template <class Static, class Dynamic>
void compare_compressive(const compressive_run& run, std::uint64_t seed) {
    using T = float;
    Static fixed(run.options);
    mnemo::compressive_options dyn_options = run.options;
    dyn_options.d_model = index_t(Static::config::d_model);
    dyn_options.heads = index_t(Static::config::heads);
    dyn_options.compression_rate = index_t(Static::config::compression_rate);
    Dynamic dyn(dyn_options);
    CHECK(dyn.shape().d_model == fixed.shape().d_model);
    CHECK(dyn.shape().heads == fixed.shape().heads);
    CHECK(dyn.shape().compression_rate == fixed.shape().compression_rate);
    check_same_parameters(fixed.parameters(), dyn.parameters());
    fixed.reset_parameters(seed);
    dyn.reset_parameters(seed);
    fixed.set_memory_attention(run.route);
    dyn.set_memory_attention(run.route);
    check_same("initial parameters", fixed.parameters().values(), dyn.parameters().values(), fixed.parameters().size());

    const index_t c_mem_len = Static::can_compress ? run.c_mem_len : 0;
    auto mf = fixed.make_memory(run.mem_len, c_mem_len);
    auto md = dyn.make_memory(run.mem_len, c_mem_len);
    mf.reset(run.batch, run.seq);
    md.reset(run.batch, run.seq);
    const index_t rows = run.batch * run.seq;
    index_t compressed = 0;
    for (index_t s = 0; s < run.segments; ++s) {
        INFO("segment " << s);
        const auto tokens = mnemo::testing::random_tokens(rows, run.vocab, seed + 100 + std::uint64_t(s));
        const auto targets = mnemo::testing::random_tokens(rows, run.vocab, seed + 200 + std::uint64_t(s));
        fixed.parameters().zero_grad();
        dyn.parameters().zero_grad();
        const auto lf = fixed.train_segment(tokens, targets, run.batch, mf);
        const auto ld = dyn.train_segment(tokens, targets, run.batch, md);
        compressed += lf.compressed;
        CHECK(lf.compressed == ld.compressed);
        check_same("ce", &lf.ce, &ld.ce, 1);
        check_same("reconstruction loss", &lf.ar, &ld.ar, 1);
        check_same("logits", fixed.logits().data(), dyn.logits().data(), fixed.logits().size());
        check_same("gradients", fixed.parameters().grads(), dyn.parameters().grads(), fixed.parameters().size());
        for (index_t l = 0; l < fixed.n_memory_layers(); ++l) {
            REQUIRE(mf.mem(l).size() == md.mem(l).size());
            REQUIRE(mf.c_mem(l).size() == md.c_mem(l).size());
            check_same("memory", mf.mem(l).data(), md.mem(l).data(), mf.mem(l).size());
            check_same("compressed memory", mf.c_mem(l).data(), md.c_mem(l).data(), mf.c_mem(l).size());
        }
        // A plain SGD step, so the next segment runs with other weights (and the gradients matter).
        for (auto* m : {&fixed.parameters(), &dyn.parameters()}) {
            T* w = m->values();
            const T* g = m->grads();
            for (index_t i = 0; i < m->size(); ++i) w[i] -= T(0.05) * g[i];
            m->mark_changed();
        }
    }
    if (Static::can_compress) CHECK(compressed > 0);

    // Generation: one token at a time, gradients off, the keys and values of the memory kept.
    fixed.set_grad_enabled(false);
    fixed.cache_memory_projections(true);
    dyn.set_grad_enabled(false);
    dyn.cache_memory_projections(true);
    for (index_t t = 0; t < 6; ++t) {
        INFO("generated token " << t);
        const auto token = mnemo::testing::random_tokens(run.batch, run.vocab, seed + 300 + std::uint64_t(t));
        const auto a = fixed.forward(token, run.batch, mf);
        const auto b = dyn.forward(token, run.batch, md);
        check_same("generation logits", a.data(), b.data(), a.size());
        CHECK(fixed.update_memory(mf) == dyn.update_memory(md));
    }
}

template <std::size_t D, std::size_t H, std::size_t C, template <class, std::size_t, std::size_t, class> class F>
void compare_compressive(const compressive_run& run, std::uint64_t seed) {
    compare_compressive<mnemo::compressive_transformer<float, mnemo::config<D, H, C>, F>,
                        mnemo::compressive_transformer<float, runtime_config, F>>(run, seed);
}

template <class Static, class Dynamic>
void compare_feedback(std::uint64_t seed) {
    const index_t batch = 3, steps = 7, vocab = 13;
    const mnemo::feedback_options o{.vocab = vocab, .n_layers = 2, .d_ff = 20, .n_pos = 16, .grad_flush_rows = 6};
    Static fixed(o);
    mnemo::feedback_options od = o;
    od.d_model = index_t(Static::config::d_model);
    od.heads = index_t(Static::config::heads);
    Dynamic dyn(od);
    check_same_parameters(fixed.parameters(), dyn.parameters());
    fixed.reset_parameters(seed);
    dyn.reset_parameters(seed);
    for (int s = 0; s < 3; ++s) {
        INFO("sequence " << s);
        const auto tokens = mnemo::testing::random_tokens(batch * steps, vocab, seed + 10 + std::uint64_t(s));
        const auto targets = mnemo::testing::random_tokens(batch * steps, vocab, seed + 20 + std::uint64_t(s));
        fixed.parameters().zero_grad();
        dyn.parameters().zero_grad();
        const double cf = fixed.train_segment(tokens, targets, batch);
        const double cd = dyn.train_segment(tokens, targets, batch);
        check_same("ce", &cf, &cd, 1);
        check_same("logits", fixed.logits().data(), dyn.logits().data(), fixed.logits().size());
        check_same("gradients", fixed.parameters().grads(), dyn.parameters().grads(), fixed.parameters().size());
        for (auto* m : {&fixed.parameters(), &dyn.parameters()}) {
            float* w = m->values();
            const float* g = m->grads();
            for (index_t i = 0; i < m->size(); ++i) w[i] -= 0.05f * g[i];
            m->mark_changed();
        }
    }
    auto gf = fixed.generator(batch);
    auto gd = dyn.generator(batch);
    for (index_t t = 0; t < steps; ++t) {
        INFO("generated step " << t);
        const auto token = mnemo::testing::random_tokens(batch, vocab, seed + 30 + std::uint64_t(t));
        const auto a = gf.step(token);
        const auto b = gd.step(token);
        check_same("generation logits", a.data(), b.data(), a.size());
    }
}

template <std::size_t D, std::size_t H, class KV>
void compare_feedback(std::uint64_t seed) {
    compare_feedback<mnemo::feedback_transformer<float, mnemo::config<D, H>, KV>,
                     mnemo::feedback_transformer<float, runtime_config, KV>>(seed);
}

}  // namespace

TEST_CASE("runtime shape: compressive, conv compression, bitwise the compiled-in model") {
    compressive_run run;
    SUBCASE("16/2/2") { compare_compressive<16, 2, 2, mnemo::conv_compression>(run, 1); }
    SUBCASE("12/3/3") { compare_compressive<12, 3, 3, mnemo::conv_compression>(run, 2); }
    SUBCASE("64/2/2") { compare_compressive<64, 2, 2, mnemo::conv_compression>(run, 3); }
    SUBCASE("absorbed memory") {
        run.route = mnemo::memory_attention::absorbed;
        compare_compressive<16, 2, 2, mnemo::conv_compression>(run, 4);
    }
    SUBCASE("projected memory") {
        run.route = mnemo::memory_attention::projected;
        compare_compressive<12, 3, 3, mnemo::conv_compression>(run, 5);
    }
}

TEST_CASE("runtime shape: compressive, most-used compression, bitwise the compiled-in model") {
    compressive_run run;
    SUBCASE("16/2/2") { compare_compressive<16, 2, 2, mnemo::most_used_compression>(run, 6); }
    SUBCASE("12/3/3") { compare_compressive<12, 3, 3, mnemo::most_used_compression>(run, 7); }
}

TEST_CASE("runtime shape: max, mean and dilated compression, bitwise the compiled-in model") {
    compressive_run run;
    SUBCASE("max") { compare_compressive<12, 3, 3, mnemo::max_pool_compression>(run, 8); }
    SUBCASE("mean") { compare_compressive<16, 2, 2, mnemo::mean_pool_compression>(run, 9); }
    SUBCASE("dilated, rate 4") {
        run.mem_len = 8;
        compare_compressive<16, 2, 4, mnemo::dilated_conv_compression>(run, 10);
    }
}

TEST_CASE("runtime shape: Transformer-XL, bitwise the compiled-in model") {
    compressive_run run;
    run.c_mem_len = 0;
    compare_compressive<16, 2, 1, mnemo::no_compression>(run, 11);
}

TEST_CASE("runtime shape: the runtime variants, bitwise the compiled-in model") {
    compressive_run run;
    run.options.n_layers = 3;
    SUBCASE("GRU residuals, post-LN, auto-encoding loss") {
        run.options.residual = mnemo::residual_kind::gru;
        run.options.norm = mnemo::norm_kind::post;
        run.options.reconstruction = mnemo::reconstruction_kind::autoencoding;
        compare_compressive<12, 3, 3, mnemo::conv_compression>(run, 12);
    }
    SUBCASE("memory layers, GRU, auto-encoding, most-used") {
        run.options.memory_layers = {1, 2};
        run.options.residual = mnemo::residual_kind::gru;
        run.options.reconstruction = mnemo::reconstruction_kind::autoencoding;
        compare_compressive<16, 2, 2, mnemo::most_used_compression>(run, 13);
    }
}

TEST_CASE("runtime shape: Feedback Transformer and its shared-KV variant, bitwise the compiled-in model") {
    SUBCASE("feedback 16/2") { compare_feedback<16, 2, mnemo::per_layer_kv>(14); }
    SUBCASE("feedback 12/3") { compare_feedback<12, 3, mnemo::per_layer_kv>(15); }
    SUBCASE("feedback-kv 16/2") { compare_feedback<16, 2, mnemo::shared_kv>(16); }
    SUBCASE("feedback-kv 64/2") { compare_feedback<64, 2, mnemo::shared_kv>(17); }
}

TEST_CASE("runtime shape: the options are checked, one line naming the option") {
    using dyn_conv = mnemo::compressive_transformer<float, runtime_config, mnemo::conv_compression>;
    using dyn_xl = mnemo::compressive_transformer<float, runtime_config, mnemo::no_compression>;
    using dyn_fb = mnemo::feedback_transformer<float, runtime_config, mnemo::per_layer_kv>;
    using fixed_conv = mnemo::compressive_transformer<float, mnemo::config<16, 2, 2>, mnemo::conv_compression>;
    const mnemo::compressive_options base{.vocab = 5, .n_layers = 1, .d_ff = 8, .n_pos = 8};
    auto with = [&](index_t d, index_t h, index_t c) {
        mnemo::compressive_options o = base;
        o.d_model = d;
        o.heads = h;
        o.compression_rate = c;
        return o;
    };
    CHECK_THROWS_WITH_AS(dyn_conv(with(0, 2, 2)),
                         "mnemo: compressive_transformer: compressive_options::d_model must be at least 1 for a "
                         "runtime-shape model (config<dynamic, dynamic, dynamic>), got 0",
                         mnemo::error);
    CHECK_THROWS_WITH_AS(dyn_conv(with(16, 0, 2)),
                         "mnemo: compressive_transformer: compressive_options::heads must be at least 1 for a "
                         "runtime-shape model (config<dynamic, dynamic, dynamic>), got 0",
                         mnemo::error);
    CHECK_THROWS_WITH_AS(dyn_conv(with(100, 3, 2)),
                         "mnemo: compressive_transformer: compressive_options::d_model 100 is not divisible by "
                         "compressive_options::heads 3",
                         mnemo::error);
    CHECK_THROWS_WITH_AS(dyn_conv(with(16, 2, 0)),
                         "mnemo: compressive_transformer: compressive_options::compression_rate must be at least 1, "
                         "got 0",
                         mnemo::error);
    // Transformer-XL compresses nothing: its rate may be left out.
    CHECK(dyn_xl(with(16, 2, 0)).shape().compression_rate == 1);
    CHECK_THROWS_WITH_AS(fixed_conv(with(24, 0, 0)),
                         "mnemo: compressive_transformer: compressive_options::d_model 24 differs from the "
                         "compiled-in d_model 16 of this model (leave it 0, or build the runtime-shape model "
                         "config<dynamic, dynamic, dynamic>)",
                         mnemo::error);
    CHECK_THROWS_WITH_AS(fixed_conv(with(0, 0, 3)),
                         doctest::Contains("compressive_options::compression_rate 3 differs from the compiled-in "
                                           "compression rate 2"),
                         mnemo::error);
    // A static model reports its own shape in its options; giving it is allowed.
    const fixed_conv given(with(16, 2, 2));
    CHECK(given.options().d_model == 16);
    CHECK(fixed_conv(base).options().heads == 2);
    CHECK(fixed_conv(base).options().compression_rate == 2);
    mnemo::feedback_options fo{.vocab = 5, .n_layers = 1, .d_ff = 8, .n_pos = 8};
    fo.d_model = 10;
    fo.heads = 4;
    CHECK_THROWS_WITH_AS(dyn_fb{fo},
                         "mnemo: feedback_transformer: feedback_options::d_model 10 is not divisible by "
                         "feedback_options::heads 4",
                         mnemo::error);
    fo.heads = 5;
    CHECK(dyn_fb(fo).shape().heads == 5);
}

TEST_CASE("runtime shape: a runtime-shape model of a shape no config has (24/3, rate 5) trains") {
    using dyn_mean = mnemo::compressive_transformer<float, runtime_config, mnemo::mean_pool_compression>;
    mnemo::compressive_options o{.vocab = 7, .n_layers = 2, .d_ff = 16, .n_pos = 32};
    o.d_model = 24;
    o.heads = 3;
    o.compression_rate = 5;
    dyn_mean model(o);
    model.reset_parameters(3);
    CHECK(model.parameters().find("transformer.layers.0.self_attn.key_pos_embeddings")->shape ==
          std::vector<index_t>{64, 3, 8});
    auto mem = model.make_memory(5, 2);
    mem.reset(2, 4);
    index_t compressed = 0;
    for (int s = 0; s < 4; ++s) {
        const auto tokens = mnemo::testing::random_tokens(8, 7, 40 + std::uint64_t(s));
        model.parameters().zero_grad();
        const auto l = model.train_segment(tokens, tokens, 2, mem);
        compressed += l.compressed;
        CHECK(std::isfinite(l.ce));
    }
    CHECK(compressed == 15);  // 16 slots through a memory of 5: 15 compressed, in groups of 5
    CHECK(mem.c_mem_slots() == 2);
}
