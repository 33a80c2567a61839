// Padding masks that travel with the tokens into the memory and the compressed memory, clamp_len, and
// evaluation with memory lengths other than the training ones. The two batch-against-documents
// equivalences run over the CPU and the fenced backend (every number read over the host path); built
// with MNEMO_TEST_CUDA (tests/cuda), the file runs them on the GPU only.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include <mnemo/models/compressive_transformer.hpp>

#ifdef MNEMO_TEST_CUDA
#include <mnemo/cuda.hpp>
#else
#include "fenced_backend.hpp"
#endif
#include "allocation_counter.hpp"
#include "gradcheck.hpp"

using mnemo::index_t;
using mnemo::token_t;
using mnemo::view;
using mnemo::testing::check_gradients;
using mnemo::testing::max_diff;
using mnemo::testing::parameter_targets;
using mnemo::testing::random_tokens;
using mnemo::testing::random_vector;
using mnemo::testing::randomize_model;

namespace {
using tiny = mnemo::config<8, 2, 2>;
template <class B>
using model_on = mnemo::compressive_transformer<double, tiny, mnemo::conv_compression, B>;
using model_t = model_on<mnemo::cpu>;
using pad_t = std::vector<std::uint8_t>;

// Sequence-major rows (position·batch + b) of the positions [from, from + q) of `streams`.
template <class V>
V segment_of(const std::vector<V>& streams, index_t from, index_t q) {
    const index_t B = index_t(streams.size());
    V out(std::size_t(q * B));
    for (index_t i = 0; i < q; ++i)
        for (index_t b = 0; b < B; ++b) out[std::size_t(i * B + b)] = streams[std::size_t(b)][std::size_t(from + i)];
    return out;
}

// The logits of the last forward [rows, vocab], over the host path.
template <class M>
std::vector<double> all_logits(const M& m) {
    const auto l = m.logits();
    return mnemo::testing::to_host<typename M::backend_type>(l.data(), l.rows() * l.cols());
}

// Logits row r of the last forward.
template <class M>
std::vector<double> logits_row(const M& m, index_t r) {
    const auto all = all_logits(m);
    const std::size_t v = std::size_t(m.logits().cols());
    return std::vector<double>(all.begin() + std::ptrdiff_t(std::size_t(r) * v), all.begin() + std::ptrdiff_t((std::size_t(r) + 1) * v));
}

template <class M>
bool all_finite(const M& m) {
    for (double x : all_logits(m))
        if (!std::isfinite(x)) return false;
    return true;
}

template <class M>
std::vector<double> all_grads(M& m) {
    std::vector<double> g(std::size_t(m.parameters().size()));
    m.parameters().download_all_grads(g);
    return g;
}

/// A left-padded Transformer-XL batch over backend B equals each document alone at its real positions.
template <class B>
void left_padded_batch() {
    const index_t vocab = 7, Q = 3, S = 3, T = Q * S, mem_len = 12;
    model_on<B> model({.vocab = vocab, .n_layers = 2, .d_ff = 6, .n_pos = 32});
    randomize_model(model.parameters(), 3);
    const auto a = random_tokens(T, vocab, 10);
    auto b_doc = random_tokens(5, vocab, 11);
    const index_t lead = T - index_t(b_doc.size());  // B is left-padded so both end together
    std::vector<token_t> b_row(std::size_t(T), 0);
    pad_t b_pad(std::size_t(T), 1), a_pad(std::size_t(T), 0);
    for (index_t i = 0; i < index_t(b_doc.size()); ++i) {
        b_row[std::size_t(lead + i)] = b_doc[std::size_t(i)];
        b_pad[std::size_t(lead + i)] = 0;
    }
    std::vector<std::vector<token_t>> toks = {a, b_row};
    std::vector<pad_t> pads = {a_pad, b_pad};

    // The batch.
    auto mem = model.make_memory(mem_len, 0);
    mem.reset(2, Q);
    std::vector<std::vector<double>> batch_logits(std::size_t(2 * T));  // [b][position]
    for (index_t s = 0; s < S; ++s) {
        const auto t = segment_of(toks, s * Q, Q);
        const auto p = segment_of(pads, s * Q, Q);
        model.forward(t, 2, mem, p);
        CHECK(all_finite(model));
        for (index_t i = 0; i < Q; ++i)
            for (index_t b = 0; b < 2; ++b) batch_logits[std::size_t(b * T + s * Q + i)] = logits_row(model, i * 2 + b);
        model.update_memory(mem);
    }
    CHECK(mem.has_padding());

    // A alone, the same segments.
    {
        auto m1 = model.make_memory(mem_len, 0);
        m1.reset(1, Q);
        for (index_t s = 0; s < S; ++s) {
            std::vector<token_t> t(a.begin() + s * Q, a.begin() + s * Q + Q);
            model.forward(t, 1, m1);
            for (index_t i = 0; i < Q; ++i) CHECK(max_diff(logits_row(model, i), batch_logits[std::size_t(s * Q + i)]) < 1e-12);
            model.update_memory(m1);
        }
    }
    // B alone: its real positions [lead, T) cut at the same segment boundaries (segments of 2 and 3).
    {
        auto m1 = model.make_memory(mem_len, 0);
        m1.reset(1, Q);
        index_t pos = lead;
        while (pos < T) {
            const index_t end = std::min(T, (pos / Q + 1) * Q);
            std::vector<token_t> t(b_row.begin() + pos, b_row.begin() + end);
            model.forward(t, 1, m1);
            for (index_t i = 0; i < end - pos; ++i)
                CHECK(max_diff(logits_row(model, i), batch_logits[std::size_t(T + pos + i)]) < 1e-12);
            model.update_memory(m1);
            pos = end;
        }
    }
}

/// A right-padded batch with compression over backend B equals each document alone; padding adds no loss.
template <class B>
void right_padded_batch() {
    const index_t vocab = 7, Q = 3, S = 3, T = Q * S;
    model_on<B> model({.vocab = vocab, .n_layers = 2, .d_ff = 6, .n_pos = 32});
    randomize_model(model.parameters(), 5);
    const auto a = random_tokens(T, vocab, 20);
    auto b_row = random_tokens(T, vocab, 21);
    const index_t b_len = 5;
    pad_t a_pad(std::size_t(T), 0), b_pad(std::size_t(T), 0);
    for (index_t i = b_len; i < T; ++i) b_pad[std::size_t(i)] = 1;
    std::vector<std::vector<token_t>> toks = {a, b_row};
    std::vector<pad_t> pads = {a_pad, b_pad};
    const index_t mem_len = 2, c_mem_len = 4;

    auto mem = model.make_memory(mem_len, c_mem_len);
    mem.reset(2, Q);
    std::vector<std::vector<double>> batch_logits(std::size_t(2 * T));
    for (index_t s = 0; s < S; ++s) {
        model.forward(segment_of(toks, s * Q, Q), 2, mem, segment_of(pads, s * Q, Q));
        CHECK(all_finite(model));
        for (index_t i = 0; i < Q; ++i)
            for (index_t b = 0; b < 2; ++b) batch_logits[std::size_t(b * T + s * Q + i)] = logits_row(model, i * 2 + b);
        model.update_memory(mem);
    }
    REQUIRE(mem.c_mem_slots() > 0);
    for (int doc = 0; doc < 2; ++doc) {
        const auto& row = toks[std::size_t(doc)];
        const index_t len = doc == 0 ? T : b_len;
        auto m1 = model.make_memory(mem_len, c_mem_len);
        m1.reset(1, Q);
        for (index_t pos = 0; pos < len; pos += Q) {
            const index_t end = std::min(len, pos + Q);
            std::vector<token_t> t(row.begin() + pos, row.begin() + end);
            model.forward(t, 1, m1);
            for (index_t i = 0; i < end - pos; ++i)
                CHECK(max_diff(logits_row(model, i), batch_logits[std::size_t(doc * T + pos + i)]) < 1e-12);
            model.update_memory(m1);
        }
    }

    // {A, a fully padded row} against {A} alone: the same CE, reconstruction loss and gradients.
    auto& ps = model.parameters();
    auto m2 = model.make_memory(mem_len, c_mem_len), m1 = model.make_memory(mem_len, c_mem_len);
    m2.reset(2, Q);
    m1.reset(1, Q);
    const auto junk = random_tokens(T, vocab, 22);
    std::vector<std::vector<token_t>> toks2 = {a, junk};
    std::vector<pad_t> pads2 = {a_pad, pad_t(std::size_t(T), 1)};
    for (index_t s = 0; s < S; ++s) {
        const auto t2 = segment_of(toks2, s * Q, Q);
        const auto p2 = segment_of(pads2, s * Q, Q);
        std::vector<token_t> tgt2(std::size_t(2 * Q), -1);
        std::vector<token_t> t1(a.begin() + s * Q, a.begin() + s * Q + Q), tgt1(static_cast<std::size_t>(Q), 0);
        for (index_t i = 0; i < Q; ++i) {
            tgt1[std::size_t(i)] = a[std::size_t((s * Q + i + 1) % T)];
            tgt2[std::size_t(i * 2)] = tgt1[std::size_t(i)];  // the padded row's targets stay −1
        }
        ps.zero_grad();
        const auto l2 = model.train_segment(t2, tgt2, 2, m2, p2);
        const std::vector<double> g2 = all_grads(model);
        std::vector<double> lg2;
        for (index_t i = 0; i < Q; ++i) {
            const auto r = logits_row(model, i * 2);
            lg2.insert(lg2.end(), r.begin(), r.end());
        }
        ps.zero_grad();
        const auto l1 = model.train_segment(t1, tgt1, 1, m1);
        const std::vector<double> g1 = all_grads(model);
        const std::vector<double> lg1 = all_logits(model);
        INFO("segment " << s);
        CHECK(l2.compressed == l1.compressed);
        CHECK(std::abs(l2.ce - l1.ce) < 1e-12);
        CHECK(std::abs(l2.ar - l1.ar) < 1e-12);
        if (s > 0) CHECK(l1.ar > 0);
        CHECK(max_diff(lg2, lg1) < 1e-12);
        CHECK(max_diff(g2, g1) < 1e-11);
    }
}

}  // namespace

