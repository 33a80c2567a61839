// models/autoregressive.hpp: sample_token (greedy, temperature, top-k, top-p, validation, no
// allocation) and autoregressive_wrapper (train_sequence / eval_sequence against hand-run segments,
// bit for bit; generate against hand-run forward / update_memory loops; end token; steady-state
// allocation).
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include <mnemo/models/autoregressive.hpp>
#include <mnemo/models/compressive_transformer.hpp>
#include <mnemo/train/optimizer.hpp>

#include "allocation_counter.hpp"
#include "gradcheck.hpp"

using mnemo::index_t;
using mnemo::sampling_options;
using mnemo::token_t;
using mnemo::testing::random_tokens;
using mnemo::testing::random_vector;
using mnemo::testing::randomize_model;
using mnemo::testing::same_bits;

namespace {

template <class T>
token_t sample(const std::vector<T>& logits, const sampling_options& o, mnemo::rng& r, mnemo::sampling_scratch& s) {
    return mnemo::sample_token<T>(std::span<const T>(logits), o, r, s);
}

template <class T>
index_t argmax(const T* p, index_t n) {
    return index_t(std::max_element(p, p + n) - p);
}

/// softmax(logits / temperature) restricted to `keep` (others 0), renormalised.
template <class T>
std::vector<double> expected_probs(const std::vector<T>& logits, double temperature, const std::vector<index_t>& keep) {
    std::vector<double> p(logits.size(), 0.0);
    double top = -std::numeric_limits<double>::infinity(), sum = 0;
    for (index_t i : keep) top = std::max(top, double(logits[std::size_t(i)]) / temperature);
    for (index_t i : keep) sum += p[std::size_t(i)] = std::exp(double(logits[std::size_t(i)]) / temperature - top);
    for (auto& x : p) x /= sum;
    return p;
}

/// Draws n samples; checks every draw lies where expected > 0 and every frequency is within 5 sigma
/// (plus a small floor) of the expected probability.
template <class T>
void check_frequencies(const std::vector<T>& logits, const sampling_options& o, const std::vector<double>& expected,
                       std::uint64_t seed, int n = 40000) {
    mnemo::rng r(seed);
    mnemo::sampling_scratch s;
    std::vector<int> count(logits.size(), 0);
    int outside = 0;
    for (int i = 0; i < n; ++i) {
        const token_t t = sample(logits, o, r, s);
        if (t < 0 || t >= token_t(logits.size())) ++outside;
        else ++count[std::size_t(t)];
    }
    CHECK(outside == 0);
    for (std::size_t i = 0; i < logits.size(); ++i) {
        const double f = double(count[i]) / n, p = expected[i];
        INFO("token " << i << ": frequency " << f << ", expected " << p);
        if (p == 0) CHECK(count[i] == 0);
        else CHECK(std::abs(f - p) <= 5 * std::sqrt(p * (1 - p) / n) + 1e-4);
    }
}

}  // namespace

TEST_CASE_TEMPLATE("sample_token: greedy is argmax (lowest index on ties) and draws no random number", T, float, double) {
    mnemo::sampling_scratch s;
    for (std::uint64_t seed = 1; seed <= 20; ++seed) {
        const auto logits = random_vector<T>(17, seed, -3, 3);
        mnemo::rng r(seed);
        sampling_options o;
        o.greedy = true;
        o.temperature = 0.3;  // ignored by greedy, but must be valid
        CHECK(sample(logits, o, r, s) == token_t(argmax(logits.data(), 17)));
        CHECK(r.offset() == 0);
    }
    const std::vector<T> tie = {0, 2, -1, 2, 2};
    mnemo::rng r(3);
    CHECK(sample(tie, {.greedy = true}, r, s) == 1);
}

