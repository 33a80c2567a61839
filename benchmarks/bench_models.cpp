// Model benchmarks: a full training step in steady state (memories full: forward, cross-entropy and
// reconstruction loss, backward, clipping, AdamW, memory merge and compression), a forward-only
// segment, and streaming generation one token at a time with memory carried.
//
//   build/benchmarks/bench_models --benchmark_filter=-scaling       the A/B/C rows
//   build/benchmarks/bench_models --benchmark_filter=scaling        growth with seq, mem, c_mem
//   build/benchmarks/bench_models --benchmark_filter=train_A        one row
//
// Configurations A, B, C: model_shapes.hpp.
// Counters: tokens/s, ms per step, GFLOP/s of the step's dense arithmetic (counted below), and
// peak_frac, that rate over this machine's FP32 peak measured in the same process (peak.hpp).
// Generation rows (cached and recomputing): MB/token, the bytes a token must read (generation_bytes
// below), bytes_read (that per second), and roofline_frac, the token's time at the machine's limits
// over its measured time: its bytes at the read bandwidth, or its arithmetic at the FP32 peak where
// that takes longer, both measured in the same process.
#include <benchmark/benchmark.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <string>
#include <vector>

#include <mnemo/mnemo.hpp>

#include "model_shapes.hpp"
#include "model_steps.hpp"
#include "peak.hpp"

