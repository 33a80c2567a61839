#pragma once
// Relative multi-head attention of Transformer-XL (Dai et al., 2019), as labml's RelativeMultiHeadAttention.
//
// Queries come from the segment (Q positions), keys and values from [compressed memory, memory, segment]
// (K = L_mem + Q positions, oldest first; a compressed slot counts as one position). Per head, with
// d_k = d_model / heads and δ = (L_mem + i) − j the distance from query i back to key j:
//
//   score[i, j] = ( (q_i + u)·k_j  +  q_i·R[P − δ]  +  S[P − δ] ) / sqrt(d_k)
//   a[i, :]     = softmax over j ≤ L_mem + i (memory fully visible, causal within the segment)
//   out_i       = output( concat_heads( Σ_j a[i, j] · v_j ) )
//
//   q = query(z_q)      `<name>.query.linear.weight` [D, D], no bias
//   k = key(z_kv)       `<name>.key.linear.weight`   [D, D], no bias
//   v = value(z_kv)     `<name>.value.linear.{weight,bias}`
//   output              `<name>.output.{weight,bias}`
//   R  `<name>.key_pos_embeddings` [2P, heads, d_k]    S  `<name>.key_pos_bias` [2P, heads]
//   u  `<name>.query_pos_bias` [heads, d_k]            (all three start at zero, as the reference)
//
// The positional term uses q without u. labml computes it with a "shift" of q·R over the table rows
// [P − K, P + Q); that shift equals the direct indexing above at every unmasked position (see
// docs/reference.md §3), which is what this module does: per head, one GEMM gives q·R for every row of
// the window, column c ↔ table row P − K + c, and score (i, j) reads column c = Q + j − i.
// P (n_pos) is a runtime setting; K > P or Q > P is an error.
//
// clamp_len (Transformer-XL's option; set_clamp_len, 0 or negative = off, the default): a distance
// δ > clamp_len uses the table row of clamp_len, P − min(δ, clamp_len), for R and S alike. The window GEMM
// is unchanged; a clamped score reads the window column of distance clamp_len (column K − clamp_len),
// and backward adds the clamped scores' gradients to that column, so R and S's row P − clamp_len
// receives them. With clamp_len ≥ K − 1 (every distance) the results are bitwise those without it.
//
// Key padding (set_key_padding; null = none, the default): flags [K·B] in key-row order (position·B + b),
// nonzero = a padding position. A padded key gets exactly zero attention weight. A query row whose every
// visible key is padded (a padded position with nothing real before it) gets all-zero weights, so its
// context Σ_j a[i, j]·v_j is zero and the sub-layer's output for it is the output projection's bias
// b_o (finite, never NaN); its gradient through the attention is zero. A batch element with no padded
// key takes the unmasked path, bitwise as without padding.
//
// Keys and values are one GEMM: the key and value weights are declared one after the other, so in the
// parameter buffer they form one [2D, D] matrix (checked at run time; two GEMMs otherwise), and k, v
// live side by side in one [K·B, 2D] buffer. Backward likewise makes dW_k, dW_v and d_zkv one GEMM each.
// The per-(batch, head) products are spread over threads; the large projections split their rows.
//
// Absorbed memory (memory_attention, chosen per call): the memory's keys and values need no input
// gradient in training (a detached memory), and with a short segment over a long memory projecting
// them dominates the cost (the reference experiment: 8 queries, 144 memory rows, d_model 128: about
// 4·M·D² multiply-adds per batch element for the projections and their gradients). Folding W_k into
// the queries and W_v into the context instead, per head h,
//   (q+u)_h·k_jᵀ = ((q+u)_h·W_k,h)·ẑ_jᵀ        Σ_j a_j·v_j,h = (Σ_j a_j·ẑ_j)·W_v,hᵀ + (Σ_j a_j)·b_v,h
// costs about 6·Q·D·(H·M + D) for forward and backward, including d ẑ of the memory rows (for the
// layer norm's parameter gradients, or as d z_kv when the rows are not frozen). The segment's own
// keys and values are projected as usual. The route is taken when it needs under half the
// multiply-adds, never with kv_reuse or keep_projections (the generation cache needs the projections).
//
// Backward (hand-written; the contract of nn/module.hpp): every parameter gradient +=, d_zq and d_zkv
// assigned (d_zq may be asked to accumulate, for callers whose queries are rows of z_kv).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "../core/buffer.hpp"
#include "../core/config.hpp"
#include "../core/parallel.hpp"
#include "../core/rng.hpp"
#include "../kernels/cpu/softmax.hpp"
#include "linear.hpp"

