#pragma once
// Runs of modules, models and the trainer over a backend B, each returning every number it produced
// (outputs, input and parameter gradients, losses, norms, generated tokens) read over the host path.
// The backend tests run them over the CPU and over another backend and compare: test_fenced.cpp
// bitwise (the fenced backend runs the CPU kernels), tests/cuda/test_cuda_models.cpp within tolerances.
#include <cstdint>
#include <fstream>
#include <iterator>
#include <memory>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "testing.hpp"

#include <mnemo/mnemo.hpp>

namespace mnemo::backend_runs {

template <class T, class B>
std::vector<T> download(const buffer<T, B>& b, index_t n) {
    return testing::to_host<B>(b.data(), n);
}
template <class T, class B>
void upload(buffer<T, B>& b, const std::vector<T>& host) {
    device_memory<B>::upload(b.ensure(index_t(host.size())), host.data(), sizeof(T) * host.size());
}


constexpr std::size_t D = 16, Dff = 40;
constexpr index_t vocab = 11;

/// A small network of the modules that run over any backend: embedding → layer norm → feed-forward
/// (ReLU) with a residual → feed-forward (GELU) → linear head → fused cross-entropy, forward and backward.
template <class B>
struct small_net {
    parameter_set<float, B> ps;
    embedding<float, D, B> emb{ps, "emb", vocab};
    layer_norm<float, D, B> ln{ps, "ln"};
    feed_forward<float, D, Dff, relu, B> ff1{ps, "ff1"};
    feed_forward<float, D, Dff, gelu, B> ff2{ps, "ff2"};
    linear<float, D, dynamic, B> head{ps, "head", index_t(D), vocab, true};
    buffer<float, B> x, z, f, r, y, logits, dlogits, dy, dr, df, dz, dx;
    cross_entropy_loss<float, B> ce;
    double loss = 0;

    small_net() {
        ps.allocate();
        rng g(7);
        emb.reset_parameters(g);
        ln.reset_parameters();
        ff1.reset_parameters(g);
        ff2.reset_parameters(g);
        head.reset_parameters(g);
    }

    void step(const std::vector<token_t>& tokens, const std::vector<token_t>& targets) {
        const index_t n = index_t(tokens.size());
        using v = view<float, D, B>;
        v xv(x.ensure(n * D), n), zv(z.ensure(n * D), n), fv(f.ensure(n * D), n), rv(r.ensure(n * D), n),
            yv(y.ensure(n * D), n);
        view<float, dynamic, B> lv(logits.ensure(n * vocab), n, vocab), dlv(dlogits.ensure(n * vocab), n, vocab);
        emb.forward(tokens, xv);
        ln.forward(xv, zv);
        ff1.forward(zv, fv);
        residual<float, D, B>::forward(xv, fv, rv);
        ff2.forward(rv, yv);
        head.forward(yv, lv);
        loss = ce(n, vocab, lv.data(), targets, dlv.data());
        ps.zero_grad();
        v dyv(dy.ensure(n * D), n), drv(dr.ensure(n * D), n), dfv(df.ensure(n * D), n), dzv(dz.ensure(n * D), n),
            dxv(dx.ensure(n * D), n);
        head.backward(yv, dlv, dyv);
        ff2.backward(rv, dyv, drv);
        residual<float, D, B>::backward(drv, dxv, dfv);
        ff1.backward(zv, dfv, dzv);
        ln.backward(xv, dzv, dxv, true);
        emb.backward(tokens, dxv);
    }