#ifdef MNEMO_TEST_CUDA  // tests/cuda: the equivalences on the GPU
TEST_CASE("padding on the GPU: left-padded Transformer-XL batch equals each document alone at its real positions") {
    left_padded_batch<mnemo::cuda>();
}
TEST_CASE("padding on the GPU: right-padded batch with compression equals each document alone; padding adds no loss") {
    right_padded_batch<mnemo::cuda>();
}
#else
TEST_CASE("padding: left-padded Transformer-XL batch equals each document alone at its real positions") {
    left_padded_batch<mnemo::cpu>();
}
TEST_CASE("padding: right-padded batch with compression equals each document alone; padding adds no loss") {
    right_padded_batch<mnemo::cpu>();
}
TEST_CASE("padding over the fenced backend: both batch-against-documents equivalences") {
    left_padded_batch<mnemo::fenced>();
    right_padded_batch<mnemo::fenced>();
}

TEST_CASE("padding: a padded key gets exactly zero attention weight; a row with no real key is zero, not NaN") {
    constexpr std::size_t D = 8;
    const index_t B = 2, Q = 3, M = 2, K = M + Q, H = 2;
    mnemo::parameter_set<double> ps;
    mnemo::relative_attention<double, tiny> attn(ps, "attn", 8);
    ps.allocate();
    randomize_model(ps, 7);
    auto zq = random_vector<double>(Q * B * index_t(D), 8), zkv = random_vector<double>(K * B * index_t(D), 9);
    std::vector<double> out(std::size_t(Q * B * index_t(D)));
    // Key rows position·B + b: b = 0 has key 1 and key 3 padded; b = 1 has every key but the last padded.
    pad_t pad(std::size_t(K * B), 0);
    pad[1 * B + 0] = pad[3 * B + 0] = 1;
    for (index_t j = 0; j < K - 1; ++j) pad[std::size_t(j * B + 1)] = 1;
    attn.set_key_padding(pad.data());
    attn.forward(view<const double, D>(zq.data(), Q * B), view<const double, D>(zkv.data(), K * B), B,
                 view<double, D>(out.data(), Q * B));
    const double* w = attn.attention_weights();
    for (index_t b = 0; b < B; ++b)
        for (index_t h = 0; h < H; ++h)
            for (index_t i = 0; i < Q; ++i) {
                const double* row = w + ((b * H + h) * Q + i) * K;
                double sum = 0;
                bool any_real = false;
                for (index_t j = 0; j < K; ++j) {
                    CHECK(std::isfinite(row[j]));
                    if (pad[std::size_t(j * B + b)] || j > M + i) CHECK(row[j] == 0.0);
                    else any_real = true;
                    sum += row[j];
                }
                if (any_real) CHECK(sum == doctest::Approx(1.0).epsilon(1e-12));
                else CHECK(sum == 0.0);
            }
    // b = 1's first two queries see only padded keys: their output is the output projection's bias.
    const double* bo = attn.output().bias().value();
    for (index_t i = 0; i < 2; ++i)
        for (index_t f = 0; f < index_t(D); ++f) CHECK(out[std::size_t((i * B + 1) * index_t(D) + f)] == bo[f]);
    for (double x : out) CHECK(std::isfinite(x));
}