namespace mnemo {

/// Key positions whose projected keys and values the previous forward of the same attention already
/// computed: position dst of this call equals position src of the last one, for len consecutive
/// positions (generation, where the memory slides by a slot or two per token). The caller vouches
/// that those key inputs and the key/value parameters are unchanged.
struct kv_reuse {
    struct span {
        index_t dst = 0, src = 0, len = 0;
    };
    span spans[2];
    index_t n = 0;
    void add(index_t dst, index_t src, index_t len) {
        if (len > 0 && n < 2) spans[n++] = {dst, src, len};
    }
    /// The same spans in order of position (dst).
    kv_reuse sorted() const {
        kv_reuse r = *this;
        if (r.n == 2 && r.spans[1].dst < r.spans[0].dst) std::swap(r.spans[0], r.spans[1]);
        return r;
    }
    /// f(begin, end) for every run of positions in [0, k_len) that no span covers, in order.
    template <class F>
    void for_each_gap(index_t k_len, F&& f) const {
        const kv_reuse r = sorted();
        index_t at = 0;
        for (index_t i = 0; i <= r.n; ++i) {
            const index_t end = i < r.n ? std::min(r.spans[i].dst, k_len) : k_len;
            if (end > at) f(at, end);
            if (i < r.n) at = std::max(at, r.spans[i].dst + r.spans[i].len);
        }
    }
};

/// Key rows that need no input gradient (a detached memory), given to relative_attention::backward.
/// Their keys and values still give the projections their weight gradients. When they are the output
/// of a layer norm, z = ẑ∘γ + β (zhat given), the norm's parameter gradients from those rows are
/// added too (dgamma, dbeta), without forming d z for them:
///   with G = dkvᵀ·ẑ [2D, D] and c = Σ_rows dkv [2D] over those rows, and W = [W_k; W_v] [2D, D]:
///   dW += G·diag(γ) + c ⊗ β,   dγ_i += Σ_j W[j, i]·G[j, i],   dβ += cᵀ·W
/// (z's rows enter dW as ẑ∘γ + β; dz = dkv·W, so Σ_r dz[r, i]·ẑ[r, i] and Σ_r dz[r, i] reduce to G and c).
/// That saves the [rows, 2D] × [2D, D] GEMM of d z, about a third of the projections' work when most
/// keys are memory. With zhat null, the rows are plain inputs: dW as usual, no d z.
template <class T>
struct frozen_key_rows {
    index_t rows = 0;  // the first `rows` rows of z_kv
    const T* zhat = nullptr;
    index_t ld_zhat = 0;
    const T* gamma = nullptr;
    const T* beta = nullptr;
    T* dgamma = nullptr;
    T* dbeta = nullptr;
    /// Given to forward: the memory rows of z_kv were not written, only ẑ (the caller asked
    /// would_absorb first); forward fails rather than read them.
    bool z_unwritten = false;
};

/// How relative_attention computes the memory's share (the key positions before the segment):
///   projected  k = ẑ·W_kᵀ and v = ẑ·W_vᵀ + b_v for every memory row, then per head q·kᵀ and a·v;
///   absorbed   the projections folded into the queries and the context, never forming k and v:
///              score = ((q+u)_h·W_k,h)·ẑ and context_h = (a·ẑ)·W_v,hᵀ + (Σ a)·b_v,h;
///   automatic  absorbed when it needs under half the multiply-adds of projected (short segments over
///              long memories, as the reference experiment: 8 queries over 144 keys), else projected.
/// Both compute the same function; they differ in float rounding only.
enum class memory_attention { automatic, projected, absorbed };

template <class T, class Config, class Backend = cpu>
class relative_attention {
    using K = ops<Backend>;

public:
    static constexpr std::size_t d_model = Config::d_model;  // `dynamic` for runtime_config, as heads and d_head
    static constexpr std::size_t heads = Config::heads;
    static constexpr std::size_t d_head = Config::d_head;
    static constexpr index_t default_n_pos = 4096;

private:
    // d_model, heads, d_head: compile-time constants for a static config, runtime values for runtime_config.
    [[no_unique_address]] extent_holder<d_model> D;
    [[no_unique_address]] extent_holder<heads> H;
    [[no_unique_address]] extent_holder<d_head> Dk;

public:
    /// `shape`: d_model and heads of a runtime-shape model (runtime_config); a static config's own
    /// (the default) otherwise.
    relative_attention(parameter_set<T>& ps, const std::string& name, index_t n_pos = default_n_pos,
                       const model_shape& shape = config_shape<Config>())
        : D(check_shape<Config>(shape, ("relative_attention '" + name + "'").c_str()).d_model),
          H(shape.heads),
          Dk(shape.d_head()),
          name_(name),
          n_pos_(n_pos),
          query_(ps, name + ".query.linear", D, D, false),
          key_(ps, name + ".key.linear", D, D, false),
          value_(ps, name + ".value.linear", D, D, true),
          output_(ps, name + ".output", D, D, true) {
        MNEMO_CHECK(n_pos >= 1, "relative_attention '", name, "': n_pos (the number of relative positions P) must be "
                    "at least 1, got ", n_pos);
        // Only the window of rows a call reaches gets gradient: zero_grad, clipping and the optimizers
        // skip the rest (grad_sparsity::rows; backward records the window with touch_grad_rows).
        r_ = ps.declare(name + ".key_pos_embeddings", {2 * n_pos, H, Dk}, grad_sparsity::rows);
        s_ = ps.declare(name + ".key_pos_bias", {2 * n_pos, H}, grad_sparsity::rows);
        u_ = ps.declare(name + ".query_pos_bias", {H, Dk});
    }

    /// Distances above clamp_len use the row of clamp_len (see the top of the file); <= 0: off.
    void set_clamp_len(index_t clamp_len) { clamp_len_ = clamp_len > 0 ? clamp_len : 0; }
    index_t clamp_len() const { return clamp_len_; }
    /// Key padding flags [K·B] (key-row order, nonzero = padding) for the following forward calls,
    /// read at each forward (the pointer must stay valid until then); null: no padding.
    void set_key_padding(const std::uint8_t* pad) { key_pad_ = pad; }

    /// How the memory's keys and values enter the attention (see the top of the file); automatic by default.
    void set_memory_attention(memory_attention mode) { mode_ = mode; }
    memory_attention memory_attention_mode() const { return mode_; }
    /// Whether the last forward took the absorbed route.
    bool last_forward_absorbed() const { return absorbed_; }
    /// Whether a forward of q_len query positions over k_len key positions without key/value reuse
    /// would take it. With norm rows given as well, such a forward never reads the memory rows of z_kv.
    bool would_absorb(index_t q_len, index_t k_len) const { return use_absorbed(q_len, k_len - q_len); }
    /// While on, every forward projects the keys and values of all positions (never absorbed), so a
    /// following forward may reuse them (kv_reuse). The compressive model turns it on with its
    /// generation cache.
    void keep_projections(bool on) { keep_projections_ = on; }

    /// PyTorch defaults for the linears; R, S and u start at zero (as the reference).
    void reset_parameters(rng& r) const {
        query_.reset_parameters(r);
        key_.reset_parameters(r);
        value_.reset_parameters(r);
        output_.reset_parameters(r);
        for (const param<T>* p : {&r_, &s_, &u_})
            for (index_t i = 0; i < p->size(); ++i) p->value()[i] = T(0);
    }

