// Forward and backward of every layer allocate nothing once their buffers have grown to the batch
// shape (the steady state), and neither does a whole training or generation step of a model. Counts
// every operator new and malloc in this binary while a window is open.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <vector>

#include <mnemo/mnemo.hpp>

#include "allocation_counter.hpp"
#include "testing.hpp"

using mnemo::testing::random_tokens;

TEST_CASE("layers: a steady-state forward and backward performs no heap allocation") {
    using mnemo::view;
    constexpr std::size_t D = 32, Dff = 64;
    const mnemo::index_t rows = 24, vocab = 17;
    mnemo::parameter_set<float> ps;
    mnemo::embedding<float, D> emb(ps, "embed", vocab);
    mnemo::layer_norm<float, D> ln(ps, "norm");
    mnemo::feed_forward<float, D, Dff, mnemo::gelu> ff(ps, "ff");
    mnemo::linear<float, D, mnemo::dynamic> gen(ps, "generator", D, vocab, true);
    ps.allocate();
    mnemo::rng r(1);
    emb.reset_parameters(r);
    ln.reset_parameters();
    ff.reset_parameters(r);
    gen.reset_parameters(r);

    std::vector<mnemo::token_t> tokens(rows);
    for (mnemo::index_t i = 0; i < rows; ++i) tokens[i] = static_cast<mnemo::token_t>(i % vocab);
    std::vector<float> x(rows * D), z(rows * D), f(rows * D), y(rows * D), logits(rows * vocab), losses(rows);
    std::vector<float> dlogits(rows * vocab), dy(rows * D), df(rows * D), dz(rows * D), dx(rows * D);
    using V = view<float, D>;
    auto step = [&] {
        emb.forward(tokens, V(x.data(), rows));
        ln.forward(V(x.data(), rows), V(z.data(), rows));
        ff.forward(V(z.data(), rows), V(f.data(), rows));
        mnemo::residual<float, D>::forward(V(x.data(), rows), V(f.data(), rows), V(y.data(), rows));
        gen.forward(V(y.data(), rows), view<float>(logits.data(), rows, vocab));
        mnemo::ops<mnemo::cpu>::cross_entropy_fused(rows, vocab, logits.data(), vocab, tokens.data(), losses.data(),
                                                    1.0f / rows, dlogits.data(), vocab);
        gen.backward(V(y.data(), rows), view<float>(dlogits.data(), rows, vocab), V(dy.data(), rows));
        mnemo::residual<float, D>::backward(V(dy.data(), rows), V(dx.data(), rows), V(df.data(), rows));
        ff.backward(V(z.data(), rows), V(df.data(), rows), V(dz.data(), rows));
        ln.backward(V(x.data(), rows), V(dz.data(), rows), V(dx.data(), rows), true);
        emb.backward(tokens, V(dx.data(), rows));
    };
    step();  // warm-up: buffers grow to the batch shape here
    CHECK(mnemo::testing::count_allocations([&] {
              for (int i = 0; i < 3; ++i) step();
          }) == 0);

    // The counter works: a vector allocated inside the window is seen.
    if (mnemo::testing::allocations_counted)
        CHECK(mnemo::testing::count_allocations([] { std::vector<float> grow(1000); }) >= 1);
}

TEST_CASE("the counter sees malloc too (Eigen's and libgomp's allocations are not operator new)") {
    if (!mnemo::testing::allocations_counted) return;  // AddressSanitizer owns malloc
    CHECK(mnemo::testing::count_allocations([] {
              void* volatile p = std::malloc(1 << 20);
              std::free(p);
          }) >= 1);
}

namespace {
using alloc_cfg = mnemo::config<64, 4, 2>;
using alloc_model = mnemo::compressive_transformer<float, alloc_cfg>;
constexpr mnemo::index_t alloc_seq = 8, alloc_batch = 4, alloc_vocab = 29;

// Six segments of random tokens through a batch-1 memory: memory and compressed memory full.
template <class Memory>
void prime_memory(alloc_model& model, Memory& mem, std::uint64_t seed) {
    const auto prime = random_tokens(alloc_seq, alloc_vocab, seed);
    for (int i = 0; i < 6; ++i) {
        model.forward(prime, 1, mem);
        model.update_memory(mem);
    }
}

// One generated token: forward, memory merge, and the greedy choice written back to tok.
template <class Memory>
void greedy_step(alloc_model& model, Memory& mem, std::vector<mnemo::token_t>& tok) {
    auto logits = model.forward(tok, 1, mem);
    model.update_memory(mem);
    tok[0] = mnemo::token_t(std::max_element(logits.row(0), logits.row(0) + logits.cols()) - logits.row(0));
}
}  // namespace

