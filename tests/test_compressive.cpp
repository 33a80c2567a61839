// The Compressive Transformer: memory management, finite-difference checks of a layer and of the
// whole model with memory in play, and the attention-reconstruction loss's gradient isolation.
#include <doctest/doctest.h>

#include <cmath>
#include <vector>

#include <omp.h>

#include <mnemo/models/compressive_transformer.hpp>
#include <mnemo/train/optimizer.hpp>

#include "gradcheck.hpp"

using mnemo::index_t;
using mnemo::token_t;
using mnemo::view;
using mnemo::testing::check_close;
using mnemo::testing::check_gradients;
using mnemo::testing::parameter_targets;
using mnemo::testing::project;
using mnemo::testing::random_tokens;
using mnemo::testing::random_vector;
using mnemo::testing::randomize_model;

namespace {

// A memory whose slots are filled with an identifiable value per (layer, slot, batch, feature).
double slot_value(index_t l, index_t slot, index_t b, index_t f) { return 1000.0 * l + 10.0 * slot + b + 0.01 * f; }

}  // namespace

TEST_CASE("memory: merge keeps mem_len slots, compresses the oldest ceil((n - mem_len)/c)*c, truncates c_mem") {
    constexpr std::size_t D = 2;
    const index_t B = 2, c = 3;
    mnemo::compressive_memory<double, D> mem(2, /*mem_len=*/5, /*c_mem_len=*/2, c);
    mem.reset(B, 4);
    index_t next_slot = 0;
    std::vector<double> seg;
    auto push = [&](index_t q) {
        seg.assign(std::size_t(q * B * index_t(D)), 0.0);
        std::vector<std::vector<double>> per_layer(2, seg);
        for (index_t l = 0; l < 2; ++l)
            for (index_t s = 0; s < q; ++s)
                for (index_t b = 0; b < B; ++b)
                    for (index_t f = 0; f < index_t(D); ++f)
                        per_layer[l][std::size_t(((s * B) + b) * index_t(D) + f)] = slot_value(l, next_slot + s, b, f);
        next_slot += q;
        // f_c: the mean of each group of c slots.
        return mem.merge([&](index_t l) { return view<const double, D>(per_layer[l].data(), q * B); },
                         [&](index_t, view<const double, D> in, view<double, D> out) {
                             for (index_t r = 0; r < out.rows(); ++r)
                                 for (index_t f = 0; f < index_t(D); ++f) {
                                     const index_t s = r / B, b = r % B;
                                     double sum = 0;
                                     for (index_t t = 0; t < c; ++t) sum += in((s * c + t) * B + b, f);
                                     out(r, f) = sum / double(c);
                                 }
                         });
    };
    CHECK(push(4) == 0);  // 4 slots fit in 5
    CHECK(mem.mem_slots() == 4);
    CHECK(mem.c_mem_slots() == 0);
    CHECK(push(4) == 3);  // 8 > 5: ceil(3/3)·3 = 3 oldest slots compressed into 1
    CHECK(mem.mem_slots() == 5);
    CHECK(mem.c_mem_slots() == 1);
    CHECK(mem.mem(1)(0, 0) == slot_value(1, 3, 0, 0));  // the oldest kept slot is slot 3
    CHECK(mem.c_mem(1)(1, 1) == doctest::Approx(slot_value(1, 1, 1, 1)));  // mean of slots 0, 1, 2
    CHECK(mem.compressed_away(0)(2 * B, 0) == slot_value(0, 2, 0, 0));
    CHECK(push(4) == 6);  // 9 > 5: ceil(4/3)·3 = 6 slots into 2; c_mem 3 > 2 keeps the newest 2
    CHECK(mem.mem_slots() == 3);
    CHECK(mem.c_mem_slots() == 2);
    CHECK(mem.c_mem(0)(0, 0) == doctest::Approx(slot_value(0, 4, 0, 0)));  // mean of slots 3, 4, 5
    CHECK(mem.mem(0)(0, 0) == slot_value(0, 9, 0, 0));
    CHECK(push(1) == 0);  // 4 slots fit
    CHECK(mem.compressed_away_slots() == 0);
}