    /// out [Q·B, D] = attention of the queries z_q [Q·B, D] over z_kv [K·B, D] (rows: position·B + b),
    /// with the first K − Q key positions the memory. Saves q, k, v and the attention weights.
    /// With `reuse`, the keys and values of the positions it names are copied from the previous call
    /// instead of projected again; only the others are projected.
    /// `norm_rows` (zhat, gamma, beta; the gradient pointers are not read here): the memory rows are a
    /// layer norm's output ẑ∘γ + β, as the frozen rows that backward will be given. The absorbed route
    /// then forms the memory's context from ẑ, which lets backward take the norm's gradients from
    /// [H·Q, D] products it already has instead of forming the memory rows' d z ([M, D] per batch element).
    template <view_of<T> ZQ, view_of<T> ZKV, view_of<T> O>
    void forward(const ZQ& zq, const ZKV& zkv, index_t batch, const O& out, const kv_reuse& reuse = {},
                 const frozen_key_rows<T>& norm_rows = {}) {
        static_assert(check_view<d_model, ZQ, axis::d_model, Backend>());
        static_assert(check_view<d_model, ZKV, axis::d_model, Backend>());
        static_assert(check_view<d_model, O, axis::d_model, Backend>());
        set_shape(zq.rows(), zkv.rows(), batch);
        check_rows(zq, out, "relative_attention", "z_q", "out");
        const index_t qb = q_len_ * batch_, kb = k_len_ * batch_, w = window();
        view<T, d_model, Backend> q(q_.ensure(qb * D), qb, D), qu(qu_.ensure(qb * D), qb, D),
            ctx(ctx_.ensure(qb * D), qb, D);
        query_.forward(zq, q);
        const index_t mem = k_len_ - q_len_;
        const bool absorb = !reuse.n && use_absorbed(q_len_, mem);
        if (!reuse.n) kv_base_ = 0;
        T* kv = reuse.n ? reuse_kv(reuse, zkv.data(), zkv.ld()) : kv_.ensure(kb * 2 * D);  // row r: [k_r, v_r]
        if (!reuse.n) {
            // Absorbed: only the segment's keys and values are projected (rows from mem·B on).
            const index_t r0 = absorb ? mem * batch_ : 0;
            project_kv(kb - r0, zkv.data() + r0 * zkv.ld(), zkv.ld(), kv + r0 * 2 * D);
        }
        absorbed_ = absorb;
        // Memory as ẑ∘γ + β (see above): only for the absorbed route over all the memory rows.
        hat_ = absorb && norm_rows.zhat && norm_rows.rows == mem * batch_ ? norm_rows : frozen_key_rows<T>{};
        MNEMO_CHECK(!norm_rows.z_unwritten || hat_.zhat, "relative_attention '", name_, "': the memory rows of z_kv "
                    "were left unwritten (only their ẑ given), but this forward does not take the absorbed route over "
                    "all of them");
        last_k_len_ = k_len_;
        last_batch_ = batch_;
        K::copy(qb, D, q.data(), D, qu.data(), D);
        K::add_bias_rows(qb, D, u_.value(), qu.data(), D);  // q + u, u [heads·d_k] broadcast over rows

        // q·R over the window of table rows [P − K, P + Q), one GEMM per head: pos[h] [Q·B, W]. (One
        // query position over projected keys: one_query below computes it with the content scores.)
        T* pos = pos_.ensure(H * qb * w);
        const T* r_win = r_.value_rows(n_pos_ - k_len_, n_pos_ - k_len_ + w);
        const bool one_query = q_len_ == 1 && !absorb;
        if (!one_query)
            for_each_head(qb * w * Dk, [&](index_t h) {
                K::gemm_nt(qb, w, Dk, q.data() + h * Dk, D, r_win + h * Dk, D, pos + h * qb * w, w);
            });

        T* attn = attn_.ensure(batch_ * H * q_len_ * k_len_);
        const T scale = T(1) / std::sqrt(T(index_t(Dk)));
        const T* s_win = s_.value_rows(n_pos_ - k_len_, n_pos_ - k_len_ + w);
        const index_t ld = batch_ * D, ldkv = batch_ * 2 * D;  // row strides of one batch element's sequence
        const std::uint8_t* keep = key_pad_ ? build_keep() : nullptr;
        // Content scores from column c0 on (absorbed: the memory's columns are already there), the
        // positional terms, the masked softmax, and the context from the keys' values from c0 on.
        const index_t c0 = absorb ? mem : 0;
        // The positional terms and the masked softmax of (batch element b, head h), over its content
        // scores a [Q, K].
        auto finish_scores = [&](index_t b, index_t h, T* a) {
            const T* ph = pos + h * qb * w;
            for (index_t i = 0; i < q_len_; ++i) {
                const T* pi = ph + (i * batch_ + b) * w + q_len_ - i;  // column Q + j − i at j = 0
                const T* si = s_win + (q_len_ - i) * H + h;
                T* ai = a + i * k_len_;
                const index_t visible = mem + i + 1, j0 = clamped(i);
                if (j0 > 0) {  // δ > clamp_len: the window column and S row of distance clamp_len
                    const T pc = ph[(i * batch_ + b) * w + k_len_ - clamp_len_], sc = s_win[(k_len_ - clamp_len_) * H + h];
                    for (index_t j = 0; j < j0; ++j) ai[j] = scale * (ai[j] + pc + sc);
                }
                for (index_t j = j0; j < visible; ++j) ai[j] = scale * (ai[j] + pi[j] + si[j * H]);
            }
            softmax_mask mask = softmax_mask::causal_from(mem);
            if (keep && keep_any_[std::size_t(b)]) {
                mask.keep = keep + b * k_len_;
                mask.ld_keep = 0;  // the same key mask for every query row
            }
            K::softmax_forward(q_len_, k_len_, a, k_len_, a, k_len_, T(1), mask);
        };
        auto head = [&](index_t b, index_t h) {
            T* a = attn + (b * H + h) * q_len_ * k_len_;  // [Q, K]
            const index_t off = b * D + h * Dk, kv_off = c0 * ldkv + b * 2 * D + h * Dk;
            head_gemm_nt(q_len_, k_len_ - c0, qu.data() + off, ld, kv + kv_off, ldkv, a + c0, k_len_);
            finish_scores(b, h, a);
            head_gemm_nn(q_len_, k_len_ - c0, a + c0, k_len_, kv + kv_off + D, ldkv, ctx.data() + off, ld);
        };
        if (one_query) {
            one_query_forward(q.data(), qu.data(), r_win, kv, pos, attn, ctx.data(), finish_scores);
        } else if (!absorb) {
            parallel_range(batch_ * H, worth_threads(), [&](index_t bh_begin, index_t bh_end) {
                for (index_t bh = bh_begin; bh < bh_end; ++bh) head(bh / H, bh % H);
            });
        } else {
            absorbed_forward(zkv.data(), zkv.ld(), qu.data(), attn, ctx.data(), head);
        }
        output_.forward(ctx, out);
    }

