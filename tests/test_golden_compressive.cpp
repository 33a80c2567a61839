// Golden parity with the PyTorch reference (tools/golden_compressive.py, run in float64): a short
// training run over consecutive segments with memory, compression, truncation of the compressed
// memory and gradient clipping in play. Every segment compares the logits, both losses, every
// parameter gradient, the memories after the merge, the clipped norm and the weights after AdamW.
// mnemo in double must agree to ~1e-10; in float to float32 precision. The double runs are repeated over
// the fenced backend (tests/fenced_backend.hpp: memory only kernels may touch), every number read over
// the host path.
#include <doctest/doctest.h>

#include <cmath>
#include <string>
#include <vector>

#include <mnemo/models/compressive_transformer.hpp>
#include <mnemo/train/clip.hpp>
#include <mnemo/train/optimizer.hpp>
#include <mnemo/io/safetensors.hpp>

#ifdef MNEMO_TEST_CUDA
#include <mnemo/cuda.hpp>
#else
#include "fenced_backend.hpp"
#endif
#include "testing.hpp"

using mnemo::index_t;
using mnemo::token_t;
using mnemo::testing::check_close;
using mnemo::testing::to_host;
using mnemo::testing::golden_fp32;
using mnemo::testing::golden_fp32_after;
using mnemo::testing::golden_fp64;
using mnemo::testing::meta_double;
using mnemo::testing::meta_int;
using mnemo::testing::tolerance;