TEST_CASE("memory: c_mem_len = 0 is Transformer-XL: the newest mem_len slots, nothing compressed") {
    constexpr std::size_t D = 1;
    mnemo::compressive_memory<double, D> mem(1, 3, 0, 2);
    mem.reset(1, 2);
    int compress_calls = 0;
    double next = 0;
    for (int step = 0; step < 4; ++step) {
        std::vector<double> x = {next, next + 1};
        next += 2;
        CHECK(mem.merge([&](index_t) { return view<const double, D>(x.data(), 2); },
                        [&](index_t, view<const double, D>, view<double, D>) { ++compress_calls; }) == 0);
    }
    CHECK(compress_calls == 0);
    CHECK(mem.c_mem_slots() == 0);
    REQUIRE(mem.mem_slots() == 3);
    CHECK(mem.mem(0)(0, 0) == 5.0);
    CHECK(mem.mem(0)(2, 0) == 7.0);
}

TEST_CASE("memory: impossible settings are clear errors") {
    using M = mnemo::compressive_memory<float, 4>;
    CHECK_THROWS_WITH_AS(M(2, 1, 8, 4), doctest::Contains("mem_len = 1 is too short for compression rate 4"), mnemo::error);
    CHECK_THROWS_WITH_AS(M(2, -1, 8, 2), doctest::Contains("mem_len must be >= 0"), mnemo::error);
    CHECK_THROWS_WITH_AS(M(0, 4, 8, 2), doctest::Contains("n_layers"), mnemo::error);
    CHECK_NOTHROW(M(2, 1, 0, 4));  // Transformer-XL: no compression, any mem_len
}

namespace {
using tiny = mnemo::config<8, 2, 2>;
using model_t = mnemo::compressive_transformer<double, tiny>;
}  // namespace

TEST_CASE("compressive_layer: backward matches finite differences with memory and compressed memory") {
    constexpr std::size_t D = 8;
    const index_t B = 2, Q = 3, M = 2, C = 2, P = 8;
    mnemo::parameter_set<double> ps;
    mnemo::compressive_layer<double, tiny, mnemo::conv_compression> layer(ps, "layer", 5, P);
    ps.allocate();
    randomize_model(ps, 1);
    auto x = random_vector<double>(Q * B * D, 2);
    auto mem = random_vector<double>(M * B * D, 3);
    auto cmem = random_vector<double>(C * B * D, 4);
    auto r = random_vector<double>(Q * B * D, 5);
    std::vector<double> y(Q * B * D), dx(Q * B * D);
    using V = view<const double, D>;
    auto loss = [&] {
        layer.forward(V(x.data(), Q * B), V(cmem.data(), C * B), V(mem.data(), M * B), B, view<double, D>(y.data(), Q * B));
        return project(y, r);
    };
    loss();
    ps.zero_grad();
    layer.backward(V(r.data(), Q * B), view<double, D>(dx.data(), Q * B));
    auto targets = parameter_targets(ps);
    // The compression function is not used by the layer's forward: its gradient is zero and not checked here.
    std::erase_if(targets, [](const auto& t) { return t.name.find("compress") != std::string::npos; });
    targets.push_back({"x", x.data(), dx});
    check_gradients(loss, targets);
}

TEST_CASE("compressive_transformer: the CE gradient of a segment with memory matches finite differences") {
    const index_t B = 2, Q = 3, vocab = 7;
    model_t model({.vocab = vocab, .n_layers = 2, .d_ff = 6, .n_pos = 16});
    randomize_model(model.parameters(), 11);
    auto mem = model.make_memory(/*mem_len=*/3, /*c_mem_len=*/2);
    mem.reset(B, Q);
    // Two segments fill the memory and compress; the checked segment reads both kinds of memory.
    for (int s = 0; s < 2; ++s) {
        auto t = random_tokens(Q * B, vocab, 20 + s);
        model.forward(t, B, mem);
        model.update_memory(mem);
    }
    REQUIRE(mem.mem_slots() > 0);
    REQUIRE(mem.c_mem_slots() > 0);
    auto tokens = random_tokens(Q * B, vocab, 30), targets = random_tokens(Q * B, vocab, 31);
    auto loss = [&] {
        model.forward(tokens, B, mem);
        return model.cross_entropy(targets, false);
    };
    auto& ps = model.parameters();
    ps.zero_grad();
    model.forward(tokens, B, mem);
    model.cross_entropy(targets, true);
    model.backward(tokens);
    auto targets_g = parameter_targets(ps);
    std::erase_if(targets_g, [](const auto& t) { return t.name.find("compress") != std::string::npos; });
    check_gradients(loss, targets_g);
}

