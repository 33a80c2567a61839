// Feedback Transformer benchmarks: a training step (forward + backward through time + AdamW), the
// forward over a whole sequence alone, and per-token generation from the key/value cache, for both
// variants.
//
//   ./build/benchmarks/bench_feedback                                  everything
//   ./build/benchmarks/bench_feedback --benchmark_filter=small         the quick configuration only
//
// "reference" is labml's feedback experiment (labml_nn/transformers/feedback/experiment.py): d_model 512,
// 8 heads, d_ff 2048, 6 layers, seq_len 128, batch 64 (character vocabulary, 65 here). "small" is a quick
// configuration: d_model 128, 4 heads, d_ff 512, 2 layers, seq_len 32, batch 8.
// Counters: tokens_per_second (the items rate: seq_len · batch tokens per training step or forward,
// batch per generation step) and ms_per_step (one training step; one forward over the sequence, the
// logits of every step from an empty memory, no loss, no gradient; one generation step of the whole
// batch, averaged over a sequence of seq_len steps from an empty memory, i.e. over slot counts 0 …
// seq_len − 1).
// Generation rows also report MB_per_step, the bytes one step must read at least (step_bytes below),
// and roofline_frac, that rate over this machine's DRAM read bandwidth measured in the same process
// (benchmarks/peak.hpp); small's weights fit in the caches, so its fraction passes 1.
#include <benchmark/benchmark.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <span>
#include <string>
#include <vector>

#include <mnemo/models/feedback_transformer.hpp>
#include <mnemo/train/optimizer.hpp>

#include "peak.hpp"

namespace {

using mnemo::index_t;
using mnemo::token_t;

struct shape {
    index_t n_layers, d_ff, seq_len, batch, vocab;
};
constexpr shape reference{6, 2048, 128, 64, 65};
constexpr shape small{2, 512, 32, 8, 65};

std::vector<token_t> tokens_for(index_t n, index_t vocab, std::uint64_t seed) {
    mnemo::rng r(seed);
    std::vector<token_t> t(static_cast<std::size_t>(n));
    for (auto& x : t) x = static_cast<token_t>(r.next_u32() % static_cast<std::uint32_t>(vocab));
    return t;
}

template <class Model>
void BM_train_step(benchmark::State& state, shape s) {
    Model model({.vocab = s.vocab, .n_layers = s.n_layers, .d_ff = s.d_ff, .n_pos = 4096});
    model.reset_parameters(1);
    auto& ps = model.parameters();
    mnemo::adamw<float> opt(ps.size(), {.lr = 1e-4});
    const index_t rows = s.seq_len * s.batch;
    const auto tokens = tokens_for(rows, s.vocab, 2), targets = tokens_for(rows, s.vocab, 3);
    auto step = [&] {
        ps.zero_grad();
        const double ce = model.train_segment(tokens, targets, s.batch);
        opt.step(ps);
        return ce;
    };
    step();  // warm-up: buffers reach their size
    double seconds = 0;
    for (auto _ : state) {
        const auto t0 = std::chrono::steady_clock::now();
        benchmark::DoNotOptimize(step());
        seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    }
    state.SetItemsProcessed(state.iterations() * rows);
    state.counters["tokens_per_second"] =
        benchmark::Counter(double(state.iterations() * rows) / seconds);
    state.counters["ms_per_step"] = benchmark::Counter(1e3 * seconds / double(state.iterations()));
}

// The forward over the sequence alone (feedback_transformer::forward: every step's logits; it keeps
// the activations a backward would read, as a training forward does, and computes no loss): what
// PyTorch's forward without autograd computes in benchmarks/compare_pytorch.py.
template <class Model>
void BM_forward(benchmark::State& state, shape s) {
    Model model({.vocab = s.vocab, .n_layers = s.n_layers, .d_ff = s.d_ff, .n_pos = 4096});
    model.reset_parameters(1);
    const index_t rows = s.seq_len * s.batch;
    const auto tokens = tokens_for(rows, s.vocab, 2);
    auto forward = [&] { return model.forward(tokens, s.batch).data()[0]; };
    forward();  // warm-up: buffers reach their size
    double seconds = 0;
    for (auto _ : state) {
        const auto t0 = std::chrono::steady_clock::now();
        benchmark::DoNotOptimize(forward());
        seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    }
    state.SetItemsProcessed(state.iterations() * rows);
    state.counters["tokens_per_second"] = benchmark::Counter(double(state.iterations() * rows) / seconds);
    state.counters["ms_per_step"] = benchmark::Counter(1e3 * seconds / double(state.iterations()));
}

// The bytes one generation step of the whole batch must read at least, averaged over the sequence
// (slot counts 0 … seq_len − 1): every weight in full except the embedding table (one row per batch
// element) and the positional tables (the rows of the distances a step sees), and the cached keys and
// values of the memory slots, one pair per layer (per-layer keys and values) or one in all (shared).
template <class Model>
double step_bytes(const Model& model, const shape& s) {
    const double slots = double(s.seq_len - 1) / 2, d = double(Model::config::d_model), b = double(s.batch);
    double elements = 0;
    for (const mnemo::tensor_entry& e : model.parameters().entries()) {
        if (e.name == "src_embed.weight")
            elements += b * double(e.row_size());
        else if (e.name.find("key_pos_") != std::string::npos)
            elements += std::min(slots + 1, double(e.rows())) * double(e.row_size());
        else
            elements += double(e.size);
    }
    const double kv_sets = Model::kv_variant::shared ? 1.0 : double(s.n_layers);
    elements += kv_sets * 2 * slots * b * d;
    return elements * sizeof(float);
}

template <class Model>
void BM_generate(benchmark::State& state, shape s) {
    Model model({.vocab = s.vocab, .n_layers = s.n_layers, .d_ff = s.d_ff, .n_pos = 4096});
    model.reset_parameters(1);
    const auto tokens = tokens_for(s.seq_len * s.batch, s.vocab, 2);
    auto gen = model.generator(s.batch);
    gen.reserve(s.seq_len);
    auto sequence = [&] {
        gen.reset();
        float sink = 0;
        for (index_t t = 0; t < s.seq_len; ++t)
            sink += gen.step(std::span<const token_t>(tokens.data() + t * s.batch, std::size_t(s.batch))).data()[0];
        return sink;
    };
    sequence();  // warm-up
    double seconds = 0;
    for (auto _ : state) {
        const auto t0 = std::chrono::steady_clock::now();
        benchmark::DoNotOptimize(sequence());
        seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    }
    const double steps = double(state.iterations() * s.seq_len);
    state.SetItemsProcessed(state.iterations() * s.seq_len * s.batch);
    state.counters["tokens_per_second"] = benchmark::Counter(steps * double(s.batch) / seconds);
    state.counters["ms_per_step"] = benchmark::Counter(1e3 * seconds / steps);
    const double bytes = step_bytes(model, s);
    state.counters["MB_per_step"] = bytes / 1e6;
    state.counters["roofline_frac"] =
        benchmark::Counter(bytes * steps / seconds / 1e9 / mnemo_bench::read_bandwidth_gbs(omp_get_max_threads()));
}

using ref_cfg = mnemo::config<512, 8>;
using small_cfg = mnemo::config<128, 4>;
using ref_plain = mnemo::feedback_transformer<float, ref_cfg>;
using ref_kv = mnemo::feedback_transformer_kv<float, ref_cfg>;
using small_plain = mnemo::feedback_transformer<float, small_cfg>;
using small_kv = mnemo::feedback_transformer_kv<float, small_cfg>;

}  // namespace