    /// Parameter gradients +=; d_zq (= or += when accumulate_dq) and d_zkv (=). Call after forward.
    /// d_zq may be rows of d_zkv (queries that are the segment's rows of z_kv) with accumulate_dq.
    template <view_of<T> ZQ, view_of<T> ZKV, view_of<T> DO, view_of<T> DZQ, view_of<T> DZKV>
    /// With `frozen`, its first rows of d_zkv are not written (see frozen_key_rows).
    void backward(const ZQ& zq, const ZKV& zkv, const DO& d_out, const DZQ& d_zq, const DZKV& d_zkv,
                  bool accumulate_dq = false, const frozen_key_rows<T>& frozen = {}) {
        static_assert(check_view<d_model, ZQ, axis::d_model, Backend>());
        static_assert(check_view<d_model, ZKV, axis::d_model, Backend>());
        static_assert(check_view<d_model, DO, axis::d_model, Backend>());
        MNEMO_CHECK(zq.rows() == q_len_ * batch_ && zkv.rows() == k_len_ * batch_,
                    "relative_attention '", name_, "': backward shapes differ from the last forward");
        const index_t qb = q_len_ * batch_, kb = k_len_ * batch_, w = window();
        MNEMO_CHECK(frozen.rows >= 0 && frozen.rows <= kb - qb, "relative_attention '", name_, "': ", frozen.rows,
                    " frozen key rows, but only ", kb - qb, " rows precede the queries");
        const view<T, d_model, Backend> q(q_.data(), qb, D), qu(qu_.data(), qb, D), ctx(ctx_.data(), qb, D);
        const T* kv = kv_.data() + kv_base_ * batch_ * 2 * D;
        T* dkv = dkv_.ensure(kb * 2 * D);  // row r: [dk_r, dv_r]
        view<T, d_model, Backend> d_ctx(d_ctx_.ensure(qb * D), qb, D), dqu(dqu_.ensure(qb * D), qb, D),
            dq(dq_.ensure(qb * D), qb, D);
        output_.backward(ctx, d_out, d_ctx);

        const T* attn = attn_.data();
        T* d_scores = d_scores_.ensure(batch_ * H * q_len_ * k_len_);
        T* d_pos = pos_.ensure(H * qb * w);  // forward's q·R is not needed any more
        const T scale = T(1) / std::sqrt(T(index_t(Dk)));
        const index_t ld = batch_ * D, ldkv = batch_ * 2 * D;
        const index_t mem = k_len_ - q_len_;
        const bool absorb = absorbed_;
        const index_t c0 = absorb ? mem : 0;  // keys projected by forward: from position c0 on
        // Per (batch, head): d attention weights, dv, the softmax's backward, d(q+u) and dk over the
        // projected keys, and the positional scores' gradient.
        auto head = [&](index_t b, index_t h) {
            const T* a = attn + (b * H + h) * q_len_ * k_len_;
            T* ds = d_scores + (b * H + h) * q_len_ * k_len_;
            const index_t off = b * D + h * Dk, k_off = c0 * ldkv + b * 2 * D + h * Dk, v_off = k_off + D;
            const index_t kc = k_len_ - c0;
            head_gemm_nt(q_len_, kc, d_ctx.data() + off, ld, kv + v_off, ldkv, ds + c0, k_len_);  // dA
            head_gemm_tn(q_len_, kc, a + c0, k_len_, d_ctx.data() + off, ld, dkv + v_off, ldkv);  // dv
            K::softmax_backward(q_len_, k_len_, a, k_len_, ds, k_len_, ds, k_len_, scale);  // d raw score
            head_gemm_nn(q_len_, kc, ds + c0, k_len_, kv + k_off, ldkv, dqu.data() + off, ld);  // d(q+u)
            head_gemm_tn(q_len_, kc, ds + c0, k_len_, qu.data() + off, ld, dkv + k_off, ldkv);  // dk
            // The positional scores' gradient lands on window column Q + j − i of row (i, b).
            T* ph = d_pos + h * qb * w;
            for (index_t i = 0; i < q_len_; ++i) {
                T* pi = ph + (i * batch_ + b) * w;
                for (index_t c = 0; c < w; ++c) pi[c] = T(0);
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
        if (!absorb) {
            parallel_range(batch_ * H, worth_threads(), [&](index_t bh_begin, index_t bh_end) {
                for (index_t bh = bh_begin; bh < bh_end; ++bh) head(bh / H, bh % H);
            });
        } else {
            absorbed_backward(zkv.data(), zkv.ld(), qu.data(), d_ctx.data(), d_scores, dqu.data(), head, frozen,
                              d_zkv.data(), d_zkv.ld());
        }

        // Per head: dq = d_pos·R_win, dR_win += d_posᵀ·q, dS_win += column sums of d_pos.
        const T* r_win = r_.value_rows(n_pos_ - k_len_, n_pos_ - k_len_ + w);
        T* dr_win = r_.touch_grad_rows(n_pos_ - k_len_, n_pos_ - k_len_ + w);  // rows [P − K, P + Q)
        T* ds_win = s_.touch_grad_rows(n_pos_ - k_len_, n_pos_ - k_len_ + w);
        T* cols = col_sums_.ensure(H * w);
        for_each_head(qb * w * Dk, [&](index_t h) {
            const T* ph = d_pos + h * qb * w;
            T* col = cols + h * w;
            head_gemm_nn(qb, w, ph, w, r_win + h * Dk, D, dq.data() + h * Dk, D);
            K::gemm_tn(w, Dk, qb, ph, w, q.data() + h * Dk, D, dr_win + h * Dk, D, T(1));
            for (index_t c = 0; c < w; ++c) col[c] = T(0);
            K::sum_rows_accumulate(qb, w, ph, w, col);
            for (index_t c = 0; c < w; ++c) ds_win[c * H + h] += col[c];
        });
        K::sum_rows_accumulate(qb, D, dqu.data(), D, u_.grad());        // du = Σ rows d(q+u)
        K::add(qb, D, dq.data(), D, dqu.data(), D, dq.data(), D);        // dq = d(q+u) + positional part

        if (absorb) {
            // The segment's rows as usual (absorbed_backward took care of the memory's).
            const index_t lb = mem * batch_;
            project_kv_backward(kb - lb, zkv.data() + lb * zkv.ld(), zkv.ld(), dkv + lb * 2 * D,
                                d_zkv.data() ? d_zkv.data() + lb * d_zkv.ld() : nullptr, d_zkv.ld());
        } else if (frozen.rows > 0) {
            const index_t fr = frozen.rows;
            project_kv_backward(kb - fr, zkv.data() + fr * zkv.ld(), zkv.ld(), dkv + fr * 2 * D,
                                d_zkv.data() ? d_zkv.data() + fr * d_zkv.ld() : nullptr, d_zkv.ld());
            if (frozen.zhat) frozen_norm_backward(frozen, dkv);
            else project_kv_backward(fr, zkv.data(), zkv.ld(), dkv, nullptr, 0);
        } else {
            project_kv_backward(kb, zkv.data(), zkv.ld(), dkv, d_zkv.data(), d_zkv.ld());
        }
        query_.backward(zq, dq, d_zq, accumulate_dq);
    }

    /// The last forward's attention weights [batch][heads][Q][K] (K = memory + segment positions).
    const T* attention_weights() const { return attn_.data(); }
    /// The last forward's query projections z_q·W_qᵀ + b_q [Q·B, D].
    const T* queries() const { return q_.data(); }
    index_t q_len() const { return q_len_; }
    index_t k_len() const { return k_len_; }
    index_t n_pos() const { return n_pos_; }
    const std::string& name() const { return name_; }
    const linear<T, d_model, d_model, Backend>& query() const { return query_; }
    const linear<T, d_model, d_model, Backend>& key() const { return key_; }
    const linear<T, d_model, d_model, Backend>& value() const { return value_; }
    const linear<T, d_model, d_model, Backend>& output() const { return output_; }
    const param<T>& key_pos_embeddings() const { return r_; }
    const param<T>& key_pos_bias() const { return s_; }
    const param<T>& query_pos_bias() const { return u_; }

private:
    void set_shape(index_t q_rows, index_t kv_rows, index_t batch) {
        MNEMO_CHECK(batch >= 1, "relative_attention '", name_, "': batch must be at least 1, got ", batch);
        MNEMO_CHECK(q_rows % batch == 0 && kv_rows % batch == 0, "relative_attention '", name_, "': ", q_rows,
                    " query rows and ", kv_rows, " key rows are not multiples of the batch ", batch);
        q_len_ = q_rows / batch;
        k_len_ = kv_rows / batch;
        batch_ = batch;
        MNEMO_CHECK(q_len_ >= 1 && k_len_ >= q_len_, "relative_attention '", name_, "': ", k_len_,
                    " key positions cannot hold the ", q_len_, " query positions (keys are [memory, segment])");
        MNEMO_CHECK(k_len_ <= n_pos_, "relative_attention '", name_, "': ", k_len_, " key positions (memory ",
                    k_len_ - q_len_, " + segment ", q_len_, ") need more relative positions than n_pos = ", n_pos_,
                    "; raise n_pos or shorten the memory");
    }
    index_t window() const { return k_len_ + q_len_; }

    // The per-head products (kernels/cpu/head_products.hpp): with d_head a compile-time width for a
    // static config, with the runtime width of a runtime-shape model otherwise (the same routes and sums).
    template <class... A>
    void head_gemm_nt(A... a) const {
        if constexpr (d_head != dynamic) K::template head_gemm_nt<index_t(d_head)>(a...);
        else K::head_gemm_nt(index_t(Dk), a...);
    }
    template <class... A>
    void head_gemm_nn(A... a) const {
        if constexpr (d_head != dynamic) K::template head_gemm_nn<index_t(d_head)>(a...);
        else K::head_gemm_nn(index_t(Dk), a...);
    }
    template <class... A>
    void head_gemm_tn(A... a) const {
        if constexpr (d_head != dynamic) K::template head_gemm_tn<index_t(d_head)>(a...);
        else K::head_gemm_tn(index_t(Dk), a...);
    }
    template <class... A>
    void heads_dot_rows(A... a) const {
        if constexpr (d_head != dynamic) K::template heads_dot_rows<index_t(d_head)>(a...);
        else K::heads_dot_rows(index_t(Dk), a...);
    }
    template <class... A>
    void heads_weighted_rows(A... a) const {
        if constexpr (d_head != dynamic) K::template heads_weighted_rows<index_t(d_head)>(a...);
        else K::heads_weighted_rows(index_t(Dk), a...);
    }

    /// The per-(batch, head) loops go to threads when they hold enough work: about 64K multiply-adds
    /// of scores (one generated token over a short memory stays on the calling thread, where an
    /// OpenMP fork and join would cost more than the loop).
    bool worth_threads() const { return batch_ * H * q_len_ * k_len_ * Dk >= (index_t(1) << 16); }
    /// f(h) for every head, the heads spread over threads when the per-head products hold at least
    /// 64K multiply-adds in all (each head's GEMMs then run on one thread; results do not depend on
    /// the thread count either way).
    template <class F>
    void for_each_head(index_t work_per_head, F&& f) const {
        parallel_range(H, H * work_per_head >= (index_t(1) << 16), [&](index_t h0, index_t h1) {
            for (index_t h = h0; h < h1; ++h) f(h);
        });
    }
    /// Keys j < clamped(i) of query i are farther than clamp_len (0 when clamping is off).
    index_t clamped(index_t i) const {
        if (clamp_len_ <= 0) return 0;
        return std::max<index_t>(0, k_len_ - q_len_ + i - clamp_len_);
    }
    /// keep [B, K] (1 = visible) from the key padding flags; keep_any_[b]: batch element b has a padded key.
    const std::uint8_t* build_keep() {
        std::uint8_t* keep = keep_.ensure(batch_ * k_len_);
        keep_any_.assign(std::size_t(batch_), 0);
        for (index_t j = 0; j < k_len_; ++j)
            for (index_t b = 0; b < batch_; ++b) {
                const bool pad = key_pad_[j * batch_ + b] != 0;
                keep[b * k_len_ + j] = pad ? 0 : 1;
                keep_any_[std::size_t(b)] |= std::uint8_t(pad);
            }
        return keep;
    }

    /// kv for this call from the last call's (spans of `reuse`) and fresh projections of the rest. The
    /// reused rows are moved within the one buffer, and only when their position changed (a token
    /// that compresses nothing moves none): spans moving to lower positions go first, lowest first,
    /// then those moving up, highest first, so no span overwrites rows another has yet to read.
    /// The keys and values of the last forward are kept in a window of positions [kv_base_,
    /// kv_base_ + K) of a buffer with as much slack again: the longest span that moves to lower
    /// positions (the compressed memory when a slot is dropped, a token's memory otherwise) moves
    /// the window instead of its rows, and only the other spans are copied. The live rows go back
    /// to the front when the window would run past the end. (Moving every row by a position was 5%
    /// of configuration A's generated token.)
    T* reuse_kv(const kv_reuse& reuse, const T* z, index_t ldz) {
        MNEMO_CHECK(last_batch_ == batch_, "relative_attention '", name_, "': key/value reuse across batch sizes (",
                    last_batch_, " then ", batch_, ")");
        MNEMO_CHECK(!absorbed_, "relative_attention '", name_, "': key/value reuse after a forward that did not project "
                    "the memory's keys (absorbed); call keep_projections(true) before that forward");
        const index_t row = batch_ * 2 * D;  // elements per position
        // Room for two windows; growing keeps the last call's rows where they are (they end at
        // kv_base_ + last_k_len_, inside the buffer as it was).
        const index_t most = std::max(k_len_, last_k_len_);
        T* buf = kv_.ensure(std::max(2 * most, kv_base_ + last_k_len_) * row);
        const index_t cap = kv_.capacity() / row;
        const kv_reuse order = reuse.sorted();
        const index_t n = order.n;
        for (index_t i = 0; i < n; ++i) {
            const auto& sp = order.spans[i];
            MNEMO_CHECK(sp.dst >= 0 && sp.src >= 0 && sp.len >= 0 && sp.dst + sp.len <= k_len_ &&
                            sp.src + sp.len <= last_k_len_,
                        "relative_attention '", name_, "': key/value reuse span out of range");
        }
        MNEMO_CHECK(n < 2 || order.spans[0].dst + order.spans[0].len <= order.spans[1].dst, "relative_attention '",
                    name_, "': key/value reuse spans overlap");
        index_t shift = 0, longest = 0;
        for (index_t i = 0; i < n; ++i) {
            const auto& sp = order.spans[i];
            if (sp.src > sp.dst && sp.len > longest) shift = sp.src - sp.dst, longest = sp.len;
        }
        const index_t old_base = kv_base_;
        index_t base = old_base + shift;
        if (base + k_len_ > cap) base = 0;  // back to the front
        // Span i's rows go from buffer position old_base + src to base + dst: those moving down
        // first, in order, then those moving up, in reverse order, so no source is overwritten.
        auto move = [&](const kv_reuse::span& sp) {
            const index_t from = old_base + sp.src, to = base + sp.dst;
            if (from != to && sp.len > 0)
                std::memmove(buf + to * row, buf + from * row, sizeof(T) * std::size_t(sp.len * row));
        };
        for (index_t i = 0; i < n; ++i)
            if (base + order.spans[i].dst < old_base + order.spans[i].src) move(order.spans[i]);
        for (index_t i = n - 1; i >= 0; --i)
            if (base + order.spans[i].dst > old_base + order.spans[i].src) move(order.spans[i]);
        kv_base_ = base;
        T* kv = buf + base * row;
        order.for_each_gap(k_len_, [&](index_t p0, index_t p1) {  // project the positions outside the spans
            project_kv((p1 - p0) * batch_, z + p0 * batch_ * ldz, ldz, kv + p0 * row);
        });
        return kv;
    }

    /// Absorbed memory when it needs under half the multiply-adds of projected, forward and backward,
    /// per batch element: projected 4·M·D² (projections, their weight and norm gradients) + 6·Q·M·D
    /// (per-head products); absorbed 6·Q·D² + 6·H·Q·M·D.
    bool use_absorbed(index_t q_len, index_t mem) const {
        if (mem == 0 || keep_projections_ || mode_ == memory_attention::projected) return false;
        if (mode_ == memory_attention::absorbed) return true;
        const double s = double(q_len), m = double(mem), d = double(D), h = double(H);
        const double projected = 4 * m * d * d + 6 * s * m * d, absorbed = 6 * s * d * d + 6 * h * s * m * d;
        return 2 * absorbed < projected;
    }

    // Absorbed memory (z: the memory's rows). Per head h, W_k,h and W_v,h are the rows
    // [h·d_k, (h+1)·d_k) of W_k and W_v [D, D]:
    //   q̃_h = (q + u)_h·W_k,h [Q·B, D]             score[i, j < M] = q̃_h,i · z_j
    //   U_h = A_h,mem·z      [Q·B, D]             context_h += U_h·W_v,hᵀ + (Σ_{j<M} a[i, j])·b_v,h
    // q̃ and U live as [H·Q, B, D]: head h's block is [Q·B, D] in the queries' row order, and batch
    // element b's rows (h, i) are one strided matrix [H·Q, D] (stride B·D), so the memory's share of
    // every head of b is one GEMM with z_b [M, D] (stride B·ld).
    // With the memory a layer norm's output z = ẑ∘γ + β (hat_), U comes from Û = A_mem·ẑ (kept) as
    // Û∘γ + (Σ_{j<M} a)⊗β, and backward's d q̃ = dS·z from dS·ẑ likewise. The norm's gradients then
    // need no d z = dSᵀ·q̃ + Aᵀ·dU ([M, D]): over the memory rows,
    //   Σ_j dz∘ẑ = Σ_rows q̃∘(dS·ẑ) + dU∘Û      Σ_j dz = Σ_rows (Σ_{j<M} dS)·q̃ + (Σ_{j<M} a)·dU
    // (elementwise over b's [H·Q, D] rows), two [H·Q, M]×[M, D] GEMMs fewer per batch element.

    /// Forward of one query position over projected keys and values (a generated token), every head of
    /// a batch element in one pass over its rows (heads_dot_rows, heads_weighted_rows): q·R over the
    /// window's table rows and (q+u)·k over the keys, then finish_scores(b, h, a) (positional terms,
    /// softmax), then the context. Rows of the dot products are split over the threads in blocks of
    /// 64, and each thread's context covers a run of heads, so a thread still reads whole runs of
    /// each row; the bits do not depend on the thread count.
    template <class Finish>
    void one_query_forward(const T* q, const T* qu, const T* r_win, const T* kv, T* pos, T* attn, T* ctx,
                           Finish& finish_scores) {
        const index_t w = window(), ldkv = batch_ * 2 * D;
        constexpr index_t block = 64;
        const index_t blocks = (w + block - 1) / block;  // w = K + 1 covers the keys' rows too
        parallel_range(batch_ * blocks, worth_threads(), [&](index_t i0, index_t i1) {
            for (index_t i = i0; i < i1; ++i) {
                const index_t b = i / blocks, r0 = i % blocks * block;
                // pos[h] [B, W]: row b of head h at h·B·W + b·W; attn [B, H, K]
                heads_dot_rows(H, r0, std::min(r0 + block, w), q + b * D, r_win, D, pos + b * w,
                                               batch_ * w);
                heads_dot_rows(H, r0, std::min(r0 + block, k_len_), qu + b * D, kv + b * 2 * D, ldkv,
                                               attn + b * H * k_len_, k_len_);
            }
        });
        parallel_range(batch_ * H, worth_threads(), [&](index_t i0, index_t i1) {
            for (index_t i = i0; i < i1;) {  // the heads [h0, h1) of batch element b
                const index_t b = i / H, h0 = i % H, h1 = std::min<index_t>(H, h0 + (i1 - i));
                T* a = attn + b * H * k_len_;
                for (index_t h = h0; h < h1; ++h) finish_scores(b, h, a + h * k_len_);
                heads_weighted_rows(h0, h1, k_len_, a, k_len_, kv + b * 2 * D + D, ldkv, ctx + b * D);
                i += h1 - h0;
            }
        });
    }

    /// Forward of the memory's share, then head(b, h) (the segment's share, softmax, context) per head.
    template <class Head>
    void absorbed_forward(const T* z, index_t ldz, const T* qu, T* attn, T* ctx, Head& head) {
        const index_t qb = q_len_ * batch_, mem = k_len_ - q_len_, hq = H * q_len_;
        const index_t ldb = batch_ * D, ldzb = batch_ * ldz;
        const T *wk = key_.weight().value(), *wv = value_.weight().value(), *bv = value_.bias().value();
        T *qt = qt_.ensure(H * qb * D), *ut = ut_.ensure(H * qb * D), *rs = row_mass_.ensure(batch_ * hq);
        const bool hat = hat_.zhat != nullptr;
        T* uh = hat ? ut_hat_.ensure(H * qb * D) : nullptr;
        const index_t ldhb = batch_ * hat_.ld_zhat;
        T* blocks = hat ? thread_blocks_.ensure(thread_slots() * hq * (D + 1)) : nullptr;
        for_each_head(qb * D * Dk, [&](index_t h) {
            K::gemm_nn(qb, D, Dk, qu + h * Dk, D, wk + h * Dk * D, D, qt + h * qb * D, D);
        });
        parallel_range(batch_, worth_threads(), [&](index_t b0, index_t b1) {
            T* qg = hat ? blocks + thread_slot(b0, b1) * hq * (D + 1) : nullptr;  // q̃∘γ [H·Q, D], then q̃·β [H·Q]
            for (index_t b = b0; b < b1; ++b) {
                T* ab = attn + b * hq * k_len_;
                if (!hat) {
                    K::gemm_nt_direct(hq, mem, D, qt + b * D, ldb, z + b * ldz, ldzb, ab, k_len_);  // memory scores
                } else {  // q̃·z_j = (q̃∘γ)·ẑ_j + q̃·β
                    T* qbeta = qg + hq * D;
                    for (index_t r = 0; r < hq; ++r) qbeta[r] = scale_row(qt + b * D + r * ldb, hat_.gamma, hat_.beta, qg + r * D);
                    K::gemm_nt_direct(hq, mem, D, qg, D, hat_.zhat + b * hat_.ld_zhat, ldhb, ab, k_len_);
                    for (index_t r = 0; r < hq; ++r)
                        for (index_t j = 0; j < mem; ++j) ab[r * k_len_ + j] += qbeta[r];
                }
                for (index_t h = 0; h < H; ++h) head(b, h);
                if (!hat) K::gemm_nn_direct(hq, D, mem, ab, k_len_, z + b * ldz, ldzb, ut + b * D, ldb);  // U = A_mem·z
                else K::gemm_nn_direct(hq, D, mem, ab, k_len_, hat_.zhat + b * hat_.ld_zhat, ldhb, uh + b * D, ldb);  // Û
                for (index_t r = 0; r < hq; ++r) {
                    const T* ar = ab + r * k_len_;
                    T sum = T(0);
                    for (index_t j = 0; j < mem; ++j) sum += ar[j];
                    rs[b * hq + r] = sum;
                    if (!hat) continue;
                    const T *g = hat_.gamma, *be = hat_.beta, *ur = uh + b * D + r * ldb;
                    T* u = ut + b * D + r * ldb;
#pragma omp simd
                    for (index_t i = 0; i < D; ++i) u[i] = ur[i] * g[i] + sum * be[i];  // U = Û∘γ + (Σ a)⊗β
                }
            }
        });
        for_each_head(qb * D * Dk, [&](index_t h) {
            K::gemm_nt(qb, Dk, D, ut + h * qb * D, D, wv + h * Dk * D, D, ctx + h * Dk, D, T(1));
        });
        for (index_t i = 0; i < q_len_; ++i)
            for (index_t b = 0; b < batch_; ++b)
                for (index_t h = 0; h < H; ++h) {
                    T* c = ctx + (i * batch_ + b) * D + h * Dk;
                    const T m = rs[b * hq + h * q_len_ + i];
                    for (index_t d = 0; d < Dk; ++d) c[d] += m * bv[h * Dk + d];
                }
    }

    /// Backward of absorbed_forward: dW_k, dW_v, db_v and d(q+u) from the memory's share, head(b, h)
    /// per head, and the memory rows' d z, consumed batch element by batch element as it is formed
    /// (absorbed_memory_input_grads): the frozen rows' norm gradients, the others' d_zkv rows.
    template <class Head>
    void absorbed_backward(const T* z, index_t ldz, const T* qu, const T* d_ctx, T* d_scores, T* dqu, Head& head,
                           const frozen_key_rows<T>& frozen, T* d_zkv, index_t ld_dzkv) {
        const index_t qb = q_len_ * batch_, mem = k_len_ - q_len_, hq = H * q_len_, lb = mem * batch_;
        const index_t ldb = batch_ * D, ldzb = batch_ * ldz;
        const T *wk = key_.weight().value(), *wv = value_.weight().value(), *bv = value_.bias().value();
        T *gk = key_.weight().grad(), *gv = value_.weight().grad(), *gbv = value_.bias().grad();
        const T *attn = attn_.data(), *qt = qt_.data(), *ut = ut_.data(), *rs = row_mass_.data();
        T *dut = dut_.ensure(H * qb * D), *dqt = dqt_.ensure(H * qb * D);
        T* dc = d_bias_score_.ensure(batch_ * hq);
        // d z of the memory rows is needed for the frozen rows' norm gradients and for the rows that
        // are not frozen; frozen raw rows (no norm) need nothing. One [M, D] block per thread.
        // With the forward's ẑ (hat_) and the same rows frozen now, no d z at all (see above).
        const bool hat = hat_.zhat && frozen.zhat == hat_.zhat && frozen.ld_zhat == hat_.ld_zhat && frozen.rows == lb &&
                         frozen.gamma == hat_.gamma && frozen.beta == hat_.beta;
        MNEMO_CHECK(hat || !hat_.z_unwritten, "relative_attention '", name_, "': backward's frozen rows differ from "
                    "the norm rows forward was given, whose z rows were left unwritten");
        const bool norm_rows = frozen.rows > 0 && frozen.zhat, open_rows = frozen.rows < lb && d_zkv;
        T* dz_blocks = !hat && (norm_rows || open_rows) ? dz_mem_.ensure(thread_slots() * mem * D) : nullptr;
        T* blocks = hat ? thread_blocks_.ensure(thread_slots() * hq * (D + 1)) : nullptr;
        const T* uh = ut_hat_.data();
        const index_t ldhb = batch_ * frozen.ld_zhat;
        T* norm_partial = norm_rows ? norm_acc_.ensure(batch_ * 2 * D) : nullptr;  // [B, 2D]: Σ dz∘ẑ, Σ dz
        for_each_head(2 * qb * D * Dk, [&](index_t h) {
            K::gemm_nn(qb, D, Dk, d_ctx + h * Dk, D, wv + h * Dk * D, D, dut + h * qb * D, D);       // dU_h
            K::gemm_tn(Dk, D, qb, d_ctx + h * Dk, D, ut + h * qb * D, D, gv + h * Dk * D, D, T(1));  // dW_v,h
        });
        // db_v += Σ_i (Σ_{j<M} a[i, j])·d context_i; every memory column's d a[i, j] gets d context_i · b_v,h.
        for (index_t i = 0; i < q_len_; ++i)
            for (index_t b = 0; b < batch_; ++b)
                for (index_t h = 0; h < H; ++h) {
                    const T* g = d_ctx + (i * batch_ + b) * D + h * Dk;
                    const T m = rs[b * hq + h * q_len_ + i];
                    T dot = T(0);
                    for (index_t d = 0; d < Dk; ++d) {
                        gbv[h * Dk + d] += m * g[d];
                        dot += g[d] * bv[h * Dk + d];
                    }
                    dc[b * hq + h * q_len_ + i] = dot;
                }
        parallel_range(batch_, worth_threads(), [&](index_t b0, index_t b1) {
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
                    K::gemm_nt_direct(hq, mem, D, dug, D, frozen.zhat + b * frozen.ld_zhat, ldhb, dsb, k_len_);
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
            K::gemm_nt(qb, Dk, D, dqt + h * qb * D, D, wk + h * Dk * D, D, dqu + h * Dk, D, T(1));   // d(q+u)_h
            K::gemm_tn(Dk, D, qb, qu + h * Dk, D, dqt + h * qb * D, D, gk + h * Dk * D, D, T(1));    // dW_k,h
        });
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
    /// Scratch blocks for the per-batch-element loops: one per thread that parallel_range may use,
    /// and the calling thread's (block 0 when one call has the whole range).
    index_t thread_slots() const { return std::min<index_t>(index_t(omp_get_max_threads()), batch_); }
    index_t thread_slot(index_t b0, index_t b1) const { return b1 - b0 == batch_ ? 0 : omp_get_thread_num(); }

    /// Batch element b's d q̃ = dS·z from dS·ẑ (into dqt's rows, then completed in place), and its norm
    /// partials acc [2D] (assigned) from q̃, dS·ẑ, dU, Û and the row sums (see absorbed_forward).
    void hat_backward(index_t b, const T* dsb, const frozen_key_rows<T>& f, index_t ldhb, const T* qt, const T* uh,
                      const T* dut, const T* rs, T* dqt, T* acc) const {
        const index_t mem = k_len_ - q_len_, hq = H * q_len_, ldb = batch_ * D;
        K::gemm_nn_direct(hq, D, mem, dsb, k_len_, f.zhat + b * f.ld_zhat, ldhb, dqt + b * D, ldb);  // dS·ẑ
        for (index_t i = 0; i < 2 * D; ++i) acc[i] = T(0);
        for (index_t r = 0; r < hq; ++r) {
            const T* dr = dsb + r * k_len_;
            T ds_sum = T(0);
            for (index_t j = 0; j < mem; ++j) ds_sum += dr[j];
            const T mass = rs[b * hq + r];
            const index_t o = b * D + r * ldb;
            const T *q = qt + o, *du = dut + o, *u = uh + o, *g = f.gamma, *be = f.beta;
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

    /// W_v directly follows W_k in the parameter buffers: [W_k; W_v] is one [2D, D] matrix.
    bool kv_fused() const {
        return value_.weight().value() == key_.weight().value() + D * D &&
               value_.weight().grad() == key_.weight().grad() + D * D;
    }

    /// kv [rows, 2D] = [z·W_kᵀ, z·W_vᵀ + b_v]
    void project_kv(index_t rows, const T* z, index_t ldz, T* kv) const {
        const T *wk = key_.weight().value(), *wv = value_.weight().value();
        if (kv_fused()) {
            K::gemm_nt(rows, 2 * D, D, z, ldz, wk, D, kv, 2 * D);
        } else {
            K::gemm_nt(rows, D, D, z, ldz, wk, D, kv, 2 * D);
            K::gemm_nt(rows, D, D, z, ldz, wv, D, kv + D, 2 * D);
        }
        K::add_bias_rows(rows, D, value_.bias().value(), kv + D, 2 * D);
    }

    /// The frozen rows' share when they are layer-norm outputs (frozen_key_rows): G = dkvᵀ·ẑ, then
    /// dW, db_v, dγ and dβ from G and the column sums of dkv.
    void frozen_norm_backward(const frozen_key_rows<T>& f, const T* dkv) {
        const index_t n = 2 * D;
        T* g = frozen_g_.ensure(n * D);
        T* c = frozen_c_.ensure(n);
        K::gemm_tn(n, D, f.rows, dkv, n, f.zhat, f.ld_zhat, g, D);
        for (index_t j = 0; j < n; ++j) c[j] = T(0);
        K::sum_rows_accumulate(f.rows, n, dkv, n, c);
        K::add(1, D, c + D, D, value_.bias().grad(), D, value_.bias().grad(), D);  // db_v
        for (index_t j = 0; j < n; ++j) {
            const T* wj = (j < D ? key_.weight().value() + j * D : value_.weight().value() + (j - D) * D);
            T* dwj = (j < D ? key_.weight().grad() + j * D : value_.weight().grad() + (j - D) * D);
            const T* gj = g + j * D;
            for (index_t i = 0; i < D; ++i) {
                dwj[i] += gj[i] * f.gamma[i] + c[j] * f.beta[i];
                f.dgamma[i] += wj[i] * gj[i];
                f.dbeta[i] += wj[i] * c[j];
            }
        }
    }

    /// [dW_k; dW_v] += dkvᵀ·z, db_v += Σ rows dv; dz = dkv·[W_k; W_v] (skipped when dz is null).
    /// The weight gradients and dz are independent: at A's sizes they run at the same time, one
    /// per thread (gemm::concurrent_pair). The parameters' pointers are read first, on this thread.
    void project_kv_backward(index_t rows, const T* z, index_t ldz, const T* dkv, T* dz, index_t lddz) const {
        const T *wk = key_.weight().value(), *wv = value_.weight().value();
        T *gk = key_.weight().grad(), *gv = value_.weight().grad(), *gbv = value_.bias().grad();
        const bool fused = kv_fused();
        auto weight_grads = [&] {
            if (fused) {
                K::gemm_tn(2 * D, D, rows, dkv, 2 * D, z, ldz, gk, D, T(1));
            } else {
                K::gemm_tn(D, D, rows, dkv, 2 * D, z, ldz, gk, D, T(1));
                K::gemm_tn(D, D, rows, dkv + D, 2 * D, z, ldz, gv, D, T(1));
            }
            K::sum_rows_accumulate(rows, D, dkv + D, 2 * D, gbv);
        };
        auto input_grad = [&] {
            if (!dz) return;
            if (fused) {
                K::gemm_nn(rows, D, 2 * D, dkv, 2 * D, wk, D, dz, lddz);
            } else {
                K::gemm_nn(rows, D, D, dkv, 2 * D, wk, D, dz, lddz);
                K::gemm_nn(rows, D, D, dkv + D, 2 * D, wv, D, dz, lddz, T(1));
            }
        };
        parallel_invoke(dz && K::concurrent_pair(rows, D, 2 * D), weight_grads, input_grad);
    }

    std::string name_;
    index_t n_pos_;
    linear<T, d_model, d_model, Backend> query_, key_, value_, output_;
    param<T> r_, s_, u_;
    index_t q_len_ = 0, k_len_ = 0, batch_ = 0, last_k_len_ = 0, last_batch_ = 0;
    memory_attention mode_ = memory_attention::automatic;
    bool keep_projections_ = false;
    bool absorbed_ = false;  // the last forward took the absorbed route (its kv_ holds the segment's rows only)
    frozen_key_rows<T> hat_;  // the memory as ẑ∘γ + β in the last (absorbed) forward; zhat null: not used
    index_t clamp_len_ = 0;                  // 0: off
    const std::uint8_t* key_pad_ = nullptr;  // [K·B], nonzero = padding; null: none
    buffer<std::uint8_t> keep_;              // [B, K], 1 = visible
    std::vector<std::uint8_t> keep_any_;     // [B]
    // Saved by forward: q, q + u [Q·B, D]; [k, v] [K·B, 2D]; attention weights [B, H, Q, K]; context [Q·B, D].
    buffer<T> q_, qu_, kv_, attn_, ctx_;
    index_t kv_base_ = 0;  // kv_'s first position (reuse_kv slides it)
    // Scratch: positional scores / their gradient [H, Q·B, W]; backward's gradients.
    buffer<T> pos_, d_ctx_, dqu_, dq_, dkv_, d_scores_, col_sums_, frozen_g_, frozen_c_;
    // Absorbed memory: saved q̃, U, Û (with hat_) [H·Q, B, D] and Σ_{j<M} a [B, H, Q]; backward's dU, d q̃, the memory
    // rows' d z (one [M, D] block per thread), the bias share of d a [B, H, Q], and the norm
    // gradients' partial sums [B, 2D].
    buffer<T> qt_, ut_, ut_hat_, row_mass_, dut_, dqt_, dz_mem_, d_bias_score_, norm_acc_, thread_blocks_;
};

}  // namespace mnemo
