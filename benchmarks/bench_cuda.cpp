// The CUDA backend's benchmark (docs/cuda.md): the Compressive Transformer's configurations A, B, C
// (model_shapes.hpp), A and B at 8× and 16× their batch, and the Feedback Transformer at its reference
// size (bench_feedback.cpp's), on the GPU. Rows:
//   train_X      steady-state training step: forward with full memories, merge and compression,
//                cross-entropy and attention-reconstruction loss, backward, clipping, AdamW
//   forward_X    one segment without gradient, memories full, no merge
//   generate_X   one token at a time, batch 1, memory carried and merged, greedy next token
//   feedback_train / feedback_generate (plain variant), feedback_kv_train / feedback_kv_generate
// Per row: ms (per step, segment or token), tokens/s, launches per step (kernels, cuBLAS calls and
// copies the backend enqueued), peak device memory of the backend's own allocations, and for the
// Compressive rows the dense arithmetic's TFLOP/s (model_shapes.hpp's count; backward ≈ 2× forward).
// Times: the median of --iterations timed steps after --warmup untimed ones, each bracketed by
// cuda_runtime::synchronize(). Without a usable GPU it says why and exits 77.
//
//   build/benchmarks/bench_cuda [--rows train_A,generate_B,...] [--iterations N] [--warmup N] [--json FILE]
//
// Not Google Benchmark: a GPU machine may lack it (tools/gpu_deps.sh bundles header-only libraries only).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include <mnemo/cuda.hpp>

#include "model_shapes.hpp"

