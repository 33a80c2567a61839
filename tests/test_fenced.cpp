// The fenced backend (tests/fenced_backend.hpp): its buffers can be reached only by kernels. These
// tests check the fence itself (a host access faults, naming the buffer; kernels and the host path
// pass), then run modules over it and compare every number with the CPU backend's, bitwise: any host
// access left in those modules would kill this test.
#include <sys/wait.h>
#include <unistd.h>

#include <bit>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "backend_runs.hpp"
#include "fenced_backend.hpp"
#include "gradcheck.hpp"
#include "testing.hpp"

#include <mnemo/mnemo.hpp>

using namespace mnemo;
using namespace mnemo::backend_runs;

namespace {

/// Runs f in a child process with stderr captured; returns (how it ended, what it wrote to stderr).
template <class F>
std::pair<int, std::string> in_child(F&& f) {
    int fds[2];
    REQUIRE(pipe(fds) == 0);
    const pid_t pid = fork();
    REQUIRE(pid >= 0);
    if (pid == 0) {
        close(fds[0]);
        dup2(fds[1], 2);
        // The child dies of the fault itself, past doctest's handler (which would report a crash).
        struct sigaction dfl{};
        dfl.sa_handler = SIG_DFL;
        sigaction(SIGSEGV, &dfl, nullptr);
        fence::install_handler();  // in front of the default action
        f();
        _exit(0);
    }
    close(fds[1]);
    std::string err;
    char buf[512];
    for (ssize_t n; (n = read(fds[0], buf, sizeof buf)) > 0;) err.append(buf, std::size_t(n));
    close(fds[0]);
    int status = 0;
    waitpid(pid, &status, 0);
    return {status, err};
}


}  // namespace

TEST_CASE("fenced backend: a host access to a fenced buffer kills the process and names the buffer") {
    auto [status, err] = in_child([] {
        buffer<float, fenced> b;
        float* p = b.ensure(100);
        std::fprintf(stderr, "reading\n");
        volatile float x = p[3];  // the fault
        (void)x;
    });
    CHECK(WIFSIGNALED(status));
    CHECK(WTERMSIG(status) == SIGSEGV);
    CHECK(err.find("reading") != std::string::npos);
    CHECK(err.find("host code touched fenced buffer #") != std::string::npos);
    CHECK(err.find("at byte 12 outside any kernel") != std::string::npos);
}

TEST_CASE("fenced backend: a host pointer given to a kernel, directly or inside an argument struct, aborts naming it") {
    auto [status, err] = in_child([] {
        std::vector<float> host(16, 1.0f);
        buffer<float, fenced> y;
        ops<fenced>::scale(1, 16, host.data(), 16, 2.0f, y.ensure(16), 16);  // argument 2: host memory
    });
    CHECK(WIFSIGNALED(status));
    CHECK(WTERMSIG(status) == SIGABRT);
    CHECK(err.find("kernel 'scale' was given a host pointer as argument 2") != std::string::npos);

    auto [status2, err2] = in_child([] {
        std::vector<float> host(2048, 1.0f);
        const float log[1] = {0.5f};
        std::uint32_t owed[2] = {0, 0};
        const std::uint8_t deferrable[2] = {1, 1};
        ops<fenced>::pay_deferred_decay(deferred_decay<float>{host.data(), 2048, log, 1, owed, deferrable}, 0, 2048);
    });
    CHECK(WIFSIGNALED(status2));
    CHECK(WTERMSIG(status2) == SIGABRT);
    CHECK(err2.find("kernel 'pay_deferred_decay' was given a host pointer as argument 0, field values") !=
          std::string::npos);
}

TEST_CASE("fenced backend: kernels and the host path reach fenced buffers; the fence closes after them") {
    const std::size_t regions_before = fence::live_regions();
    {
        buffer<float, fenced> grown;
        grown.ensure(10);
        grown.ensure(100000);  // the old block is released
        CHECK(fence::live_regions() == regions_before + 1);
    }
    CHECK(fence::live_regions() == regions_before);  // and the last one with the buffer
    buffer<float, fenced> a, b, c;
    upload(a, std::vector<float>{1, 2, 3, 4, 5, 6});
    upload(b, std::vector<float>{10, 20, 30, 40, 50, 60});
    c.ensure(6);
    checked_ops<fenced>::add(2, 3, a.data(), 3, b.data(), 3, c.data(), 3);
    CHECK(download(c, 6) == std::vector<float>{11, 22, 33, 44, 55, 66});
    // Growth keeps the contents (a kernel-side copy).
    c.ensure(4096);
    CHECK(download(c, 6) == std::vector<float>{11, 22, 33, 44, 55, 66});
    // And the fence is closed again: a host read now faults.
    float* p = c.data();
    auto [status, err] = in_child([p] {
        volatile float x = p[0];
        (void)x;
    });
    CHECK(WIFSIGNALED(status));
    CHECK(err.find("host code touched fenced buffer") != std::string::npos);
}