namespace {

using mnemo::index_t;
using mnemo::token_t;

using mnemo_bench::A;
using mnemo_bench::B;
using mnemo_bench::C;
using mnemo_bench::fill_memory;
using mnemo_bench::shape;
using mnemo_bench::tokens_for;

template <class Cfg>
using model_t = mnemo::compressive_transformer<float, Cfg>;

template <class Cfg>
double forward_flops(const shape& s, bool absorbed = false) {
    return mnemo_bench::forward_flops(s, double(Cfg::d_model), double(Cfg::heads), absorbed);
}

// peak_frac: the step's GFLOP/s over this machine's FP32 peak at the same thread count (peak.hpp).
void add_peak_frac(benchmark::State& state, double flops_per_iter) {
    const double peak = mnemo_bench::peak_gflops(omp_get_max_threads());
    state.counters["peak_frac"] = benchmark::Counter(flops_per_iter / 1e9 / peak, benchmark::Counter::kIsIterationInvariantRate);
}

// The bytes one generation step (batch 1) must read at least, from the model's own parameter list:
// every weight the token multiplies by in full; of the embedding table one row; of the positional
// tables the rows of the distances the token sees (c_mem + mem + 1); the compression function's
// weights over the rate (it runs once every `rate` tokens); and per memory layer what the token's
// attention reads of the memory: with the cache (`cached`), the memory's projected keys and values,
// 2·(mem + c_mem)·D; without it, the memory's rows themselves, (mem + c_mem)·D, which every key and
// value comes from again. Activations (a few rows of D and d_ff) are left out.
template <class Model>
double generation_bytes(const Model& model, const shape& s, bool cached) {
    const double keys = double(s.mem + s.c_mem + 1), rate = double(Model::config::compression_rate);
    const double d = double(Model::config::d_model);
    const auto has = [](const std::string& name, const char* part) { return name.find(part) != std::string::npos; };
    double elements = 0;
    for (const mnemo::tensor_entry& e : model.parameters().entries()) {
        if (e.name == "src_embed.weight")
            elements += double(e.row_size());
        else if (has(e.name, "_pos_embeddings") || has(e.name, "key_pos_bias"))
            elements += std::min(keys, double(e.rows())) * double(e.row_size());
        else if (has(e.name, ".compress."))
            elements += double(e.size) / rate;
        else
            elements += double(e.size);
    }
    elements += double(model.n_memory_layers()) * (cached ? 2 : 1) * double(s.mem + s.c_mem) * d;
    return elements * sizeof(float);
}

// Multiply-adds ×2 of one generated token (batch 1, one query position) for the route its attention
// took. Cached: the memory's keys and values are not projected again, only the token's own.
// Recomputing: forward_flops's count for one position, projected (every memory row's keys and
// values) or absorbed (W_k and W_v folded into the query and the context).
template <class Cfg>
double generation_flops(const shape& s, bool cached, bool absorbed) {
    shape one = s;
    one.seq = 1;
    one.batch = 1;
    if (!cached) return forward_flops<Cfg>(one, absorbed);
    const double D = double(Cfg::d_model), memory_rows = double(s.mem + s.c_mem);
    // forward_flops without absorption counts the projections of every key position; take the
    // memory's off.
    return forward_flops<Cfg>(one, false) - double(s.n_layers) * 2 * memory_rows * D * D * 2;
}

// bytes_read per second of a generation row (bytes_per_iter each iteration) and roofline_frac: the
// iteration's time at the machine's limits, the longer of its bytes at the read bandwidth and its
// arithmetic at the FP32 peak (both measured in the same process at the same thread count,
// peak.hpp), over the measured time. At batch 1 the bytes take longer on every route mnemo takes
// (a token's arithmetic is about 2 FLOP per 4 bytes of weights); the peak term guards a projected
// route, whose memory projections are arithmetic.
void add_roofline_frac(benchmark::State& state, double bytes_per_iter, double flops_per_iter) {
    const int threads = omp_get_max_threads();
    const double bandwidth = mnemo_bench::read_bandwidth_gbs(threads) * 1e9;
    const double peak = flops_per_iter > 0 ? mnemo_bench::peak_gflops(threads) * 1e9 : 1.0;
    const double seconds = std::max(bytes_per_iter / bandwidth, flops_per_iter / peak);
    state.counters["bytes_read"] = benchmark::Counter(bytes_per_iter, benchmark::Counter::kIsIterationInvariantRate);
    state.counters["roofline_frac"] = benchmark::Counter(seconds, benchmark::Counter::kIsIterationInvariantRate);
    state.counters["MB/token"] = bytes_per_iter / 1e6;
}

template <class Cfg>
void BM_train(benchmark::State& state, shape s) {
    model_t<Cfg> model({.vocab = s.vocab, .n_layers = s.n_layers, .d_ff = s.d_ff});
    model.reset_parameters(1);
    auto mem = model.make_memory(s.mem, s.c_mem);
    mem.reset(s.batch, s.seq);
    fill_memory(model, mem, s);
    auto& ps = model.parameters();
    mnemo::adamw<float> opt(ps.size(), {.lr = 2.5e-4});
    auto tokens = tokens_for(s, 1), targets = tokens_for(s, 2);
    // One untimed step first: the backward buffers grow (and their pages are touched) here, not in
    // the first timed step, which for C is the only one Google Benchmark runs per repetition.
    ps.zero_grad();
    model.train_segment(tokens, targets, s.batch, mem);
    mnemo::clip_grad_norm(ps, 1.0);
    opt.step(ps);
    for (auto _ : state) {
        ps.zero_grad();
        auto l = model.train_segment(tokens, targets, s.batch, mem);
        mnemo::clip_grad_norm(ps, 1.0);
        opt.step(ps);
        benchmark::DoNotOptimize(l);
    }
    const double tokens_per_step = double(s.seq * s.batch);
    state.counters["tokens/s"] = benchmark::Counter(tokens_per_step, benchmark::Counter::kIsIterationInvariantRate);
    state.counters["ms/step"] = benchmark::Counter(1e-3, benchmark::Counter::kIsIterationInvariantRate | benchmark::Counter::kInvert);
    // forward + backward ≈ 3× the forward's arithmetic, and the attention-reconstruction loss
    const double flops = 3 * forward_flops<Cfg>(s, model.layer(0).self_attn().last_forward_absorbed()) +
                         mnemo_bench::reconstruction_flops(s, double(Cfg::d_model), double(Cfg::compression_rate));
    state.counters["GFLOP/s"] = benchmark::Counter(flops / 1e9, benchmark::Counter::kIsIterationInvariantRate);
    add_peak_frac(state, flops);
}

template <class Cfg>
void BM_forward(benchmark::State& state, shape s) {
    model_t<Cfg> model({.vocab = s.vocab, .n_layers = s.n_layers, .d_ff = s.d_ff});
    model.reset_parameters(1);
    auto mem = model.make_memory(s.mem, s.c_mem);
    mem.reset(s.batch, s.seq);
    fill_memory(model, mem, s);
    auto tokens = tokens_for(s, 1);
    for (auto _ : state) benchmark::DoNotOptimize(model.forward(tokens, s.batch, mem).data());
    state.counters["tokens/s"] = benchmark::Counter(double(s.seq * s.batch), benchmark::Counter::kIsIterationInvariantRate);
    const double flops = forward_flops<Cfg>(s, model.layer(0).self_attn().last_forward_absorbed());
    state.counters["GFLOP/s"] = benchmark::Counter(flops / 1e9, benchmark::Counter::kIsIterationInvariantRate);
    add_peak_frac(state, flops);
}

// One token per stream per step, memory carried and merged (compressing every c tokens). With
// `cached`, the model keeps the projected keys and values of the memory between tokens
// (cache_memory_projections) and projects only the new slots; without, every token projects the whole
// memory again, as the PyTorch reference does.
template <class Cfg>
void BM_generate(benchmark::State& state, shape s, bool cached = true) {
    model_t<Cfg> model({.vocab = s.vocab, .n_layers = s.n_layers, .d_ff = s.d_ff});
    model.reset_parameters(1);
    model.cache_memory_projections(cached);
    model.set_grad_enabled(false);  // inference, like the reference's torch.no_grad()
    auto mem = model.make_memory(s.mem, s.c_mem);
    mem.reset(1, s.seq);
    shape one = s;
    one.batch = 1;
    fill_memory(model, mem, one);
    std::vector<token_t> tok = {1};
    for (auto _ : state) {
        auto logits = model.forward(tok, 1, mem);
        model.update_memory(mem);
        tok[0] = token_t(std::max_element(logits.row(0), logits.row(0) + logits.cols()) - logits.row(0));
    }
    state.counters["tokens/s"] = benchmark::Counter(1, benchmark::Counter::kIsIterationInvariantRate);
    state.counters["ms/token"] = benchmark::Counter(1e-3, benchmark::Counter::kIsIterationInvariantRate | benchmark::Counter::kInvert);
    const bool absorbed = model.layer(0).self_attn().last_forward_absorbed();
    add_roofline_frac(state, generation_bytes(model, s, cached), generation_flops<Cfg>(s, cached, absorbed));
    // How this CPU splits the token's weight products over the threads (gemv_tuning, by CPU model).
    state.SetLabel(std::string("gemv split: ") + mnemo::cpu_kernels::gemm::gemv_split_here().name);
}

// Scaling: the training step and per-token generation of configuration B's model (d_model 256, 8
// heads, c = 4, 6 layers) as one length grows, the others held at B's values (seq 128, mem 128,
// c_mem 128; batch 1 for generation). Args: seq_len, mem_len, c_mem_len.
template <class Cfg>
void BM_train_scaling(benchmark::State& state) {
    shape s = B;
    s.seq = state.range(0);
    s.mem = state.range(1);
    s.c_mem = state.range(2);
    BM_train<Cfg>(state, s);
}
template <class Cfg>
void BM_generate_scaling(benchmark::State& state) {
    shape s = B;
    s.seq = state.range(0);
    s.mem = state.range(1);
    s.c_mem = state.range(2);
    BM_generate<Cfg>(state, s);
}

using cfg_a = mnemo::config<128, 4, 2>;
using cfg_b = mnemo::config<256, 8, 4>;
using cfg_c = mnemo::config<512, 8, 4>;

}  // namespace