TEST_CASE("padding: the memory's pad flags shift with the memory; a compressed slot is padding iff all its sources are") {
    constexpr std::size_t D = 1;
    mnemo::compressive_memory<double, D> mem(1, /*mem_len=*/2, /*c_mem_len=*/3, /*rate=*/2);
    mem.reset(2, 4);
    std::vector<double> x(8, 0.0);
    auto push = [&](const pad_t& p) {
        return mem.merge([&](index_t) { return view<const double, D>(x.data(), 8); },
                         [](index_t, view<const double, D>, view<double, D>) {}, p.data());
    };
    // Slots 0..3, batch 2 (rows slot·2 + b): b = 0 pads slot 0; b = 1 pads slots 0 and 1.
    CHECK(push({1, 1, 0, 1, 0, 0, 0, 0}) == 2);
    REQUIRE(mem.c_mem_slots() == 1);
    CHECK(mem.c_mem_pad()[0] == 0);  // b = 0: slots 0 (pad), 1 (real) → real
    CHECK(mem.c_mem_pad()[1] == 1);  // b = 1: both padding
    CHECK(mem.compressed_away_pad()[0] == 1);
    CHECK(mem.compressed_away_pad()[3] == 1);
    REQUIRE(mem.mem_slots() == 2);
    for (index_t r = 0; r < 4; ++r) CHECK(mem.mem_pad()[r] == 0);
    CHECK(mem.has_padding());
    // No flags: new slots are real.
    CHECK(mem.merge([&](index_t) { return view<const double, D>(x.data(), 4); },
                    [](index_t, view<const double, D>, view<double, D>) {}) == 2);
    CHECK(mem.c_mem_slots() == 2);
    CHECK(mem.c_mem_pad()[2] == 0);
    CHECK(mem.c_mem_pad()[3] == 0);
    CHECK(mem.c_mem_pad()[1] == 1);
}