namespace {

using mnemo::index_t;
using mnemo::token_t;
using mnemo_bench::shape;
using gpu = mnemo::cuda;

struct compressive_config {
    const char* name;
    shape s;
    index_t d_model, heads, rate;
};

shape times_batch(shape s, index_t k) {
    s.batch *= k;
    return s;
}

const compressive_config compressive_rows[] = {
    {"A", mnemo_bench::A, 128, 4, 2},
    {"B", mnemo_bench::B, 256, 8, 4},
    {"C", mnemo_bench::C, 512, 8, 4},
    {"A_x8", times_batch(mnemo_bench::A, 8), 128, 4, 2},
    {"A_x16", times_batch(mnemo_bench::A, 16), 128, 4, 2},
    {"B_x8", times_batch(mnemo_bench::B, 8), 256, 8, 4},
    {"B_x16", times_batch(mnemo_bench::B, 16), 256, 8, 4},
};

struct result {
    std::string row;
    double ms = 0, tokens_per_s = 0, launches = 0, peak_mib = 0, tflops = 0;
};

struct settings {
    std::vector<std::string> rows;  // empty: all
    int iterations = 10, warmup = 3;
    std::string json;
    bool wants(const std::string& r) const { return rows.empty() || std::find(rows.begin(), rows.end(), r) != rows.end(); }
};

std::vector<token_t> tokens_for(index_t n, index_t vocab, std::uint64_t seed) {
    mnemo::rng r(seed);
    std::vector<token_t> t(static_cast<std::size_t>(n));
    for (auto& x : t) x = token_t(r.next_u32() % std::uint32_t(vocab));
    return t;
}

/// Median ms of `step` over the timed iterations (each synchronised), and its launches.
result time_steps(const settings& st, const std::string& row, const std::function<void()>& step) {
    for (int i = 0; i < st.warmup; ++i) step();
    mnemo::cuda_runtime::synchronize();
    std::vector<double> ms;
    std::size_t launches = 0;
    for (int i = 0; i < st.iterations; ++i) {
        const std::size_t l0 = mnemo::cuda_runtime::launches();
        const auto t0 = std::chrono::steady_clock::now();
        step();
        mnemo::cuda_runtime::synchronize();
        ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
        launches = mnemo::cuda_runtime::launches() - l0;
    }
    std::sort(ms.begin(), ms.end());
    result r;
    r.row = row;
    r.ms = ms[ms.size() / 2];
    r.launches = double(launches);
    r.peak_mib = double(mnemo::cuda_runtime::peak_bytes()) / double(1 << 20);
    return r;
}

using compressive_model = mnemo::compressive_transformer<float, mnemo::runtime_config, mnemo::conv_compression, gpu>;

mnemo::compressive_options options_for(const compressive_config& c) {
    mnemo::compressive_options o{.vocab = c.s.vocab, .n_layers = c.s.n_layers, .d_ff = c.s.d_ff};
    o.d_model = c.d_model;
    o.heads = c.heads;
    o.compression_rate = c.rate;
    return o;
}

void fill_memory(compressive_model& m, compressive_model::memory_type& mem, const compressive_config& c, index_t batch) {
    const index_t steps = (c.s.mem + c.s.c_mem * c.rate) / c.s.seq + 2;
    for (index_t i = 0; i < steps; ++i) {
        const auto t = tokens_for(c.s.seq * batch, c.s.vocab, 1000 + std::uint64_t(i));
        m.forward(t, batch, mem);
        m.update_memory(mem);
    }
}

void compressive(const settings& st, const compressive_config& c, std::vector<result>& out) {
    const shape& s = c.s;
    const double rows = double(s.seq * s.batch);
    const double flops = mnemo_bench::forward_flops(s, double(c.d_model), double(c.heads));
    if (st.wants(std::string("train_") + c.name)) {
        mnemo::cuda_runtime::reset_peak();
        compressive_model model(options_for(c));
        model.reset_parameters(1);
        auto mem = model.make_memory(s.mem, s.c_mem);
        mem.reset(s.batch, s.seq);
        fill_memory(model, mem, c, s.batch);
        auto& ps = model.parameters();
        mnemo::adamw<float, gpu> opt(ps.size(), {.lr = 2.5e-4});
        const auto tokens = tokens_for(s.seq * s.batch, s.vocab, 1), targets = tokens_for(s.seq * s.batch, s.vocab, 2);
        result r = time_steps(st, std::string("train_") + c.name, [&] {
            ps.zero_grad();
            model.train_segment(tokens, targets, s.batch, mem);
            mnemo::clip_grad_norm(ps, 1.0);
            opt.step(ps);
        });
        r.tokens_per_s = rows / (r.ms * 1e-3);
        // bench_models' count: three forward passes and the attention-reconstruction loss the step
        // computes too (model_shapes.hpp)
        const double step_flops = 3 * flops + mnemo_bench::reconstruction_flops(s, double(c.d_model), double(c.rate));
        r.tflops = step_flops / (r.ms * 1e-3) / 1e12;
        out.push_back(r);
    }
    if (st.wants(std::string("forward_") + c.name)) {
        mnemo::cuda_runtime::reset_peak();
        compressive_model model(options_for(c));
        model.reset_parameters(1);
        model.set_grad_enabled(false);
        auto mem = model.make_memory(s.mem, s.c_mem);
        mem.reset(s.batch, s.seq);
        fill_memory(model, mem, c, s.batch);
        const auto tokens = tokens_for(s.seq * s.batch, s.vocab, 1);
        result r = time_steps(st, std::string("forward_") + c.name, [&] { model.forward(tokens, s.batch, mem); });
        r.tokens_per_s = rows / (r.ms * 1e-3);
        r.tflops = flops / (r.ms * 1e-3) / 1e12;
        out.push_back(r);
    }
    // Generation runs at batch 1, so only the base configurations have a row.
    if (st.wants(std::string("generate_") + c.name) && std::string(c.name).find("_x") == std::string::npos) {
        mnemo::cuda_runtime::reset_peak();
        compressive_model model(options_for(c));
        model.reset_parameters(1);
        model.set_grad_enabled(false);
        model.cache_memory_projections(true);
        auto mem = model.make_memory(s.mem, s.c_mem);
        mem.reset(1, s.seq);
        fill_memory(model, mem, c, 1);
        std::vector<token_t> tok = {1};
        std::vector<float> logits_host(std::size_t(s.vocab));
        const index_t block = 4 * c.rate;  // compressing and non-compressing tokens both counted
        result r = time_steps(st, std::string("generate_") + c.name, [&] {
            for (index_t i = 0; i < block; ++i) {
                const auto logits = model.forward(tok, 1, mem);
                model.update_memory(mem);
                mnemo::device_memory<gpu>::download(logits_host.data(), logits.row(0), sizeof(float) * logits_host.size());
                tok[0] = token_t(std::max_element(logits_host.begin(), logits_host.end()) - logits_host.begin());
            }
        });
        r.ms /= double(block);
        r.launches /= double(block);
        r.tokens_per_s = 1e3 / r.ms;
        out.push_back(r);
    }
}

template <class KV>
void feedback(const settings& st, const char* prefix, std::vector<result>& out) {
    using model_t = mnemo::feedback_transformer<float, mnemo::runtime_config, KV, gpu>;
    const index_t vocab = 65, layers = 6, d_ff = 2048, seq = 128, batch = 64;
    mnemo::feedback_options o{.vocab = vocab, .n_layers = layers, .d_ff = d_ff, .n_pos = 4096};
    o.d_model = 512;
    o.heads = 8;
    if (st.wants(std::string(prefix) + "_train")) {
        mnemo::cuda_runtime::reset_peak();
        model_t model(o);
        model.reset_parameters(1);
        auto& ps = model.parameters();
        mnemo::adamw<float, gpu> opt(ps.size(), {.lr = 1e-4});
        const auto tokens = tokens_for(seq * batch, vocab, 2), targets = tokens_for(seq * batch, vocab, 3);
        result r = time_steps(st, std::string(prefix) + "_train", [&] {
            ps.zero_grad();
            model.train_segment(tokens, targets, batch);
            opt.step(ps);
        });
        r.tokens_per_s = double(seq * batch) / (r.ms * 1e-3);
        out.push_back(r);
    }
    if (st.wants(std::string(prefix) + "_generate")) {
        mnemo::cuda_runtime::reset_peak();
        model_t model(o);
        model.reset_parameters(1);
        auto gen = model.generator(batch);
        const auto tokens = tokens_for(batch, vocab, 4);
        result r = time_steps(st, std::string(prefix) + "_generate", [&] {
            gen.reset();
            for (index_t t = 0; t < seq; ++t) gen.step(tokens);
        });
        r.ms /= double(seq);  // per step of the whole batch, averaged over slot counts 0 … seq − 1
        r.launches /= double(seq);
        r.tokens_per_s = double(batch) / (r.ms * 1e-3);
        out.push_back(r);
    }
}

settings parse(int argc, char** argv) {
    settings st;
    for (int i = 1; i < argc; ++i) {
        const std::string a = argv[i];
        auto value = [&]() -> std::string {
            if (i + 1 >= argc) {
                std::fprintf(stderr, "bench_cuda: %s needs a value\n", a.c_str());
                std::exit(2);
            }
            return argv[++i];
        };
        if (a == "--rows") {
            const std::string v = value();
            std::size_t p = 0;
            while (p <= v.size()) {
                const std::size_t q = std::min(v.find(',', p), v.size());
                if (q > p) st.rows.push_back(v.substr(p, q - p));
                p = q + 1;
            }
        } else if (a == "--iterations") {
            st.iterations = std::max(1, std::atoi(value().c_str()));
        } else if (a == "--warmup") {
            st.warmup = std::max(0, std::atoi(value().c_str()));
        } else if (a == "--json") {
            st.json = value();
        } else {
            std::fprintf(stderr, "bench_cuda: unknown argument '%s' (--rows, --iterations, --warmup, --json)\n", a.c_str());
            std::exit(2);
        }
    }
    return st;
}

}  // namespace