TEST_CASE_TEMPLATE("sample_token: top_k = 1 is argmax at any temperature", T, float, double) {
    mnemo::sampling_scratch s;
    mnemo::rng r(5);
    for (std::uint64_t seed = 1; seed <= 10; ++seed) {
        const auto logits = random_vector<T>(23, 100 + seed, -2, 2);
        const token_t best = token_t(argmax(logits.data(), 23));
        for (double t : {1e-3, 0.5, 1.0, 10.0, 1e6})
            for (int i = 0; i < 20; ++i) CHECK(sample(logits, {.temperature = t, .top_k = 1}, r, s) == best);
    }
    const std::vector<T> tie = {1, 4, 0, 4};
    for (int i = 0; i < 50; ++i) CHECK(sample(tie, {.temperature = 100, .top_k = 1}, r, s) == 1);
}

TEST_CASE_TEMPLATE("sample_token: top_k keeps the k largest and samples their renormalised softmax", T, float, double) {
    const std::vector<T> logits = {0.3f, -1.0f, 1.2f, 0.9f, -0.2f, 1.0f, -2.0f, 0.1f};
    // Top 3: indices 2 (1.2), 5 (1.0), 3 (0.9).
    check_frequencies(logits, {.temperature = 0.7, .top_k = 3}, expected_probs(logits, 0.7, {2, 5, 3}), 11);
    check_frequencies(logits, {.temperature = 1.0, .top_k = 5}, expected_probs(logits, 1.0, {2, 5, 3, 0, 7}), 12);
    // k ≥ vocab is the full distribution.
    check_frequencies(logits, {.temperature = 1.3, .top_k = 8}, expected_probs(logits, 1.3, {0, 1, 2, 3, 4, 5, 6, 7}), 13);
    check_frequencies(logits, {.temperature = 1.3, .top_k = 100}, expected_probs(logits, 1.3, {0, 1, 2, 3, 4, 5, 6, 7}), 14);
    // Ties at the boundary: the lower indices are kept, the same every time.
    const std::vector<T> tie = {1, 3, 0, 3, 3, 2};
    check_frequencies(tie, {.temperature = 1.0, .top_k = 2}, expected_probs(tie, 1.0, {1, 3}), 15, 4000);
    check_frequencies(tie, {.temperature = 1.0, .top_k = 4}, expected_probs(tie, 1.0, {1, 3, 4, 5}), 16, 4000);
}

TEST_CASE_TEMPLATE("sample_token: top_p keeps exactly the nucleus", T, float, double) {
    // Probabilities 0.05, 0.5, 0.15, 0.3 (sorted: 1, 3, 2, 0; cumulative 0.5, 0.8, 0.95, 1).
    const std::vector<T> logits = {T(std::log(0.05)), T(std::log(0.5)), T(std::log(0.15)), T(std::log(0.3))};
    check_frequencies(logits, {.top_p = 0.7}, expected_probs(logits, 1.0, {1, 3}), 21);
    check_frequencies(logits, {.top_p = 0.85}, expected_probs(logits, 1.0, {1, 3, 2}), 22);
    check_frequencies(logits, {.top_p = 0.4}, expected_probs(logits, 1.0, {1}), 23, 2000);
    check_frequencies(logits, {.top_p = 0.97}, expected_probs(logits, 1.0, {1, 3, 2, 0}), 24);
    // After top_k = 2 the distribution is 0.625, 0.375: top_p 0.6 keeps one, 0.7 keeps both.
    check_frequencies(logits, {.top_k = 2, .top_p = 0.6}, expected_probs(logits, 1.0, {1}), 25, 2000);
    check_frequencies(logits, {.top_k = 2, .top_p = 0.7}, expected_probs(logits, 1.0, {1, 3}), 26);
    // Temperature first: at T = 0.5 the probabilities ∝ p², 0.0025 0.25 0.0225 0.09 (sum 0.365):
    // 0.685, 0.247, ...: top_p 0.9 keeps {1, 3} (0.932).
    check_frequencies(logits, {.temperature = 0.5, .top_p = 0.9}, expected_probs(logits, 0.5, {1, 3}), 27);
    // A tiny top_p is argmax, even when the top is nearly flat.
    mnemo::sampling_scratch s;
    mnemo::rng r(28);
    const auto flat = random_vector<T>(50, 29, -0.01, 0.01);
    for (int i = 0; i < 200; ++i) CHECK(sample(flat, {.top_p = 1e-9}, r, s) == token_t(argmax(flat.data(), 50)));
}