TEST_CASE("attention reconstruction: only the compression function gets gradient, and it matches finite differences") {
    const index_t B = 2, Q = 2, vocab = 5;
    model_t model({.vocab = vocab, .n_layers = 2, .d_ff = 6, .n_pos = 16});
    randomize_model(model.parameters(), 41);
    auto mem = model.make_memory(2, 4);
    mem.reset(B, Q);
    auto t0 = random_tokens(Q * B, vocab, 42), t1 = random_tokens(Q * B, vocab, 43);
    model.forward(t0, B, mem);
    REQUIRE(model.update_memory(mem) == 0);
    model.forward(t1, B, mem);
    REQUIRE(model.update_memory(mem) == 2);  // 4 slots > 2: the oldest 2 are compressed into 1
    auto& ps = model.parameters();
    ps.zero_grad();
    const double ar = model.reconstruction_loss(mem, true);
    CHECK(ar > 0);
    for (const auto& e : ps.entries()) {
        double norm = 0;
        for (index_t i = 0; i < e.size; ++i) norm += std::abs(ps.grads()[e.offset + i]);
        INFO(e.name);
        if (e.name.find(".compress.") != std::string::npos) CHECK(norm > 0);
        else CHECK(norm == 0.0);  // exactly zero
    }
    auto loss = [&] { return model.reconstruction_loss(mem, false); };
    auto targets = parameter_targets(ps);
    std::erase_if(targets, [](const auto& t) { return t.name.find(".compress.") == std::string::npos; });
    REQUIRE(targets.size() == 4);
    check_gradients(loss, targets);
}

TEST_CASE("attention reconstruction: key and value weights keep training from the cross-entropy loss") {
    // A published implementation detached its key/value weights in place while computing this loss,
    // so they never trained again. Train several steps with compression on every step and check that
    // the key and value projections of every layer receive gradient and move on every step.
    const index_t B = 2, Q = 2, vocab = 5;
    mnemo::compressive_transformer<float, tiny> model({.vocab = vocab, .n_layers = 2, .d_ff = 6, .n_pos = 16});
    model.reset_parameters(7);
    auto& ps = model.parameters();
    mnemo::adamw<float> opt(ps.size(), {.lr = 1e-2});
    auto mem = model.make_memory(2, 4);
    mem.reset(B, Q);
    for (int step = 0; step < 5; ++step) {
        auto tokens = random_tokens(Q * B, vocab, 100 + step), targets = random_tokens(Q * B, vocab, 200 + step);
        std::vector<float> before(ps.values(), ps.values() + ps.size());
        ps.zero_grad();
        const auto losses = model.train_segment(tokens, targets, B, mem);
        if (step > 0) CHECK(losses.compressed > 0);
        for (index_t l = 0; l < 2; ++l)
            for (const char* w : {"key.linear.weight", "value.linear.weight", "value.linear.bias"}) {
                const auto* e = ps.find("transformer.layers." + std::to_string(l) + ".self_attn." + w);
                double g = 0;
                for (index_t i = 0; i < e->size; ++i) g += std::abs(ps.grads()[e->offset + i]);
                INFO("step " << step << " layer " << l << " " << w);
                CHECK(g > 0);
            }
        opt.step(ps);
        const auto* k = ps.find("transformer.layers.1.self_attn.key.linear.weight");
        bool moved = false;
        for (index_t i = 0; i < k->size; ++i) moved |= ps.values()[k->offset + i] != before[std::size_t(k->offset + i)];
        CHECK(moved);
    }
}

TEST_CASE("compressive_transformer: a Transformer-XL model (no_compression) has no compress tensors and refuses c_mem") {
    using xl_t = mnemo::compressive_transformer<float, mnemo::config<8, 2, 1>, mnemo::no_compression>;
    xl_t model({.vocab = 5, .n_layers = 2, .d_ff = 6, .n_pos = 16});
    for (const auto& e : model.parameters().entries()) CHECK(e.name.find("compress") == std::string::npos);
    CHECK_THROWS_WITH_AS(model.make_memory(4, 2), doctest::Contains("needs c_mem_len = 0"), mnemo::error);
    auto mem = model.make_memory(4, 0);
    mem.reset(1, 3);
    model.reset_parameters(1);
    std::vector<token_t> t = {1, 2, 3};
    for (int s = 0; s < 3; ++s) CHECK(std::isfinite(model.train_segment(t, t, 1, mem).ce));
    CHECK(mem.mem_slots() == 4);
}