TEST_CASE("fenced backend: linear, layer norm, feed-forward, residual, embedding and the cross-entropy loss match the CPU bitwise") {
    small_net<cpu> host;
    small_net<fenced> fenced_net;
    CHECK(host.values() == fenced_net.values());
    const std::vector<token_t> tokens = {1, 4, 4, 0, 10, 3, 7, 2, 9, 4, 5, 6, 8, 1, 0, 2, 3};
    const std::vector<token_t> targets = {4, 4, 0, 10, 3, 7, -1, 9, 4, 5, 6, 8, 1, 0, 2, 3, 1};
    for (int step = 0; step < 2; ++step) {
        host.step(tokens, targets);
        fenced_net.step(tokens, targets);
        const index_t n = index_t(tokens.size());
        CHECK(download(host.logits, n * vocab) == download(fenced_net.logits, n * vocab));
        CHECK(host.loss == fenced_net.loss);
        CHECK(host.grads() == fenced_net.grads());
        CHECK(download(host.dx, n * index_t(D)) == download(fenced_net.dx, n * index_t(D)));
    }
    // A parameter's host path both ways.
    std::vector<float> w(std::size_t(fenced_net.head.weight().size()));
    fenced_net.head.weight().download(w);
    std::vector<float> hw(w.size());
    host.head.weight().download(hw);
    CHECK(w == hw);
    for (float& x : w) x *= 2;
    fenced_net.head.weight().upload(w);
    std::vector<float> back(w.size());
    fenced_net.head.weight().download(back);
    CHECK(back == w);
}


TEST_CASE("fenced backend: relative attention (projected, absorbed, one query, padding, clamp, frozen norm rows, "
          "key/value reuse) matches the CPU bitwise") {
    for (memory_attention mode : {memory_attention::projected, memory_attention::absorbed})
        for (index_t Q : {1, 3})
            for (int v = 0; v < 6; ++v) {
                const int variant = v < 4 ? v : v - 4;
                const bool forward_norm = v >= 4;
                INFO("absorbed=" << (mode == memory_attention::absorbed) << " Q=" << Q << " variant=" << v);
                const attention_run c = run_attention<cpu>(mode, Q, variant, forward_norm);
                const attention_run f = run_attention<fenced>(mode, Q, variant, forward_norm);
                CHECK(c.out == f.out);
                CHECK(c.dzq == f.dzq);
                CHECK(c.dzkv == f.dzkv);
                CHECK(c.grads == f.grads);
                CHECK(c.dgamma == f.dgamma);
                CHECK(c.dbeta == f.dbeta);
                CHECK(c.out2 == f.out2);
            }
}

namespace {

void check_same(const module_run& c, const module_run& f) {
    CHECK(c.out == f.out);
    CHECK(c.d_in == f.d_in);
    CHECK(c.d_in2 == f.d_in2);
    CHECK(c.grads == f.grads);
    CHECK(!c.out.empty());
}

}  // namespace

TEST_CASE("fenced backend: every compression function and the GRU gate match the CPU bitwise") {
    SUBCASE("conv") { check_same(run_compression<conv_compression, cpu>(), run_compression<conv_compression, fenced>()); }
    SUBCASE("max pool") {
        check_same(run_compression<max_pool_compression, cpu>(), run_compression<max_pool_compression, fenced>());
    }
    SUBCASE("mean pool") {
        check_same(run_compression<mean_pool_compression, cpu>(), run_compression<mean_pool_compression, fenced>());
    }
    SUBCASE("dilated conv") {
        check_same(run_compression<dilated_conv_compression, cpu>(), run_compression<dilated_conv_compression, fenced>());
    }
    SUBCASE("most used") {
        check_same(run_compression<most_used_compression, cpu>(), run_compression<most_used_compression, fenced>());
    }
    SUBCASE("GRU gate") { check_same(run_gru<cpu>(), run_gru<fenced>()); }
}


TEST_CASE("fenced backend: a feedback attention step matches the CPU bitwise") {
    check_same(run_feedback_step<cpu>(), run_feedback_step<fenced>());
}