    std::vector<float> values() {
        std::vector<float> h(std::size_t(ps.size()));
        ps.download_all_values(h);
        return h;
    }
    std::vector<float> grads() {
        std::vector<float> h(std::size_t(ps.size()));
        ps.download_all_grads(h);
        return h;
    }
};


template <class T, class B>
buffer<T, B> on(const std::vector<T>& host) {
    buffer<T, B> b;
    upload(b, host);
    return b;
}

struct attention_run {
    std::vector<float> out, dzq, dzkv, grads, dgamma, dbeta, out2;
};

constexpr index_t AD = 16;
using attention_cfg = config<16, 4>;

/// relative_attention on backend B: forward and backward over memory + segment, with the route,
/// padding, clamp_len and frozen rows of `variant` (as the CPU test of the absorbed route), then a
/// generated token's forward that reuses the keys and values of the previous one.
template <class B>
attention_run run_attention(memory_attention mode, index_t Q, int variant, bool forward_norm) {
    const index_t mem = 5, Kn = mem + Q, Bt = 3, P = 12;
    parameter_set<float, B> ps;
    relative_attention<float, attention_cfg, B> attn(ps, "self_attn", P);
    ps.allocate();
    {
        rng g(41);
        std::vector<float> host(std::size_t(ps.size()));
        for (float& v : host) v = float(g.uniform(-0.8, 0.8));
        ps.upload_all_values(host);
    }
    attn.set_memory_attention(mode);
    auto zkv_h = testing::random_vector<float>(Kn * Bt * AD, 42);
    auto zhat_h = testing::random_vector<float>(mem * Bt * AD, 43);
    auto gamma_h = testing::random_vector<float>(AD, 44), beta_h = testing::random_vector<float>(AD, 45);
    for (index_t r = 0; r < mem * Bt; ++r)
        for (index_t i = 0; i < AD; ++i) zkv_h[r * AD + i] = zhat_h[r * AD + i] * gamma_h[i] + beta_h[i];
    auto r_h = testing::random_vector<float>(Q * Bt * AD, 46);
    std::vector<std::uint8_t> pad(std::size_t(Kn * Bt), 0);
    buffer<std::uint8_t, B> pad_flags;
    if (variant == 1) {
        pad[0 * Bt + 1] = pad[3 * Bt + 1] = pad[2 * Bt + 2] = 1;
        attn.set_key_padding(pad_flags.upload(pad));  // the backend's memory, read by a kernel
    }
    if (variant == 2) attn.set_clamp_len(3);
    auto zkv = on<float, B>(zkv_h), zhat = on<float, B>(zhat_h), gamma = on<float, B>(gamma_h),
         beta = on<float, B>(beta_h), r = on<float, B>(r_h);
    auto dgamma = on<float, B>(std::vector<float>(AD, 0.5f)), dbeta = on<float, B>(std::vector<float>(AD, -0.25f));
    auto dzkv = on<float, B>(std::vector<float>(std::size_t(Kn * Bt * AD), -7.0f));
    buffer<float, B> out, dzq;
    frozen_key_rows<float> frozen;
    if (variant == 0 || variant == 1)
        frozen = {mem * Bt, zhat.data(), AD, gamma.data(), beta.data(), dgamma.data(), dbeta.data()};
    if (variant == 2) frozen = {2 * Bt};
    frozen_key_rows<float> norm_rows = forward_norm ? frozen : frozen_key_rows<float>{};
    using cv = view<const float, AD, B>;
    using mv = view<float, AD, B>;
    const float* zq = zkv.data() + mem * Bt * AD;
    attn.forward(cv(zq, Q * Bt), cv(zkv.data(), Kn * Bt), Bt, mv(out.ensure(Q * Bt * AD), Q * Bt), {}, norm_rows);
    ps.zero_grad();
    attn.backward(cv(zq, Q * Bt), cv(zkv.data(), Kn * Bt), cv(r.data(), Q * Bt), mv(dzq.ensure(Q * Bt * AD), Q * Bt),
                  mv(dzkv.data(), Kn * Bt), false, frozen);
    attention_run res;
    res.out = download(out, Q * Bt * AD);
    res.dzq = download(dzq, Q * Bt * AD);
    res.dzkv = download(dzkv, Kn * Bt * AD);
    res.dgamma = download(dgamma, AD);
    res.dbeta = download(dbeta, AD);
    res.grads.resize(std::size_t(ps.size()));
    ps.download_all_grads(res.grads);
    // Generation: one token over the keys, then the next with the memory slid by one position (the
    // first Kn − 1 positions' keys and values reused, the last projected).
    if (Q == 1 && mode == memory_attention::projected) {
        attn.set_key_padding(nullptr);
        attn.keep_projections(true);
        buffer<float, B> o1, o2;
        attn.forward(cv(zq, Bt), cv(zkv.data(), Kn * Bt), Bt, mv(o1.ensure(Bt * AD), Bt));
        kv_reuse reuse;
        reuse.add(0, 1, Kn - 1);
        attn.forward(cv(zq, Bt), cv(zkv.data(), Kn * Bt), Bt, mv(o2.ensure(Bt * AD), Bt), reuse);
        res.out2 = download(o2, Bt * AD);
    }
    return res;
}


struct module_run {
    std::vector<float> out, d_in, d_in2, grads;
};

/// A compression function C<float, 8, 4, B> over 8·4·2 memory rows (batch 2): forward, backward.
template <template <class, std::size_t, std::size_t, class> class C, class B>
module_run run_compression() {
    constexpr std::size_t d = 8, rate = 4;
    const index_t batch = 2, mem_rows = index_t(2 * rate) * batch, out_rows = mem_rows / index_t(rate);
    parameter_set<float, B> ps;
    C<float, d, rate, B> f(ps, "compress");
    ps.allocate();
    {
        rng g(5);
        std::vector<float> host(std::size_t(ps.size()));
        for (float& v : host) v = float(g.uniform(-0.5, 0.5));
        if (ps.size() > 0) ps.upload_all_values(host);
    }
    auto mem = on<float, B>(testing::random_vector<float>(mem_rows * index_t(d), 6));
    auto d_out = on<float, B>(testing::random_vector<float>(out_rows * index_t(d), 7));
    buffer<float, B> out, d_mem;
    if constexpr (compression_needs_usage<C<float, d, rate, B>>) {
        auto usage = on<float, B>(testing::random_vector<float>(mem_rows, 8, 0.0, 1.0));
        f.set_usage(usage.data(), mem_rows);
        f.forward(view<const float, d, B>(mem.data(), mem_rows), batch, view<float, d, B>(out.ensure(out_rows * index_t(d)), out_rows));
    } else {
        f.forward(view<const float, d, B>(mem.data(), mem_rows), batch, view<float, d, B>(out.ensure(out_rows * index_t(d)), out_rows));
    }
    ps.zero_grad();
    f.backward(view<const float, d, B>(mem.data(), mem_rows), batch, view<const float, d, B>(d_out.data(), out_rows),
               view<float, d, B>(d_mem.ensure(mem_rows * index_t(d)), mem_rows));
    module_run r;
    r.out = download(out, out_rows * index_t(d));
    r.d_in = download(d_mem, mem_rows * index_t(d));
    r.grads.resize(std::size_t(ps.size()));
    if (ps.size() > 0) ps.download_all_grads(r.grads);
    return r;
}

template <class B>
module_run run_gru() {
    constexpr std::size_t d = 12;
    const index_t rows = 7;
    parameter_set<float, B> ps;
    gru_gate<float, d, B> gate(ps, "gate");
    ps.allocate();
    rng g(9);
    gate.reset_parameters(g);
    auto x = on<float, B>(testing::random_vector<float>(rows * index_t(d), 10));
    auto y = on<float, B>(testing::random_vector<float>(rows * index_t(d), 11));
    auto d_out = on<float, B>(testing::random_vector<float>(rows * index_t(d), 12));
    buffer<float, B> out, dx, dy;
    using cv = view<const float, d, B>;
    using mv = view<float, d, B>;
    gate.forward(cv(x.data(), rows), cv(y.data(), rows), mv(out.ensure(rows * index_t(d)), rows));
    ps.zero_grad();
    gate.backward(cv(d_out.data(), rows), mv(dx.ensure(rows * index_t(d)), rows), mv(dy.ensure(rows * index_t(d)), rows));
    module_run r;
    r.out = download(out, rows * index_t(d));
    r.d_in = download(dx, rows * index_t(d));
    r.d_in2 = download(dy, rows * index_t(d));
    r.grads.resize(std::size_t(ps.size()));
    ps.download_all_grads(r.grads);
    return r;
}



/// One feedback attention step over t = 5 slots (sequence-major), forward and backward.
template <class B>
module_run run_feedback_step() {
    const index_t t = 5, batch = 3, P = 9;
    parameter_set<float, B> ps;
    feedback_attention<float, attention_cfg, B> attn(ps, "attn", P);
    ps.allocate();
    {
        rng g(31);
        std::vector<float> host(std::size_t(ps.size()));
        for (float& v : host) v = float(g.uniform(-0.8, 0.8));
        ps.upload_all_values(host);
    }
    auto z = on<float, B>(testing::random_vector<float>(batch * AD, 32));
    auto k = on<float, B>(testing::random_vector<float>(t * batch * AD, 33));
    auto v = on<float, B>(testing::random_vector<float>(t * batch * AD, 34));
    auto r = on<float, B>(testing::random_vector<float>(batch * AD, 35));
    auto dk = on<float, B>(std::vector<float>(std::size_t(t * batch * AD), 0.25f));
    auto dv = on<float, B>(std::vector<float>(std::size_t(t * batch * AD), -0.5f));
    buffer<float, B> out, q, ctx, a, dz;
    const auto slots = [&](const float* p) { return memory_slots<const float>(p, t, batch * AD, AD); };
    const auto dslots = [&](float* p) { return memory_slots<float>(p, t, batch * AD, AD); };
    using cv = view<const float, AD, B>;
    using mv = view<float, AD, B>;
    attn.forward(cv(z.data(), batch), slots(k.data()), slots(v.data()), batch,
                 {q.ensure(batch * AD), a.ensure(attn.attn_size(batch, t)), ctx.ensure(batch * AD)},
                 mv(out.ensure(batch * AD), batch));
    ps.zero_grad();
    attn.backward(cv(z.data(), batch), slots(k.data()), slots(v.data()), cv(r.data(), batch), batch,
                  {q.data(), a.data(), ctx.data()}, dslots(dk.data()), dslots(dv.data()),
                  mv(dz.ensure(batch * AD), batch));
    module_run res;
    res.out = download(out, batch * AD);
    res.d_in = download(dz, batch * AD);
    res.d_in2 = download(dk, t * batch * AD);
    const auto dvh = download(dv, t * batch * AD);
    res.d_in2.insert(res.d_in2.end(), dvh.begin(), dvh.end());
    res.grads.resize(std::size_t(ps.size()));
    ps.download_all_grads(res.grads);
    return res;
}


struct model_run {
    std::vector<double> ce, ar, norms;
    std::vector<std::vector<float>> grads;
    index_t compressed = 0;  // memory slots compressed over the segments
};

enum class optim_kind { adamw, labml, adam, sgd };

/// One optimizer of each kind over a parameter_set<float, B>, stepped after clipping, and resumed by
/// the host path: its state downloaded, a new optimizer made, the state set into it.
template <class B>
struct optimizer_run {
    optim_kind kind;
    index_t n;
    std::unique_ptr<adamw<float, B>> aw;
    std::unique_ptr<labml_adam<float, B>> lb;
    std::unique_ptr<adam<float, B>> ad;
    std::unique_ptr<sgd<float, B>> sg;

