// The Compressive Transformer's variants (compressive_options): GRU-gated residuals, post-LayerNorm,
// memory only in some layers, the auto-encoding loss, and the dilated-convolution and most-used
// compression functions. Forward passes against compositions of the modules, finite-difference checks
// of the whole model in double, gradient isolation of the auxiliary losses, and the memory and
// checkpoint layout of memory_layers.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <numeric>
#include <string>
#include <vector>

#include <mnemo/models/compressive_transformer.hpp>
#include <mnemo/io/safetensors.hpp>

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

using tiny = mnemo::config<8, 2, 2>;
constexpr std::size_t D = 8;
using model_t = mnemo::compressive_transformer<double, tiny>;
using V = view<const double, D>;
using W = view<double, D>;

mnemo::compressive_options tiny_options(index_t n_layers = 2) {
    return {.vocab = 7, .n_layers = n_layers, .d_ff = 6, .n_pos = 16};
}

bool has_tensor(const mnemo::parameter_set<double>& ps, const std::string& name) { return ps.find(name) != nullptr; }

/// Copies every tensor of `from` into the tensor of the same name in `to` (which must have it).
template <class T>
void copy_by_name(const mnemo::parameter_set<T>& from, mnemo::parameter_set<T>& to) {
    for (const auto& f : from.entries()) {
        const auto* e = to.find(f.name);
        REQUIRE_MESSAGE(e, f.name);
        REQUIRE(f.size == e->size);
        std::copy(from.values() + f.offset, from.values() + f.offset + f.size, to.values() + e->offset);
    }
}
/// Runs `n` segments through the model, merging each into the memory (filling it and compressing).
template <class Model, class Memory>
void fill_memory(Model& model, Memory& mem, index_t batch, index_t q, int n, std::uint64_t seed) {
    for (int s = 0; s < n; ++s) {
        auto t = random_tokens(q * batch, model.vocab(), seed + std::uint64_t(s));
        model.forward(t, batch, mem);
        model.update_memory(mem);
    }
}

/// The CE gradient of one segment with both kinds of memory in play, against finite differences
/// (every parameter; the compression function and decoder, unused by the forward, excluded).
template <class Model>
void check_model_gradient(const mnemo::compressive_options& o, std::uint64_t seed) {
    const index_t B = 2, Q = 3;
    Model model(o);
    randomize_model(model.parameters(), seed);
    auto mem = model.make_memory(/*mem_len=*/3, /*c_mem_len=*/2);
    mem.reset(B, Q);
    fill_memory(model, mem, B, Q, 2, seed + 10);
    REQUIRE(mem.mem_slots() > 0);
    REQUIRE(mem.c_mem_slots() > 0);
    auto tokens = random_tokens(Q * B, o.vocab, seed + 20), targets = random_tokens(Q * B, o.vocab, seed + 21);
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
    std::erase_if(targets_g, [](const auto& t) {
        return t.name.find(".compress.") != std::string::npos || t.name.find(".decoder.") != std::string::npos;
    });
    check_gradients(loss, targets_g);
}

