#pragma once
// The benchmark configurations of the Compressive Transformer (the performance issues') and the
// dense arithmetic of one forward segment, shared by bench_models (CPU) and bench_cuda (GPU).
//   A  the reference experiment: d_model 128, heads 4, d_ff 256, 6 layers, seq 8, mem 8, c_mem 128, c 2, batch 32, vocab 65
//   B  d_model 256, heads 8, d_ff 1024, 6 layers, seq 128, mem 128, c_mem 128, c 4, batch 8, vocab 65
//   C  d_model 512, heads 8, d_ff 2048, 6 layers, seq 256, mem 256, c_mem 256, c 4, batch 4, vocab 256
#include <mnemo/core/shape.hpp>

namespace mnemo_bench {

using mnemo::index_t;

struct shape {
    index_t vocab, n_layers, d_ff, seq, mem, c_mem, batch;
};
inline constexpr shape A{65, 6, 256, 8, 8, 128, 32};
inline constexpr shape B{65, 6, 1024, 128, 128, 128, 8};
inline constexpr shape C{256, 6, 2048, 256, 256, 256, 4};

/// Multiply-adds ×2 of one forward pass over a segment with full memory (GEMMs and attention only),
/// counted for the route the attention takes (relative_attention's memory_attention): projected
/// (keys and values of every memory row) or absorbed (W_k, W_v folded into queries and context).
inline double forward_flops(const shape& s, double d_model, double heads, bool absorbed = false) {
    const double D = d_model, H = heads, rows = double(s.seq * s.batch), keys = double(s.seq + s.mem + s.c_mem);
    const double mem_rows = double(s.mem + s.c_mem) * double(s.batch);
    double attention;
    if (!absorbed) {
        attention = 2 * (keys * double(s.batch)) * D * D * 2  // key, value projections over memory + segment
                    + 2 * rows * keys * D * 2;                // scores and weighted values
    } else {
        attention = 2 * rows * D * D * 2                      // key, value projections of the segment
                    + 2 * rows * double(s.seq) * D * 2        // the segment's scores and weighted values
                    + 2 * rows * D * D * 2                    // q̃ = (q+u)·W_k, context += U·W_vᵀ
                    + 2 * H * rows * (mem_rows / double(s.batch)) * D * 2;  // q̃·ẑᵀ and A·ẑ, every head
    }
    double per_layer = 2 * rows * D * D * 2                   // query, output projections
                       + attention
                       + 2 * rows * (keys + double(s.seq)) * D  // positional scores
                       + 2 * rows * D * double(s.d_ff) * 2;     // feed-forward
    return double(s.n_layers) * per_layer + 2 * rows * D * double(s.vocab);
}

/// Multiply-adds ×2 of one training step's attention-reconstruction loss (the Compressive
/// Transformer's, losses/attention_reconstruction.hpp) in the steady state, where every layer
/// compresses the seq·batch rows its memory evicts (`old` below) into old/rate slots, for d_model D
/// and the compression rate c. Per layer:
///   forward   f_c over the old rows (a kernel-c, stride-c convolution)  2·old·D²
///             keys and values of m and of f_c(m)                         4·(old + old/c)·D²
///             attn(h, m) and attn(h, f_c(m)): scores, weighted values    4·rows·(seq + seq/c)·D
///   backward  (to f_c's weights only) attn(h, f_c(m)): dA, dV, dK        6·rows·(seq/c)·D
///             d f_c(m) from dK and dV                                    4·(old/c)·D²
///             f_c's weight gradient                                      2·old·D²
/// (the queries are the attention's own, from the forward). Matches the products the step runs,
/// tallied call by call (docs/performance.md, "What bench_models measures").
inline double reconstruction_flops(const shape& s, double d_model, double rate) {
    const double D = d_model, c = rate, rows = double(s.seq * s.batch), old = rows, seq = double(s.seq);
    const double per_layer = 2 * old * D * D + 4 * (old + old / c) * D * D + 4 * rows * (seq + seq / c) * D
                             + 6 * rows * (seq / c) * D + 4 * (old / c) * D * D + 2 * old * D * D;
    return double(s.n_layers) * per_layer;
}

}  // namespace mnemo_bench