// One named row per (kind, configuration): e.g. BM_train_A.
#define MNEMO_MODEL_ROWS(NAME, CFG, SHAPE)                                                        \
    void BM_train_##NAME(benchmark::State& st) { BM_train<CFG>(st, SHAPE); }                     \
    void BM_forward_##NAME(benchmark::State& st) { BM_forward<CFG>(st, SHAPE); }                 \
    void BM_generate_##NAME(benchmark::State& st) { BM_generate<CFG>(st, SHAPE); }               \
    void BM_generate_recompute_##NAME(benchmark::State& st) { BM_generate<CFG>(st, SHAPE, false); } \
    BENCHMARK(BM_train_##NAME)->Unit(benchmark::kMillisecond)->UseRealTime();                    \
    BENCHMARK(BM_forward_##NAME)->Unit(benchmark::kMillisecond)->UseRealTime();                  \
    BENCHMARK(BM_generate_##NAME)->Unit(benchmark::kMillisecond)->UseRealTime();                 \
    BENCHMARK(BM_generate_recompute_##NAME)->Unit(benchmark::kMillisecond)->UseRealTime();

MNEMO_MODEL_ROWS(A, cfg_a, A)
MNEMO_MODEL_ROWS(B, cfg_b, B)
MNEMO_MODEL_ROWS(C, cfg_c, C)

void scaling_args(benchmark::internal::Benchmark* b) {
    b->ArgNames({"seq", "mem", "c_mem"});
    for (index_t seq : {32, 64, 128, 256}) b->Args({seq, 128, 128});
    for (index_t mem : {32, 64, 256, 512}) b->Args({128, mem, 128});
    for (index_t c_mem : {32, 64, 256, 512}) b->Args({128, 128, c_mem});
}
BENCHMARK(BM_train_scaling<cfg_b>)->Apply(scaling_args)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_generate_scaling<cfg_b>)->Apply(scaling_args)->Unit(benchmark::kMillisecond)->UseRealTime();

BENCHMARK_MAIN();
