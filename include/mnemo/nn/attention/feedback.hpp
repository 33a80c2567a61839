#pragma once
// Feedback attention (Fan et al., 2020, "Addressing Some Limitations of Transformers with Feedback
// Memory"), as labml's FeedbackAttention (labml_nn/transformers/feedback/__init__.py): at step t ONE
// query per batch row attends to the t memory slots of the earlier steps 0 … t − 1 (never to itself;
// no mask). Per head, d_k = d_model / heads:
//
//   q        = query(z)                                     z [B, D], `<name>.query.linear.weight`, no bias
//   score_j  = ( (q + u)·k_j + q·R[P − (t − j)] + S[P − (t − j)] ) / sqrt(d_k)      j = 0 … t − 1
//   a        = softmax_j(score)
//   out      = output( concat_heads( Σ_j a_j · v_j ) )      `<name>.output.{weight,bias}`
//
//   R  `<name>.key_pos_embeddings` [P, heads, d_k]   S  `<name>.key_pos_bias` [P, heads]
//   u  `<name>.query_pos_bias` [heads, d_k]          (all three start at zero, as the reference)
//
// The tables have P rows (not 2P as in Transformer-XL) and are indexed from the most recent slot
// backwards: slot j at step t reads row P − (t − j), so the window is rows [P − t, P) and row P never
// exists (docs/reference.md §14). t > P is an error. The positional term uses q without u.
//
// Keys and values arrive already projected (the model caches them once per slot) as memory_slots: any
// layout with D contiguous features per (slot, batch row), e.g. sequence-major [t, B, D] or batch-major
// [B, capacity, D] (the model's: each batch row's slots are consecutive, so a head's keys are read with
// a stride of D rather than B·D). The attention itself has no key/value parameters.
//
// Backward (hand-written; nn/module.hpp's contract): d_keys and d_values are ACCUMULATED (they collect
// the contributions of every later step), R, S, u and the weight gradients +=, d_z assigned (or +=
// on request). The model splits backward in two so that the weight-gradient GEMMs run over many steps
// at once: backward_step (everything that must happen per step, d_q saved by the caller) and
// backward_weights (W_q, W_o, b_o over any number of rows). backward() is both, for one step.
#include <cmath>
#include <string>
#include <type_traits>

#include "../../core/buffer.hpp"
#include "../../core/config.hpp"
#include "../../core/rng.hpp"
#include "../../kernels/feedback_attention_state.hpp"
#include "../linear.hpp"

namespace mnemo {

/// What feedback_attention's forward saves for backward, in caller-owned storage (the model keeps one
/// per step of a sequence): q [B, D] (without u), attn [B, heads, t] (softmax weights), ctx [B, D]
/// (heads concatenated, before the output projection).
template <class T>
struct feedback_attention_cache {
    T* q = nullptr;
    T* attn = nullptr;
    T* ctx = nullptr;
};

template <class T, class Config, class Backend = cpu>
class feedback_attention {
    using kernels = checked_ops<Backend>;

public:
    static constexpr std::size_t d_model = Config::d_model;  // `dynamic` for runtime_config, as heads and d_head
    static constexpr std::size_t heads = Config::heads;
    static constexpr std::size_t d_head = Config::d_head;
    static constexpr index_t default_n_pos = 4096;
    using view_d = view<T, d_model, Backend>;
    using cview_d = view<const T, d_model, Backend>;

private:
    // d_model, heads, d_head: compile-time constants for a static config, runtime values for runtime_config.
    [[no_unique_address]] extent_holder<d_model> D;
    [[no_unique_address]] extent_holder<heads> H;
    [[no_unique_address]] extent_holder<d_head> Dk;

public:
    /// `shape`: d_model and heads of a runtime-shape model (runtime_config); a static config's own
    /// (the default) otherwise.
    feedback_attention(parameter_set<T, Backend>& ps, const std::string& name, index_t n_pos = default_n_pos,
                       const model_shape& shape = config_shape<Config>())
        : D(check_shape<Config>(shape, ("feedback_attention '" + name + "'").c_str()).d_model),
          H(shape.heads),
          Dk(shape.d_head()),
          name_(name),
          n_pos_(n_pos),
          query_(ps, name + ".query.linear", D, D, false),
          output_(ps, name + ".output", D, D, true) {
        MNEMO_CHECK(n_pos >= 1, "feedback_attention '", name, "': n_pos (the number of relative positions P) must be "
                    "at least 1, got ", n_pos);
        // Rows [P − t, P) get gradient at step t; the rest is skipped by zero_grad, clipping and the
        // optimizers (grad_sparsity::rows, recorded by touch_grad_rows in backward).
        r_ = ps.declare(name + ".key_pos_embeddings", {n_pos, H, Dk}, grad_sparsity::rows);
        s_ = ps.declare(name + ".key_pos_bias", {n_pos, H}, grad_sparsity::rows);
        u_ = ps.declare(name + ".query_pos_bias", {H, Dk});
    }

