// char_mlp: a character-level language model built from mnemo's foundation layers, trained end to end.
//
// The model (Bengio et al., 2003, with a pre-LN residual feed-forward block):
//   e = Embed(c_{t−K} … c_{t−1})            [B, K·D]   (the K embeddings side by side)
//   h = e·W_inᵀ + b_in                       [B, D]
//   h = h + FFN(LN(h))                       [B, D]     (feed-forward D → 4D → D, GELU)
//   logits = LN(h)·W_outᵀ + b_out            [B, vocab]
// trained on next-character cross-entropy with AdamW, global-norm clipping and a cosine schedule;
// validation in bits per character, a greedy sample, and a checkpoint round trip through safetensors.
//
//   char_mlp                         trains on a built-in text (no download)
//   char_mlp --data FILE             trains on any text file
//   options: --steps N (1500)  --batch B (64)  --lr LR (3e-3)  --seed S (1)  --checkpoint PATH
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <span>
#include <string>
#include <vector>

#include <mnemo/mnemo.hpp>
#include <mnemo/train/clip.hpp>
#include <mnemo/train/optimizer.hpp>
#include <mnemo/io/safetensors.hpp>
#include <mnemo/train/schedule.hpp>

namespace {

using mnemo::index_t;
using mnemo::token_t;
using mnemo::view;

constexpr std::size_t D = 64;        // d_model
constexpr std::size_t Ctx = 8;       // characters of context
constexpr std::size_t Dff = 4 * D;   // feed-forward width

// A deterministic built-in corpus: sentences from a small grammar, so the program needs no download
// and the loss has somewhere to fall to (the grammar's entropy is well below log2(vocab)).
std::string builtin_text() {
    const char* names[] = {"the king", "a fool", "the queen", "my lord", "the ghost", "a sailor", "the duke"};
    const char* verbs[] = {"speaks to", "laughs at", "follows", "remembers", "forgives", "betrays", "waits for"};
    const char* adjs[] = {"old", "quiet", "proud", "gentle", "strange", "weary", "noble"};
    const char* nouns[] = {"river", "castle", "stranger", "crown", "letter", "garden", "storm"};
    mnemo::rng r(2024);
    std::string text;
    while (text.size() < 200000) {
        auto pick = [&](const auto& arr) { return arr[r.next_u32() % std::size(arr)]; };
        text += pick(names);
        text += ' ';
        text += pick(verbs);
        text += " the ";
        text += pick(adjs);
        text += ' ';
        text += pick(nouns);
        text += (r.next_u32() % 4 == 0) ? ".\n" : ", and ";
    }
    return text;
}

std::string read_file(const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    MNEMO_CHECK(in.good(), "char_mlp: cannot open data file '", path, "'");
    std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    MNEMO_CHECK(!text.empty(), "char_mlp: data file '", path, "' is empty");
    return text;
}

struct model {
    mnemo::parameter_set<float> ps;
    mnemo::embedding<float, D> embed;
    mnemo::linear<float, Ctx * D, D> proj;
    mnemo::layer_norm<float, D> norm_ff;
    mnemo::feed_forward<float, D, Dff, mnemo::gelu> ff;
    mnemo::layer_norm<float, D> norm;
    mnemo::linear<float, D, mnemo::dynamic> generator;

    // Activations and their gradients for a batch (grown on demand, reused after: no allocation in
    // steady state).
    mnemo::buffer<float> e, h0, z, f, h1, hn, logits, losses, d_logits, d_hn, d_h1, d_z, d_h0, d_e;

    explicit model(index_t vocab)
        : embed(ps, "embed", vocab), proj(ps, "proj"), norm_ff(ps, "norm_ff"), ff(ps, "feed_forward"),
          norm(ps, "norm"), generator(ps, "generator", D, vocab, true) {
        ps.allocate();
    }
    index_t vocab() const { return embed.vocab(); }

