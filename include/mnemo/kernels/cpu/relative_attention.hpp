#pragma once
// The CPU kernels of relative_attention's core (nn/relative_attention.hpp has the math and the
// routes; kernels/relative_attention_state.hpp the arguments): the positional window GEMMs, the
// per-(batch, head) scores with their positional terms, clamping, masks and softmax, the context,
// the one-query (generation) pass, the absorbed-memory route, their backward passes, and the
// frozen-norm and key/value projection gradients. Every loop over the tensors and every thread
// decision of the attention is here; results do not depend on the thread count.
#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "parallel.hpp"
#include "../../core/error.hpp"
#include "../../core/shape.hpp"
#include "../relative_attention_state.hpp"
#include "elementwise.hpp"
#include "gemm.hpp"
#include "head_products.hpp"
#include "softmax.hpp"

namespace mnemo::cpu_kernels {

/// The route of a forward of one query position over projected keys: chosen by the size of its rows
/// (automatic, relative_attention_pass::one_query_streams), or forced, for tests and benchmarks that
/// run both routes on any shape. Not meant to change while a forward runs.
enum class one_query_route { automatic, two_pass, online };
inline one_query_route one_query_override = one_query_route::automatic;

namespace detail {

/// A generated token's attention reads its rows in one pass (one_query_online) from this many bytes
/// of window and cache rows on. On the 2-core Zen 4 VM, a token alternating the two routes in one
/// process (medians of 16 rounds): A's rows (205 KiB a layer, from L2) 1.31× the time online, B's
/// (771 KiB, L3) 0.947×, C's (3 MiB, DRAM) 0.93×. On a 2-core Granite Rapids VM (2 MiB L2, B's and
/// C's rows from its 480 MiB L3), the same way (2026-12-07, two runs): A 0.99-1.01×, B 0.96-0.97×,
/// C 0.98×: the same choice, so one constant for both.
inline constexpr index_t one_query_stream_bytes = index_t(512) << 10;

/// From this many queries on, the projected route computes each head's q·R (forward) and d_pos
/// (backward) in its thread's score block (relative_attention_pass::pos_in_head).
inline constexpr index_t positional_scratch_from = 16;

/// One call's attention core over the state's pointers. E: the extents that are compile-time constants
/// (a static config's), so the loops compile as they would inside the module.
template <class T, static_extents E>
class relative_attention_pass {
    struct K : gemm, softmax, elementwise {};
    using heads = heads_for<E>;  // the per-head products at this head width
    using causal_keys = head_products::causal_keys;

public:
    explicit relative_attention_pass(const relative_attention_state<T>& state)
        : s(state),
          batch_(state.batch),
          H(state.heads),
          D(state.d_model),
          Dk(state.d_head),
          q_len_(state.q_len),
          k_len_(state.k_len),
          clamp_len_(state.clamp_len) {}

    /// Scores, positional terms, masked softmax and context (s.attn, s.ctx; s.pos, and the absorbed
    /// route's q̃, U, Û and row masses, for backward).
    void forward() {
        const index_t qb = q_len_ * batch_, w = window(), mem = k_len_ - q_len_;
        const bool absorb = s.absorbed;
        // q·R over the window of table rows [P − K, P + Q) into pos[h] [Q·B, W], per head and block of
        // query positions over the block's band of columns only (pos_band). (One query position over
        // projected keys: one_query_forward computes it with the content scores; with pos_in_head(),
        // each head computes its own rows in its score block.)
        T* pos = s.pos;
        const bool one_query = q_len_ == 1 && !absorb, fused_pos = pos_in_head();
        if (!one_query && !fused_pos)
            for_each_head(qb * w * Dk, [&](index_t h) {
                for_each_pos_block(pos_block(), [&](index_t i0, index_t i1, index_t lo) {
                    const index_t r0 = i0 * batch_;
                    heads::gemm_nt(index_t(Dk), (i1 - i0) * batch_, k_len_ + 1 - lo, s.q + r0 * D + h * Dk, D,
                                   s.r_win + lo * D + h * Dk, D, pos + h * qb * w + r0 * w + lo, w);
                });
            });
        T* attn = s.attn;
        const T scale = s.scale;
        // S's window by head, s_h [H, W] (S is [W, H]): a score row reads it along the keys.
        T* s_h = s.col_sums;
        if (!one_query || !one_query_streams())
            for (index_t c = 0; c < w; ++c)
                for (index_t h = 0; h < H; ++h) s_h[h * w + c] = s.s_win[c * H + h];
        const T* kv = s.kv;
        const index_t ld = batch_ * D, ldkv = batch_ * 2 * D;  // row strides of one batch element's sequence
        const std::uint8_t* keep = s.keep;
        // Content scores from column c0 on (absorbed: the memory's columns are already there), the
        // positional terms, the masked softmax, and the context from the keys' values from c0 on.
        const index_t c0 = absorb ? mem : 0;
        // The positional terms and the masked softmax of (batch element b, head h), over its content
        // scores a [Q, K]; p: its q·R over the window, query i's row at p + i·ldp.
        auto finish_scores = [&](index_t b, index_t h, T* a, const T* p, index_t ldp) {
            for (index_t i = 0; i < q_len_; ++i) {
                const T* pi = p + i * ldp + q_len_ - i;  // column Q + j − i at j = 0
                const T* si = s_h + h * w + q_len_ - i;  // the same window column
                T* ai = a + i * k_len_;
                const index_t visible = mem + i + 1, j0 = clamped(i);
                if (j0 > 0) {  // δ > clamp_len: the window column and S row of distance clamp_len
                    const T pc = p[i * ldp + k_len_ - clamp_len_], sc = s_h[h * w + k_len_ - clamp_len_];
                    for (index_t j = 0; j < j0; ++j) ai[j] = scale * (ai[j] + pc + sc);
                }
#pragma omp simd
                for (index_t j = j0; j < visible; ++j) ai[j] = scale * (ai[j] + pi[j] + si[j]);
            }
            softmax_mask mask = softmax_mask::causal_from(mem);
            if (keep && s.keep_any[b]) {
                mask.keep = keep + b * k_len_;
                mask.ld_keep = 0;  // the same key mask for every query row
            }
            K::softmax_forward(q_len_, k_len_, a, k_len_, a, k_len_, T(1), mask);
        };
        // (b, h)'s q·R rows in pos (one_query_two_pass's layout too: [B, W] per head).
        auto finish_from_pos = [&](index_t b, index_t h, T* a) { finish_scores(b, h, a, pos + h * qb * w + b * w, ld_pos()); };
        // Query i sees the keys up to M + i: the products skip the segment's future keys. a: the
        // head's [Q, K] block, followed (fused_pos) by room for its q·R rows [Q, W].
        const causal_keys band{mem - c0};
        auto head = [&](index_t b, index_t h, T* a) {
            const index_t off = b * D + h * Dk, kv_off = c0 * ldkv + b * 2 * D + h * Dk;
            heads::gemm_nt(index_t(Dk), q_len_, k_len_ - c0, s.qu + off, ld, kv + kv_off, ldkv, a + c0, k_len_, band);
            if (fused_pos) {
                T* p = a + score_rows_size();
                for_each_pos_block(head_pos_block(), [&](index_t i0, index_t i1, index_t lo) {
                    heads::gemm_nt(index_t(Dk), i1 - i0, k_len_ + 1 - lo, s.q + i0 * ld + off, ld, s.r_win + lo * D + h * Dk, D,
                                   p + i0 * w + lo, w);
                });
                finish_scores(b, h, a, p, w);
            } else {
                finish_from_pos(b, h, a);
            }
            heads::gemm_nn(index_t(Dk), q_len_, k_len_ - c0, a + c0, k_len_, kv + kv_off + D, ldkv, s.ctx + off, ld, T(0),
                           band);
        };
        MNEMO_CHECK(s.kv_split == 0 || one_query, "relative_attention_forward: key rows split at position ", s.kv_split,
                    " are read by the one-query route only (", q_len_, " queries", absorb ? ", absorbed)" : ")");
        if (one_query) {
            if (one_query_streams()) one_query_online(s.q, s.qu, s.r_win, kv, s.kv_lo, s.kv_split, attn, s.ctx);
            else one_query_two_pass(s.q, s.qu, s.r_win, kv, s.kv_lo, s.kv_split, pos, attn, s.ctx, finish_from_pos);
        } else if (!absorb) {
            // Each head in this thread's score block, then its weights copied to s.attn for backward.
            const index_t block = q_len_ * k_len_;
            const bool stream = stream_weights();
            parallel_range(batch_ * H, worth_threads(), [&](index_t bh_begin, index_t bh_end) {
                T* a = score_block(score_rows_size() + (fused_pos ? q_len_ * w : 0));
                for (index_t bh = bh_begin; bh < bh_end; ++bh) {
                    head(bh / H, bh % H, a);
                    K::copy_block(block, a, attn + bh * block, stream);
                }
                K::copy_fence();
            });
        } else {  // the memory's columns are in s.attn already: the heads finish there
            auto head_in_place = [&](index_t b, index_t h) { head(b, h, attn + (b * H + h) * q_len_ * k_len_); };
            absorbed_forward(s.z, s.ldz, s.qu, attn, s.ctx, head_in_place);
        }
    }

