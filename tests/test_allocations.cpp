// Forward and backward of every layer allocate nothing once their buffers have grown to the batch
// shape (the steady state). Counts every operator new in this binary while a window is open.
#include <doctest/doctest.h>

#include <vector>

#include <mnemo/mnemo.hpp>

#include "allocation_counter.hpp"
#include "testing.hpp"

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
    CHECK(mnemo::testing::count_allocations([] { std::vector<float> grow(1000); }) >= 1);
}