TEST_CASE_TEMPLATE("sample_token: temperature samples softmax(logits / T); -inf logits are never drawn", T, float, double) {
    const std::vector<T> logits = {0.5f, -0.4f, 1.1f, 0.0f, -1.5f};
    for (double t : {0.5, 1.0, 2.5})
        check_frequencies(logits, {.temperature = t}, expected_probs(logits, t, {0, 1, 2, 3, 4}), 31);
    const T ninf = -std::numeric_limits<T>::infinity();
    const std::vector<T> masked = {0.2f, ninf, 1.0f, ninf, 0.7f};
    check_frequencies(masked, {.temperature = 1.5}, expected_probs(masked, 1.5, {0, 2, 4}), 32);
    check_frequencies(masked, {.top_k = 4}, expected_probs(masked, 1.0, {0, 2, 4}), 33);  // keeps a -inf: weight 0
    check_frequencies(masked, {.top_k = 4, .top_p = 0.999}, expected_probs(masked, 1.0, {0, 2, 4}), 34);
}

TEST_CASE_TEMPLATE("sample_token: one uniform draw per token, reproducible from the rng state", T, float, double) {
    const auto logits = random_vector<T>(30, 41, -2, 2);
    mnemo::sampling_scratch s;
    for (const sampling_options& o : {sampling_options{}, sampling_options{.top_k = 5}, sampling_options{.top_p = 0.8}}) {
        mnemo::rng a(42, 7), b(42, 7);
        for (int i = 0; i < 10; ++i) CHECK(sample(logits, o, a, s) == mnemo::sample_token<T>(std::span<const T>(logits), o, b));
        CHECK(a.offset() == 7 + 10 * 2);  // rng::uniform() consumes two 32-bit words
    }
}

TEST_CASE("sample_token: invalid options and logits are errors naming the parameter") {
    const std::vector<float> logits = {0.1f, 0.2f};
    mnemo::rng r(1);
    mnemo::sampling_scratch s;
    const double nan = std::numeric_limits<double>::quiet_NaN(), inf = std::numeric_limits<double>::infinity();
    for (double t : {0.0, -1.0, nan, inf})
        CHECK_THROWS_WITH_AS(sample(logits, {.temperature = t}, r, s), doctest::Contains("temperature"), mnemo::error);
    CHECK_THROWS_WITH_AS(sample(logits, {.temperature = 0, .greedy = true}, r, s), doctest::Contains("temperature"),
                         mnemo::error);
    CHECK_THROWS_WITH_AS(sample(logits, {.top_k = -1}, r, s), doctest::Contains("top_k must be >= 0"), mnemo::error);
    for (double p : {0.0, -0.5, 1.5, nan})
        CHECK_THROWS_WITH_AS(sample(logits, {.top_p = p}, r, s), doctest::Contains("top_p must be in (0, 1]"), mnemo::error);
    CHECK_THROWS_WITH_AS(sample(std::vector<float>{}, {}, r, s), doctest::Contains("logits are empty"), mnemo::error);
    CHECK_THROWS_WITH_AS(sample(std::vector<float>{0.f, float(nan)}, {}, r, s), doctest::Contains("logit 1 is nan"),
                         mnemo::error);
    CHECK_THROWS_WITH_AS(sample(std::vector<float>{float(inf)}, {}, r, s), doctest::Contains("logit 0 is inf"),
                         mnemo::error);
    CHECK_THROWS_WITH_AS(sample(std::vector<float>{-float(inf), -float(inf)}, {}, r, s),
                         doctest::Contains("every one of the 2 logits is -inf"), mnemo::error);
    CHECK_NOTHROW(sample(logits, {.temperature = 1e-6, .top_k = 0, .top_p = 1.0}, r, s));
}