namespace {

template <class T, class Model>
void check_golden(const std::string& name, tolerance tol, tolerance tol_after) {
    using Backend = typename Model::backend_type;
    const auto f = mnemo::read_safetensors(std::string(MNEMO_TEST_DATA_DIR) + "/golden/" + name + ".safetensors");
    const index_t B = meta_int(f, "batch"), Q = meta_int(f, "seq_len"), n_seg = meta_int(f, "n_segments");
    Model model({.vocab = meta_int(f, "vocab"), .n_layers = meta_int(f, "n_layers"), .d_ff = meta_int(f, "d_ff"),
                 .n_pos = meta_int(f, "n_pos")});
    REQUIRE(index_t(Model::config::d_model) == meta_int(f, "d_model"));
    REQUIRE(index_t(Model::config::heads) == meta_int(f, "heads"));
    auto& ps = model.parameters();
    {
        std::vector<T> init(std::size_t(ps.size()), T(0));
        for (const auto& e : ps.entries()) f.copy_to("init." + e.name, init.data() + e.offset, std::size_t(e.size));
        ps.upload_all_values(init);
    }
    mnemo::adamw<T, Backend> opt(ps.size(), {.lr = meta_double(f, "lr"), .weight_decay = meta_double(f, "weight_decay")});
    const double clip = meta_double(f, "clip");
    auto mem = model.make_memory(meta_int(f, "mem_len"), meta_int(f, "c_mem_len"));
    mem.reset(B, Q);

    const auto data = f.to_vector<std::int64_t>("data"), target = f.to_vector<std::int64_t>("target");
    for (index_t s = 0; s < n_seg; ++s) {
        const std::string seg = "seg" + std::to_string(s) + ".";
        INFO(name << " segment " << s);
        std::vector<token_t> tokens(data.begin() + s * Q * B, data.begin() + (s + 1) * Q * B);
        std::vector<token_t> targets(target.begin() + s * Q * B, target.begin() + (s + 1) * Q * B);
        ps.zero_grad();
        const auto losses = model.train_segment(tokens, targets, B, mem);

        const auto logits = f.to_vector<double>(seg + "logits");
        const auto got_logits = to_host<Backend>(model.logits().data(), index_t(logits.size()));
        check_close(seg + "logits", got_logits.data(), logits.data(), index_t(logits.size()), tol.atol, tol.rtol);
        const double ce = f.to_vector<double>(seg + "ce_loss").at(0), ar = f.to_vector<double>(seg + "ar_loss").at(0);
        check_close(seg + "ce_loss", &losses.ce, &ce, 1, tol.atol, tol.rtol);
        check_close(seg + "ar_loss", &losses.ar, &ar, 1, tol.atol, tol.rtol);
        CHECK((losses.compressed > 0) == (ar > 0));
        for (index_t l = 0; l < model.n_layers(); ++l) {
            for (const char* kind : {"mem", "c_mem"}) {
                const std::string key = seg + kind + "." + std::to_string(l);
                const auto v = std::string(kind) == "mem" ? mem.mem(l) : mem.c_mem(l);
                if (!f.contains(key)) {
                    CHECK_MESSAGE(v.rows() == 0, key << " is empty in the reference");
                    continue;
                }
                const auto ref = f.to_vector<double>(key);
                REQUIRE_MESSAGE(v.size() == index_t(ref.size()), key);
                check_close(key, to_host<Backend>(v.data(), v.size()).data(), ref.data(), v.size(), tol.atol, tol.rtol);
            }
        }
        std::vector<T> grads(std::size_t(ps.size())), values(grads.size());
        ps.download_all_grads(grads);
        for (const auto& e : ps.entries()) {
            const auto g = f.to_vector<double>(seg + "grad." + e.name);
            check_close(seg + "grad." + e.name, grads.data() + e.offset, g.data(), e.size, tol.atol, tol.rtol);
        }
        const double norm = mnemo::clip_grad_norm(ps, clip), ref_norm = f.to_vector<double>(seg + "grad_norm").at(0);
        check_close(seg + "grad_norm", &norm, &ref_norm, 1, tol.atol, tol.rtol);
        opt.step(ps);
        ps.download_all_values(values);
        for (const auto& e : ps.entries()) {
            const auto w = f.to_vector<double>(seg + "after." + e.name);
            check_close(seg + "after." + e.name, values.data() + e.offset, w.data(), e.size, tol_after.atol,
                        tol_after.rtol);
        }
    }
}

template <std::size_t D, std::size_t H, std::size_t C, template <class, std::size_t, std::size_t, class> class F>
void both(const std::string& name) {
#ifdef MNEMO_TEST_CUDA  // tests/cuda: the same data on the GPU
    SUBCASE("double, cuda backend") {
        check_golden<double, mnemo::compressive_transformer<double, mnemo::config<D, H, C>, F, mnemo::cuda>>(
            name, golden_fp64, golden_fp64);
    }
    SUBCASE("float, cuda backend") {
        check_golden<float, mnemo::compressive_transformer<float, mnemo::config<D, H, C>, F, mnemo::cuda>>(
            name, golden_fp32, golden_fp32_after);
    }
#else
    SUBCASE("double") {
        check_golden<double, mnemo::compressive_transformer<double, mnemo::config<D, H, C>, F>>(name, golden_fp64,
                                                                                                 golden_fp64);
    }
    SUBCASE("float") {
        check_golden<float, mnemo::compressive_transformer<float, mnemo::config<D, H, C>, F>>(name, golden_fp32,
                                                                                               golden_fp32_after);
    }
    SUBCASE("double, fenced backend") {
        check_golden<double, mnemo::compressive_transformer<double, mnemo::config<D, H, C>, F, mnemo::fenced>>(
            name, golden_fp64, golden_fp64);
    }
#endif
}

}  // namespace

TEST_CASE("golden: compressive_tiny (conv compression, c_mem truncation) matches the PyTorch reference") {
    both<16, 2, 2, mnemo::conv_compression>("compressive_tiny");
}
TEST_CASE("golden: compressive_odd (rate 3, 3 heads, odd lengths) matches the PyTorch reference") {
    both<12, 3, 3, mnemo::conv_compression>("compressive_odd");
}
TEST_CASE("golden: xl_tiny (c_mem_len 0, Transformer-XL) matches the PyTorch reference") {
    both<16, 2, 2, mnemo::conv_compression>("xl_tiny");
}
TEST_CASE("golden: compressive_tiny_max (max pooling) matches the PyTorch reference") {
    both<16, 2, 2, mnemo::max_pool_compression>("compressive_tiny_max");
}
TEST_CASE("golden: compressive_tiny_mean (mean pooling) matches the PyTorch reference") {
    both<16, 2, 2, mnemo::mean_pool_compression>("compressive_tiny_mean");
}