    /// From d context: d scores, dv and dk over the projected keys, d(q+u) (assigned), dq's positional
    /// part (assigned), dR and dS over the window (+=); absorbed: dW_k, dW_v, db_v and the memory rows'
    /// gradients (see absorbed_backward).
    void backward() {
        const index_t qb = q_len_ * batch_, w = window(), mem = k_len_ - q_len_;
        const T* attn = s.attn;
        T* d_scores = s.d_scores;
        T* d_pos = s.pos;  // forward's q·R is not needed any more (null when pos_in_head())
        const T scale = s.scale;
        const index_t ld = batch_ * D, ldkv = batch_ * 2 * D;
        const bool absorb = s.absorbed;
        const index_t c0 = absorb ? mem : 0;  // keys projected by forward: from position c0 on
        const T *kv = s.kv, *d_ctx = s.d_ctx, *qu = s.qu;
        T *dkv = s.dkv, *dqu = s.dqu;
        // Per (batch, head): d attention weights, dv, the softmax's backward, d(q+u) and dk over the
        // projected keys, and the positional scores' gradient; the products skip the future keys (the
        // softmax's backward reads d attention weights over the visible keys only, and d raw scores
        // past them are zero).
        // ds: the head's d scores [Q, K].
        const causal_keys band{mem - c0};
        // (b, h)'s d scores ds [Q, K] from d context (the products and the softmax's backward).
        auto head_scores = [&](index_t b, index_t h, T* ds) {
            const T* a = attn + (b * H + h) * q_len_ * k_len_;
            const index_t off = b * D + h * Dk, k_off = c0 * ldkv + b * 2 * D + h * Dk, v_off = k_off + D;
            const index_t kc = k_len_ - c0;
            heads::gemm_nt(index_t(Dk), q_len_, kc, d_ctx + off, ld, kv + v_off, ldkv, ds + c0, k_len_, band);  // dA
            heads::gemm_tn(index_t(Dk), q_len_, kc, a + c0, k_len_, d_ctx + off, ld, dkv + v_off, ldkv, T(0), band);  // dv
            K::softmax_backward(q_len_, k_len_, a, k_len_, ds, k_len_, ds, k_len_, scale,
                                softmax_mask::causal_from(mem));  // d raw score
            heads::gemm_nn(index_t(Dk), q_len_, kc, ds + c0, k_len_, kv + k_off, ldkv, dqu + off, ld, T(0), band);  // d(q+u)
            heads::gemm_tn(index_t(Dk), q_len_, kc, ds + c0, k_len_, qu + off, ld, dkv + k_off, ldkv, T(0), band);  // dk
        };
        // The positional scores' gradient of query rows [i0, i1) from their d scores ds: query i's
        // lands on window column Q + j − i of row p + (i − i0)·ldp; the rest of the row from column
        // lo on (the columns the row's block of products reads) is zero.
        auto scatter_pos = [&](const T* ds, index_t i0, index_t i1, index_t lo, T* p, index_t ldp) {
            for (index_t i = i0; i < i1; ++i) {
                T* pi = p + (i - i0) * ldp;
                for (index_t c = lo; c <= k_len_; ++c) pi[c] = T(0);
                const T* dsi = ds + i * k_len_;
                const index_t visible = mem + i + 1, j0 = clamped(i);
                for (index_t j = j0; j < visible; ++j) pi[q_len_ + j - i] = dsi[j];
                if (j0 > 0) {  // clamped scores read the column of distance clamp_len
                    T sum = T(0);
                    for (index_t j = 0; j < j0; ++j) sum += dsi[j];
                    pi[k_len_ - clamp_len_] += sum;
                }
            }
        };
        const T* r_win = s.r_win;
        T *dr_win = s.dr_win, *ds_win = s.ds_win, *cols = s.col_sums;
        if (pos_in_head()) {
            // Each head on one thread, its batch elements in order: (b, h)'s d scores in the score
            // block, then per block of head_pos_block() queries their positional gradient rows in
            // the block after it (in L1 or L2) and at once dq = d_pos·R_win (assigned), dR_win +=
            // d_posᵀ·q and dS_win's column sums. dR_win and dS_win of head h sum over b in order on
            // one thread: the bits do not depend on the thread count. (The route below writes d_pos
            // [H, Q·B, W] for all heads, 16.8 MB a layer in configuration B, by one pass and reads it
            // back by the next from L3 or DRAM.)
            const index_t pos_rows = head_pos_block();
            parallel_range(H, worth_threads(), [&](index_t h0, index_t h1) {
                T* ds = score_block(score_rows_size() + pos_rows * w);
                T* p = ds + score_rows_size();
                for (index_t h = h0; h < h1; ++h) {
                    T* col = cols + h * w;
                    for (index_t c = 0; c < w; ++c) col[c] = T(0);
                    for (index_t b = 0; b < batch_; ++b) {
                        head_scores(b, h, ds);
                        for_each_pos_block(pos_rows, [&](index_t i0, index_t i1, index_t lo) {
                            const index_t n = k_len_ + 1 - lo, r0 = i0 * batch_ + b;  // row (i0, b) of q and dq
                            scatter_pos(ds, i0, i1, lo, p, w);
                            heads::gemm_nn(index_t(Dk), i1 - i0, n, p + lo, w, r_win + lo * D + h * Dk, D,
                                           s.dq + r0 * D + h * Dk, ld);
                            heads::gemm_tn(index_t(Dk), i1 - i0, n, p + lo, w, s.q + r0 * D + h * Dk, ld,
                                           dr_win + lo * D + h * Dk, D, T(1));
                            K::sum_rows_accumulate(i1 - i0, n, p + lo, w, col + lo);
                        });
                    }
                    for (index_t c = 0; c < w; ++c) ds_win[c * H + h] += col[c];
                }
            });
            return;
        }
        // (b, h)'s d scores, then its rows of d_pos [H, Q·B, W] (query i at row i·B + b of head h).
        auto head = [&](index_t b, index_t h, T* ds) {
            head_scores(b, h, ds);
            T* ph = d_pos + h * qb * w + b * w;
            for_each_pos_block(pos_block(), [&](index_t i0, index_t i1, index_t lo) {
                scatter_pos(ds, i0, i1, lo, ph + i0 * ld_pos(), ld_pos());
            });
        };
        if (!absorb) {  // d scores in this thread's score block: only d_pos keeps them
            parallel_range(batch_ * H, worth_threads(), [&](index_t bh_begin, index_t bh_end) {
                T* ds = score_block(score_rows_size());
                for (index_t bh = bh_begin; bh < bh_end; ++bh) head(bh / H, bh % H, ds);
            });
        } else {  // the memory's columns of d scores are in s.d_scores already
            auto head_in_place = [&](index_t b, index_t h) { head(b, h, d_scores + (b * H + h) * q_len_ * k_len_); };
            absorbed_backward(s.z, s.ldz, qu, d_ctx, d_scores, dqu, head_in_place, s.frozen, s.d_zkv, s.ld_dzkv);
        }

        // Per head and block of query positions, over the block's band: dq = d_pos·R_win (assigned:
        // each row in one block), dR_win += d_posᵀ·q, dS_win += column sums of d_pos.
        for_each_head(qb * w * Dk, [&](index_t h) {
            const T* ph = d_pos + h * qb * w;
            T* col = cols + h * w;
            for (index_t c = 0; c < w; ++c) col[c] = T(0);
            for_each_pos_block(pos_block(), [&](index_t i0, index_t i1, index_t lo) {
                const index_t r0 = i0 * batch_, rows = (i1 - i0) * batch_, n = k_len_ + 1 - lo;
                const T* pb = ph + r0 * w + lo;
                heads::gemm_nn(index_t(Dk), rows, n, pb, w, r_win + lo * D + h * Dk, D, s.dq + r0 * D + h * Dk, D);
                heads::gemm_tn(index_t(Dk), rows, n, pb, w, s.q + r0 * D + h * Dk, D, dr_win + lo * D + h * Dk, D, T(1));
                K::sum_rows_accumulate(rows, n, pb, w, col + lo);
            });
            for (index_t c = 0; c < w; ++c) ds_win[c * H + h] += col[c];
        });
    }

private:
    index_t window() const { return k_len_ + q_len_; }