TEST_CASE("sample_token: with a warm scratch, sampling performs no heap allocation") {
    const auto logits = random_vector<float>(500, 51, -3, 3);
    mnemo::rng r(52);
    mnemo::sampling_scratch s;
    const sampling_options opts[] = {{}, {.temperature = 0.8, .top_k = 40}, {.top_p = 0.9}, {.top_k = 50, .top_p = 0.5}};
    for (const auto& o : opts) sample(logits, o, r, s);  // warm-up
    CHECK(mnemo::testing::count_allocations([&] {
              for (int i = 0; i < 10; ++i)
                  for (const auto& o : opts) sample(logits, o, r, s);
          }) == 0);
}

// ── autoregressive_wrapper ───────────────────────────────────────────────────────────────────────

namespace {

using tiny = mnemo::config<8, 2, 2>;  // d_model 8, 2 heads, compression rate 2
constexpr index_t vocab = 7, seg_len = 3, mem_len = 3, c_mem_len = 2;
const mnemo::compressive_options model_options{.vocab = vocab, .n_layers = 2, .d_ff = 6, .n_pos = 32};

template <class T>
using model_t = mnemo::compressive_transformer<T, tiny>;

template <class Memory>
bool same_memory(const Memory& a, const Memory& b) {
    if (a.mem_slots() != b.mem_slots() || a.c_mem_slots() != b.c_mem_slots() || a.batch() != b.batch()) return false;
    for (index_t l = 0; l < a.n_layers(); ++l) {
        if (!same_bits(a.mem(l).data(), b.mem(l).data(), a.mem(l).size())) return false;
        if (!same_bits(a.c_mem(l).data(), b.c_mem(l).data(), a.c_mem(l).size())) return false;
    }
    return true;
}

bool same_losses(const mnemo::segment_losses& a, const mnemo::segment_losses& b) {
    return std::memcmp(&a.ce, &b.ce, sizeof(double)) == 0 && std::memcmp(&a.ar, &b.ar, sizeof(double)) == 0 &&
           a.compressed == b.compressed;
}

/// The segments by hand: inputs positions [start, start + len), targets one position later.
template <class T, class Memory, class After>
std::vector<mnemo::segment_losses> manual_segments(model_t<T>& model, const std::vector<token_t>& seq, index_t batch,
                                                   Memory& mem, bool train, After&& after) {
    const index_t n = index_t(seq.size()) / batch;
    std::vector<mnemo::segment_losses> out;
    for (index_t start = 0, s = 0; start < n - 1; start += seg_len, ++s) {
        const index_t len = std::min(seg_len, n - 1 - start);
        std::vector<token_t> in(seq.begin() + start * batch, seq.begin() + (start + len) * batch);
        std::vector<token_t> tg(seq.begin() + (start + 1) * batch, seq.begin() + (start + 1 + len) * batch);
        out.push_back(train ? model.train_segment(in, tg, batch, mem) : model.eval_segment(in, tg, batch, mem));
        after(s);
    }
    return out;
}

}  // namespace