TEST_CASE("padding: the model's gradient with a pad mask matches finite differences") {
    const index_t B = 2, Q = 3, vocab = 7;
    model_t model({.vocab = vocab, .n_layers = 2, .d_ff = 6, .n_pos = 16});
    randomize_model(model.parameters(), 13);
    auto mem = model.make_memory(/*mem_len=*/3, /*c_mem_len=*/2);
    mem.reset(B, Q);
    // b = 1 starts with two padded positions (left padding), so the memory and the compressed memory
    // hold padded slots; b = 0 ends with a padded position in the checked segment.
    const pad_t p0 = {0, 1, 0, 1, 0, 0}, p1 = {0, 0, 0, 0, 0, 0};
    for (int s = 0; s < 2; ++s) {
        auto t = random_tokens(Q * B, vocab, 20 + s);
        model.forward(t, B, mem, s == 0 ? p0 : p1);
        model.update_memory(mem);
    }
    REQUIRE(mem.mem_slots() > 0);
    REQUIRE(mem.c_mem_slots() > 0);
    auto tokens = random_tokens(Q * B, vocab, 30), targets = random_tokens(Q * B, vocab, 31);
    const pad_t pad = {0, 0, 0, 1, 1, 0};
    for (index_t r = 0; r < Q * B; ++r)
        if (pad[std::size_t(r)]) targets[std::size_t(r)] = -1;
    auto loss = [&] {
        model.forward(tokens, B, mem, pad);
        return model.cross_entropy(targets, false);
    };
    auto& ps = model.parameters();
    ps.zero_grad();
    model.forward(tokens, B, mem, pad);
    CHECK(model.last_forward_padded());
    model.cross_entropy(targets, true);
    model.backward(tokens);
    auto tg = parameter_targets(ps);
    std::erase_if(tg, [](const auto& t) { return t.name.find("compress") != std::string::npos; });
    check_gradients(loss, tg);
}