int main(int argc, char** argv) try {
    const settings st = parse(argc, argv);
    if (!mnemo::cuda_runtime::available()) {
        std::fprintf(stderr, "bench_cuda: skipped: %s\n", mnemo::cuda_runtime::describe().c_str());
        return 77;
    }
    const std::string device = mnemo::cuda_runtime::describe();
    std::printf("bench_cuda on %s, %d timed iterations after %d\n", device.c_str(), st.iterations, st.warmup);
    std::vector<result> out;
    for (const auto& c : compressive_rows) compressive(st, c, out);
    feedback<mnemo::per_layer_kv>(st, "feedback", out);
    feedback<mnemo::shared_kv>(st, "feedback_kv", out);
    std::printf("| row | ms | tokens/s | launches/step | peak MiB | TFLOP/s |\n|---|---|---|---|---|---|\n");
    for (const result& r : out)
        std::printf("| %s | %.3f | %.0f | %.0f | %.0f | %s |\n", r.row.c_str(), r.ms, r.tokens_per_s, r.launches,
                    r.peak_mib, r.tflops > 0 ? std::to_string(r.tflops).c_str() : "");
    if (!st.json.empty()) {
        std::ofstream f(st.json);
        f << "{\"device\": \"" << device << "\", \"rows\": [";
        for (std::size_t i = 0; i < out.size(); ++i) {
            const result& r = out[i];
            f << (i ? ", " : "") << "{\"row\": \"" << r.row << "\", \"ms\": " << r.ms << ", \"tokens_per_s\": "
              << r.tokens_per_s << ", \"launches\": " << r.launches << ", \"peak_mib\": " << r.peak_mib
              << ", \"tflops\": " << r.tflops << "}";
        }
        f << "]}\n";
        if (!f) throw mnemo::error("bench_cuda: cannot write '" + st.json + "'");
    }
    return 0;
} catch (const std::exception& e) {
    std::fprintf(stderr, "bench_cuda: %s\n", e.what());
    return 1;
}