TEST_CASE_TEMPLATE("autoregressive_wrapper: train_sequence is bitwise the hand-run segments, last one shorter", T,
                   float, double) {
    const index_t B = 2;
    for (index_t n_pos : {index_t(10), index_t(9), index_t(2)}) {  // segments 3+3+3, 3+3+2, 1
        CAPTURE(n_pos);
        model_t<T> a(model_options), b(model_options);
        randomize_model(a.parameters(), 3);
        randomize_model(b.parameters(), 3);
        auto seq = random_tokens(n_pos * B, vocab, 4);
        seq[std::size_t((n_pos - 1) * B + 1)] = -1;  // an ignored target (last position: never an input)

        auto mem_a = a.make_memory(mem_len, c_mem_len);
        mem_a.reset(B, seg_len);
        const auto expected = manual_segments<T>(a, seq, B, mem_a, true, [](index_t) {});

        mnemo::autoregressive_wrapper wrap(b, seg_len, mem_len, c_mem_len);
        auto mem_b = wrap.make_memory();
        const auto got = wrap.train_sequence(seq, B, mem_b);

        REQUIRE(got.size() == expected.size());
        CHECK(index_t(got.size()) == wrap.segment_count(n_pos));
        for (std::size_t s = 0; s < got.size(); ++s) CHECK(same_losses(got[s], expected[s]));
        CHECK(same_bits(a.parameters().grads(), b.parameters().grads(), a.parameters().size()));
        CHECK(same_memory(mem_a, mem_b));
        if (n_pos == 10) {
            CHECK(got[2].compressed > 0);  // the memory path, compression and AR loss were exercised
            CHECK(got[2].ar > 0);
        }
        if (n_pos == 9) CHECK(wrap.segment_length(2, n_pos) == 2);

        // A second sequence continues the same memory; gradients keep accumulating.
        const auto seq2 = random_tokens(7 * B, vocab, 5);
        const auto e2 = manual_segments<T>(a, seq2, B, mem_a, true, [](index_t) {});
        const auto g2 = wrap.train_sequence(seq2, B, mem_b);
        REQUIRE(g2.size() == e2.size());
        for (std::size_t s = 0; s < g2.size(); ++s) CHECK(same_losses(g2[s], e2[s]));
        CHECK(same_bits(a.parameters().grads(), b.parameters().grads(), a.parameters().size()));
    }
}

TEST_CASE_TEMPLATE("autoregressive_wrapper: an optimizer step per segment through after_segment", T, float, double) {
    const index_t B = 2, n_pos = 11;  // segments 3, 3, 3, 1
    model_t<T> a(model_options), b(model_options);
    randomize_model(a.parameters(), 6);
    randomize_model(b.parameters(), 6);
    const auto seq = random_tokens(n_pos * B, vocab, 7);
    mnemo::adamw<T> opt_a(a.parameters().size(), {.lr = 1e-2}), opt_b(b.parameters().size(), {.lr = 1e-2});

    auto mem_a = a.make_memory(mem_len, c_mem_len);
    mem_a.reset(B, seg_len);
    const auto expected = manual_segments<T>(a, seq, B, mem_a, true, [&](index_t) {
        opt_a.step(a.parameters());
        a.parameters().zero_grad();
    });

    mnemo::autoregressive_wrapper wrap(b, seg_len, mem_len, c_mem_len);
    auto mem_b = wrap.make_memory();
    std::vector<index_t> seen;
    const auto got = wrap.train_sequence(seq, B, mem_b, [&](index_t s, const mnemo::segment_losses& l) {
        seen.push_back(s);
        CHECK(l.ce > 0);
        opt_b.step(b.parameters());
        b.parameters().zero_grad();
    });
    CHECK(seen == std::vector<index_t>{0, 1, 2, 3});
    REQUIRE(got.size() == expected.size());
    for (std::size_t s = 0; s < got.size(); ++s) CHECK(same_losses(got[s], expected[s]));
    CHECK(same_bits(a.parameters().values(), b.parameters().values(), a.parameters().size()));
    CHECK(same_memory(mem_a, mem_b));
}