/// Every gradient is exactly zero except those whose name contains one of `keep` (which must be non-zero).
void check_only(const mnemo::parameter_set<double>& ps, std::initializer_list<const char*> keep) {
    for (const auto& e : ps.entries()) {
        double norm = 0;
        for (index_t i = 0; i < e.size; ++i) norm += std::abs(ps.grads()[e.offset + i]);
        const bool kept = std::any_of(keep.begin(), keep.end(),
                                      [&](const char* k) { return e.name.find(k) != std::string::npos; });
        INFO(e.name);
        if (kept) CHECK(norm > 0);
        else CHECK(norm == 0.0);  // exactly zero
    }
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// The layer's forward pass against its definition, composed from the modules
// ---------------------------------------------------------------------------------------------

TEST_CASE("compressive_layer: pre-LN and post-LN, add and GRU, match their definitions") {
    const index_t B = 2, Q = 3, M = 2, C = 1, P = 8, d_ff = 5;
    auto x = random_vector<double>(Q * B * D, 2);
    auto mem = random_vector<double>(M * B * D, 3);
    auto cmem = random_vector<double>(C * B * D, 4);
    for (auto residual : {mnemo::residual_kind::add, mnemo::residual_kind::gru})
        for (auto norm : {mnemo::norm_kind::pre, mnemo::norm_kind::post}) {
            const bool gru = residual == mnemo::residual_kind::gru, post = norm == mnemo::norm_kind::post;
            INFO("gru " << gru << " post " << post);
            mnemo::parameter_set<double> ps;
            mnemo::compressive_layer<double, tiny, mnemo::conv_compression> layer(
                ps, "l", d_ff, P, {.residual = residual, .norm = norm});
            ps.allocate();
            randomize_model(ps, 1);
            CHECK(has_tensor(ps, "l.gate_attn.weight_ih") == gru);
            CHECK(has_tensor(ps, "l.gate_ff.bias_hh") == gru);
            std::vector<double> y(Q * B * D);
            layer.forward(V(x.data(), Q * B), V(cmem.data(), C * B), V(mem.data(), M * B), B, W(y.data(), Q * B));

            // The same from the modules, under the same names.
            mnemo::parameter_set<double> rs;
            mnemo::relative_attention<double, tiny> attn(rs, "l.self_attn", P);
            mnemo::feed_forward<double, D, mnemo::dynamic> ff(rs, "l.feed_forward", d_ff);
            mnemo::layer_norm<double, D> n_attn(rs, "l.norm_self_attn"), n_ff(rs, "l.norm_ff");
            mnemo::gru_gate<double, D> g_attn(rs, "l.gate_attn"), g_ff(rs, "l.gate_ff");
            rs.allocate();
            for (const auto& e : rs.entries())
                if (const auto* f = ps.find(e.name))
                    std::copy(ps.values() + f->offset, ps.values() + f->offset + f->size, rs.values() + e.offset);
            const index_t K = (C + M + Q) * B;
            std::vector<double> kv(K * D), z(K * D), a(Q * B * D), s1(Q * B * D), xm(Q * B * D), h(Q * B * D),
                f(Q * B * D), s2(Q * B * D), ref(Q * B * D);
            std::copy(cmem.begin(), cmem.end(), kv.begin());
            std::copy(mem.begin(), mem.end(), kv.begin() + C * B * D);
            std::copy(x.begin(), x.end(), kv.begin() + (C + M) * B * D);
            const auto join = [&](mnemo::gru_gate<double, D>& g, const std::vector<double>& stream,
                                  const std::vector<double>& sub, std::vector<double>& out) {
                if (gru) g.forward(V(stream.data(), Q * B), V(sub.data(), Q * B), W(out.data(), Q * B));
                else
                    for (std::size_t i = 0; i < out.size(); ++i) out[i] = stream[i] + sub[i];
            };
            if (post) {
                // a = attn(x, [cm, m, x]); x' = LN_attn(x ⊕ a); y = LN_ff(x' ⊕ FFN(x'))
                attn.forward(V(x.data(), Q * B), V(kv.data(), K), B, W(a.data(), Q * B));
                join(g_attn, x, a, s1);
                n_attn.forward(V(s1.data(), Q * B), W(xm.data(), Q * B));
                ff.forward(V(xm.data(), Q * B), W(f.data(), Q * B));
                join(g_ff, xm, f, s2);
                n_ff.forward(V(s2.data(), Q * B), W(ref.data(), Q * B));
            } else {
                // z = LN_attn([cm, m, x]); x' = x ⊕ attn(z_x, z); y = x' ⊕ FFN(LN_ff(x'))
                n_attn.forward(V(kv.data(), K), W(z.data(), K));
                attn.forward(V(z.data() + (C + M) * B * D, Q * B), V(z.data(), K), B, W(a.data(), Q * B));
                join(g_attn, x, a, xm);
                n_ff.forward(V(xm.data(), Q * B), W(h.data(), Q * B));
                ff.forward(V(h.data(), Q * B), W(f.data(), Q * B));
                join(g_ff, xm, f, ref);
            }
            check_close("layer output", y, ref, 1e-12, 1e-12);
        }
}

TEST_CASE("compressive_layer: post-LN and GRU backward match finite differences with memory") {
    const index_t B = 2, Q = 3, M = 2, C = 2, P = 8;
    for (auto residual : {mnemo::residual_kind::add, mnemo::residual_kind::gru})
        for (auto norm : {mnemo::norm_kind::pre, mnemo::norm_kind::post}) {
            if (residual == mnemo::residual_kind::add && norm == mnemo::norm_kind::pre) continue;  // test_compressive
            INFO("gru " << (residual == mnemo::residual_kind::gru) << " post " << (norm == mnemo::norm_kind::post));
            mnemo::parameter_set<double> ps;
            mnemo::compressive_layer<double, tiny, mnemo::conv_compression> layer(ps, "layer", 5, P,
                                                                                  {.residual = residual, .norm = norm});
            ps.allocate();
            randomize_model(ps, 1);
            auto x = random_vector<double>(Q * B * D, 2);
            auto mem = random_vector<double>(M * B * D, 3);
            auto cmem = random_vector<double>(C * B * D, 4);
            auto r = random_vector<double>(Q * B * D, 5);
            std::vector<double> y(Q * B * D), dx(Q * B * D);
            auto loss = [&] {
                layer.forward(V(x.data(), Q * B), V(cmem.data(), C * B), V(mem.data(), M * B), B, W(y.data(), Q * B));
                return project(y, r);
            };
            loss();
            ps.zero_grad();
            layer.backward(V(r.data(), Q * B), W(dx.data(), Q * B));
            auto targets = parameter_targets(ps);
            std::erase_if(targets, [](const auto& t) { return t.name.find("compress") != std::string::npos; });
            targets.push_back({"x", x.data(), dx});
            check_gradients(loss, targets);
        }
}

// ---------------------------------------------------------------------------------------------
// The whole model
// ---------------------------------------------------------------------------------------------

TEST_CASE("compressive_transformer: GRU residuals, post-LN and both: the CE gradient matches finite differences") {
    auto o = tiny_options();
    SUBCASE("gru") { o.residual = mnemo::residual_kind::gru; }
    SUBCASE("post-LN") { o.norm = mnemo::norm_kind::post; }
    SUBCASE("gru + post-LN") {
        o.residual = mnemo::residual_kind::gru;
        o.norm = mnemo::norm_kind::post;
    }
    check_model_gradient<model_t>(o, 11);
}

TEST_CASE("compressive_transformer: GRU gates are named transformer.layers.<l>.gate_attn / gate_ff, after the layer's other tensors") {
    model_t plain(tiny_options()), gated({.vocab = 7, .n_layers = 2, .d_ff = 6, .n_pos = 16,
                                          .residual = mnemo::residual_kind::gru});
    const auto& g = gated.parameters();
    for (const std::string l : {"0", "1"})
        for (const std::string gate : {"gate_attn", "gate_ff"}) {
            const std::string p = "transformer.layers." + l + "." + gate;
            REQUIRE(has_tensor(g, p + ".weight_ih"));
            CHECK(g.find(p + ".weight_ih")->shape == std::vector<index_t>{24, 8});
            CHECK(g.find(p + ".weight_hh")->shape == std::vector<index_t>{24, 8});
            CHECK(g.find(p + ".bias_ih")->shape == std::vector<index_t>{24});
            CHECK(g.find(p + ".bias_hh")->shape == std::vector<index_t>{24});
        }
    CHECK(g.count() == plain.parameters().count() + 2 * 2 * (2 * 24 * 8 + 2 * 24));
    // The gates draw their initial values after their layer's other tensors: layer 0's own tensors
    // start as in the plain model.
    plain.reset_parameters(5);
    gated.reset_parameters(5);
    const auto* f0 = g.find("transformer.layers.0.feed_forward.layer2.weight");
    const auto* p0 = plain.parameters().find(f0->name);
    CHECK(std::equal(plain.parameters().values() + p0->offset, plain.parameters().values() + p0->offset + p0->size,
                     g.values() + f0->offset));
}

TEST_CASE("compressive_transformer: the options off build exactly the reference model") {
    // Same tensors, same order, same initial values, same logits and gradients, bit for bit.
    model_t a(tiny_options()), b({.vocab = 7, .n_layers = 2, .d_ff = 6, .n_pos = 16,
                                  .residual = mnemo::residual_kind::add, .norm = mnemo::norm_kind::pre,
                                  .memory_layers = {1, 0},
                                  .reconstruction = mnemo::reconstruction_kind::attention});
    REQUIRE(a.parameters().entries().size() == b.parameters().entries().size());
    for (std::size_t i = 0; i < a.parameters().entries().size(); ++i)
        CHECK(a.parameters().entries()[i].name == b.parameters().entries()[i].name);
    a.reset_parameters(3);
    b.reset_parameters(3);
    auto ma = a.make_memory(3, 2), mb = b.make_memory(3, 2);
    ma.reset(2, 3);
    mb.reset(2, 3);
    for (int s = 0; s < 4; ++s) {
        auto t = random_tokens(6, 7, 70 + std::uint64_t(s)), y = random_tokens(6, 7, 80 + std::uint64_t(s));
        a.parameters().zero_grad();
        b.parameters().zero_grad();
        const auto la = a.train_segment(t, y, 2, ma), lb = b.train_segment(t, y, 2, mb);
        CHECK(la.ce == lb.ce);
        CHECK(la.ar == lb.ar);
        CHECK(std::equal(a.parameters().grads(), a.parameters().grads() + a.parameters().size(),
                         b.parameters().grads()));
    }
}

TEST_CASE("compressive_transformer: post-LN attention reconstruction attends over the raw memory; only f_c gets its gradient") {
    const index_t B = 2, Q = 2;
    model_t model({.vocab = 5, .n_layers = 2, .d_ff = 6, .n_pos = 16, .norm = mnemo::norm_kind::post});
    randomize_model(model.parameters(), 41);
    auto mem = model.make_memory(2, 4);
    mem.reset(B, Q);
    fill_memory(model, mem, B, Q, 1, 42);
    auto t = random_tokens(Q * B, 5, 43);
    model.forward(t, B, mem);
    REQUIRE(model.update_memory(mem) == 2);
    auto& ps = model.parameters();
    ps.zero_grad();
    const double ar = model.reconstruction_loss(mem, true);
    CHECK(ar > 0);
    check_only(ps, {".compress."});
    // Post-LN's loss ignores norm_self_attn (it is not on the attention's input path).
    const auto* w = ps.find("transformer.layers.1.norm_self_attn.weight");
    for (index_t i = 0; i < w->size; ++i) ps.values()[w->offset + i] *= 3.0;
    CHECK(model.reconstruction_loss(mem, false) == ar);
    auto loss = [&] { return model.reconstruction_loss(mem, false); };
    auto targets = parameter_targets(ps);
    std::erase_if(targets, [](const auto& t) { return t.name.find(".compress.") == std::string::npos; });
    REQUIRE(targets.size() == 4);
    check_gradients(loss, targets);
}

// ---------------------------------------------------------------------------------------------
// memory_layers
// ---------------------------------------------------------------------------------------------

TEST_CASE("compressive_transformer: memory_layers = {1}: layer 0 attends within the segment only, memory and checkpoint hold layer 1 only") {
    const index_t B = 2, Q = 3;
    model_t only1({.vocab = 7, .n_layers = 2, .d_ff = 6, .n_pos = 16, .memory_layers = {1}});
    model_t all(tiny_options());
    CHECK(only1.memory_layers() == std::vector<index_t>{1});
    CHECK(only1.memory_slot(0) == -1);
    CHECK(only1.memory_slot(1) == 0);
    CHECK_FALSE(only1.layer(0).has_memory());
    for (const auto& e : only1.parameters().entries())
        CHECK_MESSAGE(e.name.find("transformer.layers.0.compress") == std::string::npos, e.name);
    REQUIRE(has_tensor(only1.parameters(), "transformer.layers.1.compress.conv.weight"));
    CHECK(only1.parameters().entries().size() + 2 == all.parameters().entries().size());
    randomize_model(only1.parameters(), 5);
    copy_by_name(only1.parameters(), all.parameters());  // `all`'s layer 0 compress stays 0 (unused below)

    auto mem1 = only1.make_memory(4, 3);
    CHECK(mem1.n_layers() == 1);
    auto none = all.make_memory(0, 0);  // no memory anywhere
    mem1.reset(B, Q);
    none.reset(B, Q);
    for (int s = 0; s < 4; ++s) {
        auto t = random_tokens(Q * B, 7, 100 + std::uint64_t(s));
        only1.forward(t, B, mem1);
        all.forward(t, B, none);
        const auto a = only1.layer_input(1), b = all.layer_input(1);  // layer 0's outputs
        check_close("layer 0 output", a.data(), b.data(), a.size(), 0, 0);
        if (s > 0) {  // layer 1 reads its memory
            const auto la = only1.logits(), lb = all.logits();
            CHECK_FALSE(std::equal(la.data(), la.data() + la.size(), lb.data()));
        }
        only1.update_memory(mem1);
        all.update_memory(none);
        // The memory holds layer 1's inputs, i.e. layer 0's outputs.
        if (s == 0) {
            REQUIRE(mem1.mem_slots() == Q);
            check_close("memory = layer 1 input", mem1.mem(0).data(), a.data(), a.size(), 0, 0);
        }
    }
    CHECK(mem1.c_mem_slots() > 0);
    CHECK_THROWS_WITH_AS(only1.forward(random_tokens(Q * B, 7, 1), B, all.make_memory(4, 3)),
                         doctest::Contains("the memory has 2 layers, the model 1 memory layers"), mnemo::error);

    // The checkpoint: layer 1's compress tensors only.
    const auto path = (std::filesystem::temp_directory_path() / "mnemo_test_memory_layers.safetensors").string();
    mnemo::save_parameters(path, only1.parameters());
    const auto f = mnemo::read_safetensors(path);
    std::vector<std::string> compress;
    for (const auto& t : f.tensors())
        if (t.name.find(".compress.") != std::string::npos) compress.push_back(t.name);
    std::sort(compress.begin(), compress.end());
    CHECK(compress == std::vector<std::string>{"transformer.layers.1.compress.conv.bias",
                                               "transformer.layers.1.compress.conv.weight"});
    std::filesystem::remove(path);

    // The reconstruction loss covers layer 1 only.
    only1.parameters().zero_grad();
    fill_memory(only1, mem1, B, Q, 1, 200);
    REQUIRE(mem1.compressed_away_slots() > 0);
    CHECK(only1.reconstruction_loss(mem1, true) > 0);
    check_only(only1.parameters(), {"transformer.layers.1.compress."});
}

TEST_CASE("compressive_transformer: memory_layers: the CE gradient matches finite differences; bad lists are errors") {
    auto o = tiny_options(3);
    o.memory_layers = {2, 0};
    o.residual = mnemo::residual_kind::gru;
    check_model_gradient<model_t>(o, 21);
    CHECK_THROWS_WITH_AS(model_t({.vocab = 7, .n_layers = 2, .d_ff = 6, .memory_layers = {2}}),
                         doctest::Contains("memory layer 2 is not a layer of a model with 2 layers"), mnemo::error);
    CHECK_THROWS_WITH_AS(model_t({.vocab = 7, .n_layers = 2, .d_ff = 6, .memory_layers = {1, 1}}),
                         doctest::Contains("memory layer 1 is listed twice"), mnemo::error);
}

// ---------------------------------------------------------------------------------------------
// The auto-encoding loss
// ---------------------------------------------------------------------------------------------

TEST_CASE("compressive_transformer: auto-encoding reconstruction: decoders of memory layers only, gradient only to f_c and g") {
    const index_t B = 2, Q = 2;
    model_t model({.vocab = 5, .n_layers = 3, .d_ff = 6, .n_pos = 16, .memory_layers = {0, 2},
                   .reconstruction = mnemo::reconstruction_kind::autoencoding});
    const auto& ps0 = model.parameters();
    CHECK(has_tensor(ps0, "transformer.layers.0.decoder.weight"));
    CHECK(ps0.find("transformer.layers.2.decoder.weight")->shape == std::vector<index_t>{8, 8, 2});
    CHECK(has_tensor(ps0, "transformer.layers.2.decoder.bias"));
    CHECK_FALSE(has_tensor(ps0, "transformer.layers.1.decoder.weight"));
    randomize_model(model.parameters(), 51);
    auto mem = model.make_memory(2, 4);
    mem.reset(B, Q);
    fill_memory(model, mem, B, Q, 1, 52);
    auto t = random_tokens(Q * B, 5, 53), y = random_tokens(Q * B, 5, 54);
    model.forward(t, B, mem);
    REQUIRE(model.update_memory(mem) == 2);
    auto& ps = model.parameters();
    ps.zero_grad();
    const double ae = model.reconstruction_loss(mem, true);
    CHECK(ae > 0);
    check_only(ps, {".compress.", ".decoder."});

    // Its value: Σ over memory layers of mean((g(f_c(m)) − m)²), computed here directly.
    double expected = 0;
    for (index_t s = 0; s < 2; ++s) {
        const index_t l = model.memory_layer(s);
        const auto m = mem.compressed_away(s);
        std::vector<double> cm(std::size_t(m.size() / 2)), rec(std::size_t(m.size()));
        model.layer(l).compress().forward(m, B, W(cm.data(), m.rows() / 2));
        model.layer(l).decoder().forward(V(cm.data(), m.rows() / 2), B, W(rec.data(), m.rows()));
        double sum = 0;
        for (index_t i = 0; i < m.size(); ++i) sum += (rec[std::size_t(i)] - m.data()[i]) * (rec[std::size_t(i)] - m.data()[i]);
        expected += sum / double(m.size());
    }
    CHECK(ae == doctest::Approx(expected).epsilon(1e-12));

    auto loss = [&] { return model.reconstruction_loss(mem, false); };
    auto targets = parameter_targets(ps);
    std::erase_if(targets, [](const auto& g) {
        return g.name.find(".compress.") == std::string::npos && g.name.find(".decoder.") == std::string::npos;
    });
    REQUIRE(targets.size() == 8);
    check_gradients(loss, targets);

    // train_segment: CE + AE; the decoders get gradient from AE only.
    ps.zero_grad();
    const auto l = model.train_segment(t, y, B, mem);
    CHECK(l.compressed > 0);
    CHECK(l.ar > 0);
}

// ---------------------------------------------------------------------------------------------
// The dilated and most-used compression functions in the model
// ---------------------------------------------------------------------------------------------

TEST_CASE("compressive_transformer<dilated_conv_compression>: trains; its reconstruction gradients match finite differences") {
    using dil_t = mnemo::compressive_transformer<double, mnemo::config<8, 2, 4>, mnemo::dilated_conv_compression>;
    const index_t B = 2, Q = 4;
    dil_t model({.vocab = 6, .n_layers = 2, .d_ff = 6, .n_pos = 32});
    CHECK(has_tensor(model.parameters(), "transformer.layers.1.compress.convs.1.weight"));
    randomize_model(model.parameters(), 61);
    auto mem = model.make_memory(4, 4);
    mem.reset(B, Q);
    fill_memory(model, mem, B, Q, 1, 62);
    auto t = random_tokens(Q * B, 6, 63);
    model.forward(t, B, mem);
    REQUIRE(model.update_memory(mem) == 4);
    auto& ps = model.parameters();
    ps.zero_grad();
    CHECK(model.reconstruction_loss(mem, true) > 0);
    check_only(ps, {".compress."});
    auto loss = [&] { return model.reconstruction_loss(mem, false); };
    auto targets = parameter_targets(ps);
    std::erase_if(targets, [](const auto& g) { return g.name.find(".compress.") == std::string::npos; });
    REQUIRE(targets.size() == 8);
    check_gradients(loss, targets);
}

namespace {
template <class A>
concept has_attention_weights = requires(const A& a) { a.attention_weights(); };
}  // namespace

TEST_CASE("compressive_transformer<most_used_compression>: the usage travels with the memory and picks the slots") {
    // Needs relative_attention::attention_weights(); a generic lambda keeps the model uninstantiated without it.
    []<class Cfg>() {
        if constexpr (!has_attention_weights<mnemo::relative_attention<double, Cfg>>) {
            MESSAGE("skipped: relative_attention has no attention_weights() accessor yet");
        } else {
            using mu_t = mnemo::compressive_transformer<double, Cfg, mnemo::most_used_compression>;
            static_assert(mu_t::needs_usage);
            const index_t B = 2, Q = 3, H = 2;
            mu_t model({.vocab = 7, .n_layers = 2, .d_ff = 6, .n_pos = 32, .memory_layers = {1}});
            randomize_model(model.parameters(), 71);
            auto mem = model.make_memory(/*mem_len=*/4, /*c_mem_len=*/4);
            mem.reset(B, Q);
            // Segment 1: every query's attention (mass 1 per head) lands on this segment's rows.
            fill_memory(model, mem, B, Q, 1, 72);
            REQUIRE(mem.mem_slots() == Q);
            const auto total = [&] {
                const double* u = mem.usage(0);
                return std::accumulate(u, u + mem.mem_slots() * B, 0.0);
            };
            CHECK(total() == doctest::Approx(double(B * H * Q)));
            // Segment 2 (6 slots > 4): the oldest 2 are compressed into 1, by usage.
            const std::vector<double> usage_before(mem.usage(0), mem.usage(0) + mem.mem_slots() * B);
            const std::vector<double> mem_before(mem.mem(0).data(), mem.mem(0).data() + mem.mem(0).size());
            auto t = random_tokens(Q * B, 7, 73);
            model.forward(t, B, mem);
            // Expected: held rows += this segment's attention on them; the new rows get theirs.
            const index_t K = Q + Q;  // no compressed memory yet: keys = 3 memory + 3 segment slots
            const double* a = model.layer(1).self_attn().attention_weights();
            std::vector<double> expected(std::size_t(K * B), 0.0);
            std::copy(usage_before.begin(), usage_before.end(), expected.begin());
            for (index_t b = 0; b < B; ++b)
                for (index_t h = 0; h < H; ++h)
                    for (index_t i = 0; i < Q; ++i)
                        for (index_t j = 0; j < K; ++j)
                            expected[std::size_t(j * B + b)] += a[((b * H + h) * Q + i) * K + j];
            CHECK(model.update_memory(mem) == 2);
            REQUIRE(mem.mem_slots() == 4);
            // The oldest 2 slots are gone from the usage too.
            check_close("usage", mem.usage(0), expected.data() + 2 * B, 4 * B, 1e-14, 0);
            // The compressed slot of stream b is the more used of its two oldest slots.
            for (index_t b = 0; b < B; ++b) {
                const index_t pick = expected[std::size_t(1 * B + b)] > expected[std::size_t(b)] ? 1 : 0;
                const double* want = mem_before.data() + (pick * B + b) * index_t(D);
                check_close("compressed slot", mem.c_mem(0).data() + b * index_t(D), want, index_t(D), 0, 0);
            }
            // A saved state restores: resize, write the usage back.
            std::vector<double> u(mem.usage(0), mem.usage(0) + mem.mem_slots() * B);
            auto copy = model.make_memory(4, 4);
            copy.reset(B, Q);
            copy.resize(mem.mem_slots(), mem.c_mem_slots());
            std::copy(u.begin(), u.end(), copy.usage_data(0));
            CHECK(std::equal(u.begin(), u.end(), copy.usage(0)));
        }
    }.template operator()<tiny>();
}

// memory_attention: the absorbed route (folding W_k, W_v into the queries and the context) and the
// projected one give the same losses, gradients and memory over several training segments that fill
// and compress the memory, with pre-LN and post-LN and a GRU gate; and the generation cache keeps the
// projections (it needs them), whatever the mode.
TEST_CASE("compressive_transformer: absorbed and projected memory attention train identically") {
    for (auto norm : {mnemo::norm_kind::pre, mnemo::norm_kind::post}) {
        INFO("post-LN " << (norm == mnemo::norm_kind::post));
        auto o = tiny_options(2);
        o.norm = norm;
        o.residual = mnemo::residual_kind::gru;
        model_t proj(o), abs(o);
        randomize_model(proj.parameters(), 71);
        copy_by_name(proj.parameters(), abs.parameters());
        proj.set_memory_attention(mnemo::memory_attention::projected);
        abs.set_memory_attention(mnemo::memory_attention::absorbed);
        const index_t batch = 2, q = 3;
        auto mp = proj.make_memory(4, 3), ma = abs.make_memory(4, 3);
        mp.reset(batch, q);
        ma.reset(batch, q);
        for (int s = 0; s < 6; ++s) {
            auto t = random_tokens(q * batch, proj.vocab(), 300 + std::uint64_t(s));
            auto y = random_tokens(q * batch, proj.vocab(), 400 + std::uint64_t(s));
            proj.parameters().zero_grad();
            abs.parameters().zero_grad();
            const auto lp = proj.train_segment(t, y, batch, mp);
            const auto la = abs.train_segment(t, y, batch, ma);
            INFO("segment " << s);
            CHECK(la.ce == doctest::Approx(lp.ce).epsilon(1e-12));
            CHECK(la.ar == doctest::Approx(lp.ar).epsilon(1e-10));
            check_close("gradients", abs.parameters().grads(), proj.parameters().grads(), proj.parameters().size(),
                        1e-11, 1e-9);
        }
        // The first layer attends over memory from the second segment on: the route was taken.
        CHECK(abs.layer(0).self_attn().last_forward_absorbed());
        CHECK_FALSE(proj.layer(0).self_attn().last_forward_absorbed());
        abs.cache_memory_projections(true);
        auto t = random_tokens(q * batch, abs.vocab(), 999);
        abs.forward(t, batch, ma);
        CHECK_FALSE(abs.layer(0).self_attn().last_forward_absorbed());
    }
}

// On the absorbed route a layer keeps the normalised memory rows ẑ of the slots it has seen
// (compressive_layer::keep_normalised_memory) and normalises only the new ones: training over a
// memory whose contents are copied into a fresh memory before every segment (a new epoch: nothing
// is kept) gives the same losses and gradients to the bit, while the memory fills, compresses and
// drops slots, the window slides and restarts at its slab's front, for segments shorter than the
// memory (uncompressed slots kept too) and as long as it (all replaced), and for Transformer-XL
// (no compressed memory: the uncompressed slots slide the window).
TEST_CASE("compressive_transformer: the kept normalised memory rows train bitwise as normalising them all") {
    struct shape_case {
        index_t q, mem_len, c_mem_len;
    };
    auto run = [&]<class Model>(std::initializer_list<shape_case> cases) {
        for (const shape_case sc : cases) {
            CAPTURE(sc.q);
            CAPTURE(sc.mem_len);
            CAPTURE(sc.c_mem_len);
            Model kept(tiny_options(2)), fresh(tiny_options(2));
            randomize_model(kept.parameters(), 83);
            copy_by_name(kept.parameters(), fresh.parameters());
            kept.set_memory_attention(mnemo::memory_attention::absorbed);
            fresh.set_memory_attention(mnemo::memory_attention::absorbed);
            const index_t batch = 2;
            auto mk = kept.make_memory(sc.mem_len, sc.c_mem_len);
            mk.reset(batch, sc.q);
            for (int s = 0; s < 14; ++s) {
                INFO("segment " << s);
                // The fresh model's memory: the same slots under a new epoch.
                auto mf = fresh.make_memory(sc.mem_len, sc.c_mem_len);
                mf.reset(batch, sc.q);
                mf.resize(mk.mem_slots(), mk.c_mem_slots());
                for (index_t l = 0; l < mk.n_layers(); ++l) {
                    std::copy(mk.mem(l).data(), mk.mem(l).data() + mk.mem(l).size(), mf.mem_data(l));
                    std::copy(mk.c_mem(l).data(), mk.c_mem(l).data() + mk.c_mem(l).size(), mf.c_mem_data(l));
                }
                auto t = random_tokens(sc.q * batch, kept.vocab(), 500 + std::uint64_t(s));
                auto y = random_tokens(sc.q * batch, kept.vocab(), 600 + std::uint64_t(s));
                kept.parameters().zero_grad();
                fresh.parameters().zero_grad();
                const auto lk = kept.train_segment(t, y, batch, mk);
                const auto lf = fresh.train_segment(t, y, batch, mf);
                CHECK(lk.ce == lf.ce);
                CHECK(lk.ar == lf.ar);
                check_close("gradients", kept.parameters().grads(), fresh.parameters().grads(), kept.parameters().size(),
                            0, 0);
            }
            CHECK(kept.layer(0).self_attn().last_forward_absorbed());
        }
    };
    run.template operator()<model_t>({{3, 4, 3}, {2, 2, 5}, {1, 3, 2}});
    run.template operator()<mnemo::compressive_transformer<double, tiny, mnemo::no_compression>>({{2, 5, 0}, {3, 3, 0}});
}