    /// PyTorch defaults for the linears; R, S and u start at zero (as the reference).
    void reset_parameters(rng& r) const {
        query_.reset_parameters(r);
        output_.reset_parameters(r);
        for (const param<T, Backend>* p : {&r_, &s_, &u_})
            p->fill(T(0));
    }

    /// Number of attention weights one step saves: batch · heads · t.
    index_t attn_size(index_t batch, index_t t) const { return batch * H * t; }

    /// out [B, D] = attention of z [B, D] over the t memory slots' keys and values (oldest first).
    /// Saves q, the weights and the context into `cache`.
    void forward(cview_d z, memory_slots<const T> keys, memory_slots<const T> values, index_t batch,
                 feedback_attention_cache<T> cache, view_d out) {
        const index_t t = steps(z, keys, values, batch);
        check_rows(z, out, "feedback_attention", "z", "out");
        const view_d q(cache.q, batch, D), ctx(cache.ctx, batch, D), qu(qu_.ensure(batch * D), batch, D);
        query_.forward(z, q);
        kernels::add(batch, D, q.data(), D, u_.value(), 0, qu.data(), D);  // q + u, u [heads·d_k] added to every row

        feedback_attention_state<T> st = state(batch, t, q.data(), qu.data(), keys, values);
        st.attn = cache.attn;
        st.ctx = ctx.data();
        kernels::template feedback_attention_forward<extents>(st);
        output_.forward(ctx, out);
    }

    /// The per-step half of backward. From d_out [B, D] and forward's cache: d_q [B, D] (assigned, in
    /// caller storage: backward_weights reads it), d_keys and d_values (+=, in the layout of their own
    /// memory_slots), R, S and u gradients (+=), and d_z = d_q·W_q (assigned, or += with accumulate_dz;
    /// skipped when d_z has no data).
    void backward_step(memory_slots<const T> keys, memory_slots<const T> values, cview_d d_out, index_t batch,
                       feedback_attention_cache<const T> cache, view_d d_q, memory_slots<T> d_keys,
                       memory_slots<T> d_values, view_d d_z, bool accumulate_dz = false) {
        const index_t t = steps(d_out, keys, values, batch);
        MNEMO_CHECK(d_keys.slots == t && d_values.slots == t, "feedback_attention '", name_, "': gradients for ",
                    d_keys.slots, " and ", d_values.slots, " slots, the keys have ", t);
        check_rows(d_out, d_q, "feedback_attention", "d_out", "d_q");
        const cview_d q(cache.q, batch, D);
        const view_d d_ctx(d_ctx_.ensure(batch * D), batch, D), qu(qu_.ensure(batch * D), batch, D),
            d_qu(d_qu_.ensure(batch * D), batch, D);
        output_.backward_input(d_out, d_ctx);
        kernels::add(batch, D, q.data(), D, u_.value(), 0, qu.data(), D);

        feedback_attention_state<T> st = state(batch, t, q.data(), qu.data(), keys, values);
        st.saved_attn = cache.attn;
        st.d_ctx = d_ctx.data();
        st.d_scores = d_scores_.ensure(attn_size(batch, t));  // [B, H, t]
        st.d_qu = d_qu.data();
        st.d_q = d_q.data();
        st.d_keys = d_keys;
        st.d_values = d_values;
        st.dr_win = r_.touch_grad_rows(n_pos_ - t, n_pos_);
        st.ds_win = s_.touch_grad_rows(n_pos_ - t, n_pos_);
        kernels::template feedback_attention_backward<extents>(st);
        kernels::sum_rows_accumulate(batch, D, d_qu.data(), D, u_.grad());            // du = Σ_b d(q + u)
        kernels::add(batch, D, d_q.data(), D, d_qu.data(), D, d_q.data(), D);         // dq = d(q + u) + positional part
        if (d_z.data()) {
            check_rows(d_out, d_z, "feedback_attention", "d_out", "d_z");
            query_.backward_input(cview_d(d_q), d_z, accumulate_dz);
        }
    }