    void init(std::uint64_t seed) {
        mnemo::rng r(seed);
        embed.reset_parameters(r);
        proj.reset_parameters(r);
        norm_ff.reset_parameters();
        ff.reset_parameters(r);
        norm.reset_parameters();
        generator.reset_parameters(r);
    }

    // Logits [b, vocab] of the next character after each context (contexts: b·Ctx tokens).
    view<float> forward(std::span<const token_t> contexts) {
        const index_t b = static_cast<index_t>(contexts.size() / Ctx), v = vocab();
        view<float, D> ev(e.ensure(b * index_t(Ctx * D)), b * index_t(Ctx));      // (B·K, D)
        view<float, Ctx * D> ecat(ev.data(), b);                                   // (B, K·D), same memory
        view<float, D> h0v(h0.ensure(b * D), b), zv(z.ensure(b * D), b), fv(f.ensure(b * D), b);
        view<float, D> h1v(h1.ensure(b * D), b), hnv(hn.ensure(b * D), b);
        view<float> lv(logits.ensure(b * v), b, v);                                // (B, vocab)
        embed.forward(contexts, ev);
        proj.forward(ecat, h0v);
        norm_ff.forward(h0v, zv);
        ff.forward(zv, fv);
        mnemo::residual<float, D>::forward(h0v, fv, h1v);
        norm.forward(h1v, hnv);
        generator.forward(hnv, lv);
        return lv;
    }