    /// This thread's block for one (batch element, head) over projected keys, at least n floats: a
    /// head's scores, softmax and context (forward) or its d scores (backward) run there, in the
    /// core's L2, and forward then copies the weights to s.attn. Written straight into s.attn
    /// (12.6 MB a layer in configuration B), each product's output lines came from L3 or DRAM: B's
    /// 64 score products in turn ran at 0.45 of the peak against 0.78 for one head's block kept hot
    /// (BM_head_products/nt, one thread, Emerald Rapids VM), and B's training step on 2 threads
    /// took 6-10% longer than with this block (docs/performance.md). one_query_forward keeps its
    /// partial context rows in the calling thread's block, which the region's threads share (no
    /// score block is in use on that route). Grown once, kept: a steady-state call allocates nothing.
    static T* score_block(index_t n) {
        thread_local std::vector<T, Eigen::aligned_allocator<T>> block;
        if (block.size() < std::size_t(n)) block.resize(std::size_t(n));
        return block.data();
    }
    /// Whether forward's copies of the weights bypass the caches (elementwise::copy_block): when they
    /// fill more than a core's L2 on any machine measured (4 MiB), backward reads them from L3 or
    /// DRAM anyway, and the caches keep the working set instead.
    bool stream_weights() const {
        return double(batch_) * double(H) * double(q_len_) * double(k_len_) * sizeof(T) >= double(1 << 22);
    }
    /// A head's [Q, K] scores in its score block, rounded up to whole 64-byte lines (its q·R rows follow).
    index_t score_rows_size() const { return (q_len_ * k_len_ + 15) / 16 * 16; }
    /// Row stride of pos [H, Q·B, W] (query i of batch element b at row i·B + b).
    index_t ld_pos() const { return batch_ * window(); }
    /// Whether forward computes each head's positional scores q·R in its score block (head by head,
    /// then read there by the positional terms) and backward each (batch element, head)'s d_pos
    /// rows a block at a time after its d scores, instead of both going through pos for all heads:
    /// over projected keys with positional_scratch_from (16) or more queries, so that a head's
    /// blocks of queries (head_pos_block) take the per-head products' register tiles. pos is
    /// [H, Q·B, W] (16.8 MB a layer in configuration B), written by one pass and read back by the
    /// next, each line fetched from L3 or DRAM; a head's rows (256 KB in B) stay in L2, a block's
    /// (64 KB) in L1 or L2. The module then allocates no pos (kernels/kernel_table.hpp). The bands
    /// of columns are those of pos's blocks.
    bool pos_in_head() const { return !s.absorbed && q_len_ >= positional_scratch_from; }
    /// Query positions per positional product of one head: Q in equal blocks of at most 36, so at
    /// least 16 (the register tiles' route; a remainder of a few rows would take the general
    /// GEMM). A block reads the band of its last query, so a taller one computes more columns no
    /// query reads (half the block's height a row on average).
    index_t head_pos_block() const {
        const index_t blocks = (q_len_ + 35) / 36;
        return (q_len_ + blocks - 1) / blocks;
    }

    /// The per-(batch, head) loops go to threads when they hold enough work: about 64K multiply-adds
    /// of scores (one generated token over a short memory stays on the calling thread, where an
    /// OpenMP fork and join would cost more than the loop).
    bool worth_threads() const { return batch_ * H * q_len_ * k_len_ * Dk >= (index_t(1) << 16); }
    /// One query position takes one_query_online when its rows (window and [k, v], every batch
    /// element) fill one_query_stream_bytes or more: read from DRAM, a row wants reading front to
    /// back once; from the caches the two passes' lighter arithmetic wins (one_query_block).
    bool one_query_streams() const {
        switch (one_query_override) {
            case one_query_route::two_pass: return false;
            case one_query_route::online: return true;
            default: return batch_ * (window() + 2 * k_len_) * D * index_t(sizeof(T)) >= one_query_stream_bytes;
        }
    }
    /// One query position (one_query_online, one_query_two_pass) reads the window's table rows, the
    /// keys and the values once each, from DRAM in configurations B and C, where two cores read about
    /// 1.5× as fast as one: worth threads from 64K multiply-adds over all three. (Counting the scores
    /// alone put B's token, K = 254 to 257 as the memory fills and compresses, on one thread in half of
    /// its steps; A's token, 53K multiply-adds from L3, stays on one.)
    bool one_query_worth_threads() const {
        return batch_ * H * (window() + 2 * k_len_) * Dk >= (index_t(1) << 16);
    }
    /// f(h) for every head, the heads spread over threads when the per-head products hold at least
    /// 64K multiply-adds in all (each head's GEMMs then run on one thread; results do not depend on
    /// the thread count either way).
    template <class F>
    void for_each_head(index_t work_per_head, F&& f) const {
        parallel_range(H, H * work_per_head >= (index_t(1) << 16), [&](index_t h0, index_t h1) {
            for (index_t h = h0; h < h1; ++h) f(h);
        });
    }
    /// The positional products run per block of pos_block() query positions (about 128 rows of
    /// [Q·B, W]), each over its band: row i reads window columns Q + j − i for its visible keys
    /// j ∈ [clamped(i), M + i], that is [max(Q − i, K − clamp_len), K], so a block ending before
    /// query i1 needs the columns [pos_band(i1), K]. Column 0 and those past K are never read, and
    /// the early queries see less of the window: with Q = M = 128 the bands hold about 64% of the
    /// full window's products.
    index_t pos_block() const { return std::clamp<index_t>((128 + batch_ - 1) / batch_, 1, q_len_); }
    index_t pos_band(index_t i1) const {
        const index_t lo = q_len_ - i1 + 1;
        return clamp_len_ > 0 ? std::max(lo, k_len_ - clamp_len_) : lo;
    }
    /// f(i0, i1, pos_band(i1)) for the blocks of `step` query positions [i0, i1), in order
    /// (pos_block() for the all-heads products, head_pos_block() for one head's).
    template <class F>
    void for_each_pos_block(index_t step, F&& f) const {
        for (index_t i0 = 0; i0 < q_len_; i0 += step) {
            const index_t i1 = std::min(q_len_, i0 + step);
            f(i0, i1, pos_band(i1));
        }
    }
    /// Keys j < clamped(i) of query i are farther than clamp_len (0 when clamping is off).
    index_t clamped(index_t i) const {
        if (clamp_len_ <= 0) return 0;
        return std::max<index_t>(0, k_len_ - q_len_ + i - clamp_len_);
    }