TEST_CASE("compressive_transformer: training steps are bitwise the same on 1 and 2 threads") {
    // Results must not depend on the thread count (STYLE: reductions in a fixed order), so a run
    // resumed with another --threads continues exactly.
    using m_t = mnemo::compressive_transformer<float, mnemo::config<64, 4, 2>>;
    std::vector<float> grads[2], logits[2];
    for (int threads = 1; threads <= 2; ++threads) {
        const int saved = omp_get_max_threads();
        omp_set_num_threads(threads);
        m_t model({.vocab = 30, .n_layers = 2, .d_ff = 128, .n_pos = 64});
        model.reset_parameters(3);
        auto mem = model.make_memory(8, 16);
        mem.reset(32, 8);
        for (int s = 0; s < 4; ++s) {  // the memory fills and compresses
            auto tokens = random_tokens(8 * 32, 30, 50 + s), targets = random_tokens(8 * 32, 30, 60 + s);
            model.parameters().zero_grad();
            model.train_segment(tokens, targets, 32, mem);
        }
        omp_set_num_threads(saved);
        auto& ps = model.parameters();
        grads[threads - 1].assign(ps.grads(), ps.grads() + ps.size());
        logits[threads - 1].assign(model.logits().data(), model.logits().data() + model.logits().size());
    }
    CHECK(logits[0] == logits[1]);
    CHECK(grads[0] == grads[1]);
}

TEST_CASE("compressive_transformer: batch 1 over the absorbed memory is bitwise the same on 1 and 2 threads") {
    // Without the generation cache a token's attention takes the absorbed route over the whole memory
    // at batch 1, where the memory's products [H, M]·ẑ and q̃·ẑᵀ split their columns over the threads
    // (gemm::direct_split_min). d_model 512, 8 heads, M = 256: 1M multiply-adds each, at the threshold.
    // A training segment of 4 positions at batch 1 then takes the same route with gradients (ẑ
    // forward, its backward's products: 4M multiply-adds each).
    using m_t = mnemo::compressive_transformer<float, mnemo::config<512, 8, 4>>;
    REQUIRE(index_t(8) * 256 * 512 >= mnemo::cpu_kernels::gemm::direct_split_min);
    std::vector<float> logits[2], grads[2];
    for (int threads = 1; threads <= 2; ++threads) {
        const int saved = omp_get_max_threads();
        omp_set_num_threads(threads);
        m_t model({.vocab = 11, .n_layers = 1, .d_ff = 32, .n_pos = 320});
        model.reset_parameters(4);
        randomize_model(model.parameters(), 21);  // u, R and S start at zero: give every term a value
        model.cache_memory_projections(false);
        model.set_grad_enabled(false);
        auto mem = model.make_memory(64, 192);
        mem.reset(1, 64);
        for (int s = 0; s < 14; ++s) {  // 64 + 4·192 = 832 positions fill both memories
            model.forward(random_tokens(64, 11, 80 + s), 1, mem);
            model.update_memory(mem);
        }
        REQUIRE(mem.mem_slots() == 64);
        REQUIRE(mem.c_mem_slots() == 192);
        for (int t = 0; t < 6; ++t) {
            const auto out = model.forward(random_tokens(1, 11, 90 + t), 1, mem);
            CHECK(model.layer(0).self_attn().last_forward_absorbed());
            logits[threads - 1].insert(logits[threads - 1].end(), out.data(), out.data() + out.size());
            model.update_memory(mem);
        }
        model.set_grad_enabled(true);
        auto& ps = model.parameters();
        ps.zero_grad();
        model.train_segment(random_tokens(4, 11, 99), random_tokens(4, 11, 98), 1, mem);
        CHECK(model.layer(0).self_attn().last_forward_absorbed());
        grads[threads - 1].assign(ps.grads(), ps.grads() + ps.size());
        omp_set_num_threads(saved);
    }
    REQUIRE(logits[0].size() == 6 * 11);
    CHECK(logits[0] == logits[1]);
    CHECK(grads[0] == grads[1]);
}