// The whole training step of the performance issue, in steady state (memory and compressed memory
// full, so every step compresses and computes the reconstruction loss): forward, memory merge, CE + AR,
// backward, gradient clipping and AdamW. GEMMs are large enough here to be split over two threads.
TEST_CASE("compressive transformer: a steady-state training step performs no heap allocation") {
    alloc_model model({.vocab = alloc_vocab, .n_layers = 2, .d_ff = 128, .n_pos = 256});
    model.reset_parameters(3);
    auto mem = model.make_memory(16, 16);
    mem.reset(alloc_batch, alloc_seq);
    auto& ps = model.parameters();
    mnemo::adamw<float> opt(ps.size(), {.lr = 1e-3});
    const auto tokens = random_tokens(alloc_seq * alloc_batch, alloc_vocab, 1),
               targets = random_tokens(alloc_seq * alloc_batch, alloc_vocab, 2);
    mnemo::segment_losses l;
    auto step = [&] {
        ps.zero_grad();
        l = model.train_segment(tokens, targets, alloc_batch, mem);
        mnemo::clip_grad_norm(ps, 1.0);
        opt.step(ps);
    };
    for (int i = 0; i < 8; ++i) step();  // fills memory (16) and compressed memory (16 slots = 32 at c = 2)
    REQUIRE(mem.mem_slots() == 16);
    REQUIRE(mem.c_mem_slots() == 16);
    REQUIRE(l.compressed > 0);
    CHECK(mnemo::testing::count_allocations([&] {
              for (int i = 0; i < 3; ++i) step();
          }) == 0);
    CHECK(l.ar > 0);
}

// Streaming generation: one token per step through forward, memory merge (compressing every c
// tokens) and a greedy choice.
TEST_CASE("compressive transformer: a steady-state generation step performs no heap allocation") {
    alloc_model model({.vocab = alloc_vocab, .n_layers = 2, .d_ff = 128, .n_pos = 256});
    model.reset_parameters(4);
    auto mem = model.make_memory(16, 16);
    mem.reset(1, alloc_seq);
    prime_memory(model, mem, 5);
    std::vector<mnemo::token_t> tok = {1};
    auto step = [&] { greedy_step(model, mem, tok); };
    for (int i = 0; i < 4; ++i) step();
    CHECK(mnemo::testing::count_allocations([&] {
              for (int i = 0; i < 8; ++i) step();
          }) == 0);
}

// Inference never needs the gradients, so a model that only generates never holds them (C's
// generation: 204 MB of 697 MiB). The first training step allocates them, zero, and trains as usual.
TEST_CASE("compressive transformer: generation never allocates the gradients; training does, at zero") {
    for (const bool absorbed : {false, true}) {
        CAPTURE(absorbed);
        alloc_model model({.vocab = alloc_vocab, .n_layers = 2, .d_ff = 128, .n_pos = 256});
        model.set_memory_attention(absorbed ? mnemo::memory_attention::absorbed : mnemo::memory_attention::projected);
        model.reset_parameters(6);
        auto& ps = model.parameters();
        model.set_grad_enabled(false);
        auto mem = model.make_memory(16, 16);
        mem.reset(1, alloc_seq);
        prime_memory(model, mem, 7);
        for (const bool cached : {false, true}) {
            model.cache_memory_projections(cached);
            std::vector<mnemo::token_t> tok = {1};
            for (int i = 0; i < 6; ++i) greedy_step(model, mem, tok);
        }
        CHECK_FALSE(ps.grads_allocated());

        model.set_grad_enabled(true);
        model.cache_memory_projections(false);
        mem.reset(alloc_batch, alloc_seq);
        const auto tokens = random_tokens(alloc_seq * alloc_batch, alloc_vocab, 8),
                   targets = random_tokens(alloc_seq * alloc_batch, alloc_vocab, 9);
        const mnemo::parameter_set<float>& cps = ps;
        REQUIRE(cps.grads() != nullptr);  // the first use allocates
        CHECK(ps.grads_allocated());
        CHECK(std::all_of(cps.grads(), cps.grads() + ps.size(), [](float g) { return g == 0.0f; }));
        ps.zero_grad();
        model.train_segment(tokens, targets, alloc_batch, mem);
        CHECK(std::any_of(cps.grads(), cps.grads() + ps.size(), [](float g) { return g != 0.0f; }));
    }
}