    /// Forward of one query position over projected keys and values (a generated token) whose rows come
    /// from DRAM (one_query_streams()), every head of a batch element in one pass over its rows, by
    /// blocks of one_query_block keys: each key j reads its window row (q·R at column j + 1,
    /// heads_row_dots) and then its [k, v] cache row front to back, the scores (q+u)·k of every head
    /// and at once their share of the context (an online softmax: the block's running maximum m and sum
    /// l per head, the block's partial context rescaled by exp(m_old − m_new) whenever m rises,
    /// heads_rescale_add). Then by (b, h) the blocks' partial rows are summed in order, each scaled by
    /// exp(m_blk − M)/L (M: the largest of the blocks' m, L: Σ exp(m_blk − M)·l_blk), and the weights
    /// for s.attn (backward, attention_weights()) are exp(t_j − M)/L from the scaled scores t_j the
    /// first pass left there. Reading half of each 4 KiB row in one pass and the other half in a second
    /// made the prefetchers start over twice a row: see one_query_block. Masked keys (s.keep) are
    /// skipped (weight 0; a row with none visible gets zeros, as softmax_forward gives). The blocks do
    /// not depend on the thread count, nor then do the bits. The keys and values of positions [0,
    /// split) are read from kv_lo, the rest from kv (both with position j's rows at j·B·2D).
    void one_query_online(const T* q, const T* qu, const T* r_win, const T* kv, const T* kv_lo, index_t split, T* attn,
                          T* ctx) {
        const index_t ldkv = batch_ * 2 * D, K = k_len_;
        constexpr index_t block = one_query_block, W = simd::width<T>;
        const index_t key_blocks = (K + block - 1) / block;
        // Per (b, block): its partial context [D], then (hp: H padded to whole vectors) m, l, one row's
        // c, e, scaled scores and dot products, the far keys' positional term (q·R + S at the clamped
        // column), and the block's rows of S [block, H] (and hp lanes of padding: a row's S is read
        // a whole vector at a time). Every vector the online step loads was stored whole, or well
        // before (a load over several narrower stores still in flight waits for them).
        const index_t hp = (H + W - 1) / W * W, item = (D + 7 * hp + block * H + hp + W - 1) / W * W;
        T* parts = score_block(batch_ * key_blocks * item);  // the calling thread's, shared
        const index_t j0 = clamped(0), far_col = clamp_len_ > 0 ? K - clamp_len_ : 0;
        const T scale = s.scale, ninf = -std::numeric_limits<T>::infinity();
        const std::uint8_t* keep = s.keep;
        const auto rows = [&](index_t i0, index_t i1) {
            using B = simd::batch<T>;
            const B vscale = simd::splat(scale), one = simd::splat(T(1));
            for (index_t i = i0; i < i1; ++i) {
                const index_t b = i / key_blocks, r0 = i % key_blocks * block, r1 = std::min(r0 + block, K);
                T *o = parts + i * item, *m = o + D, *l = m + hp, *c = l + hp, *e = c + hp, *t = e + hp, *sc = t + hp;
                T *far = sc + hp, *s_blk = far + hp;
                std::fill(o, o + D, T(0));
                std::fill(m, m + hp, ninf);
                std::fill(l, s_blk + block * H + hp, T(0));  // the lanes past H stay finite
                // S of the rows' window columns j + 1 (a whole block of them: one copy, long before
                // the loads of each row's vector)
                std::copy(s.s_win + (r0 + 1) * H, s.s_win + (r1 + 1) * H, s_blk);
                const std::uint8_t* kb = keep && s.keep_any[b] ? keep + b * K : nullptr;
                const T *qb = q + b * D, *qub = qu + b * D;
                T* tb = attn + b * H * K;  // the scaled scores [H, K], by head
                const T* none = nullptr;
                // Keys farther than clamp_len (j < j0) all take the window column K − clamp_len.
                if (r0 < j0) {
                    heads::row_dots(index_t(Dk), H, qb, r_win + far_col * D, none, none, far);
                    for (index_t h = 0; h < H; ++h) far[h] += s.s_win[far_col * H + h];
                }
                for (index_t j = r0; j < r1; ++j) {
                    if (kb && !kb[j]) {
                        for (index_t h = 0; h < H; ++h) tb[h * K + j] = ninf;
                        continue;
                    }
                    const T* kr = (j < split ? kv_lo : kv) + j * ldkv + b * 2 * D;
                    const bool near = j >= j0;
                    // (q+u)·k + q·R by head, the window row read first (near keys)
                    if (near) heads::row_dots(index_t(Dk), H, qub, kr, qb, r_win + (j + 1) * D, sc);
                    else heads::row_dots(index_t(Dk), H, qub, kr, none, none, sc);
                    const T* added = near ? s_blk + (j - r0) * H : far;  // S, or the far term
                    // Online step, W heads at a time: t = scale·(scores + added); with t > m, c =
                    // exp(m − t), e = 1 and m = t; otherwise c = 1, e = exp(t − m); l = l·c + e.
                    for (index_t h = 0; h < hp; h += W) {
                        const B tv = vscale * (simd::load(sc + h) + simd::load(added + h));
                        const B mv = simd::load(m + h);
                        const auto up = tv > mv;
                        const B x = exp_batch(xsimd::select(up, mv - tv, tv - mv));
                        const B cv = xsimd::select(up, x, one), ev = xsimd::select(up, one, x);
                        simd::store(m + h, xsimd::select(up, tv, mv));
                        simd::store(l + h, simd::fma(simd::load(l + h), cv, ev));
                        simd::store(c + h, cv);
                        simd::store(e + h, ev);
                        simd::store(t + h, tv);
                    }
                    for (index_t h = 0; h < H; ++h) tb[h * K + j] = t[h];
                    heads::rescale_add(index_t(Dk), H, c, e, kr + D, o);
                }
            }
        };
        const auto combine = [&](index_t i0, index_t i1) {  // ctx[b, head h], attn[b, h, ·]
            for (index_t i = i0; i < i1; ++i) {
                const index_t b = i / H, h = i % H, off = h * Dk;
                const T* pb = parts + b * key_blocks * item;
                T big = ninf;
                for (index_t k = 0; k < key_blocks; ++k) big = std::max(big, pb[k * item + D + h]);  // m
                T* cx = ctx + b * D + off;
                T* ab = attn + (b * H + h) * K;
                if (big == ninf) {  // no visible key
                    std::fill(cx, cx + Dk, T(0));
                    std::fill(ab, ab + K, T(0));
                    continue;
                }
                T sum = T(0);
                for (index_t k = 0; k < key_blocks; ++k) {
                    const T* pk = pb + k * item;
                    if (pk[D + h] != ninf) sum += std::exp(pk[D + h] - big) * pk[D + hp + h];  // l
                }
                const T inv = T(1) / sum;
                std::fill(cx, cx + Dk, T(0));
                for (index_t k = 0; k < key_blocks; ++k) {
                    const T* pk = pb + k * item;
                    if (pk[D + h] == ninf) continue;
                    const T f = std::exp(pk[D + h] - big) * inv;
#pragma omp simd
                    for (index_t d = 0; d < index_t(Dk); ++d) cx[d] += f * pk[off + d];
                }
                for (index_t j = 0; j < K; ++j) ab[j] -= big;
                exp_in_place(ab, K);
#pragma omp simd
                for (index_t j = 0; j < K; ++j) ab[j] *= inv;
            }
        };
        parallel_phases(one_query_worth_threads(), batch_ * key_blocks, rows, batch_ * H, combine);
    }
    /// Forward of one query position over projected keys and values whose rows are few enough to come
    /// from the caches (one_query_online otherwise), every head of a batch element in one pass over its
    /// rows (heads_dot_rows, heads_weighted_rows), in four phases of one region: q·R over the window's
    /// table rows and (q+u)·k over the keys, by blocks of one_query_block rows; finish_scores(b, h, a)
    /// (positional terms, softmax) by (b, h); each block of keys' share of the context, every head,
    /// into its own partial row; the partial rows summed in the blocks' order by (b, h). Every phase
    /// reads whole rows: a context split by heads reads each value row's part for a thread's heads,
    /// d_k·heads/threads floats out of every 2·D (1 KiB of each 4 KiB of configuration C's cache),
    /// which the prefetchers follow poorly (see one_query_block). The blocks do not depend on the
    /// thread count, nor then do the bits. The keys and values of positions [0, split) are read from
    /// kv_lo, the rest from kv (both with position j's rows at j·B·2D): a block across the split reads
    /// its rows in two calls, which give the bits of one (dot_rows' rows are apart; weighted_rows
    /// continues its sums in order).
    template <class Finish>
    void one_query_two_pass(const T* q, const T* qu, const T* r_win, const T* kv, const T* kv_lo, index_t split, T* pos,
                           T* attn, T* ctx, Finish& finish_scores) {
        const index_t w = window(), ldkv = batch_ * 2 * D;
        constexpr index_t block = one_query_block;
        const index_t blocks = (w + block - 1) / block;  // w = K + 1 covers the keys' rows too
        const index_t key_blocks = (k_len_ + block - 1) / block;
        T* parts = score_block(batch_ * key_blocks * D);  // [B, key_blocks, D], the calling thread's, shared
        const auto scores = [&](index_t i0, index_t i1) {
            for (index_t i = i0; i < i1; ++i) {
                const index_t b = i / blocks, r0 = i % blocks * block;
                // pos[h] [B, W]: row b of head h at h·B·W + b·W; attn [B, H, K]
                heads::dot_rows(index_t(Dk), H, r0, std::min(r0 + block, w), q + b * D, r_win, D, pos + b * w, batch_ * w);
                const index_t r1 = std::min(r0 + block, k_len_), mid = std::clamp(split, r0, r1);
                if (mid > r0)
                    heads::dot_rows(index_t(Dk), H, r0, mid, qu + b * D, kv_lo + b * 2 * D, ldkv, attn + b * H * k_len_, k_len_);
                if (r1 > mid)
                    heads::dot_rows(index_t(Dk), H, mid, r1, qu + b * D, kv + b * 2 * D, ldkv, attn + b * H * k_len_, k_len_);
            }
        };
        const auto finish = [&](index_t i0, index_t i1) {
            for (index_t i = i0; i < i1; ++i) finish_scores(i / H, i % H, attn + i * k_len_);
        };
        const auto mix = [&](index_t i0, index_t i1) {  // parts[b, blk] = Σ_{rows of blk} a·v, every head
            for (index_t i = i0; i < i1; ++i) {
                const index_t b = i / key_blocks, r0 = i % key_blocks * block, r1 = std::min(r0 + block, k_len_);
                const index_t mid = std::clamp(split, r0, r1);
                const T* a = attn + b * H * k_len_;
                if (mid > r0)
                    heads::weighted_rows(index_t(Dk), 0, H, mid - r0, a + r0, k_len_, kv_lo + r0 * ldkv + b * 2 * D + D, ldkv,
                                         parts + i * D);
                if (r1 > mid)
                    heads::weighted_rows(index_t(Dk), 0, H, r1 - mid, a + mid, k_len_, kv + mid * ldkv + b * 2 * D + D, ldkv,
                                         parts + i * D, mid > r0);
            }
        };
        const auto combine = [&](index_t i0, index_t i1) {  // ctx[b, head h] = Σ_blk parts[b, blk, head h]
            for (index_t i = i0; i < i1; ++i) {
                const index_t b = i / H, off = i % H * Dk;
                const T* p = parts + b * key_blocks * D + off;
                T* c = ctx + b * D + off;
                std::copy(p, p + Dk, c);
                for (index_t k = 1; k < key_blocks; ++k)
#pragma omp simd
                    for (index_t d = 0; d < index_t(Dk); ++d) c[d] += p[k * D + d];
            }
        };
        parallel_phases(one_query_worth_threads(), batch_ * blocks, scores, batch_ * H, finish, batch_ * key_blocks, mix,
                        batch_ * H, combine);
    }
    /// exp of every lane (xsimd's for float; std::exp lane by lane for double, whose xsimd exponential
    /// g++ 12 warns inside when inlined).
    static simd::batch<T> exp_batch(const simd::batch<T>& x) {
        if constexpr (std::is_same_v<T, float>) {
            return xsimd::exp(x);
        } else {
            alignas(64) T lanes[simd::width<T>];
            x.store_aligned(lanes);
            for (T& v : lanes) v = std::exp(v);
            return simd::batch<T>::load_aligned(lanes);
        }
    }
    /// x[i] = exp(x[i]) for i < n: exp_batch over whole vectors, then over a padded one.
    static void exp_in_place(T* x, index_t n) {
        using B = simd::batch<T>;
        constexpr index_t W = simd::width<T>;
        index_t k = 0;
        for (; k + W <= n; k += W) simd::store(x + k, exp_batch(simd::load(x + k)));
        if (k < n) {
            alignas(64) T tail[W];
            for (index_t t = 0; t < W; ++t) tail[t] = k + t < n ? x[k + t] : T(0);
            exp_batch(B::load_aligned(tail)).store_aligned(tail);
            for (index_t t = 0; k + t < n; ++t) x[k + t] = tail[t];
        }
    }
    /// Keys a block of one_query_online or one_query_two_pass covers: the unit of their thread split
    /// and of their partial contexts. Reading the rows from DRAM, on the 2-core Zen 4 VM (AVX-512; a
    /// scratch program reading configuration C's window and [k, v] rows of 6 layers cold, a 12 MiB
    /// read between layers, 2 threads, medians of 300 rounds, three runs each, alternated): every
    /// row's keys' half and then every row's values' half (the two passes' order) 0.84-1.13 ms;
    /// whole rows, the window row before each cache row (the online pass's) 0.40-0.51 ms; the halves
    /// of 2 rows at a time (k, k, v, v) 0.83-0.88 ms: the prefetchers want each page front to back.
    /// The two kernels on 6 layers of C cold, 8 alternated runs: 0.53-0.83 → 0.33-0.45 ms online.
    /// Software prefetch of the rows 1, 2 or 4 keys ahead was slower (0.72-0.98 ms against
    /// 0.44-0.73). On the 2-core Zen 3 VM (AVX2), the two passes by blocks of 64 keys against a
    /// split by heads: 25.1 against 21.9 GB/s.
    static constexpr index_t one_query_block = 64;