TEST_CASE_TEMPLATE("autoregressive_wrapper: eval_sequence is the hand-run eval segments, without gradients", T, float,
                   double) {
    const index_t B = 3, n_pos = 9;
    model_t<T> a(model_options), b(model_options);
    randomize_model(a.parameters(), 8);
    randomize_model(b.parameters(), 8);
    const auto seq = random_tokens(n_pos * B, vocab, 9);
    auto mem_a = a.make_memory(mem_len, c_mem_len);
    mem_a.reset(B, seg_len);
    std::vector<std::vector<T>> logits_a;
    const auto expected = manual_segments<T>(a, seq, B, mem_a, false, [&](index_t) {
        const auto l = a.logits();
        logits_a.emplace_back(l.data(), l.data() + l.size());
    });
    mnemo::autoregressive_wrapper wrap(b, seg_len, mem_len, c_mem_len);
    auto mem_b = wrap.make_memory();
    std::vector<std::vector<T>> logits_b;
    const auto got = wrap.eval_sequence(seq, B, mem_b, [&](index_t, const mnemo::segment_losses&) {
        const auto l = b.logits();
        logits_b.emplace_back(l.data(), l.data() + l.size());
    });
    REQUIRE(got.size() == expected.size());
    for (std::size_t s = 0; s < got.size(); ++s) CHECK(same_losses(got[s], expected[s]));
    CHECK(logits_a == logits_b);
    CHECK(same_memory(mem_a, mem_b));
    const auto& g = b.parameters();
    CHECK(std::all_of(g.grads(), g.grads() + g.size(), [](T x) { return x == T(0); }));
    CHECK(wrap.eval_sequence(seq, B, mem_b).size() == 3);  // the 3-argument form
}

TEST_CASE("autoregressive_wrapper: bad sequences and settings are clear errors") {
    model_t<float> m(model_options);
    randomize_model(m.parameters(), 1);
    CHECK_THROWS_WITH_AS(mnemo::autoregressive_wrapper(m, 0, 3, 2), doctest::Contains("seg_len must be at least 1"),
                         mnemo::error);
    CHECK_THROWS_WITH_AS(mnemo::autoregressive_wrapper(m, 3, 0, 4), doctest::Contains("mem_len = 0 is too short"),
                         mnemo::error);  // from the memory
    mnemo::autoregressive_wrapper wrap(m, seg_len, mem_len, c_mem_len);
    auto mem = wrap.make_memory();
    const std::vector<token_t> seq(10, 1);
    CHECK_THROWS_WITH_AS(wrap.train_sequence(seq, 3, mem), doctest::Contains("10 tokens do not form a whole number"),
                         mnemo::error);
    CHECK_THROWS_WITH_AS(wrap.train_sequence(std::span<const token_t>(seq).first(2), 2, mem),
                         doctest::Contains("at least 2 positions"), mnemo::error);
    CHECK_THROWS_WITH_AS(wrap.eval_sequence(seq, 0, mem), doctest::Contains("batch must be at least 1"), mnemo::error);
    auto other = m.make_memory(4, 2);
    CHECK_THROWS_WITH_AS(wrap.train_sequence(seq, 2, other), doctest::Contains("the memory has mem_len 4"), mnemo::error);
    // A non-empty memory of another batch: the model's own check.
    wrap.eval_sequence(seq, 2, mem);
    CHECK_THROWS_WITH_AS(wrap.eval_sequence(seq, 5, mem), doctest::Contains("batch"), mnemo::error);

    mnemo::rng r(1);
    const std::vector<token_t> prime = {1, 2};
    CHECK_THROWS_WITH_AS(wrap.generate({}, 3, {}, r), doctest::Contains("the prime is empty"), mnemo::error);
    CHECK_THROWS_WITH_AS(wrap.generate(prime, -1, {}, r), doctest::Contains("n_new must be >= 0"), mnemo::error);
    CHECK_THROWS_WITH_AS(wrap.generate(prime, 3, {}, r, token_t(vocab)), doctest::Contains("end_token 7 is outside"),
                         mnemo::error);
    CHECK_THROWS_WITH_AS(wrap.generate(prime, 3, {.top_p = 2}, r), doctest::Contains("top_p"), mnemo::error);
    CHECK_THROWS_WITH_AS(wrap.generate(std::vector<token_t>{1, 9}, 3, {}, r), doctest::Contains("token 9"), mnemo::error);
    CHECK(wrap.generate(prime, 0, {}, r).empty());
}

