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
// REFERENCE_NOTES), which is what this module does: per head, one GEMM gives q·R for every row of
// the window, column c ↔ table row P − K + c, and score (i, j) reads column c = Q + j − i.
// P (n_pos) is a runtime setting; K > P or Q > P is an error.
//
// Backward (hand-written; the contract of nn/module.hpp): every parameter gradient +=, d_zq and d_zkv
// assigned (d_zq may be asked to accumulate, for callers whose queries are rows of z_kv).
#include <cmath>
#include <string>

#include "../core/buffer.hpp"
#include "../core/rng.hpp"
#include "../kernels/cpu/softmax.hpp"
#include "linear.hpp"

namespace mnemo {

template <class T, class Config, class Backend = cpu>
class relative_attention {
    using K = ops<Backend>;

public:
    static constexpr std::size_t d_model = Config::d_model;
    static constexpr std::size_t heads = Config::heads;
    static constexpr std::size_t d_head = Config::d_head;
    static constexpr index_t default_n_pos = 4096;

    relative_attention(parameter_set<T>& ps, const std::string& name, index_t n_pos = default_n_pos)
        : name_(name),
          n_pos_(n_pos),
          query_(ps, name + ".query.linear", false),
          key_(ps, name + ".key.linear", false),
          value_(ps, name + ".value.linear", true),
          output_(ps, name + ".output", true) {
        MNEMO_CHECK(n_pos >= 1, "relative_attention '", name, "': n_pos (the number of relative positions P) must be "
                    "at least 1, got ", n_pos);
        r_ = ps.declare(name + ".key_pos_embeddings", {2 * n_pos, index_t(heads), index_t(d_head)});
        s_ = ps.declare(name + ".key_pos_bias", {2 * n_pos, index_t(heads)});
        u_ = ps.declare(name + ".query_pos_bias", {index_t(heads), index_t(d_head)});
    }

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
    template <view_of<T> ZQ, view_of<T> ZKV, view_of<T> O>
    void forward(const ZQ& zq, const ZKV& zkv, index_t batch, const O& out) {
        static_assert(check_view<d_model, ZQ, axis::d_model, Backend>());
        static_assert(check_view<d_model, ZKV, axis::d_model, Backend>());
        static_assert(check_view<d_model, O, axis::d_model, Backend>());
        set_shape(zq.rows(), zkv.rows(), batch);
        check_rows(zq, out, "relative_attention", "z_q", "out");
        const index_t qb = q_len_ * batch_, kb = k_len_ * batch_, w = window();
        view<T, d_model, Backend> q(q_.ensure(qb * D), qb), qu(qu_.ensure(qb * D), qb), ctx(ctx_.ensure(qb * D), qb);
        view<T, d_model, Backend> k(k_.ensure(kb * D), kb), v(v_.ensure(kb * D), kb);
        query_.forward(zq, q);
        key_.forward(zkv, k);
        value_.forward(zkv, v);
        K::copy(qb, D, q.data(), D, qu.data(), D);
        K::add_bias_rows(qb, D, u_.value(), qu.data(), D);  // q + u, u [heads·d_k] broadcast over rows

        // q·R over the window of table rows [P − K, P + Q), one GEMM per head: pos[h] [Q·B, W].
        T* pos = pos_.ensure(index_t(heads) * qb * w);
        const T* r_win = r_.value() + (n_pos_ - k_len_) * D;
        for (index_t h = 0; h < H; ++h)
            K::gemm_nt(qb, w, Dk, q.data() + h * Dk, D, r_win + h * Dk, D, pos + h * qb * w, w);

        T* attn = attn_.ensure(batch_ * H * q_len_ * k_len_);
        const T scale = T(1) / std::sqrt(T(d_head));
        const T* s_win = s_.value() + (n_pos_ - k_len_) * H;
        const index_t ld = batch_ * D;  // row stride of one batch element's sequence
        const index_t mem = k_len_ - q_len_;
#pragma omp parallel for schedule(static) collapse(2)
        for (index_t b = 0; b < batch_; ++b) {
            for (index_t h = 0; h < H; ++h) {
                T* a = attn + (b * H + h) * q_len_ * k_len_;  // [Q, K]
                const index_t off = b * D + h * Dk;
                K::gemm_nt(q_len_, k_len_, Dk, qu.data() + off, ld, k.data() + off, ld, a, k_len_);
                const T* ph = pos + h * qb * w;
                for (index_t i = 0; i < q_len_; ++i) {
                    const T* pi = ph + (i * batch_ + b) * w + q_len_ - i;  // column Q + j − i at j = 0
                    const T* si = s_win + (q_len_ - i) * H + h;
                    T* ai = a + i * k_len_;
                    const index_t visible = mem + i + 1;
                    for (index_t j = 0; j < visible; ++j) ai[j] = scale * (ai[j] + pi[j] + si[j * H]);
                }
                K::softmax_forward(q_len_, k_len_, a, k_len_, a, k_len_, T(1), softmax_mask::causal_from(mem));
                K::gemm_nn(q_len_, Dk, k_len_, a, k_len_, v.data() + off, ld, ctx.data() + off, ld);
            }
        }
        output_.forward(ctx, out);
    }