    // Mean cross-entropy (nats) of predicting targets from contexts; parameter gradients += when train.
    double step(std::span<const token_t> contexts, std::span<const token_t> targets, bool train) {
        using K = mnemo::ops<mnemo::cpu>;
        const index_t b = static_cast<index_t>(targets.size()), v = vocab();
        view<float> lv = forward(contexts);
        mnemo::check_targets(targets, v);
        view<float> dl(d_logits.ensure(b * v), b, v);
        float* rows = losses.ensure(b);
        K::cross_entropy_fused(b, v, lv.data(), v, targets.data(), rows, 1.0f / float(b), dl.data(), v);
        double loss = 0;
        for (index_t i = 0; i < b; ++i) loss += rows[i];
        loss /= double(b);
        if (!train) return loss;

        view<float, D> h0v(h0.data(), b), zv(z.data(), b), h1v(h1.data(), b), hnv(hn.data(), b);
        view<float, D> dhn(d_hn.ensure(b * D), b), dh1(d_h1.ensure(b * D), b), dz(d_z.ensure(b * D), b);
        view<float, D> dh0(d_h0.ensure(b * D), b), de(d_e.ensure(b * index_t(Ctx * D)), b * index_t(Ctx));
        generator.backward(hnv, dl, dhn);
        norm.backward(h1v, dhn, dh1);
        mnemo::residual<float, D>::backward(dh1, dh0, view<float, D>());  // stream: dh0 = dh1
        ff.backward(zv, dh1, dz);                                          // branch: dh1 is also dFFN
        norm_ff.backward(h0v, dz, dh0, /*accumulate_dx=*/true);            // dh0 += LN_ff backward
        proj.backward(view<float, Ctx * D>(e.data(), b), dh0, view<float, Ctx * D>(de.data(), b));
        embed.backward(contexts, de);
        return loss;
    }
};

struct options {
    std::string data;
    std::string checkpoint = "char_mlp.safetensors";
    std::int64_t steps = 1500;
    index_t batch = 64;
    double lr = 3e-3;
    std::uint64_t seed = 1;
};

options parse(int argc, char** argv) {
    options o;
    for (int i = 1; i < argc; ++i) {
        const std::string a = argv[i];
        auto value = [&]() -> std::string {
            MNEMO_CHECK(i + 1 < argc, "char_mlp: option ", a, " needs a value");
            return argv[++i];
        };
        auto number = [&](const std::string& s) {
            std::size_t used = 0;
            double x = 0;
            try { x = std::stod(s, &used); } catch (const std::exception&) { used = 0; }
            MNEMO_CHECK(used == s.size(), "char_mlp: option ", a, " expects a number, got '", s, "'");
            return x;
        };
        if (a == "--data") o.data = value();
        else if (a == "--checkpoint") o.checkpoint = value();
        else if (a == "--steps") o.steps = static_cast<std::int64_t>(number(value()));
        else if (a == "--batch") o.batch = static_cast<index_t>(number(value()));
        else if (a == "--lr") o.lr = number(value());
        else if (a == "--seed") o.seed = static_cast<std::uint64_t>(number(value()));
        else if (a == "--help" || a == "-h") {
            std::printf("usage: char_mlp [--data FILE] [--steps N] [--batch B] [--lr LR] [--seed S] [--checkpoint PATH]\n");
            std::exit(0);
        } else mnemo::detail::fail("char_mlp: unknown option '", a, "' (try --help)");
    }
    MNEMO_CHECK(o.steps > 0, "char_mlp: --steps must be positive");
    MNEMO_CHECK(o.batch > 0, "char_mlp: --batch must be positive");
    return o;
}

// Samples `count` random windows (context, target) from text[lo, hi).
void sample_batch(const std::vector<token_t>& text, std::size_t lo, std::size_t hi, index_t count, mnemo::rng& r,
                  std::vector<token_t>& ctx, std::vector<token_t>& tgt) {
    ctx.resize(static_cast<std::size_t>(count) * Ctx);
    tgt.resize(static_cast<std::size_t>(count));
    for (index_t i = 0; i < count; ++i) {
        const std::size_t t = lo + Ctx + r.next_u32() % (hi - lo - Ctx);
        std::copy(text.begin() + std::ptrdiff_t(t - Ctx), text.begin() + std::ptrdiff_t(t), ctx.begin() + i * index_t(Ctx));
        tgt[static_cast<std::size_t>(i)] = text[t];
    }
}

// Mean loss over the validation range in fixed, contiguous batches.
double validate(model& m, const std::vector<token_t>& text, std::size_t lo, std::size_t hi) {
    std::vector<token_t> ctx, tgt;
    double total = 0;
    index_t n = 0;
    const index_t b = 256;
    for (std::size_t t = lo + Ctx; t + std::size_t(b) <= hi; t += std::size_t(b)) {
        ctx.clear();
        tgt.clear();
        for (index_t i = 0; i < b; ++i) {
            ctx.insert(ctx.end(), text.begin() + std::ptrdiff_t(t + std::size_t(i) - Ctx), text.begin() + std::ptrdiff_t(t + std::size_t(i)));
            tgt.push_back(text[t + std::size_t(i)]);
        }
        total += m.step(ctx, tgt, false) * double(b);
        n += b;
    }
    return total / double(n);
}

}  // namespace

