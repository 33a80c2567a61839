// Whole modules, models and the trainer on the GPU (mnemo::cuda) against the CPU: the same runs as
// the fenced backend's (tests/backend_runs.hpp), compared within tolerances instead of bitwise, since
// cuBLAS and the CUDA kernels sum in other orders. The PyTorch golden runs on the GPU are
// test_cuda_golden_* (the golden test files built for this backend).
//
// Tolerances: one forward and backward in float agree to ~1e-5 of the values' scale (check_close_run,
// 2e-4 to leave room); after optimizer steps, Adam's update of an element whose gradient is near zero
// is ±lr whatever the gradient's size, so a rounding difference can move such an element by up to
// 2·lr: the final values are compared element-wise with 1e-3 and at most 0.2% of them may differ more
// (mostly_close). The golden tests in double are the exactness check.
#include <cmath>
#include <string>
#include <vector>

#include "backend_runs.hpp"
#include "cuda_testing.hpp"

#include <mnemo/cuda.hpp>

using namespace mnemo;
using namespace mnemo::backend_runs;

namespace {

/// Every element of a within atol + rtol·|b| of b.
template <class T>
void close_all(const std::string& what, const std::vector<T>& a, const std::vector<T>& b, double tol = 2e-4) {
    INFO(what);
    REQUIRE(a.size() == b.size());
    testing::check_close(what, a.data(), b.data(), index_t(a.size()), tol, tol);
}

/// All but a fraction max_outliers of the elements within tol (absolute and relative), and none NaN.
void mostly_close(const std::string& what, const std::vector<float>& a, const std::vector<float>& b, double tol = 1e-3,
                  double max_outliers = 2e-3) {
    INFO(what);
    REQUIRE(a.size() == b.size());
    std::size_t out = 0;
    for (std::size_t i = 0; i < a.size(); ++i) {
        REQUIRE(std::isfinite(a[i]));
        if (std::abs(double(a[i]) - double(b[i])) > tol * (1 + std::abs(double(b[i])))) ++out;
    }
    CHECK(double(out) <= max_outliers * double(a.size()));
}

void check_close_run(const module_run& c, const module_run& g) {
    close_all("out", g.out, c.out);
    close_all("d_in", g.d_in, c.d_in);
    close_all("d_in2", g.d_in2, c.d_in2);
    close_all("grads", g.grads, c.grads);
    CHECK(!c.out.empty());
}

/// Losses and norms close; the first segment's gradients close (no step has happened yet); the later
/// ones and the final values mostly close (see the file's comment).
void check_close_run(const model_run& c, const model_run& g, bool compresses = true) {
    CHECK((g.compressed > 0) == compresses);
    CHECK(g.compressed == c.compressed);
    close_all("ce", g.ce, c.ce, 1e-4);
    close_all("ar", g.ar, c.ar, 1e-4);
    close_all("norms", g.norms, c.norms, 1e-4);
    REQUIRE(g.grads.size() == c.grads.size());
    close_all("first gradients", g.grads.front(), c.grads.front());
    for (std::size_t i = 1; i < g.grads.size(); ++i) mostly_close("gradients/values " + std::to_string(i), g.grads[i], c.grads[i]);
}

}  // namespace

TEST_CASE("cuda: linear, layer norm, feed-forward, residual, embedding and the cross-entropy loss match the CPU") {
    small_net<cpu> host;
    small_net<cuda> gpu;
    CHECK(host.values() == gpu.values());  // initialised on the host, uploaded
    const std::vector<token_t> tokens = {1, 4, 4, 0, 10, 3, 7, 2, 9, 4, 5, 6, 8, 1, 0, 2, 3};
    const std::vector<token_t> targets = {4, 4, 0, 10, 3, 7, -1, 9, 4, 5, 6, 8, 1, 0, 2, 3, 1};
    host.step(tokens, targets);
    gpu.step(tokens, targets);
    const index_t n = index_t(tokens.size());
    close_all("logits", download(gpu.logits, n * vocab), download(host.logits, n * vocab));
    CHECK(gpu.loss == doctest::Approx(host.loss).epsilon(1e-5));
    close_all("grads", gpu.grads(), host.grads());
    close_all("dx", download(gpu.dx, n * index_t(D)), download(host.dx, n * index_t(D)));
}

TEST_CASE("cuda: relative attention (one query, padding, clamp, frozen norm rows, key/value reuse) matches the CPU") {
    // ops<cuda> has no absorbed route: asked for it, the module projects (the CPU run projects too).
    for (memory_attention mode : {memory_attention::projected, memory_attention::absorbed})
        for (index_t Q : {1, 3})
            for (int v = 0; v < 6; ++v) {
                const int variant = v < 4 ? v : v - 4;
                const bool forward_norm = v >= 4;
                INFO("asked absorbed=" << (mode == memory_attention::absorbed) << " Q=" << Q << " variant=" << v);
                const attention_run c = run_attention<cpu>(memory_attention::projected, Q, variant, forward_norm);
                const attention_run g = run_attention<cuda>(mode, Q, variant, forward_norm);
                close_all("out", g.out, c.out);
                close_all("dzq", g.dzq, c.dzq);
                close_all("dzkv", g.dzkv, c.dzkv);
                close_all("grads", g.grads, c.grads);
                close_all("dgamma", g.dgamma, c.dgamma);
                close_all("dbeta", g.dbeta, c.dbeta);
                if (mode == memory_attention::projected) close_all("out2", g.out2, c.out2);  // (run_attention)
            }
}