TEST_CASE("compressive_transformer: training over the absorbed memory at batch 8 is bitwise the same on 1, 2 and 3 threads") {
    // Configuration A's route at a smaller size: 8 positions over 72 memory rows of d_model 128 take
    // the absorbed memory, whose per-batch-element loops split the elements over the threads
    // (parallel_range) with one scratch block per thread, the kept normalised rows (ẑ) from the
    // second segment on.
    using m_t = mnemo::compressive_transformer<float, mnemo::config<128, 4, 2>>;
    std::vector<float> logits[3], grads[3];
    for (int threads = 1; threads <= 3; ++threads) {
        const int saved = omp_get_max_threads();
        omp_set_num_threads(threads);
        m_t model({.vocab = 13, .n_layers = 2, .d_ff = 64, .n_pos = 96});
        model.reset_parameters(5);
        randomize_model(model.parameters(), 23);
        auto mem = model.make_memory(8, 64);
        mem.reset(8, 8);
        auto& ps = model.parameters();
        for (int s = 0; s < 20; ++s) {  // 8 + 2·64 = 136 positions fill both memories, then 3 more
            ps.zero_grad();
            model.train_segment(random_tokens(64, 13, 200 + s), random_tokens(64, 13, 300 + s), 8, mem);
            if (s < 17) continue;
            CHECK(model.layer(0).self_attn().last_forward_absorbed());
            logits[threads - 1].insert(logits[threads - 1].end(), model.logits().data(),
                                       model.logits().data() + model.logits().size());
        }
        REQUIRE(mem.c_mem_slots() == 64);
        grads[threads - 1].assign(ps.grads(), ps.grads() + ps.size());
        omp_set_num_threads(saved);
    }
    CHECK(logits[0] == logits[1]);
    CHECK(logits[0] == logits[2]);
    CHECK(grads[0] == grads[1]);
    CHECK(grads[0] == grads[2]);
}

TEST_CASE("attention reconstruction: the model's loss reuses its forward's queries and normalised rows, bitwise") {
    // reconstruction_loss takes the attention's queries of h and the layer's LN of the rows the merge
    // compressed away (the oldest of [mem, x]) from the forward instead of recomputing them. The
    // loss and the compression gradients must be bitwise a fresh computation's, including when the
    // compressed rows reach into the segment, and after a parameter change (nothing reused then).
    const index_t B = 2, Q = 3, vocab = 7;
    mnemo::compressive_transformer<float, tiny> model({.vocab = vocab, .n_layers = 2, .d_ff = 6, .n_pos = 32});
    model.reset_parameters(5);
    randomize_model(model.parameters(), 17);
    auto& ps = model.parameters();
    auto mem = model.make_memory(2, 4);
    mem.reset(B, Q);
    auto fresh = [&](std::vector<float>& grads) {
        mnemo::attention_reconstruction<float, tiny> ar;
        ps.zero_grad();
        double total = 0;
        for (index_t l = 0; l < 2; ++l) {
            auto& layer = model.layer(l);
            total += double(ar.compute(layer.attention_input_norm(), layer.self_attn(), layer.compress(),
                                       model.layer_input(l), mem.compressed_away(l), B, true));
        }
        grads.assign(ps.grads(), ps.grads() + ps.size());
        return total;
    };
    for (int step = 0; step < 4; ++step) {
        model.forward(random_tokens(Q * B, vocab, 60 + step), B, mem);
        const index_t away = model.update_memory(mem);
        if (step == 0) continue;
        REQUIRE(away > 0);
        if (step == 3) ps.values()[0] += 0.5f;  // a parameter change after the forward: nothing reused
        ps.zero_grad();
        const double reused = model.reconstruction_loss(mem, true);
        const std::vector<float> g_reused(ps.grads(), ps.grads() + ps.size());
        std::vector<float> g_fresh;
        const double recomputed = fresh(g_fresh);
        INFO("step " << step);
        CHECK(reused > 0);
        CHECK(reused == recomputed);
        CHECK(g_reused == g_fresh);
    }
}