    /// The weight half of backward, over any number of rows (one step, or many steps at once):
    /// W_q += d_qᵀ·z,  W_o += d_outᵀ·ctx,  b_o += Σ d_out.
    void backward_weights(cview_d z, cview_d ctx, cview_d d_q, cview_d d_out) const {
        query_.backward(z, d_q, view_d());
        output_.backward(ctx, d_out, view_d());
    }

    /// Both halves for one step (d_z assigned, or += with accumulate_dz).
    void backward(cview_d z, memory_slots<const T> keys, memory_slots<const T> values, cview_d d_out, index_t batch,
                  feedback_attention_cache<const T> cache, memory_slots<T> d_keys, memory_slots<T> d_values,
                  view_d d_z, bool accumulate_dz = false) {
        const view_d d_q(d_q_.ensure(batch * D), batch, D);
        backward_step(keys, values, d_out, batch, cache, d_q, d_keys, d_values, d_z, accumulate_dz);
        backward_weights(z, cview_d(cache.ctx, batch, D), d_q, d_out);
    }

    index_t n_pos() const { return n_pos_; }
    const std::string& name() const { return name_; }
    const linear<T, d_model, d_model, Backend>& query() const { return query_; }
    const linear<T, d_model, d_model, Backend>& output() const { return output_; }
    const param<T, Backend>& key_pos_embeddings() const { return r_; }
    const param<T, Backend>& key_pos_bias() const { return s_; }
    const param<T, Backend>& query_pos_bias() const { return u_; }

private:
    /// The extents the kernels take as compile-time constants (`dynamic` for a runtime shape).
    static constexpr static_extents extents{d_model, heads, d_head};

    /// The kernels' state for one step: shapes, queries, slots and the tables' window rows [P − t, P).
    feedback_attention_state<T> state(index_t batch, index_t t, const T* q, const T* qu, memory_slots<const T> keys,
                                      memory_slots<const T> values) {
        feedback_attention_state<T> st;
        st.batch = batch;
        st.heads = H;
        st.d_model = D;
        st.d_head = Dk;
        st.t = t;
        st.scale = T(1) / std::sqrt(T(index_t(Dk)));
        st.q = q;
        st.qu = qu;
        st.keys = keys;
        st.values = values;
        r_.pay_rows(n_pos_ - t, n_pos_);  // (deferred decay: parameters.hpp)
        s_.pay_rows(n_pos_ - t, n_pos_);
        st.r_win = r_.value_rows(n_pos_ - t, n_pos_);  // R[P − t + j] for j = 0 … t − 1
        st.s_win = s_.value_rows(n_pos_ - t, n_pos_);
        return st;
    }

    // t, the number of memory slots, with the shape checks every entry point makes.
    template <class Z>
    index_t steps(const Z& z, memory_slots<const T> keys, memory_slots<const T> values, index_t batch) const {
        MNEMO_CHECK(batch >= 1 && z.rows() == batch, "feedback_attention '", name_, "': ", z.rows(),
                    " query rows for a batch of ", batch, " (one query per batch row)");
        MNEMO_CHECK(keys.slots == values.slots, "feedback_attention '", name_, "': ", keys.slots, " key slots but ",
                    values.slots, " value slots");
        const index_t t = keys.slots;
        MNEMO_CHECK(t >= 1, "feedback_attention '", name_, "': no memory slots to attend to (the first step has no "
                    "attention)");
        MNEMO_CHECK(t <= n_pos_, "feedback_attention '", name_, "': ", t, " memory slots need more relative positions "
                    "than n_pos = ", n_pos_, "; raise n_pos or shorten the sequence");
        return t;
    }

    std::string name_;
    index_t n_pos_;
    linear<T, d_model, d_model, Backend> query_, output_;
    param<T, Backend> r_, s_, u_;
    // Scratch: q + u [B, D]; backward's d_ctx, d(q + u) [B, D], d scores [B, H, t]; backward()'s d_q.
    buffer<T, Backend> qu_, d_ctx_, d_qu_, d_scores_, d_q_;
};

}  // namespace mnemo