TEST_CASE("padding: the reconstruction loss with padding matches finite differences and skips padded rows") {
    const index_t B = 2, Q = 2, vocab = 5;
    model_t model({.vocab = vocab, .n_layers = 2, .d_ff = 6, .n_pos = 16});
    randomize_model(model.parameters(), 41);
    auto mem = model.make_memory(2, 4);
    mem.reset(B, Q);
    auto t0 = random_tokens(Q * B, vocab, 42), t1 = random_tokens(Q * B, vocab, 43);
    model.forward(t0, B, mem, pad_t{0, 1, 0, 0});  // b = 1's first slot is padding
    REQUIRE(model.update_memory(mem) == 0);
    model.forward(t1, B, mem, pad_t{0, 0, 1, 0});  // b = 0's second query is padding
    REQUIRE(model.update_memory(mem) == 2);
    auto& ps = model.parameters();
    ps.zero_grad();
    const double ar = model.reconstruction_loss(mem, true);
    CHECK(ar > 0);
    CHECK(std::isfinite(ar));
    auto loss = [&] { return model.reconstruction_loss(mem, false); };
    auto targets = parameter_targets(ps);
    std::erase_if(targets, [](const auto& t) { return t.name.find(".compress.") == std::string::npos; });
    REQUIRE(targets.size() == 4);
    check_gradients(loss, targets);
}

TEST_CASE("padding: an all-zero mask is bitwise the same as no mask") {
    const index_t B = 2, Q = 3, vocab = 7;
    std::vector<double> logits[2], grads[2];
    for (int with_mask = 0; with_mask < 2; ++with_mask) {
        model_t model({.vocab = vocab, .n_layers = 2, .d_ff = 6, .n_pos = 16});
        randomize_model(model.parameters(), 17);
        auto mem = model.make_memory(2, 3);
        mem.reset(B, Q);
        for (int s = 0; s < 4; ++s) {
            auto t = random_tokens(Q * B, vocab, 60 + s), g = random_tokens(Q * B, vocab, 70 + s);
            model.parameters().zero_grad();
            if (with_mask) model.train_segment(t, g, B, mem, pad_t(std::size_t(Q * B), 0));
            else model.train_segment(t, g, B, mem);
        }
        logits[with_mask].assign(model.logits().data(), model.logits().data() + model.logits().size());
        grads[with_mask].assign(model.parameters().grads(), model.parameters().grads() + model.parameters().size());
    }
    CHECK(logits[0] == logits[1]);
    CHECK(grads[0] == grads[1]);
}

TEST_CASE("padding: a steady-state training step with a pad mask allocates nothing") {
    using f_model = mnemo::compressive_transformer<float, mnemo::config<16, 2, 2>>;
    const index_t B = 3, Q = 4, vocab = 11;
    f_model model({.vocab = vocab, .n_layers = 2, .d_ff = 32, .n_pos = 64});
    model.reset_parameters(1);
    auto mem = model.make_memory(4, 6);
    mem.reset(B, Q);
    auto tokens = random_tokens(Q * B, vocab, 1), targets = random_tokens(Q * B, vocab, 2);
    pad_t pad(std::size_t(Q * B), 0);
    for (index_t i = 0; i < 2; ++i) pad[std::size_t(i * B + 1)] = 1;  // b = 1 left-padded by 2
    for (index_t r = 0; r < Q * B; ++r)
        if (pad[std::size_t(r)]) targets[std::size_t(r)] = -1;
    model.set_clamp_len(3);
    for (int s = 0; s < 6; ++s) {  // grow every buffer: memory full, compressing every step
        model.parameters().zero_grad();
        model.train_segment(tokens, targets, B, mem, pad);
    }
    const long n = mnemo::testing::count_allocations([&] {
        for (int s = 0; s < 3; ++s) {
            model.parameters().zero_grad();
            model.train_segment(tokens, targets, B, mem, pad);
            model.eval_segment(tokens, targets, B, mem, pad);
        }
    });
    CHECK(n == 0);
}

// ---- clamp_len ----