namespace {

void check_same(const model_run& c, const model_run& f, bool compresses = true) {
    CHECK((c.compressed > 0) == compresses);  // the merges compressed (the reconstruction losses ran)
    CHECK(c.ce == f.ce);
    CHECK(c.ar == f.ar);
    CHECK(c.norms == f.norms);
    CHECK(c.grads == f.grads);
}

}  // namespace

TEST_CASE("fenced backend: compressive transformer and Transformer-XL training steps (clipping, every optimizer, "
          "resume) match the CPU bitwise") {
    // The fenced runs resume their optimizer midway and the CPU runs do not: resuming changes nothing.
    SUBCASE("conv compression, pre-LN, attention reconstruction, padding; AdamW") {
        check_same(run_model<conv_compression, cpu>({}, 4, true), run_model<conv_compression, fenced>({}, 4, true, optim_kind::adamw, true));
    }
    SUBCASE("max pooling, post-LN; labml's Adam with warm-up") {
        compressive_options o{.norm = norm_kind::post};
        check_same(run_model<max_pool_compression, cpu>(o, 4, false, optim_kind::labml),
                   run_model<max_pool_compression, fenced>(o, 4, false, optim_kind::labml, true));
    }
    SUBCASE("mean pooling, GRU gates, one memory layer; Adam with L2") {
        compressive_options o{.residual = residual_kind::gru, .memory_layers = {1}};
        check_same(run_model<mean_pool_compression, cpu>(o, 4, false, optim_kind::adam),
                   run_model<mean_pool_compression, fenced>(o, 4, false, optim_kind::adam, true));
    }
    SUBCASE("dilated convolutions, auto-encoding loss; SGD with Nesterov momentum") {
        compressive_options o{.reconstruction = reconstruction_kind::autoencoding};
        check_same(run_model<dilated_conv_compression, cpu>(o, 4, false, optim_kind::sgd),
                   run_model<dilated_conv_compression, fenced>(o, 4, false, optim_kind::sgd, true));
    }
    SUBCASE("most-used compression (the memory's usage over the backend); AdamW") {
        check_same(run_model<most_used_compression, cpu>({}, 4, true),
                   run_model<most_used_compression, fenced>({}, 4, true, optim_kind::adamw, true));
    }
    SUBCASE("Transformer-XL; AdamW") {
        check_same(run_model<no_compression, cpu>({}, 0, true), run_model<no_compression, fenced>({}, 0, true, optim_kind::adamw, true), false);
    }
}


/// A double's bits (so that bitwise equality is what a check compares).
std::uint64_t bits(double x) { return std::bit_cast<std::uint64_t>(x); }

/// Three training segments and one evaluation segment queued on the fenced backend, each checked to
/// read nothing on the host (no download: a GPU would not wait), their losses read afterwards with
/// read_losses(); against train_segment / eval_segment on the CPU: losses, compressed counts and
/// gradients bitwise the same. `pad_all`: the second segment is padding throughout (the attention
/// reconstruction then counts no row and its gradient pass adds nothing).
template <template <class, std::size_t, std::size_t, class> class Compression>
void check_queued_segments(compressive_options o, index_t c_mem_len, bool pad_all = false) {
    o.vocab = 7;
    o.n_layers = 2;
    o.d_ff = 24;
    o.n_pos = 32;
    compressive_transformer<float, config<16, 4, 2>, Compression, cpu> host(o);
    compressive_transformer<float, config<16, 4, 2>, Compression, fenced> dev(o);
    host.reset_parameters(5);
    dev.reset_parameters(5);
    auto host_mem = host.make_memory(4, c_mem_len);
    auto dev_mem = dev.make_memory(4, c_mem_len);
    const index_t batch = 2, q = 4;
    rng g(29);
    CHECK_THROWS_WITH_AS(dev.read_losses(), doctest::Contains("read_losses without a queued segment"), error);
    for (int seg = 0; seg < 4; ++seg) {
        std::vector<token_t> tokens(std::size_t(q * batch)), targets(tokens.size());
        for (auto& t : tokens) t = token_t(g.uniform(0, 7));
        for (auto& t : targets) t = token_t(g.uniform(0, 7));
        std::vector<std::uint8_t> pad(tokens.size(), std::uint8_t(pad_all && seg == 1));
        if (pad_all && seg == 1) std::fill(targets.begin(), targets.end(), -1);
        host.parameters().zero_grad();
        dev.parameters().zero_grad();
        const bool train = seg < 3;
        const segment_losses want = train ? host.train_segment(tokens, targets, batch, host_mem, pad)
                                          : host.eval_segment(tokens, targets, batch, host_mem, pad);
        const std::size_t before = fence::downloads();
        if (train) dev.queue_train_segment(tokens, targets, batch, dev_mem, pad);
        else dev.queue_eval_segment(tokens, targets, batch, dev_mem, pad);
        CHECK_MESSAGE(fence::downloads() == before, "segment ", seg, " read backend memory on the host");
        const segment_losses got = dev.read_losses();
        CHECK(fence::downloads() == before + 1);  // every loss in one transfer
        CHECK(bits(got.ce) == bits(want.ce));
        CHECK(bits(got.ar) == bits(want.ar));
        CHECK(got.compressed == want.compressed);
        const segment_losses again = dev.read_losses();  // reading twice reads the same
        CHECK(bits(again.ar) == bits(got.ar));
        std::vector<float> hg(std::size_t(host.parameters().size())), dg(hg.size());
        host.parameters().download_all_grads(hg);
        dev.parameters().download_all_grads(dg);
        CHECK(hg == dg);
    }
}