    // Absorbed memory (z: the memory's rows): see nn/relative_attention.hpp. Locals qt, ut, uh, dut,
    // dqt are q̃ (q_absorbed), U (mem_mix), Û (mem_mix_hat) and their gradients. Per head h, W_k,h and
    // W_v,h are the rows [h·d_k, (h+1)·d_k) of W_k and W_v [D, D]:
    //   q̃_h = (q + u)_h·W_k,h [Q·B, D]             score[i, j < M] = q̃_h,i · z_j
    //   U_h = A_h,mem·z      [Q·B, D]             context_h += U_h·W_v,hᵀ + (Σ_{j<M} a[i, j])·b_v,h
    // q̃ and U live as [H·Q, B, D]: head h's block is [Q·B, D] in the queries' row order, and batch
    // element b's rows (h, i) are one strided matrix [H·Q, D] (stride B·D), so the memory's share of
    // every head of b is one GEMM with z_b [M, D] (stride B·ld).
    // With the memory a layer norm's output z = ẑ∘γ + β (hat), U comes from Û = A_mem·ẑ (kept) as
    // Û∘γ + (Σ_{j<M} a)⊗β, and backward's d q̃ = dS·z from dS·ẑ likewise. The norm's gradients then
    // need no d z = dSᵀ·q̃ + Aᵀ·dU ([M, D]): over the memory rows,
    //   Σ_j dz∘ẑ = Σ_rows q̃∘(dS·ẑ) + dU∘Û      Σ_j dz = Σ_rows (Σ_{j<M} dS)·q̃ + (Σ_{j<M} a)·dU
    // (elementwise over b's [H·Q, D] rows), two [H·Q, M]×[M, D] GEMMs fewer per batch element.