    /// Parameter gradients +=; d_zq (= or += when accumulate_dq) and d_zkv (=). Call after forward.
    /// d_zq may be rows of d_zkv (queries that are the segment's rows of z_kv) with accumulate_dq.
    template <view_of<T> ZQ, view_of<T> ZKV, view_of<T> DO, view_of<T> DZQ, view_of<T> DZKV>
    void backward(const ZQ& zq, const ZKV& zkv, const DO& d_out, const DZQ& d_zq, const DZKV& d_zkv,
                  bool accumulate_dq = false) {
        static_assert(check_view<d_model, ZQ, axis::d_model, Backend>());
        static_assert(check_view<d_model, ZKV, axis::d_model, Backend>());
        static_assert(check_view<d_model, DO, axis::d_model, Backend>());
        MNEMO_CHECK(zq.rows() == q_len_ * batch_ && zkv.rows() == k_len_ * batch_,
                    "relative_attention '", name_, "': backward shapes differ from the last forward");
        const index_t qb = q_len_ * batch_, kb = k_len_ * batch_, w = window();
        const view<T, d_model, Backend> q(q_.data(), qb), qu(qu_.data(), qb), ctx(ctx_.data(), qb);
        const view<T, d_model, Backend> k(k_.data(), kb), v(v_.data(), kb);
        view<T, d_model, Backend> d_ctx(d_ctx_.ensure(qb * D), qb), dqu(dqu_.ensure(qb * D), qb),
            dq(dq_.ensure(qb * D), qb), dk(dk_.ensure(kb * D), kb), dv(dv_.ensure(kb * D), kb);
        output_.backward(ctx, d_out, d_ctx);

        const T* attn = attn_.data();
        T* d_scores = d_scores_.ensure(batch_ * H * q_len_ * k_len_);
        T* d_pos = pos_.ensure(index_t(heads) * qb * w);  // forward's q·R is not needed any more
        const T scale = T(1) / std::sqrt(T(d_head));
        const index_t ld = batch_ * D;
        const index_t mem = k_len_ - q_len_;
#pragma omp parallel for schedule(static) collapse(2)
        for (index_t b = 0; b < batch_; ++b) {
            for (index_t h = 0; h < H; ++h) {
                const T* a = attn + (b * H + h) * q_len_ * k_len_;
                T* ds = d_scores + (b * H + h) * q_len_ * k_len_;
                const index_t off = b * D + h * Dk;
                K::gemm_nt(q_len_, k_len_, Dk, d_ctx.data() + off, ld, v.data() + off, ld, ds, k_len_);   // dA
                K::gemm_tn(k_len_, Dk, q_len_, a, k_len_, d_ctx.data() + off, ld, dv.data() + off, ld);  // dv
                K::softmax_backward(q_len_, k_len_, a, k_len_, ds, k_len_, ds, k_len_, scale);  // d raw score
                K::gemm_nn(q_len_, Dk, k_len_, ds, k_len_, k.data() + off, ld, dqu.data() + off, ld);   // d(q+u)
                K::gemm_tn(k_len_, Dk, q_len_, ds, k_len_, qu.data() + off, ld, dk.data() + off, ld);   // dk
                // The positional scores' gradient lands on window column Q + j − i of row (i, b).
                T* ph = d_pos + h * qb * w;
                for (index_t i = 0; i < q_len_; ++i) {
                    T* pi = ph + (i * batch_ + b) * w;
                    for (index_t c = 0; c < w; ++c) pi[c] = T(0);
                    const T* dsi = ds + i * k_len_;
                    const index_t visible = mem + i + 1;
                    for (index_t j = 0; j < visible; ++j) pi[q_len_ + j - i] = dsi[j];
                }
            }
        }

        // Per head: dq = d_pos·R_win, dR_win += d_posᵀ·q, dS_win += column sums of d_pos.
        const T* r_win = r_.value() + (n_pos_ - k_len_) * D;
        T* dr_win = r_.grad() + (n_pos_ - k_len_) * D;
        T* ds_win = s_.grad() + (n_pos_ - k_len_) * H;
        T* col = col_sums_.ensure(w);
        for (index_t h = 0; h < H; ++h) {
            const T* ph = d_pos + h * qb * w;
            K::gemm_nn(qb, Dk, w, ph, w, r_win + h * Dk, D, dq.data() + h * Dk, D);
            K::gemm_tn(w, Dk, qb, ph, w, q.data() + h * Dk, D, dr_win + h * Dk, D, T(1));
            for (index_t c = 0; c < w; ++c) col[c] = T(0);
            K::sum_rows_accumulate(qb, w, ph, w, col);
            for (index_t c = 0; c < w; ++c) ds_win[c * H + h] += col[c];
        }
        K::sum_rows_accumulate(qb, D, dqu.data(), D, u_.grad());        // du = Σ rows d(q+u)
        K::add(qb, D, dq.data(), D, dqu.data(), D, dq.data(), D);        // dq = d(q+u) + positional part

        key_.backward(zkv, dk, d_zkv);
        value_.backward(zkv, dv, d_zkv, true);
        query_.backward(zq, dq, d_zq, accumulate_dq);
    }

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
    static constexpr index_t D = index_t(d_model), H = index_t(heads), Dk = index_t(d_head);

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

    std::string name_;
    index_t n_pos_;
    linear<T, d_model, d_model, Backend> query_, key_, value_, output_;
    param<T> r_, s_, u_;
    index_t q_len_ = 0, k_len_ = 0, batch_ = 0;
    // Saved by forward: q, q + u, k, v [rows, D]; attention weights [B, H, Q, K]; context [Q·B, D].
    buffer<T> q_, qu_, k_, v_, attn_, ctx_;
    // Scratch: positional scores / their gradient [H, Q·B, W]; backward's gradients.
    buffer<T> pos_, d_ctx_, dqu_, dq_, dk_, dv_, d_scores_, col_sums_;
};

}  // namespace mnemo
