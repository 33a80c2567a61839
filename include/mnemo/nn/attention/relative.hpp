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

#include "../../core/buffer.hpp"
#include "../../core/config.hpp"
#include "../../core/rng.hpp"
#include "../../kernels/relative_attention_state.hpp"
#include "../linear.hpp"

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
    /// Positions [0, split) (the compressed memory) may be kept apart from the rest, each part
    /// sliding on its own, by a forward of one query position on a backend with splits_key_rows: its
    /// keys are then not where backward reads them, so a caller sets it only when no backward follows.
    index_t split = 0;
    void add(index_t dst, index_t src, index_t len) {
        if (len > 0 && n < 2) spans[n++] = {dst, src, len};
    }
    /// The same spans in order of position (dst).
    kv_reuse sorted() const {
        kv_reuse r = *this;
        if (r.n == 2 && r.spans[1].dst < r.spans[0].dst) std::swap(r.spans[0], r.spans[1]);
        return r;
    }
    /// Whether a span covers position `pos` (its keys and values are reused, not projected).
    bool covers(index_t pos) const {
        for (index_t i = 0; i < n; ++i)
            if (pos >= spans[i].dst && pos < spans[i].dst + spans[i].len) return true;
        return false;
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
    using kernels = checked_ops<Backend>;

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
    relative_attention(parameter_set<T, Backend>& ps, const std::string& name, index_t n_pos = default_n_pos,
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
    /// Key padding flags [K·B] (key-row order, nonzero = padding; in Backend's memory) for the following
    /// forward calls, read at each forward (the pointer must stay valid until then); null: no padding.
    void set_key_padding(const std::uint8_t* pad) { key_pad_ = pad; }

    /// How the memory's keys and values enter the attention (see the top of the file); automatic by default.
    void set_memory_attention(memory_attention mode) { mode_ = mode; }
    memory_attention memory_attention_mode() const { return mode_; }
    /// Whether the last forward took the absorbed route.
    bool last_forward_absorbed() const { return absorbed_; }
    /// Whether the last forward projected q, k and v in one product (a generated token; see qkv_fused).
    bool last_forward_fused() const { return fused_rows_ != nullptr; }
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
        for (const param<T, Backend>* p : {&r_, &s_, &u_})
            p->fill(T(0));
    }

    /// out [Q·B, D] = attention of the queries z_q [Q·B, D] over z_kv [K·B, D] (rows: position·B + b),
    /// with the first K − Q key positions the memory. Saves q, k, v and the attention weights.
    /// With `reuse`, the keys and values of the positions it names are copied from the previous call
    /// instead of projected again; only the others are projected.
    /// `norm_rows` (zhat, gamma, beta; the gradient pointers are not read here): the memory rows are a
    /// layer norm's output ẑ∘γ + β, as the frozen rows that backward will be given. The absorbed route
    /// then forms the memory's context from ẑ, which lets backward take the norm's gradients from
    /// [H·Q, D] products it already has instead of forming the memory rows' d z ([M, D] per batch element).
    /// ẑ may be laid out by batch element (norm_rows.ld_batch > 0), the way the absorbed route reads
    /// it; then that route must be taken (an error otherwise).
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
        const index_t mem = k_len_ - q_len_;
        const bool absorb = !reuse.n && use_absorbed(q_len_, mem);
        // A generated token (one query position, z_q the last rows of z_kv, whose keys and values this
        // forward projects): q, k and v from one product with [W_q; W_k; W_v] (see qkv_fused).
        const bool fuse = q_len_ == 1 && qkv_fused() && zq.ld() == zkv.ld() &&
                          zq.data() == zkv.data() + (kb - qb) * zkv.ld() &&
                          (reuse.n ? !reuse.covers(k_len_ - 1) : absorb || mem == 0);
        fused_rows_ = nullptr;
        if (fuse) {
            T* qkv = qkv_.ensure(qb * 3 * D);
            kernels::gemm_nt(qb, 3 * D, D, zq.data(), zq.ld(), query_.weight().value(), D, qkv, 3 * D);
            kernels::copy(qb, D, qkv, 3 * D, q.data(), D);
            fused_rows_ = zq.data();
        } else {
            query_.forward(zq, q);
        }
        if (!reuse.n) kv_base_ = 0, kv_split_ = 0;
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
        MNEMO_CHECK(norm_rows.ld_batch == 0 || hat_.zhat, "relative_attention '", name_, "': ẑ laid out by batch "
                    "element is read by the absorbed route over all the memory rows only, which this forward does not take");
        last_k_len_ = k_len_;
        last_batch_ = batch_;
        kernels::add(qb, D, q.data(), D, u_.value(), 0, qu.data(), D);  // q + u, u [heads·d_k] added to every row

        // The visibility of the keys under padding (kept for backward).
        if (key_pad_) kernels::key_padding_keep(batch_, k_len_, key_pad_, keep_.ensure(batch_ * k_len_), keep_any_.ensure(batch_));
        // The attention core (kernels: positional window GEMMs, scores, masks, softmax, context).
        relative_attention_state<T> st = core_state(q.data(), qu.data(), kv, absorb);
        // [H, Q·B, W]: 16.8 MB a layer in configuration B, which the CPU's projected route does without
        // from 16 queries on (kernel_table.hpp, positional_scratch_from).
        if (positional_buffer()) st.pos = pos_.ensure(H * qb * w);
        st.col_sums = col_sums_.ensure(H * w);
        st.attn = attn_.ensure(batch_ * H * q_len_ * k_len_);
        st.ctx = ctx.data();
        if (absorb) {
            const index_t hq = H * q_len_;
            st.z = zkv.data();
            st.ldz = zkv.ld();
            st.wk = key_.weight().value();
            st.wv = value_.weight().value();
            st.bv = value_.bias().value();
            st.hat = hat_;
            st.q_absorbed = q_absorbed_.ensure(H * qb * D);
            st.mem_mix = hat_.zhat ? nullptr : mem_mix_.ensure(H * qb * D);  // with ẑ only Û is formed
            st.row_mass = row_mass_.ensure(batch_ * hq);
            if (hat_.zhat) {
                st.mem_mix_hat = mem_mix_hat_.ensure(H * qb * D);
                st.thread_blocks = thread_blocks_.ensure(kernels::parallel_slots(batch_) * hq * (D + 1));
            }
        }
        kernels::template relative_attention_forward<extents>(st);
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
        MNEMO_CHECK(kv_split_ == 0, "relative_attention '", name_, "': backward after a forward that kept the first ",
                    kv_split_, " key positions apart (kv_reuse::split, for generation without gradients)");
        const T* kv = kv_.data() + kv_base_ * batch_ * 2 * D;
        T* dkv = dkv_.ensure(kb * 2 * D);  // row r: [dk_r, dv_r]
        view<T, d_model, Backend> d_ctx(d_ctx_.ensure(qb * D), qb, D), dqu(dqu_.ensure(qb * D), qb, D),
            dq(dq_.ensure(qb * D), qb, D);
        output_.backward(ctx, d_out, d_ctx);

        const index_t mem = k_len_ - q_len_, hq = H * q_len_, lb = mem * batch_;
        const bool absorb = absorbed_;
        relative_attention_state<T> st = core_state(q.data(), qu.data(), kv, absorb);
        if (positional_buffer()) st.pos = pos_.data();  // d_pos from here on
        st.attn = attn_.data();
        st.d_ctx = d_ctx.data();
        // [B, H, Q, K]: 75 MB over configuration B's 6 layers, which the CPU's projected route does
        // without (kernel_table.hpp, scores_grad_scratch).
        if (absorb || !kernels::scores_grad_scratch) st.d_scores = d_scores_.ensure(batch_ * H * q_len_ * k_len_);
        st.dqu = dqu.data();
        st.dq = dq.data();
        st.dkv = dkv;
        st.dr_win = r_.touch_grad_rows(n_pos_ - k_len_, n_pos_ - k_len_ + w);  // rows [P − K, P + Q)
        st.ds_win = s_.touch_grad_rows(n_pos_ - k_len_, n_pos_ - k_len_ + w);
        st.col_sums = col_sums_.ensure(H * w);
        if (absorb) {
            st.z = zkv.data();
            st.ldz = zkv.ld();
            st.wk = key_.weight().value();
            st.wv = value_.weight().value();
            st.bv = value_.bias().value();
            st.gk = key_.weight().grad();
            st.gv = value_.weight().grad();
            st.gbv = value_.bias().grad();
            st.hat = hat_;
            st.q_absorbed = q_absorbed_.data();
            st.mem_mix = hat_.zhat ? nullptr : mem_mix_.data();
            st.mem_mix_hat = mem_mix_hat_.data();
            st.row_mass = row_mass_.data();
            st.d_mem_mix = d_mem_mix_.ensure(H * qb * D);
            st.d_q_absorbed = d_q_absorbed_.ensure(H * qb * D);
            st.d_bias_score = d_bias_score_.ensure(batch_ * hq);
            // d z of the memory rows is needed for the frozen rows' norm gradients and for the rows
            // that are not frozen; frozen raw rows (no norm) need nothing. One [M, D] block per thread.
            // With the forward's ẑ (hat_) and the same rows frozen now, no d z at all.
            const bool hat = hat_.zhat && frozen.zhat == hat_.zhat && frozen.ld_zhat == hat_.ld_zhat &&
                             frozen.ld_batch == hat_.ld_batch && frozen.rows == lb && frozen.gamma == hat_.gamma &&
                             frozen.beta == hat_.beta;
            MNEMO_CHECK(hat || !hat_.z_unwritten, "relative_attention '", name_, "': backward's frozen rows differ "
                        "from the norm rows forward was given, whose z rows were left unwritten");
            MNEMO_CHECK(hat || frozen.ld_batch == 0, "relative_attention '", name_, "': backward's frozen rows are laid "
                        "out by batch element but are not the norm rows forward was given");
            const bool norm_rows = frozen.rows > 0 && frozen.zhat, open_rows = frozen.rows < lb && d_zkv.data();
            const index_t slots = kernels::parallel_slots(batch_);
            st.hat_backward = hat;
            st.dz_blocks = !hat && (norm_rows || open_rows) ? dz_mem_.ensure(slots * mem * D) : nullptr;
            st.thread_blocks = hat ? thread_blocks_.ensure(slots * hq * (D + 1)) : nullptr;
            st.norm_partial = norm_rows ? norm_acc_.ensure(batch_ * 2 * D) : nullptr;
            st.frozen = frozen;
            st.d_zkv = d_zkv.data();
            st.ld_dzkv = d_zkv.ld();
        }
        kernels::template relative_attention_backward<extents>(st);
        kernels::sum_rows_accumulate(qb, D, dqu.data(), D, u_.grad());        // du = Σ rows d(q+u)
        kernels::add(qb, D, dq.data(), D, dqu.data(), D, dq.data(), D);        // dq = d(q+u) + positional part

        if (absorb) {
            // The segment's rows as usual (the absorbed backward took care of the memory's).
            project_kv_backward(kb - lb, zkv.data() + lb * zkv.ld(), zkv.ld(), dkv + lb * 2 * D,
                                d_zkv.data() ? d_zkv.data() + lb * d_zkv.ld() : nullptr, d_zkv.ld());
        } else if (frozen.rows > 0) {
            MNEMO_CHECK(frozen.ld_batch == 0, "relative_attention '", name_, "': frozen ẑ rows laid out by batch "
                        "element need the absorbed route, which the last forward did not take");
            const index_t fr = frozen.rows;
            project_kv_backward(kb - fr, zkv.data() + fr * zkv.ld(), zkv.ld(), dkv + fr * 2 * D,
                                d_zkv.data() ? d_zkv.data() + fr * d_zkv.ld() : nullptr, d_zkv.ld());
            if (frozen.zhat)
                kernels::frozen_norm_backward(index_t(D), frozen, dkv, key_.weight().value(), value_.weight().value(),
                                        key_.weight().grad(), value_.weight().grad(), value_.bias().grad(),
                                        frozen_g_.ensure(2 * D * D), frozen_c_.ensure(2 * D));
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
    const param<T, Backend>& key_pos_embeddings() const { return r_; }
    const param<T, Backend>& key_pos_bias() const { return s_; }
    const param<T, Backend>& query_pos_bias() const { return u_; }

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
    /// Whether the attention core reads and writes pos_ (the last forward's route and shape).
    bool positional_buffer() const { return absorbed_ || q_len_ < kernels::positional_scratch_from; }

    /// The extents the kernels take as compile-time constants (`dynamic` for a runtime shape).
    static constexpr static_extents extents{d_model, heads, d_head};

    /// The kernels' state for this call: shapes and the pointers forward and backward share.
    relative_attention_state<T> core_state(const T* q, const T* qu, const T* kv, bool absorb) {
        relative_attention_state<T> st;
        st.batch = batch_;
        st.heads = H;
        st.d_model = D;
        st.d_head = Dk;
        st.q_len = q_len_;
        st.k_len = k_len_;
        st.clamp_len = clamp_len_;
        st.absorbed = absorb;
        st.scale = T(1) / std::sqrt(T(index_t(Dk)));
        st.q = q;
        st.qu = qu;
        st.kv = kv;
        if (kv_split_ > 0) {
            st.kv_lo = kv_lo_.data() + kv_lo_base_ * batch_ * 2 * D;
            st.kv_split = kv_split_;
        }
        const index_t w = window();
        r_.pay_rows(n_pos_ - k_len_, n_pos_ - k_len_ + w);  // (deferred decay: parameters.hpp)
        s_.pay_rows(n_pos_ - k_len_, n_pos_ - k_len_ + w);
        st.r_win = r_.value_rows(n_pos_ - k_len_, n_pos_ - k_len_ + w);
        st.s_win = s_.value_rows(n_pos_ - k_len_, n_pos_ - k_len_ + w);
        st.keep = key_pad_ ? keep_.data() : nullptr;
        st.keep_any = key_pad_ ? keep_any_.data() : nullptr;
        return st;
    }

    /// kv for this call from the last call's (spans of `reuse`) and fresh projections of the rest. The
    /// keys and values of the last forward are kept in a window of positions [kv_base_, kv_base_ + K)
    /// of a buffer with as much slack again: the longest span that moves to lower positions (a
    /// token's memory) moves the window instead of its rows, and only the other spans are copied
    /// (moving every row by a position was 5% of configuration A's generated token). The live rows go
    /// back to the front when the window would run past the end. With reuse.split (one query
    /// position, a backend with splits_key_rows), positions [0, split) live in a second buffer,
    /// kv_lo_, in a window of their own: the compressed memory and the memory then both slide and
    /// neither is copied (every rate-th token moved one of them, a 1 MiB copy a layer in
    /// configuration C). Returns the window of kv_: position p's rows at kv + p·B·2D for p ≥ split.
    T* reuse_kv(const kv_reuse& reuse, const T* z, index_t ldz) {
        MNEMO_CHECK(last_batch_ == batch_, "relative_attention '", name_, "': key/value reuse across batch sizes (",
                    last_batch_, " then ", batch_, ")");
        MNEMO_CHECK(!absorbed_, "relative_attention '", name_, "': key/value reuse after a forward that did not project "
                    "the memory's keys (absorbed); call keep_projections(true) before that forward");
        const index_t row = batch_ * 2 * D;  // elements per position
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
        MNEMO_CHECK(reuse.split >= 0, "relative_attention '", name_, "': key/value reuse split ", reuse.split, " < 0");
        // The spans cut where a position's buffer changes: at the last call's split (sources) and this
        // call's (destinations). A piece goes within kv_lo_, within kv_, or from one to the other.
        const index_t old_split = kv_split_;
        struct piece {
            index_t dst, src, len;
            bool from_lo, to_lo;
        };
        piece pieces[6];
        index_t np = 0, split = 0;
        auto cut = [&](index_t new_split) {
            np = 0;
            for (index_t i = 0; i < n; ++i) {
                const auto& sp = order.spans[i];
                for (index_t at = 0; at < sp.len;) {
                    const index_t d = sp.dst + at, s = sp.src + at;
                    index_t end = sp.len;
                    if (d < new_split) end = std::min(end, new_split - sp.dst);
                    if (s < old_split) end = std::min(end, old_split - sp.src);
                    pieces[np++] = {d, s, end - at, s < old_split, d < new_split};
                    at = end;
                }
            }
        };
        const bool can_split = kernels::splits_key_rows && q_len_ == 1 && reuse.split > 0 && reuse.split < k_len_;
        cut(can_split ? reuse.split : 0);
        bool crosses = false;
        for (index_t i = 0; i < np; ++i) crosses |= pieces[i].from_lo != pieces[i].to_lo;
        // Rows cross between the buffers only when a one-buffer layout splits or a split one joins (the
        // moves below are ordered for those two cases); a split layout whose spans would cross joins.
        if (can_split && !(crosses && old_split > 0)) split = reuse.split;
        else cut(0);
        // Each window's new base: the longest piece within it that moves to lower positions stays put.
        auto slide = [&](bool lo, index_t base, index_t end, index_t cap) {
            index_t shift = 0, longest = 0;
            for (index_t i = 0; i < np; ++i) {
                const piece& p = pieces[i];
                if (p.from_lo == lo && p.to_lo == lo && p.src > p.dst && p.len > longest) shift = p.src - p.dst, longest = p.len;
            }
            base += shift;
            return base + end > cap ? index_t(0) : base;  // back to the front
        };
        // Room for two windows; growing keeps the last call's rows where they are.
        const index_t most = std::max(k_len_, last_k_len_);
        T* hi = kv_.ensure(std::max(2 * most, kv_base_ + last_k_len_) * row);
        T* lo = nullptr;
        if (split > 0 || old_split > 0) {
            const index_t lo_most = std::max(split, old_split);
            lo = kv_lo_.ensure(std::max(2 * lo_most, kv_lo_base_ + old_split) * row);
        }
        const index_t hi_base = slide(false, kv_base_, k_len_, kv_.capacity() / row);
        const index_t lo_base = split > 0 ? slide(true, kv_lo_base_, split, kv_lo_.capacity() / row) : 0;
        // Piece p's rows go from the last call's place of position src to this call's of dst.
        auto from = [&](const piece& p) { return (p.from_lo ? lo + (kv_lo_base_ + p.src) * row : hi + (kv_base_ + p.src) * row); };
        auto to = [&](const piece& p) { return (p.to_lo ? lo + (lo_base + p.dst) * row : hi + (hi_base + p.dst) * row); };
        auto move = [&](const piece& p) {
            if (from(p) != to(p) && p.len > 0) device_memory<Backend>::copy(to(p), from(p), sizeof(T) * std::size_t(p.len * row));
        };
        // Within one buffer, those moving down first, in order, then those moving up, in reverse order,
        // so no source is overwritten. Between the buffers (only when one side has no moves of its
        // own: splitting a one-buffer layout, or joining a split one): from kv_ before kv_'s moves,
        // into kv_ after them.
        auto moves_within = [&](bool in_lo) {
            for (index_t i = 0; i < np; ++i)
                if (pieces[i].from_lo == in_lo && pieces[i].to_lo == in_lo && to(pieces[i]) < from(pieces[i])) move(pieces[i]);
            for (index_t i = np - 1; i >= 0; --i)
                if (pieces[i].from_lo == in_lo && pieces[i].to_lo == in_lo && to(pieces[i]) > from(pieces[i])) move(pieces[i]);
        };
        for (index_t i = 0; i < np; ++i)
            if (!pieces[i].from_lo && pieces[i].to_lo) move(pieces[i]);
        moves_within(true);
        moves_within(false);
        for (index_t i = 0; i < np; ++i)
            if (pieces[i].from_lo && !pieces[i].to_lo) move(pieces[i]);
        kv_base_ = hi_base;
        kv_lo_base_ = lo_base;
        kv_split_ = split;
        T* kv = hi + hi_base * row;
        T* kv_lo = split > 0 ? lo + lo_base * row : nullptr;
        order.for_each_gap(k_len_, [&](index_t p0, index_t p1) {  // project the positions outside the spans
            if (p0 < split) {
                const index_t e = std::min(p1, split);
                project_kv((e - p0) * batch_, z + p0 * batch_ * ldz, ldz, kv_lo + p0 * row);
                p0 = e;
            }
            if (p1 > p0) project_kv((p1 - p0) * batch_, z + p0 * batch_ * ldz, ldz, kv + p0 * row);
        });
        return kv;
    }

    /// Absorbed memory when it needs under half the multiply-adds of projected, forward and backward,
    /// per batch element: projected 4·M·D² (projections, their weight and norm gradients) + 6·Q·M·D
    /// (per-head products); absorbed 6·Q·D² + 6·H·Q·M·D.
    bool use_absorbed(index_t q_len, index_t mem) const {
        if constexpr (!kernels::absorbs_memory) return false;  // the backend has no absorbed route
        if (mem == 0 || keep_projections_ || mode_ == memory_attention::projected) return false;
        if (mode_ == memory_attention::absorbed) return true;
        const double s = double(q_len), m = double(mem), d = double(D), h = double(H);
        const double projected = 4 * m * d * d + 6 * s * m * d, absorbed = 6 * s * d * d + 6 * h * s * m * d;
        return 2 * absorbed < projected;
    }

    /// W_v directly follows W_k in the parameter buffers: [W_k; W_v] is one [2D, D] matrix, and so are
    /// their gradients (the gradient buffer has the values' layout; asking for a gradient pointer here
    /// would allocate the gradients of a model that only generates).
    bool kv_fused() const { return value_.weight().value() == key_.weight().value() + D * D; }

    /// W_k directly follows W_q, and W_v W_k: [W_q; W_k; W_v] is one [3D, D] matrix. A generated
    /// token's three projections are then one matrix-vector product (one fork and join of the
    /// threads instead of two; each output is the same dot product as apart, so the bits do not move).
    bool qkv_fused() const { return kv_fused() && key_.weight().value() == query_.weight().value() + D * D; }

    /// kv [rows, 2D] = [z·W_kᵀ, z·W_vᵀ + b_v]; for the query rows of a fused forward (fused_rows_),
    /// copied from the product that gave q.
    void project_kv(index_t rows, const T* z, index_t ldz, T* kv) const {
        const T *wk = key_.weight().value(), *wv = value_.weight().value();
        if (z == fused_rows_ && rows == q_len_ * batch_) {
            kernels::copy(rows, 2 * D, qkv_.data() + D, 3 * D, kv, 2 * D);
        } else if (kv_fused()) {
            kernels::gemm_nt(rows, 2 * D, D, z, ldz, wk, D, kv, 2 * D);
        } else {
            kernels::gemm_nt(rows, D, D, z, ldz, wk, D, kv, 2 * D);
            kernels::gemm_nt(rows, D, D, z, ldz, wv, D, kv + D, 2 * D);
        }
        kernels::add_bias_rows(rows, D, value_.bias().value(), kv + D, 2 * D);
    }

    /// [dW_k; dW_v] += dkvᵀ·z, db_v += Σ rows dv; dz = dkv·[W_k; W_v] (skipped when dz is null).
    void project_kv_backward(index_t rows, const T* z, index_t ldz, const T* dkv, T* dz, index_t lddz) const {
        const T *wk = key_.weight().value(), *wv = value_.weight().value();
        T *gk = key_.weight().grad(), *gv = value_.weight().grad(), *gbv = value_.bias().grad();
        kernels::kv_projection_backward(rows, index_t(D), z, ldz, dkv, wk, wv, gk, gv, gbv, kv_fused(), dz, lddz);
    }

    std::string name_;
    index_t n_pos_;
    linear<T, d_model, d_model, Backend> query_, key_, value_, output_;
    param<T, Backend> r_, s_, u_;
    index_t q_len_ = 0, k_len_ = 0, batch_ = 0, last_k_len_ = 0, last_batch_ = 0;
    memory_attention mode_ = memory_attention::automatic;
    bool keep_projections_ = false;
    bool absorbed_ = false;  // the last forward took the absorbed route (its kv_ holds the segment's rows only)
    frozen_key_rows<T> hat_;  // the memory as ẑ∘γ + β in the last (absorbed) forward; zhat null: not used
    index_t clamp_len_ = 0;                  // 0: off
    const std::uint8_t* key_pad_ = nullptr;  // [K·B], nonzero = padding; null: none
    buffer<std::uint8_t, Backend> keep_;      // [B, K], 1 = visible
    buffer<std::uint8_t, Backend> keep_any_;  // [B]: batch element b has a padded key
    // Saved by forward: q, q + u [Q·B, D]; [k, v] [K·B, 2D]; attention weights [B, H, Q, K]; context [Q·B, D].
    buffer<T, Backend> q_, qu_, kv_, attn_, ctx_;
    // A fused forward's [q, k, v] rows [Q·B, 3D]; the last forward's z_q rows if it was fused, else
    // null (compared with project_kv's rows, never read).
    buffer<T, Backend> qkv_;
    const T* fused_rows_ = nullptr;
    index_t kv_base_ = 0;  // kv_'s first position (reuse_kv slides it)
    // With kv_split_ > 0 (reuse_kv), positions [0, kv_split_) of the last forward are kept in kv_lo_
    // from its row kv_lo_base_ on, and kv_ holds the rest.
    buffer<T, Backend> kv_lo_;
    index_t kv_split_ = 0, kv_lo_base_ = 0;
    // Scratch: positional scores / their gradient [H, Q·B, W]; backward's gradients.
    buffer<T, Backend> pos_, d_ctx_, dqu_, dq_, dkv_, d_scores_, col_sums_, frozen_g_, frozen_c_;
    // Absorbed memory: saved q̃ (q_absorbed_), U (mem_mix_, without hat_) or Û (mem_mix_hat_, with hat_) [H·Q, B, D] and
    // Σ_{j<M} a [B, H, Q]; backward's dU, d q̃, the memory rows' d z (one [M, D] block per thread), the
    // bias share of d a [B, H, Q], and the norm gradients' partial sums [B, 2D].
    buffer<T, Backend> q_absorbed_, mem_mix_, mem_mix_hat_, row_mass_, d_mem_mix_, d_q_absorbed_, dz_mem_, d_bias_score_,
        norm_acc_, thread_blocks_;
};

}  // namespace mnemo