namespace {

/// Generation by hand: the prime in segments of seg_len, then one token per segment.
template <class T, class Pick>
std::vector<token_t> manual_generate(model_t<T>& model, const std::vector<token_t>& prime, index_t n_new, Pick&& pick) {
    auto mem = model.make_memory(mem_len, c_mem_len);
    mem.reset(1, seg_len);
    for (std::size_t i = 0; i < prime.size(); i += seg_len) {
        const std::vector<token_t> seg(prime.begin() + index_t(i),
                                       prime.begin() + index_t(std::min(prime.size(), i + seg_len)));
        model.forward(seg, 1, mem);
        model.update_memory(mem);
    }
    std::vector<token_t> out;
    for (index_t k = 0; k < n_new; ++k) {
        const auto l = model.logits();
        const token_t next = pick(l.row(l.rows() - 1), l.cols());
        out.push_back(next);
        if (k + 1 == n_new) break;
        model.forward(std::vector<token_t>{next}, 1, mem);
        model.update_memory(mem);
    }
    return out;
}

}  // namespace

TEST_CASE_TEMPLATE("autoregressive_wrapper: greedy and sampled generation equal the hand-run loop", T, float, double) {
    model_t<T> m(model_options);
    randomize_model(m.parameters(), 12, 1.0);
    mnemo::autoregressive_wrapper wrap(m, seg_len, mem_len, c_mem_len);
    const std::vector<token_t> prime = {1, 5, 2, 2, 0, 6, 3};  // segments 3, 3, 1
    const index_t n_new = 15;

    const auto expected = manual_generate<T>(m, prime, n_new, [](const T* row, index_t v) { return token_t(argmax(row, v)); });
    mnemo::rng r(1);
    const auto got = wrap.generate(prime, n_new, {.greedy = true}, r);
    CHECK(got == expected);
    CHECK(r.offset() == 0);
    CHECK(wrap.generation_memory().c_mem_slots() > 0);  // long enough to compress

    const sampling_options o{.temperature = 1.3, .top_k = 5, .top_p = 0.95};
    mnemo::rng r_manual(77);
    mnemo::sampling_scratch s;
    const auto expected_s = manual_generate<T>(m, prime, n_new, [&](const T* row, index_t v) {
        return mnemo::sample_token<T>(std::span<const T>(row, std::size_t(v)), o, r_manual, s);
    });
    mnemo::rng r_wrap(77);
    CHECK(wrap.generate(prime, n_new, o, r_wrap) == expected_s);
    CHECK(r_wrap.offset() == r_manual.offset());
}

TEST_CASE_TEMPLATE("autoregressive_wrapper: a prime longer than seg_len goes through the memory", T, float, double) {
    model_t<T> m(model_options), ref(model_options);
    randomize_model(m.parameters(), 13);
    randomize_model(ref.parameters(), 13);
    ref.cache_memory_projections(true);  // generate runs with the generation cache: the same arithmetic, bit for bit
    mnemo::autoregressive_wrapper wrap(m, seg_len, mem_len, c_mem_len);
    const auto prime = random_tokens(11, vocab, 14);  // segments 3, 3, 3, 2
    mnemo::rng r(1);
    const auto first = wrap.generate(prime, 1, {}, r);  // the last token is not fed: logits are the prime's
    REQUIRE(first.size() == 1);

    auto mem = ref.make_memory(mem_len, c_mem_len);
    mem.reset(1, seg_len);
    for (std::size_t i = 0; i < prime.size(); i += seg_len) {
        const std::vector<token_t> seg(prime.begin() + index_t(i), prime.begin() + index_t(std::min(prime.size(), i + seg_len)));
        ref.forward(seg, 1, mem);
        ref.update_memory(mem);
    }
    const auto la = m.logits(), lb = ref.logits();
    REQUIRE(la.rows() == 2);  // the last prime segment, not one 11-token window
    REQUIRE(lb.rows() == 2);
    CHECK(same_bits(la.data(), lb.data(), la.size()));
    CHECK(same_memory(wrap.generation_memory(), mem));
    CHECK(mem.c_mem_slots() > 0);

    // n_new = 0 still feeds the prime.
    model_t<T> m2(model_options);
    randomize_model(m2.parameters(), 13);
    mnemo::autoregressive_wrapper wrap2(m2, seg_len, mem_len, c_mem_len);
    CHECK(wrap2.generate(prime, 0, {}, r).empty());
    CHECK(same_bits(m2.logits().data(), lb.data(), lb.size()));
}