TEST_CASE("fenced backend: a queued segment leaves its losses on the backend until read_losses, bitwise train_segment's") {
    SUBCASE("conv compression, attention reconstruction") { check_queued_segments<conv_compression>({}, 4); }
    SUBCASE("attention reconstruction, a segment padded throughout") { check_queued_segments<conv_compression>({}, 4, true); }
    SUBCASE("post-LN, max pooling") { check_queued_segments<max_pool_compression>({.norm = norm_kind::post}, 4); }
    SUBCASE("auto-encoding loss, one memory layer") {
        check_queued_segments<mean_pool_compression>(
            {.memory_layers = {1}, .reconstruction = reconstruction_kind::autoencoding}, 4);
    }
    SUBCASE("most-used compression") { check_queued_segments<most_used_compression>({}, 4); }
    SUBCASE("Transformer-XL") { check_queued_segments<no_compression>({}, 0); }
}

TEST_CASE("fenced backend: a queued Feedback Transformer sequence reads its loss with read_loss, bitwise") {
    feedback_transformer<float, config<16, 4>, per_layer_kv, cpu> host({.vocab = 7, .n_layers = 2, .d_ff = 24, .n_pos = 16});
    feedback_transformer<float, config<16, 4>, per_layer_kv, fenced> dev({.vocab = 7, .n_layers = 2, .d_ff = 24, .n_pos = 16});
    host.reset_parameters(6);
    dev.reset_parameters(6);
    CHECK_THROWS_WITH_AS(dev.read_loss(), doctest::Contains("read_loss without a queued sequence"), error);
    rng g(31);
    for (int seq = 0; seq < 2; ++seq) {
        std::vector<token_t> tokens(10), targets(10);
        for (auto& t : tokens) t = token_t(g.uniform(0, 7));
        for (auto& t : targets) t = token_t(g.uniform(0, 7));
        const double want = seq == 0 ? host.train_segment(tokens, targets, 2) : host.eval_segment(tokens, targets, 2);
        if (seq == 0) dev.queue_train_segment(tokens, targets, 2);
        else dev.queue_eval_segment(tokens, targets, 2);
        const std::size_t before = fence::downloads();
        CHECK(bits(dev.read_loss()) == bits(want));
        CHECK(fence::downloads() == before + 1);
    }
}

TEST_CASE("fenced backend: Feedback Transformer training and cached generation match the CPU bitwise") {
    SUBCASE("per-layer keys and values") {
        check_same(run_feedback_model<per_layer_kv, cpu>(), run_feedback_model<per_layer_kv, fenced>(), false);
    }
    SUBCASE("shared keys and values") {
        check_same(run_feedback_model<shared_kv, cpu>(), run_feedback_model<shared_kv, fenced>(), false);
    }
}


TEST_CASE("fenced backend: compressive transformer and Transformer-XL generation match the CPU") {
    CHECK(run_generation<conv_compression, cpu>() == run_generation<conv_compression, fenced>());
    CHECK(run_generation<mean_pool_compression, cpu>() == run_generation<mean_pool_compression, fenced>());
    CHECK(run_generation<no_compression, cpu>() == run_generation<no_compression, fenced>());
}


namespace {

template <class Of>
void check_trainer() {
    testing::temp_dir dir("fenced_trainer");
    const auto c = run_trainer<Of, cpu>(dir.path.string());
    const auto f = run_trainer<Of, fenced>(dir.path.string());
    CHECK(c.ce == f.ce);
    CHECK(c.model_file == f.model_file);  // the files written over the host path, byte for byte
    CHECK(c.state_file == f.state_file);
    CHECK(c.values == f.values);
    CHECK(c.valid_ce == f.valid_ce);
    CHECK(c.sample == f.sample);
    CHECK(!c.sample.empty());
}

}  // namespace