    optimizer_run(optim_kind k, index_t size) : kind(k), n(size) { make(); }
    void make() {
        switch (kind) {
            case optim_kind::adamw: aw = std::make_unique<adamw<float, B>>(n, adamw_options{.lr = 1e-2, .weight_decay = 0.1}); break;
            case optim_kind::labml: lb = std::make_unique<labml_adam<float, B>>(n, labml_adam_options{.lr = 1e-2, .weight_decay = 0.05}); break;
            case optim_kind::adam: ad = std::make_unique<adam<float, B>>(n, adam_options{.lr = 1e-2, .weight_decay = 0.01}); break;
            case optim_kind::sgd: sg = std::make_unique<sgd<float, B>>(n, sgd_options{.lr = 0.1, .momentum = 0.9, .nesterov = true}); break;
        }
    }
    void step(parameter_set<float, B>& ps) {
        switch (kind) {
            case optim_kind::adamw: aw->step(ps); break;
            case optim_kind::labml: lb->step(ps, adam_warmup_schedule(1e-2, 3)); break;
            case optim_kind::adam: ad->step(ps); break;
            case optim_kind::sgd: sg->step(ps); break;
        }
    }
    template <class O>
    void resume_adam(std::unique_ptr<O>& o) {
        std::vector<float> m(std::size_t(n), 1.0f), v(std::size_t(n), 1.0f);
        o->download_state(m, v);
        const auto step = o->step_count();
        o.reset();
        make();
        o->set_state(step, m, v);
    }
    void resume() {
        switch (kind) {
            case optim_kind::adamw: resume_adam(aw); break;
            case optim_kind::labml: resume_adam(lb); break;
            case optim_kind::adam: resume_adam(ad); break;
            case optim_kind::sgd: {
                std::vector<float> b(std::size_t(n), 1.0f);
                sg->download_state(b);
                const auto step = sg->step_count();
                sg.reset();
                make();
                sg->set_state(step, b);
                break;
            }
        }
    }
};

/// Four training segments and one evaluation segment of a compressive_transformer<float, config<16, 4, 2>,
/// Compression, B> with memory 6 and compressed memory 4 (Transformer-XL: none), batch 2, segment 4,
/// each training segment followed by clip_grad_norm and a step of the optimizer `k`: the losses, the
/// norms, every segment's parameter gradients and the final values. With `resume`, the optimizer is
/// resumed after the second step (its state through the host path into a new one) and the parameter
/// values make a round trip through the host path: the results must not change.
template <template <class, std::size_t, std::size_t, class> class Compression, class B>
model_run run_model(compressive_options o, index_t c_mem_len, bool padded, optim_kind k = optim_kind::adamw,
                    bool resume = false) {
    using model_t = compressive_transformer<float, config<16, 4, 2>, Compression, B>;
    o.vocab = 7;
    o.n_layers = 2;
    o.d_ff = 24;
    o.n_pos = 32;
    model_t model(o);
    model.reset_parameters(3);
    auto mem = model.make_memory(6, c_mem_len);
    const index_t batch = 2, q = 4;
    auto& ps = model.parameters();
    optimizer_run<B> opt(k, ps.size());
    model_run r;
    rng g(17);
    for (int seg = 0; seg < 5; ++seg) {
        std::vector<token_t> tokens(std::size_t(q * batch)), targets(tokens.size());
        for (auto& t : tokens) t = token_t(g.uniform(0, 7));
        for (auto& t : targets) t = token_t(g.uniform(0, 7));
        std::vector<std::uint8_t> pad(tokens.size(), 0);
        if (padded && seg == 0) pad[0] = pad[2] = 1;  // the first positions of batch element 0
        if (padded && seg == 0) targets[0] = targets[2] = -1;
        model.parameters().zero_grad();
        segment_losses l = seg < 4 ? model.train_segment(tokens, targets, batch, mem, pad)
                                   : model.eval_segment(tokens, targets, batch, mem, pad);
        r.ce.push_back(l.ce);
        r.ar.push_back(l.ar);
        r.compressed += l.compressed;
        std::vector<float> grads(std::size_t(model.parameters().size()));
        model.parameters().download_all_grads(grads);
        r.grads.push_back(std::move(grads));
        if (seg < 4) {
            r.norms.push_back(clip_grad_norm(ps, 0.5));
            opt.step(ps);
        }
        if (resume && seg == 1) {
            opt.resume();
            std::vector<float> values(std::size_t(ps.size()));
            ps.download_all_values(values);
            ps.upload_all_values(values);
        }
    }
    std::vector<float> values(std::size_t(ps.size()));
    ps.download_all_values(values);
    r.grads.push_back(std::move(values));
    return r;
}



/// Two training sequences of a Feedback Transformer (KV: per-layer or shared keys and values), then
/// six generated steps from the cache: the losses, the gradients and every step's logits.
template <class KV, class B>
model_run run_feedback_model() {
    using model_t = feedback_transformer<float, config<16, 4>, KV, B>;
    model_t model({.vocab = 7, .n_layers = 2, .d_ff = 24, .n_pos = 16});
    model.reset_parameters(4);
    const index_t batch = 2, steps = 6;
    model_run r;
    rng g(23);
    for (int seq = 0; seq < 2; ++seq) {
        std::vector<token_t> tokens(std::size_t(steps * batch)), targets(tokens.size());
        for (auto& t : tokens) t = token_t(g.uniform(0, 7));
        for (auto& t : targets) t = token_t(g.uniform(0, 7));
        model.parameters().zero_grad();
        r.ce.push_back(model.train_segment(tokens, targets, batch));
        std::vector<float> grads(std::size_t(model.parameters().size()));
        model.parameters().download_all_grads(grads);
        r.grads.push_back(std::move(grads));
    }
    auto gen = model.generator(batch);
    for (index_t t = 0; t < steps; ++t) {
        const std::vector<token_t> next = {token_t(t % 7), token_t((3 * t + 1) % 7)};
        const auto logits = gen.step(next);
        std::vector<float> host(std::size_t(logits.rows() * logits.cols()));
        device_memory<B>::download(host.data(), logits.data(), sizeof(float) * host.size());
        r.grads.push_back(std::move(host));  // the logits, compared as the gradients are
    }
    return r;
}


/// Generation from a compressive transformer (the cached projections of the memory reused token to
/// token, memory and compressed memory filling up) after one training segment: the tokens drawn.
template <template <class, std::size_t, std::size_t, class> class Compression, class B>
std::vector<token_t> run_generation() {
    using model_t = compressive_transformer<float, config<16, 4, 2>, Compression, B>;
    model_t model({.vocab = 7, .n_layers = 2, .d_ff = 24, .n_pos = 64});
    model.reset_parameters(5);
    autoregressive_wrapper<model_t> wrapper(model, 4, 6, model_t::can_compress ? 4 : 0);  // Transformer-XL: none
    const std::vector<token_t> prime = {1, 2, 3, 4, 5, 6, 0, 1, 2};
    rng r(8);
    return wrapper.generate(prime, 20, {.temperature = 0.9}, r);
}


inline std::string bytes_of(const std::string& path) {
    std::ifstream f(path, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
}

inline std::string trainer_text() {
    std::string t;
    for (int i = 0; i < 30; ++i) t += "line " + std::to_string(i) + ": the quick brown fox jumps over a lazy dog.\n";
    return t;
}

template <template <class, std::size_t, std::size_t, class> class Compression>
struct compressive_of {
    template <class B>
    using type = compressive_transformer<float, config<16, 2, 2>, Compression, B>;
};
struct feedback_of {
    template <class B>
    using type = feedback_transformer<float, config<16, 2>, per_layer_kv, B>;
};

struct trainer_run {
    std::vector<float> values;
    std::vector<double> ce;
    std::string model_file, state_file, sample;
    double valid_ce = 0;
};

/// The trainer library over backend B: 4 steps, a save, a fresh model and trainer over backend B2
/// restored from it, 4 more steps; then validation and a sample: the losses, both files' bytes, the
/// final values, the validation loss and the sample.
template <class Of, class B, class B2 = B>
trainer_run run_trainer(const std::string& dir) {
    using model_t = typename Of::template type<B>;
    using model2_t = typename Of::template type<B2>;
    constexpr bool feedback = std::is_same_v<Of, feedback_of>;
    const text_corpus data = split_text(trainer_text(), "fenced");
    const trainer_options o{.batch = 2, .seq_len = 4, .mem_len = feedback ? 0 : 4, .c_mem_len = feedback ? 0 : 4,
                            .lr = 3e-3, .warmup = 2, .steps = 20, .seed = 7};
    using options_t = std::conditional_t<feedback, feedback_options, compressive_options>;
    const options_t mo{.vocab = data.vocab.size(), .n_layers = 2, .d_ff = 16, .n_pos = 16};
    const auto make = [&]<class M>(M& m) {
        return trainer<M>(m, o, data.vocab, segment_streams(data.train, o.batch, o.seq_len, "training"),
                          segment_streams(data.valid, o.batch, o.seq_len, "validation"));
    };
    trainer_run r;
    const std::string path = dir + "/" + B::name + ".safetensors";
    {
        model_t model(mo);
        model.reset_parameters(3);
        auto t = make(model);
        for (int i = 0; i < 4; ++i) r.ce.push_back(t.step().ce);
        t.save(path, {});
    }
    r.model_file = bytes_of(path);
    r.state_file = bytes_of(checkpoint_state_path(path));
    model2_t model(mo);  // on backend B2: a checkpoint written on B continues there
    model.reset_parameters(99);  // the checkpoint replaces every value
    auto t = make(model);
    t.restore(read_trainer_checkpoint(path), path);
    for (int i = 0; i < 4; ++i) r.ce.push_back(t.step().ce);
    r.valid_ce = t.validate(2).ce;
    r.sample = t.sample_text(std::vector<token_t>{1, 2, 3}, 6, sampling_options{});
    r.values.resize(std::size_t(model.parameters().size()));
    model.parameters().download_all_values(r.values);
    return r;
}



/// A runtime-shape compressive transformer (config<dynamic, dynamic, dynamic>: d_model 12, 3 heads,
/// rate 2, every extent a runtime value in the kernels) over backend B: three training segments with
/// AdamW, then an evaluation segment: the losses, the gradients, the final values.
template <class B>
model_run run_runtime_shape() {
    using model_t = compressive_transformer<float, runtime_config, conv_compression, B>;
    compressive_options o{.vocab = 7, .n_layers = 2, .d_ff = 20, .n_pos = 32};
    o.d_model = 12;
    o.heads = 3;
    o.compression_rate = 2;
    model_t model(o);
    model.reset_parameters(5);
    auto mem = model.make_memory(4, 4);
    auto& ps = model.parameters();
    adamw<float, B> opt(ps.size(), {.lr = 1e-2});
    const index_t batch = 2, q = 4;
    model_run r;
    rng g(29);
    for (int seg = 0; seg < 4; ++seg) {
        std::vector<token_t> tokens(std::size_t(q * batch)), targets(tokens.size());
        for (auto& t : tokens) t = token_t(g.uniform(0, 7));
        for (auto& t : targets) t = token_t(g.uniform(0, 7));
        ps.zero_grad();
        const segment_losses l = seg < 3 ? model.train_segment(tokens, targets, batch, mem)
                                         : model.eval_segment(tokens, targets, batch, mem);
        r.ce.push_back(l.ce);
        r.ar.push_back(l.ar);
        r.compressed += l.compressed;
        std::vector<float> grads(std::size_t(ps.size()));
        ps.download_all_grads(grads);
        r.grads.push_back(std::move(grads));
        if (seg < 3) opt.step(ps);
    }
    std::vector<float> values(std::size_t(ps.size()));
    ps.download_all_values(values);
    r.grads.push_back(std::move(values));
    return r;
}


/// The autoregressive wrapper over backend B: a sequence trained and evaluated segment by segment (the
/// last segment shorter, an ignored target), then 12 tokens generated at temperature 0.9: the losses
/// and the tokens (as numbers in ce).
template <class B>
model_run run_wrapper() {
    using model_t = compressive_transformer<float, config<16, 4, 2>, max_pool_compression, B>;
    model_t model({.vocab = 9, .n_layers = 2, .d_ff = 24, .n_pos = 64});
    model.reset_parameters(8);
    const index_t batch = 2, seg_len = 3, n_pos = 11;
    autoregressive_wrapper wrap(model, seg_len, 4, 2);
    auto seq = testing::random_tokens(n_pos * batch, 9, 4);
    seq[std::size_t((n_pos - 1) * batch + 1)] = -1;  // an ignored target
    model_run r;
    auto mem = wrap.make_memory();
    for (const segment_losses& l : wrap.train_sequence(seq, batch, mem)) r.ce.push_back(l.ce), r.ar.push_back(l.ar);
    std::vector<float> grads(std::size_t(model.parameters().size()));
    model.parameters().download_all_grads(grads);
    r.grads.push_back(std::move(grads));
    auto eval_mem = wrap.make_memory();
    for (const segment_losses& l : wrap.eval_sequence(seq, batch, eval_mem)) r.ce.push_back(l.ce), r.ar.push_back(l.ar);
    rng g(3);
    for (token_t t : wrap.generate(std::vector<token_t>{1, 2, 3, 4}, 12, sampling_options{.temperature = 0.9}, g))
        r.ce.push_back(double(t));
    return r;
}

}  // namespace mnemo::backend_runs