namespace {
// Plain-loop relative attention (the formula of nn/attention/relative.hpp) with clamp_len.
std::vector<double> reference_attention(const mnemo::relative_attention<double, tiny>& attn, const std::vector<double>& zq,
                                        const std::vector<double>& zkv, index_t B, index_t clamp) {
    const index_t D = 8, H = 2, Dk = 4, P = attn.n_pos();
    const index_t Q = index_t(zq.size()) / (B * D), K = index_t(zkv.size()) / (B * D), M = K - Q;
    auto lin = [&](const mnemo::linear<double, 8, 8>& l, const double* x, bool bias, double* y) {
        for (index_t o = 0; o < D; ++o) {
            double s = bias ? l.bias().value()[o] : 0.0;
            for (index_t i = 0; i < D; ++i) s += l.weight().value()[o * D + i] * x[i];
            y[o] = s;
        }
    };
    std::vector<double> q(std::size_t(Q * B * D)), k(std::size_t(K * B * D)), v(std::size_t(K * B * D));
    for (index_t r = 0; r < Q * B; ++r) lin(attn.query(), &zq[std::size_t(r * D)], false, &q[std::size_t(r * D)]);
    for (index_t r = 0; r < K * B; ++r) {
        lin(attn.key(), &zkv[std::size_t(r * D)], false, &k[std::size_t(r * D)]);
        lin(attn.value(), &zkv[std::size_t(r * D)], true, &v[std::size_t(r * D)]);
    }
    const double* R = attn.key_pos_embeddings().value();
    const double* Sb = attn.key_pos_bias().value();
    const double* u = attn.query_pos_bias().value();
    std::vector<double> ctx(std::size_t(Q * B * D), 0.0), out(std::size_t(Q * B * D));
    for (index_t b = 0; b < B; ++b)
        for (index_t h = 0; h < H; ++h)
            for (index_t i = 0; i < Q; ++i) {
                const double* qi = &q[std::size_t((i * B + b) * D + h * Dk)];
                std::vector<double> s(std::size_t(M + i + 1));
                double mx = -1e300;
                for (index_t j = 0; j <= M + i; ++j) {
                    const double* kj = &k[std::size_t((j * B + b) * D + h * Dk)];
                    index_t delta = M + i - j;
                    if (clamp > 0) delta = std::min(delta, clamp);
                    const index_t row = P - delta;
                    double sc = Sb[row * H + h];
                    for (index_t d = 0; d < Dk; ++d) sc += (qi[d] + u[h * Dk + d]) * kj[d] + qi[d] * R[(row * H + h) * Dk + d];
                    s[std::size_t(j)] = sc / std::sqrt(double(Dk));
                    mx = std::max(mx, s[std::size_t(j)]);
                }
                double z = 0;
                for (auto& e : s) z += (e = std::exp(e - mx));
                for (index_t j = 0; j <= M + i; ++j)
                    for (index_t d = 0; d < Dk; ++d)
                        ctx[std::size_t((i * B + b) * D + h * Dk + d)] +=
                            s[std::size_t(j)] / z * v[std::size_t((j * B + b) * D + h * Dk + d)];
            }
    for (index_t r = 0; r < Q * B; ++r) lin(attn.output(), &ctx[std::size_t(r * D)], true, &out[std::size_t(r * D)]);
    return out;
}
}  // namespace

TEST_CASE("clamp_len: a small clamp_len equals a plain-loop reference; a large one is bitwise off") {
    constexpr std::size_t D = 8;
    const index_t B = 2, Q = 3, M = 4, K = M + Q;
    mnemo::parameter_set<double> ps;
    mnemo::relative_attention<double, tiny> attn(ps, "attn", 10);
    ps.allocate();
    randomize_model(ps, 19);
    const auto zq = random_vector<double>(Q * B * index_t(D), 20), zkv = random_vector<double>(K * B * index_t(D), 21);
    std::vector<double> out(zq.size()), off(zq.size());
    auto run = [&](index_t clamp, std::vector<double>& o) {
        attn.set_clamp_len(clamp);
        attn.forward(view<const double, D>(zq.data(), Q * B), view<const double, D>(zkv.data(), K * B), B,
                     view<double, D>(o.data(), Q * B));
    };
    run(0, off);
    CHECK(max_diff(off, reference_attention(attn, zq, zkv, B, 0)) < 1e-12);
    for (index_t clamp : {1, 2, 4}) {
        run(clamp, out);
        INFO("clamp_len " << clamp);
        CHECK(max_diff(out, reference_attention(attn, zq, zkv, B, clamp)) < 1e-12);
        CHECK(max_diff(out, off) > 1e-6);
    }
    for (index_t clamp : {K - 1, K, index_t(100)}) {
        run(clamp, out);
        CHECK(out == off);  // bitwise
    }
}