int main(int argc, char** argv) try {
    const options o = parse(argc, argv);
    const std::string text = o.data.empty() ? builtin_text() : read_file(o.data);

    // Vocabulary: the distinct bytes of the text.
    std::vector<int> id_of(256, -1);
    std::vector<unsigned char> byte_of;
    for (unsigned char c : text)
        if (id_of[c] < 0) { id_of[c] = static_cast<int>(byte_of.size()); byte_of.push_back(c); }
    std::vector<token_t> tokens(text.size());
    for (std::size_t i = 0; i < text.size(); ++i) tokens[i] = id_of[static_cast<unsigned char>(text[i])];
    const std::size_t split = tokens.size() * 9 / 10;
    MNEMO_CHECK(split > 4 * Ctx && tokens.size() - split > 300 + Ctx, "char_mlp: the text (", text.size(),
                " bytes) is too short: it needs at least ", (300 + Ctx) * 10 + 1, " bytes for training and validation");

    model m(static_cast<index_t>(byte_of.size()));
    m.init(o.seed);
    std::printf("char_mlp: %s, %zu characters, vocabulary %zu, %lld parameters\n",
                o.data.empty() ? "built-in text" : o.data.c_str(), text.size(), byte_of.size(),
                static_cast<long long>(m.ps.count()));
    std::printf("           d_model %zu, context %zu, feed-forward %zu, batch %lld, %lld steps, AdamW lr %g\n", D, Ctx,
                Dff, static_cast<long long>(o.batch), static_cast<long long>(o.steps), o.lr);

    mnemo::adamw<float> opt(m.ps.size(), {.lr = o.lr, .weight_decay = 0.01});
    const mnemo::cosine_schedule schedule(o.lr, o.steps, o.lr / 10, std::min<std::int64_t>(100, o.steps / 10));
    mnemo::rng data_rng(o.seed + 1);
    std::vector<token_t> ctx, tgt;
    const double val0 = validate(m, tokens, split, tokens.size());
    std::printf("step %5d  val %.3f bits/char (uniform would be %.3f)\n", 0, val0 / std::log(2.0),
                std::log2(double(byte_of.size())));

    const auto t0 = std::chrono::steady_clock::now();
    double smooth = 0;
    for (std::int64_t step = 0; step < o.steps; ++step) {
        sample_batch(tokens, 0, split, o.batch, data_rng, ctx, tgt);
        m.ps.zero_grad();
        const double loss = m.step(ctx, tgt, true);
        const double norm = mnemo::clip_grad_norm(m.ps, 1.0);
        opt.step(m.ps, schedule.lr(step));
        smooth = step == 0 ? loss : 0.95 * smooth + 0.05 * loss;
        if ((step + 1) % 100 == 0 || step + 1 == o.steps) {
            const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
            const double tok_s = double(step + 1) * double(o.batch) / secs;
            const double eta = secs / double(step + 1) * double(o.steps - step - 1);
            std::printf("step %5lld  loss %.3f bits/char  |grad| %.2f  lr %.2e  %.0f tokens/s  ETA %.0fs\n",
                        static_cast<long long>(step + 1), smooth / std::log(2.0), norm, schedule.lr(step), tok_s, eta);
            std::fflush(stdout);
        }
    }
    const double val = validate(m, tokens, split, tokens.size());
    std::printf("validation: %.3f bits/char (from %.3f before training)\n", val / std::log(2.0), val0 / std::log(2.0));

    // Greedy sample from the first characters of the validation text.
    std::vector<token_t> window(tokens.begin() + std::ptrdiff_t(split), tokens.begin() + std::ptrdiff_t(split + Ctx));
    std::string sample;
    for (token_t t : window) sample += static_cast<char>(byte_of[static_cast<std::size_t>(t)]);
    for (int i = 0; i < 160; ++i) {
        view<float> l = m.forward(window);
        const token_t next = static_cast<token_t>(std::max_element(l.row(0), l.row(0) + l.cols()) - l.row(0));
        sample += static_cast<char>(byte_of[static_cast<std::size_t>(next)]);
        window.erase(window.begin());
        window.push_back(next);
    }
    std::printf("greedy sample:\n%s\n", sample.c_str());

    // Checkpoint round trip: save atomically, load into a fresh model, same validation loss bit for bit.
    mnemo::save_parameters(o.checkpoint, m.ps, mnemo::dtype::f32);
    model reloaded(m.vocab());
    mnemo::load_parameters(o.checkpoint, reloaded.ps);
    const double val_reloaded = validate(reloaded, tokens, split, tokens.size());
    MNEMO_CHECK(val_reloaded == val, "char_mlp: the reloaded checkpoint gives a different loss (", val_reloaded,
                " vs ", val, ")");
    std::printf("checkpoint: %s (%lld bytes), reloaded: identical validation loss\n", o.checkpoint.c_str(),
                static_cast<long long>(std::filesystem::file_size(o.checkpoint)));
    return 0;
} catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
}