    /// Forward of the memory's share, then head(b, h) (the segment's share, softmax, context) per head.
    template <class Head>
    void absorbed_forward(const T* z, index_t ldz, const T* qu, T* attn, T* ctx, Head& head) {
        const index_t qb = q_len_ * batch_, mem = k_len_ - q_len_, hq = H * q_len_;
        const index_t ldb = batch_ * D, ldzb = batch_ * ldz;
        const T *wk = s.wk, *wv = s.wv, *bv = s.bv;
        const frozen_key_rows<T>& hat_ = s.hat;
        T *qt = s.q_absorbed, *ut = s.mem_mix, *rs = s.row_mass;
        const bool hat = hat_.zhat != nullptr;
        T* uh = hat ? s.mem_mix_hat : nullptr;
        const index_t ldhb = zhat_stride(hat_);
        T* blocks = hat ? s.thread_blocks : nullptr;
        for_each_head(qb * D * Dk, [&](index_t h) {
            head_nn(qb, D, Dk, qu + h * Dk, D, wk + h * Dk * D, D, qt + h * qb * D, D, T(0));
        });
        // The batch elements in fixed halves (parallel_range), the same thread for an element in every
        // layer and in the backward, which finds its scores in that core's caches. Dealt one at a time
        // to whichever thread was free (a shared counter), the wait at the region's end fell (Zen 3 VM,
        // 2026-12-04: 1.21-1.86% → 0.55-0.79% of A's step here, 1.44-2.43% → 0.60-0.64% in
        // absorbed_backward's), but on the Zen 5 VM, whose two vCPUs share no L3, A's step was 4%
        // slower dealt: one process alternating the two, medians of 20 rounds of 20 steps, two runs:
        // 18.7 / 18.7 ms dealt, 18.0 / 17.8 in halves.
        parallel_range(batch_, worth_threads(), [&](index_t b0, index_t b1) {
            T* qg = hat ? blocks + thread_slot(b0, b1) * hq * (D + 1) : nullptr;  // q̃∘γ [H·Q, D], then q̃·β [H·Q]
            for (index_t b = b0; b < b1; ++b) {
                T* ab = attn + b * hq * k_len_;
                if (!hat) {
                    K::gemm_nt_direct(hq, mem, D, qt + b * D, ldb, z + b * ldz, ldzb, ab, k_len_);  // memory scores
                } else {  // q̃·z_j = (q̃∘γ)·ẑ_j + q̃·β
                    T* qbeta = qg + hq * D;
                    for (index_t r = 0; r < hq; ++r) qbeta[r] = scale_row(qt + b * D + r * ldb, hat_.gamma, hat_.beta, qg + r * D);
                    K::gemm_nt_direct(hq, mem, D, qg, D, zhat_rows(hat_, b), ldhb, ab, k_len_);
                    for (index_t r = 0; r < hq; ++r)
                        for (index_t j = 0; j < mem; ++j) ab[r * k_len_ + j] += qbeta[r];
                }
                for (index_t h = 0; h < H; ++h) head(b, h);
                if (!hat) K::gemm_nn_direct(hq, D, mem, ab, k_len_, z + b * ldz, ldzb, ut + b * D, ldb);  // U = A_mem·z
                else K::gemm_nn_direct(hq, D, mem, ab, k_len_, zhat_rows(hat_, b), ldhb, uh + b * D, ldb);  // Û
                for (index_t r = 0; r < hq; ++r) {
                    const T* ar = ab + r * k_len_;
                    // In SIMD lanes: in order, one add chain was a third of this function's own time in A.
                    T sum = T(0);
#pragma omp simd reduction(+ : sum)
                    for (index_t j = 0; j < mem; ++j) sum += ar[j];
                    rs[b * hq + r] = sum;
                }
            }
        });
        // With ẑ, U = Û∘γ + (Σ a)⊗β is never formed: U_h·W_v,hᵀ = Û_h·(W_v,h∘γ)ᵀ + (Σ a)⊗(W_v,h·β), the
        // scaled rows of W_v,h in the thread's score block, and W_v·β folded into the bias below.
        // (Forming U wrote [H·Q·B, D] rows B·D floats apart, each line first read from L3, to be
        // read once by this product and once by backward's dW_v.)
        for_each_head(qb * D * Dk, [&](index_t h) {
            const T* w = wv + h * Dk * D;
            if (hat) {
                T* wg = score_block(Dk * D);
                for (index_t o = 0; o < Dk; ++o) scale_columns(w + o * D, hat_.gamma, wg + o * D);
                w = wg;
            }
            head_nt(qb, Dk, D, hat ? uh + h * qb * D : ut + h * qb * D, D, w, D, ctx + h * Dk, D, T(1));
        });
        const T* bias = bv;  // b_v, or with ẑ b_v + W_v·β
        if (hat) {
            T* bb = score_block(D);
            for (index_t o = 0; o < D; ++o) {
                const T* w = wv + o * D;
                T dot = T(0);
#pragma omp simd reduction(+ : dot)
                for (index_t i = 0; i < D; ++i) dot += w[i] * hat_.beta[i];
                bb[o] = bv[o] + dot;
            }
            bias = bb;
        }
        for (index_t i = 0; i < q_len_; ++i)
            for (index_t b = 0; b < batch_; ++b)
                for (index_t h = 0; h < H; ++h) {
                    T* c = ctx + (i * batch_ + b) * D + h * Dk;
                    const T m = rs[b * hq + h * q_len_ + i];
                    for (index_t d = 0; d < Dk; ++d) c[d] += m * bias[h * Dk + d];
                }
    }
    /// out[i] = w[i]·γ[i] over D.
    void scale_columns(const T* w, const T* gamma, T* out) const {
#pragma omp simd
        for (index_t i = 0; i < D; ++i) out[i] = w[i] * gamma[i];
    }