TEST_CASE("fenced backend: the trainer (steps, checkpoint save and restore, validation, sampling) matches the CPU") {
    SUBCASE("conv compression") { check_trainer<compressive_of<conv_compression>>(); }
    SUBCASE("most-used compression (the memory's usage in the checkpoint)") {
        check_trainer<compressive_of<most_used_compression>>();
    }
    SUBCASE("Feedback Transformer") { check_trainer<feedback_of>(); }
}

// Finite differences over the fenced backend (tests/gradcheck.hpp perturbs each parameter on a host copy
// and uploads it): the models' gradients, computed by kernels only, against central differences, at 8
// elements of each tensor (every kernel call opens and closes the fence, which makes a full sweep slow).
TEST_CASE("fenced backend: the compressive transformer's CE and reconstruction gradients match finite differences") {
    using model_f = compressive_transformer<double, config<8, 2, 2>, conv_compression, fenced>;
    const index_t B = 2, Q = 3, vocab = 7;
    model_f model({.vocab = vocab, .n_layers = 2, .d_ff = 6, .n_pos = 16});
    testing::randomize_model(model.parameters(), 11);
    auto mem = model.make_memory(/*mem_len=*/3, /*c_mem_len=*/2);
    mem.reset(B, Q);
    for (int s = 0; s < 2; ++s) {  // fill the memory and compress
        const auto t = testing::random_tokens(Q * B, vocab, 20 + std::uint64_t(s));
        model.forward(t, B, mem);
        model.update_memory(mem);
    }
    REQUIRE(mem.mem_slots() > 0);
    REQUIRE(mem.c_mem_slots() > 0);
    const auto tokens = testing::random_tokens(Q * B, vocab, 30), targets = testing::random_tokens(Q * B, vocab, 31);
    auto& ps = model.parameters();
    SUBCASE("cross-entropy of a segment reading both memories") {
        const auto loss = [&] {
            model.forward(tokens, B, mem);
            return model.cross_entropy(targets, false);
        };
        ps.zero_grad();
        model.forward(tokens, B, mem);
        model.cross_entropy(targets, true);
        model.backward(tokens);
        auto t = testing::parameter_targets(ps);
        std::erase_if(t, [](const auto& x) { return x.name.find("compress") != std::string::npos; });
        testing::check_gradients(loss, t, 1e-6, 1e-6, /*sample=*/8);
    }
    SUBCASE("attention reconstruction: the compression function's gradient") {
        model.forward(tokens, B, mem);
        REQUIRE(model.update_memory(mem) > 0);
        ps.zero_grad();
        CHECK(model.reconstruction_loss(mem, true) > 0);
        auto t = testing::parameter_targets(ps);
        std::erase_if(t, [](const auto& x) { return x.name.find(".compress.") == std::string::npos; });
        REQUIRE(t.size() == 4);
        testing::check_gradients([&] { return model.reconstruction_loss(mem, false); }, t, 1e-6, 1e-6, /*sample=*/8);
    }
}

TEST_CASE("fenced backend: the Feedback Transformer's gradient matches finite differences") {
    using model_f = feedback_transformer<double, config<8, 2>, shared_kv, fenced>;
    const index_t B = 2, T = 4, vocab = 7;
    model_f model({.vocab = vocab, .n_layers = 2, .d_ff = 6, .n_pos = 8});
    auto& ps = model.parameters();
    testing::randomize_model(ps, 11);
    auto tokens = testing::random_tokens(T * B, vocab, 30), targets = testing::random_tokens(T * B, vocab, 31);
    targets[3] = -1;  // an ignored position
    const auto loss = [&] {
        model.forward(tokens, B);
        return model.cross_entropy(targets, false);
    };
    ps.zero_grad();
    model.train_segment(tokens, targets, B);
    testing::check_gradients(loss, testing::parameter_targets(ps), 1e-6, 1e-6, /*sample=*/8);
}


TEST_CASE("fenced backend: a runtime-shape compressive transformer (every extent dynamic) matches the CPU bitwise") {
    check_same(run_runtime_shape<cpu>(), run_runtime_shape<fenced>());
}


TEST_CASE("fenced backend: the autoregressive wrapper (training, evaluation, generation) matches the CPU bitwise") {
    const model_run c = run_wrapper<cpu>(), f = run_wrapper<fenced>();
    CHECK(c.ce == f.ce);
    CHECK(c.ar == f.ar);
    CHECK(c.grads == f.grads);
    CHECK(c.ce.size() > 12);
}