TEST_CASE("cuda: every compression function, the GRU gate and a feedback attention step match the CPU") {
    SUBCASE("conv") { check_close_run(run_compression<conv_compression, cpu>(), run_compression<conv_compression, cuda>()); }
    SUBCASE("max") {
        check_close_run(run_compression<max_pool_compression, cpu>(), run_compression<max_pool_compression, cuda>());
    }
    SUBCASE("mean") {
        check_close_run(run_compression<mean_pool_compression, cpu>(), run_compression<mean_pool_compression, cuda>());
    }
    SUBCASE("dilated") {
        check_close_run(run_compression<dilated_conv_compression, cpu>(), run_compression<dilated_conv_compression, cuda>());
    }
    SUBCASE("most used") {
        check_close_run(run_compression<most_used_compression, cpu>(), run_compression<most_used_compression, cuda>());
    }
    SUBCASE("GRU gate") { check_close_run(run_gru<cpu>(), run_gru<cuda>()); }
    SUBCASE("feedback attention step") { check_close_run(run_feedback_step<cpu>(), run_feedback_step<cuda>()); }
}

TEST_CASE("cuda: compressive transformer and Transformer-XL training (every variant, clipping, every optimizer, "
          "resume) match the CPU") {
    SUBCASE("conv compression, pre-LN, attention reconstruction, padding; AdamW, resumed") {
        check_close_run(run_model<conv_compression, cpu>({}, 4, true),
                        run_model<conv_compression, cuda>({}, 4, true, optim_kind::adamw, true));
    }
    SUBCASE("max pooling, post-LN; labml's Adam with warm-up") {
        compressive_options o{.norm = norm_kind::post};
        check_close_run(run_model<max_pool_compression, cpu>(o, 4, false, optim_kind::labml),
                        run_model<max_pool_compression, cuda>(o, 4, false, optim_kind::labml, true));
    }
    SUBCASE("mean pooling, GRU gates, one memory layer; Adam with L2") {
        compressive_options o{.residual = residual_kind::gru, .memory_layers = {1}};
        check_close_run(run_model<mean_pool_compression, cpu>(o, 4, false, optim_kind::adam),
                        run_model<mean_pool_compression, cuda>(o, 4, false, optim_kind::adam, true));
    }
    SUBCASE("dilated convolutions, auto-encoding loss; SGD with Nesterov momentum") {
        compressive_options o{.reconstruction = reconstruction_kind::autoencoding};
        check_close_run(run_model<dilated_conv_compression, cpu>(o, 4, false, optim_kind::sgd),
                        run_model<dilated_conv_compression, cuda>(o, 4, false, optim_kind::sgd, true));
    }
    SUBCASE("most-used compression; AdamW") {
        check_close_run(run_model<most_used_compression, cpu>({}, 4, true),
                        run_model<most_used_compression, cuda>({}, 4, true, optim_kind::adamw, true));
    }
    SUBCASE("Transformer-XL; AdamW") {
        check_close_run(run_model<no_compression, cpu>({}, 0, true), run_model<no_compression, cuda>({}, 0, true), false);
    }
}

TEST_CASE("cuda: Feedback Transformer training and cached generation match the CPU") {
    SUBCASE("per-layer keys and values") {
        check_close_run(run_feedback_model<per_layer_kv, cpu>(), run_feedback_model<per_layer_kv, cuda>(), false);
    }
    SUBCASE("shared keys and values") {
        check_close_run(run_feedback_model<shared_kv, cpu>(), run_feedback_model<shared_kv, cuda>(), false);
    }
}

TEST_CASE("cuda: generation from the cache draws the CPU's tokens") {
    // Sampling at temperature 0.9 from logits that agree to ~1e-6: a token differs only if a draw lands
    // that close to a boundary of the distribution.
    CHECK(run_generation<conv_compression, cpu>() == run_generation<conv_compression, cuda>());
    CHECK(run_generation<mean_pool_compression, cpu>() == run_generation<mean_pool_compression, cuda>());
    CHECK(run_generation<no_compression, cpu>() == run_generation<no_compression, cuda>());
}

TEST_CASE("cuda: a runtime-shape model and the autoregressive wrapper match the CPU") {
    check_close_run(run_runtime_shape<cpu>(), run_runtime_shape<cuda>());
    const model_run c = run_wrapper<cpu>(), g = run_wrapper<cuda>();
    close_all("losses and tokens", g.ce, c.ce, 1e-4);
    close_all("ar", g.ar, c.ar, 1e-4);
    close_all("grads", g.grads.front(), c.grads.front());
}

namespace {

template <class Of, class B, class B2>
void check_trainer_across() {
    testing::temp_dir dir("cuda_trainer");
    const auto ref = run_trainer<Of, cpu>(dir.path.string());
    const auto across = run_trainer<Of, B, B2>(dir.path.string());
    close_all("losses", across.ce, ref.ce, 1e-4);
    mostly_close("values", across.values, ref.values);
    CHECK(across.valid_ce == doctest::Approx(ref.valid_ce).epsilon(1e-4));
    CHECK(!across.sample.empty());
    CHECK(across.model_file.size() == ref.model_file.size());  // the same tensors, names and metadata
}

}  // namespace

TEST_CASE("cuda: the trainer resumes across backends (a checkpoint written on one continues on the other)") {
    SUBCASE("conv compression: GPU, then CPU") { check_trainer_across<compressive_of<conv_compression>, cuda, cpu>(); }
    SUBCASE("conv compression: CPU, then GPU") { check_trainer_across<compressive_of<conv_compression>, cpu, cuda>(); }
    SUBCASE("most-used compression: GPU throughout") {
        check_trainer_across<compressive_of<most_used_compression>, cuda, cuda>();
    }
    SUBCASE("Feedback Transformer: GPU, then CPU") { check_trainer_across<feedback_of, cuda, cpu>(); }
}