    /// Backward of absorbed_forward: dW_k, dW_v, db_v and d(q+u) from the memory's share, head(b, h)
    /// per head, and the memory rows' d z, consumed batch element by batch element as it is formed
    /// (absorbed_memory_input_grads): the frozen rows' norm gradients, the others' d_zkv rows.
    template <class Head>
    void absorbed_backward(const T* z, index_t ldz, const T* qu, const T* d_ctx, T* d_scores, T* dqu, Head& head,
                           const frozen_key_rows<T>& frozen, T* d_zkv, index_t ld_dzkv) {
        const index_t qb = q_len_ * batch_, mem = k_len_ - q_len_, hq = H * q_len_;
        const index_t ldb = batch_ * D, ldzb = batch_ * ldz;
        const T *wk = s.wk, *wv = s.wv, *bv = s.bv;
        T *gk = s.gk, *gv = s.gv, *gbv = s.gbv;
        const T *attn = s.attn, *qt = s.q_absorbed, *ut = s.mem_mix, *rs = s.row_mass;
        T *dut = s.d_mem_mix, *dqt = s.d_q_absorbed;
        T* dc = s.d_bias_score;
        // d z of the memory rows (one [M, D] block per thread) is needed for the frozen rows' norm
        // gradients and for the rows that are not frozen; with the forward's ẑ and the same rows
        // frozen now (hat), no d z at all: the caller passes dz_blocks or thread_blocks accordingly.
        const bool hat = s.hat_backward;
        T* dz_blocks = s.dz_blocks;
        T* blocks = hat ? s.thread_blocks : nullptr;
        const T* uh = s.mem_mix_hat;
        const index_t ldhb = zhat_stride(frozen);
        T* norm_partial = s.norm_partial;  // [B, 2D]: Σ dz∘ẑ, Σ dz
        const bool formed_u = s.hat.zhat == nullptr;  // forward formed U (without ẑ), else only Û
        for_each_head(2 * qb * D * Dk, [&](index_t h) {
            head_nn(qb, D, Dk, d_ctx + h * Dk, D, wv + h * Dk * D, D, dut + h * qb * D, D, T(0));    // dU_h
            if (formed_u) {
                head_tn(Dk, D, qb, d_ctx + h * Dk, D, ut + h * qb * D, D, gv + h * Dk * D, D, T(1));  // dW_v,h
                return;
            }
            // dW_v,h += dctx_hᵀ·U_h = (dctx_hᵀ·Û_h)∘γ + (dctx_hᵀ·Σ a)⊗β
            T* g = score_block(Dk * D + Dk);  // dctx_hᵀ·Û_h [d_k, D], then dctx_hᵀ·Σ a [d_k]
            T* cm = g + Dk * D;
            head_tn(Dk, D, qb, d_ctx + h * Dk, D, uh + h * qb * D, D, g, D, T(0));
            for (index_t o = 0; o < Dk; ++o) cm[o] = T(0);
            for (index_t i = 0; i < q_len_; ++i)
                for (index_t b = 0; b < batch_; ++b) {
                    const T* dc_row = d_ctx + (i * batch_ + b) * D + h * Dk;
                    const T m = rs[b * hq + h * q_len_ + i];
                    for (index_t o = 0; o < Dk; ++o) cm[o] += m * dc_row[o];
                }
            const T *ga = s.hat.gamma, *be = s.hat.beta;
            for (index_t o = 0; o < Dk; ++o) {
                T* gr = gv + (h * Dk + o) * D;
                const T* go = g + o * D;
                const T c = cm[o];
#pragma omp simd
                for (index_t i = 0; i < D; ++i) gr[i] += go[i] * ga[i] + c * be[i];
            }
        });
        // db_v += Σ_i (Σ_{j<M} a[i, j])·d context_i; every memory column's d a[i, j] gets d context_i · b_v,h.
        for (index_t i = 0; i < q_len_; ++i)
            for (index_t b = 0; b < batch_; ++b)
                for (index_t h = 0; h < H; ++h) {
                    const T* g = d_ctx + (i * batch_ + b) * D + h * Dk;
                    const T m = rs[b * hq + h * q_len_ + i];
                    T dot = T(0);
#pragma omp simd reduction(+ : dot)
                    for (index_t d = 0; d < Dk; ++d) {
                        gbv[h * Dk + d] += m * g[d];
                        dot += g[d] * bv[h * Dk + d];
                    }
                    dc[b * hq + h * q_len_ + i] = dot;
                }
        parallel_range(batch_, worth_threads(), [&](index_t b0, index_t b1) {  // halves, as absorbed_forward's
            // The whole range on one call: any block will do; otherwise this thread's own.
            T* dzb = dz_blocks ? dz_blocks + thread_slot(b0, b1) * mem * D : nullptr;
            T* dug = hat ? blocks + thread_slot(b0, b1) * hq * (D + 1) : nullptr;  // dU∘γ [H·Q, D]
            for (index_t b = b0; b < b1; ++b) {
                const T* zb = z + b * ldz;
                const T* ab = attn + b * hq * k_len_;
                T* dsb = d_scores + b * hq * k_len_;
                if (!hat) {
                    K::gemm_nt_direct(hq, mem, D, dut + b * D, ldb, zb, ldzb, dsb, k_len_);  // d a over the memory columns
                } else {  // dU·z_j = (dU∘γ)·ẑ_j + dU·β, the second term with the bias's below
                    for (index_t r = 0; r < hq; ++r)
                        dc[b * hq + r] += scale_row(dut + b * D + r * ldb, frozen.gamma, frozen.beta, dug + r * D);
                    K::gemm_nt_direct(hq, mem, D, dug, D, zhat_rows(frozen, b), ldhb, dsb, k_len_);
                }
                for (index_t r = 0; r < hq; ++r) {
                    const T c = dc[b * hq + r];
                    T* dr = dsb + r * k_len_;
                    for (index_t j = 0; j < mem; ++j) dr[j] += c;
                }
                for (index_t h = 0; h < H; ++h) head(b, h);  // d raw scores from here on
                if (hat) {
                    hat_backward(b, dsb, frozen, ldhb, qt, uh, dut, rs, dqt, norm_partial + b * 2 * D);
                    continue;
                }
                K::gemm_nn_direct(hq, D, mem, dsb, k_len_, zb, ldzb, dqt + b * D, ldb);  // d q̃
                if (!dzb) continue;
                K::gemm_tn(mem, D, hq, dsb, k_len_, qt + b * D, ldb, dzb, D);          // d z = dSᵀ·q̃
                K::gemm_tn(mem, D, hq, ab, k_len_, dut + b * D, ldb, dzb, D, T(1));    //     + Aᵀ·dU
                absorbed_memory_input_grads(frozen, b, dzb, norm_partial ? norm_partial + b * 2 * D : nullptr, d_zkv,
                                            ld_dzkv);
            }
        });
        if (norm_partial) {  // in batch order, whatever the threads
            for (index_t b = 0; b < batch_; ++b) {
                const T* p = norm_partial + b * 2 * D;
                for (index_t i = 0; i < D; ++i) {
                    frozen.dgamma[i] += p[i];
                    frozen.dbeta[i] += p[D + i];
                }
            }
        }
        for_each_head(2 * qb * D * Dk, [&](index_t h) {
            head_nt(qb, Dk, D, dqt + h * qb * D, D, wk + h * Dk * D, D, dqu + h * Dk, D, T(1));      // d(q+u)_h
            head_tn(Dk, D, qb, qu + h * Dk, D, dqt + h * qb * D, D, gk + h * Dk * D, D, T(1));       // dW_k,h
        });
    }

    // The absorbed route's per-head products with the weights (q̃_h, U_h·W_v,hᵀ and their gradients),
    // one head's on one thread (for_each_head): read in place (gemm_*_direct) below
    // gemm::parallel_min_work multiply-adds, where Eigen's path, which they took before, packed
    // both operands and zeroed C for beta 0 first; larger ones (a forced absorbed route over long
    // segments) take the general dispatch, whose packed panels are re-read where the direct tiles
    // would re-read A once per 32 columns. Configuration A's 256×128×32, 256×32×128 and
    // 32×128×256 (one thread, operands hot, Granite Rapids VM): Eigen 21.6, 18.0 and 19.5 µs,
    // direct 15.6, 14.4 (gemm_direct's nt through Bᵀ) and 14.9. Tried alone in earlier sessions
    // (nn and nt only) they moved A's step within the noise of interleaved runs; with two
    // prefetches of the strided rows, A's step 2.5-3.3% faster (docs/performance.md, History,
    // 2026-12-06).
    static bool head_direct(index_t m, index_t n, index_t k) {
        return double(m) * double(n) * double(k) < gemm::parallel_min_work;
    }
    static void head_nn(index_t m, index_t n, index_t k, const T* a, index_t lda, const T* b, index_t ldb, T* c,
                        index_t ldc, T beta) {
        if (head_direct(m, n, k)) K::gemm_nn_direct(m, n, k, a, lda, b, ldb, c, ldc, beta);
        else K::gemm_nn(m, n, k, a, lda, b, ldb, c, ldc, beta);
    }
    static void head_nt(index_t m, index_t n, index_t k, const T* a, index_t lda, const T* b, index_t ldb, T* c,
                        index_t ldc, T beta) {
        if (head_direct(m, n, k)) K::gemm_nt_direct(m, n, k, a, lda, b, ldb, c, ldc, beta);
        else K::gemm_nt(m, n, k, a, lda, b, ldb, c, ldc, beta);
    }
    static void head_tn(index_t m, index_t n, index_t k, const T* a, index_t lda, const T* b, index_t ldb, T* c,
                        index_t ldc, T beta) {
        if (head_direct(m, n, k)) K::gemm_tn_direct(m, n, k, a, lda, b, ldb, c, ldc, beta);
        else K::gemm_tn(m, n, k, a, lda, b, ldb, c, ldc, beta);
    }

    /// out = row∘γ; returns row·β.
    T scale_row(const T* row, const T* gamma, const T* beta, T* out) const {
        T dot = T(0);
#pragma omp simd reduction(+ : dot)
        for (index_t i = 0; i < D; ++i) {
            out[i] = row[i] * gamma[i];
            dot += row[i] * beta[i];
        }
        return dot;
    }
    /// The per-thread scratch block of a parallel_range call over [b0, b1) of the batch: block 0 when
    /// one call has the whole range, else the thread's own (see relative_attention::parallel_slots).
    /// Every batch element writes its block before reading it, so which thread takes it does not matter.
    index_t thread_slot(index_t b0, index_t b1) const { return b1 - b0 == batch_ ? 0 : omp_get_thread_num(); }
    /// Batch element b's first memory row of ẑ, and the stride between its rows (frozen_key_rows'
    /// two layouts).
    const T* zhat_rows(const frozen_key_rows<T>& f, index_t b) const {
        return f.zhat + b * (f.ld_batch > 0 ? f.ld_batch : f.ld_zhat);
    }
    index_t zhat_stride(const frozen_key_rows<T>& f) const { return f.ld_batch > 0 ? f.ld_zhat : batch_ * f.ld_zhat; }