TEST_CASE_TEMPLATE("autoregressive_wrapper: generation stops at end_token, which is returned", T, float, double) {
    model_t<T> m(model_options);
    randomize_model(m.parameters(), 15, 1.0);
    mnemo::autoregressive_wrapper wrap(m, seg_len, mem_len, c_mem_len);
    const std::vector<token_t> prime = {4, 4, 1, 0};
    mnemo::rng r(2);
    const sampling_options o{.temperature = 2.0};
    const auto full = wrap.generate(prime, 30, o, r);
    REQUIRE(full.size() == 30);
    const token_t end = full[10];
    const auto stop = std::size_t(std::find(full.begin(), full.end(), end) - full.begin());
    mnemo::rng r2(2);
    const auto cut = wrap.generate(prime, 30, o, r2, end);
    CHECK(cut == std::vector<token_t>(full.begin(), full.begin() + index_t(stop) + 1));
    CHECK(cut.back() == end);
    // An end token that never comes changes nothing.
    for (token_t t = 0; t < vocab; ++t)
        if (std::find(full.begin(), full.end(), t) == full.end()) {
            mnemo::rng r3(2);
            CHECK(wrap.generate(prime, 30, o, r3, t) == full);
        }
    // generate_into writes into the caller's span.
    std::vector<token_t> out(40, -5);
    mnemo::rng r4(2);
    CHECK(wrap.generate_into(prime, std::span<token_t>(out).first(30), o, r4, end) == index_t(stop) + 1);
    CHECK(std::equal(cut.begin(), cut.end(), out.begin()));
    CHECK(out[stop + 1] == -5);
}

TEST_CASE_TEMPLATE("autoregressive_wrapper: Transformer-XL (no compression) generates and trains", T, float, double) {
    using xl_t = mnemo::compressive_transformer<T, tiny, mnemo::no_compression>;
    xl_t m(model_options);
    randomize_model(m.parameters(), 16);
    mnemo::autoregressive_wrapper wrap(m, seg_len, mem_len, 0);
    mnemo::rng r(3);
    const auto out = wrap.generate(std::vector<token_t>{1, 2, 3, 4, 5}, 8, {.top_k = 3}, r);
    CHECK(out.size() == 8);
    auto mem = wrap.make_memory();
    const auto l = wrap.train_sequence(random_tokens(10 * 2, vocab, 17), 2, mem);
    CHECK(l.size() == 3);
    CHECK(mem.mem_slots() == mem_len);
}

TEST_CASE("autoregressive_wrapper: steady-state generation performs no heap allocation") {
    model_t<float> m(model_options);
    randomize_model(m.parameters(), 18);
    mnemo::autoregressive_wrapper wrap(m, seg_len, mem_len, c_mem_len);
    const auto prime = random_tokens(8, vocab, 19);
    std::vector<token_t> out(20);
    const sampling_options o{.temperature = 0.9, .top_k = 4, .top_p = 0.9};
    mnemo::rng r(20);
    // Warm-up: buffers, memory and scratch grow here (the counter sees it).
    const long warm_up = mnemo::testing::count_allocations([&] { wrap.generate_into(prime, out, o, r); });
    if (mnemo::testing::allocations_counted) CHECK(warm_up > 0);
    long n = mnemo::testing::count_allocations([&] {
        for (int i = 0; i < 3; ++i) wrap.generate_into(prime, out, o, r);
    });
    CHECK(n == 0);
    // Greedy too, and a shorter prime.
    n = mnemo::testing::count_allocations([&] { wrap.generate_into(std::span<const token_t>(prime).first(4), out, {.greedy = true}, r); });
    CHECK(n == 0);
}