// Registered at run time: BENCHMARK_CAPTURE cannot take a template-id as its function.
int main(int argc, char** argv) {
    auto add = [](const char* name, auto fn, shape s, bool reference_size) {
        auto* b = benchmark::RegisterBenchmark(name, [fn, s](benchmark::State& st) { fn(st, s); });
        b->Unit(benchmark::kMillisecond)->UseRealTime();
        // The reference configuration takes seconds per training step on a few cores: few iterations.
        if (reference_size) b->Iterations(2);
    };
    add("train_step/small/feedback", BM_train_step<small_plain>, small, false);
    add("train_step/small/feedback_kv", BM_train_step<small_kv>, small, false);
    add("forward/small/feedback", BM_forward<small_plain>, small, false);
    add("forward/small/feedback_kv", BM_forward<small_kv>, small, false);
    add("generate/small/feedback", BM_generate<small_plain>, small, false);
    add("generate/small/feedback_kv", BM_generate<small_kv>, small, false);
    add("train_step/reference/feedback", BM_train_step<ref_plain>, reference, true);
    add("train_step/reference/feedback_kv", BM_train_step<ref_kv>, reference, true);
    add("forward/reference/feedback", BM_forward<ref_plain>, reference, true);
    add("forward/reference/feedback_kv", BM_forward<ref_kv>, reference, true);
    add("generate/reference/feedback", BM_generate<ref_plain>, reference, true);
    add("generate/reference/feedback_kv", BM_generate<ref_kv>, reference, true);
    benchmark::Initialize(&argc, argv);
    if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
    benchmark::RunSpecifiedBenchmarks();
    benchmark::Shutdown();
    return 0;
}