    /// Batch element b's d q̃ = dS·z from dS·ẑ (into dqt's rows, then completed in place), and its norm
    /// partials acc [2D] (assigned) from q̃, dS·ẑ, dU, Û and the row sums (see absorbed_forward).
    void hat_backward(index_t b, const T* dsb, const frozen_key_rows<T>& f, index_t ldhb, const T* qt, const T* uh,
                      const T* dut, const T* rs, T* dqt, T* acc) const {
        const index_t mem = k_len_ - q_len_, hq = H * q_len_, ldb = batch_ * D;
        K::gemm_nn_direct(hq, D, mem, dsb, k_len_, zhat_rows(f, b), ldhb, dqt + b * D, ldb);  // dS·ẑ
        for (index_t i = 0; i < 2 * D; ++i) acc[i] = T(0);
        for (index_t r = 0; r < hq; ++r) {
            const T* dr = dsb + r * k_len_;
            T ds_sum = T(0);
#pragma omp simd reduction(+ : ds_sum)
            for (index_t j = 0; j < mem; ++j) ds_sum += dr[j];
            const T mass = rs[b * hq + r];
            const index_t o = b * D + r * ldb;
            const T *q = qt + o, *du = dut + o, *u = uh + o, *g = f.gamma, *be = f.beta;
            // The rows two on (B·D floats apart, written long before: L3), which the hardware
            // prefetchers do not follow. A's step about 1% faster (alternated step by step, 2 of 2
            // runs).
            if (r + 2 < hq) {
                simd::prefetch_lines(q + 2 * ldb, D);
                simd::prefetch_lines(du + 2 * ldb, D);
                simd::prefetch_lines(u + 2 * ldb, D);
            }
            T* p = dqt + o;
#pragma omp simd
            for (index_t i = 0; i < D; ++i) {
                acc[i] += q[i] * p[i] + du[i] * u[i];
                acc[D + i] += ds_sum * q[i] + mass * du[i];
                p[i] = p[i] * g[i] + ds_sum * be[i];  // d q̃ = (dS·ẑ)∘γ + (Σ dS)⊗β
            }
        }
    }

    /// Batch element b's memory rows' d z, dzb [M, D] (row j is key row j·B + b): a frozen row that
    /// is a layer-norm output adds to b's norm partials (Σ dz∘ẑ, Σ dz: acc [2D], assigned here), a
    /// row that is not frozen goes to d_zkv.
    void absorbed_memory_input_grads(const frozen_key_rows<T>& f, index_t b, const T* dzb, T* acc, T* d_zkv,
                                     index_t ld) const {
        const index_t mem = k_len_ - q_len_;
        if (acc)
            for (index_t i = 0; i < 2 * D; ++i) acc[i] = T(0);
        for (index_t j = 0; j < mem; ++j) {
            const index_t r = j * batch_ + b;
            const T* g = dzb + j * D;
            if (r >= f.rows) {
                if (d_zkv) std::memcpy(d_zkv + r * ld, g, sizeof(T) * std::size_t(D));
            } else if (acc) {
                const T* zh = f.zhat + r * f.ld_zhat;
#pragma omp simd
                for (index_t i = 0; i < D; ++i) {
                    acc[i] += g[i] * zh[i];
                    acc[D + i] += g[i];
                }
            }
        }
    }

    const relative_attention_state<T>& s;
    index_t batch_;
    [[no_unique_address]] extent_holder<E.heads> H;
    [[no_unique_address]] extent_holder<E.d_model> D;
    [[no_unique_address]] extent_holder<E.d_head> Dk;
    index_t q_len_, k_len_, clamp_len_;
};

}  // namespace detail

struct relative_attention_core {
    /// From this many queries on, the projected route needs no pos buffer (pos_in_head).
    static constexpr index_t positional_scratch_from = detail::positional_scratch_from;

    /// The attention core's forward (see relative_attention_state). E: the extents that are
    /// compile-time constants.
    template <static_extents E, class T>
    static void relative_attention_forward(const relative_attention_state<T>& s) {
        detail::relative_attention_pass<T, E>(s).forward();
    }
    /// The attention core's backward, after forward of the same state.
    template <static_extents E, class T>
    static void relative_attention_backward(const relative_attention_state<T>& s) {
        detail::relative_attention_pass<T, E>(s).backward();
    }

    /// Scratch blocks a per-batch-element kernel may use at once over n elements: one per thread that
    /// parallel_range may run (and block 0 for the calling thread alone).
    static index_t parallel_slots(index_t n) { return std::min<index_t>(index_t(omp_get_max_threads()), n); }

    /// keep [B, K] (1 = visible) from key padding flags pad [K·B] (key-row order, nonzero = padding),
    /// and keep_any [B]: whether batch element b has a padded key.
    static void key_padding_keep(index_t batch, index_t k_len, const std::uint8_t* pad, std::uint8_t* keep,
                                 std::uint8_t* keep_any) {
        for (index_t b = 0; b < batch; ++b) keep_any[b] = 0;
        for (index_t j = 0; j < k_len; ++j)
            for (index_t b = 0; b < batch; ++b) {
                const bool padded = pad[j * batch + b] != 0;
                keep[b * k_len + j] = padded ? 0 : 1;
                keep_any[b] |= std::uint8_t(padded);
            }
    }

    /// The frozen rows' share when they are layer-norm outputs (frozen_key_rows): G = dkvᵀ·ẑ [2D, D]
    /// (into g) and c = Σ rows dkv [2D] (into c), then db_v += c's value half, and per row j of
    /// W = [W_k; W_v]: dW_j += G_j∘γ + c_j·β, dγ += W_j∘G_j, dβ += W_j·c_j.
    template <class T>
    static void frozen_norm_backward(index_t d, const frozen_key_rows<T>& f, const T* dkv, const T* wk, const T* wv,
                                     T* gk, T* gv, T* gbv, T* g, T* c) {
        const index_t n = 2 * d;
        gemm::gemm_tn(n, d, f.rows, dkv, n, f.zhat, f.ld_zhat, g, d);
        for (index_t j = 0; j < n; ++j) c[j] = T(0);
        elementwise::sum_rows_accumulate(f.rows, n, dkv, n, c);
        elementwise::add(1, d, c + d, d, gbv, d, gbv, d);  // db_v
        for (index_t j = 0; j < n; ++j) {
            const T* wj = (j < d ? wk + j * d : wv + (j - d) * d);
            T* dwj = (j < d ? gk + j * d : gv + (j - d) * d);
            const T* gj = g + j * d;
            for (index_t i = 0; i < d; ++i) {
                dwj[i] += gj[i] * f.gamma[i] + c[j] * f.beta[i];
                f.dgamma[i] += wj[i] * gj[i];
                f.dbeta[i] += wj[i] * c[j];
            }
        }
    }

    /// The key/value projections' backward over `rows` rows: [dW_k; dW_v] += dkvᵀ·z, db_v += Σ rows dv;
    /// dz = dkv·[W_k; W_v] (skipped when dz is null). fused: W_v directly follows W_k (and dW_v dW_k),
    /// one [2D, D] matrix, so each product is one GEMM. The weight gradients and dz are independent: at
    /// mid sizes they run at the same time, one per thread (gemm::concurrent_pair).
    template <class T>
    static void kv_projection_backward(index_t rows, index_t d, const T* z, index_t ldz, const T* dkv, const T* wk,
                                       const T* wv, T* gk, T* gv, T* gbv, bool fused, T* dz, index_t lddz) {
        auto weight_grads = [&] {
            if (fused) {
                gemm::gemm_tn(2 * d, d, rows, dkv, 2 * d, z, ldz, gk, d, T(1));
            } else {
                gemm::gemm_tn(d, d, rows, dkv, 2 * d, z, ldz, gk, d, T(1));
                gemm::gemm_tn(d, d, rows, dkv + d, 2 * d, z, ldz, gv, d, T(1));
            }
            elementwise::sum_rows_accumulate(rows, d, dkv + d, 2 * d, gbv);
        };
        auto input_grad = [&] {
            if (!dz) return;
            if (fused) {
                gemm::gemm_nn(rows, d, 2 * d, dkv, 2 * d, wk, d, dz, lddz);
            } else {
                gemm::gemm_nn(rows, d, d, dkv, 2 * d, wk, d, dz, lddz);
                gemm::gemm_nn(rows, d, d, dkv + d, 2 * d, wv, d, dz, lddz, T(1));
            }
        };
        parallel_invoke(dz && gemm::concurrent_pair(rows, d, 2 * d), weight_grads, input_grad);
    }
};

}  // namespace mnemo::cpu_kernels