TEST_CASE("clamp_len: larger than every distance leaves a training step bitwise unchanged") {
    const index_t B = 2, Q = 3, vocab = 7;
    std::vector<double> logits[2], grads[2];
    for (int clamp = 0; clamp < 2; ++clamp) {
        model_t model({.vocab = vocab, .n_layers = 2, .d_ff = 6, .n_pos = 16});
        randomize_model(model.parameters(), 23);
        if (clamp) model.set_clamp_len(2 + 3 + 3);  // c_mem + mem + Q: every distance is below
        auto mem = model.make_memory(3, 2);
        mem.reset(B, Q);
        for (int s = 0; s < 4; ++s) {
            auto t = random_tokens(Q * B, vocab, 80 + s), g = random_tokens(Q * B, vocab, 90 + s);
            model.parameters().zero_grad();
            model.train_segment(t, g, B, mem);
        }
        logits[clamp].assign(model.logits().data(), model.logits().data() + model.logits().size());
        grads[clamp].assign(model.parameters().grads(), model.parameters().grads() + model.parameters().size());
    }
    CHECK(logits[0] == logits[1]);
    CHECK(grads[0] == grads[1]);
}

TEST_CASE("clamp_len: the gradient with clamping matches finite differences (and reaches the clamp_len row)") {
    const index_t B = 2, Q = 3, vocab = 7, P = 16, clamp = 2;
    model_t model({.vocab = vocab, .n_layers = 2, .d_ff = 6, .n_pos = P});
    randomize_model(model.parameters(), 29);
    model.set_clamp_len(clamp);
    auto mem = model.make_memory(3, 2);
    mem.reset(B, Q);
    for (int s = 0; s < 2; ++s) {
        auto t = random_tokens(Q * B, vocab, 40 + s);
        model.forward(t, B, mem, pad_t{0, 0, 1, 0, 0, 0});
        model.update_memory(mem);
    }
    auto tokens = random_tokens(Q * B, vocab, 50), targets = random_tokens(Q * B, vocab, 51);
    auto loss = [&] {
        model.forward(tokens, B, mem);
        return model.cross_entropy(targets, false);
    };
    auto& ps = model.parameters();
    ps.zero_grad();
    model.forward(tokens, B, mem);
    model.cross_entropy(targets, true);
    model.backward(tokens);
    // Rows P − δ for δ > clamp_len are never read: their gradient is exactly zero.
    const auto* s_bias = ps.find("transformer.layers.1.self_attn.key_pos_bias");
    for (index_t row = 0; row < P - clamp; ++row)
        for (index_t h = 0; h < 2; ++h) CHECK(ps.grads()[s_bias->offset + row * 2 + h] == 0.0);
    CHECK(ps.grads()[s_bias->offset + (P - clamp) * 2] != 0.0);
    auto tg = parameter_targets(ps);
    std::erase_if(tg, [](const auto& t) { return t.name.find("compress") != std::string::npos; });
    check_gradients(loss, tg);
}

// ---- evaluation with memory lengths other than the training ones ----

TEST_CASE("evaluation memory: mem_len twice the training one runs and differs; too long for P is an error") {
    const index_t B = 2, Q = 3, vocab = 7, P = 16;
    model_t model({.vocab = vocab, .n_layers = 2, .d_ff = 6, .n_pos = P});
    randomize_model(model.parameters(), 31);
    auto run = [&](index_t mem_len, index_t c_mem_len) {
        auto mem = model.make_memory(mem_len, c_mem_len);
        mem.reset(B, Q);
        double ce = 0;
        for (int s = 0; s < 8; ++s) {
            auto t = random_tokens(Q * B, vocab, 100 + s), g = random_tokens(Q * B, vocab, 110 + s);
            ce = model.eval_segment(t, g, B, mem).ce;
        }
        return std::pair{ce, std::vector<double>(model.logits().data(), model.logits().data() + model.logits().size())};
    };
    const auto [ce1, l1] = run(3, 2);  // "training" lengths
    const auto [ce2, l2] = run(6, 2);  // twice the memory
    CHECK(std::isfinite(ce2));
    CHECK(ce1 != ce2);
    CHECK(max_diff(l1, l2) > 1e-6);
    // c_mem + mem + Q > P: a clear error naming n_pos.
    CHECK_THROWS_WITH_AS(run(14, 4), doctest::Contains("n_pos"), mnemo::error);
}
#endif
