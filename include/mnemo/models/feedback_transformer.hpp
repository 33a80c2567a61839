#pragma once
// The Feedback Transformer (Fan et al., 2020, "Addressing Some Limitations of Transformers with
// Feedback Memory"), as labml's FeedbackTransformer and FeedbackTransformerKV
// (labml_nn/transformers/feedback/__init__.py; its behaviour pinned down in docs/reference.md §12-17).
//
// Tokens are processed one step at a time; at step t every layer attends to the memory slots of ALL
// earlier steps (not to the layer below), so the model is recurrent. With x_t the token embedding:
//
//   y_0      = x_t                                           `src_embed` (no scaling, no positions)
//   layer l (state_dict prefix `transformer.layers.<l-1>`), pre-LayerNorm:
//     h'     = y_{l-1} + FeedbackAttn_l(LN_attn(y_{l-1}), K_l[0 … t−1], V_l[0 … t−1])   (t > 0 only:
//              at t = 0 there is no memory and the whole sub-layer, LayerNorm and residual included, is
//              skipped, as the reference)                  `norm_self_attn`, `attn` (nn/attention/feedback.hpp)
//     y_l    = h' + FFN(LN_ff(h'))                          `norm_ff`, `feed_forward` (Linear–ReLU–Linear)
//   mem_t    = Σ_{l=0..L} softmax(w)_l · y_l                `transformer.weights` [L + 1], initialised to ones;
//                                                           not detached, not normalised
//   K_l[t]   = mem_t·W_k,lᵀ,   V_l[t] = mem_t·W_v,lᵀ + b_v,l
//   output_t = y_L  →  `transformer.norm`  →  `generator`   (logits)
//
// Two variants, chosen by a tag:
//   per_layer_kv  the original model: every layer has its own key projection (no bias)
//                 `transformer.layers.<l>.attn.key.linear.weight` and value projection (with bias)
//                 `…attn.value.linear.{weight,bias}`.
//   shared_kv     the updated model (labml's FeedbackTransformerKV): one key and one value projection,
//                 both without bias, `transformer.key.linear.weight` and `transformer.value.linear.weight`,
//                 shared by all layers.
// The reference re-projects the whole stacked memory at every step (per_layer_kv); here K_l[j] and V_l[j]
// are computed ONCE, when slot j is created, and cached: mathematically the same values. The last slot
// of a training sequence is never read, so training skips its projection (the reference computes it and
// throws it away; nothing downstream depends on it). Every sequence starts from an empty memory
// (docs/reference.md §16): no state is carried between forward passes.
//
// Training is backpropagation through time over the whole sequence. The key/value gradients of all slots
// live in preallocated [B, T, D] buffers (no re-stacking per step); the reverse sweep visits steps
// T−1 … 0, and when it reaches step j every later step has added its share to dK_l[j], dV_l[j], so they
// are complete:
//   d mem_j  = Σ_l dK_l[j]·W_k,l + dV_l[j]·W_v,l
//   d y_l   += softmax(w)_l · d mem_j          (for l = 0 … L; y_L also receives the final norm's gradient)
//   d w      = softmax backward of G_l = Σ_j ⟨y_l[j], d mem_j⟩
// and the layers' backward at step j runs top-down, adding to dK, dV of the slots before j. Per-step work
// is batched over the batch ([B, D]·[D, D] GEMMs); the weight gradients of the per-step linears are
// deferred and computed over `grad_flush_rows` rows at a time (one GEMM per weight per block of steps),
// those of the key/value projections once over the whole sequence. The memory and its keys/values are
// stored batch-major, [B, T, D], so that one head's keys of one batch row are D apart, not B·D (at
// batch 64, 2 KiB instead of 128 KiB: the attention's reads stay in few pages and prefetch well).
//
// Generation (feedback_generator): one step appends one slot to the cached keys and values and costs
// O(t·D) attention plus the fixed projections; earlier steps are never recomputed.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "../core/buffer.hpp"
#include "../core/config.hpp"
#include "../core/parameters.hpp"
#include "../losses/cross_entropy.hpp"
#include "../nn/embedding.hpp"
#include "../nn/feed_forward.hpp"
#include "../nn/attention/feedback.hpp"
#include "../nn/layer_norm.hpp"
#include "../nn/linear.hpp"
#include "../nn/residual.hpp"

namespace mnemo {

/// The original Feedback Transformer: each layer projects the memory to its own keys and values.
struct per_layer_kv {
    static constexpr bool shared = false;
    static constexpr const char* name = "feedback";
};
/// The updated Feedback Transformer: one key and one value projection shared by all layers.
struct shared_kv {
    static constexpr bool shared = true;
    static constexpr const char* name = "feedback-kv";
};

/// Settings fixed when the model is built (the compile-time ones are in Config; with runtime_config,
/// d_model and heads are here too).
struct feedback_options {
    index_t vocab = 0;
    index_t n_layers = 0;
    index_t d_ff = 0;
    index_t n_pos = 4096;  // P, the rows of the positional tables; a sequence may have at most P + 1 tokens
    // Rows per deferred weight-gradient GEMM in backward (steps are grouped until they cover this many
    // rows): 512 rows keep Eigen's GEMM near its large-matrix speed while the per-block gradient
    // buffers stay small. Any value gives the same gradients up to summation order.
    index_t grad_flush_rows = 512;
    /// The shape of a runtime-shape model (config<dynamic, dynamic, dynamic>): d_model and heads (>= 1,
    /// heads dividing d_model). For a static config, 0 (its own) or its own value; the model's
    /// options() report its own.
    index_t d_model = 0;
    index_t heads = 0;
};

/// What a feedback layer saves per step, for any number of steps: rows step·B + b (a whole training
/// sequence, or one generation step at row 0).
template <class T, class Backend = cpu>
struct feedback_layer_activations {
    buffer<T, Backend> z1, q, ctx, hm, z2;        // [rows, D]: LN_attn(x), queries, attention context, h', LN_ff(h')
    buffer<T, Backend> a;                         // [rows, d_ff]: ReLU output of the first feed-forward linear
    buffer<T, Backend> mean1, rstd1, mean2, rstd2;  // [rows]: the two LayerNorms' statistics
    buffer<T, Backend> attn;                      // attention weights, B·heads·t per step t, steps back to back
};

/// A feedback layer's gradients of one block of steps, read by the deferred weight-gradient GEMMs.
template <class T, class Backend = cpu>
struct feedback_layer_gradients {
    buffer<T, Backend> d_y, d_z2, d_hm, d_q, d_z1;  // [rows, D]: d output, d LN_ff out, d h', d q, d LN_attn out
    buffer<T, Backend> d_a;                         // [rows, d_ff]: d (pre-activation) of the first linear
};

/// One layer's parameters and its per-step forward and backward over caller-owned storage.
template <class T, class Config, class KV, class Backend = cpu>
class feedback_layer {
    using kernels = checked_ops<Backend>;
    static constexpr std::size_t DM = Config::d_model;
    [[no_unique_address]] extent_holder<DM> D;  // d_model: a constant for a static config

public:
    using view_d = view<T, DM, Backend>;
    using cview_d = view<const T, DM, Backend>;
    using acts_type = feedback_layer_activations<T, Backend>;
    using grads_type = feedback_layer_gradients<T, Backend>;

    /// `shape`: d_model and heads of a runtime-shape model (runtime_config); a static config's own
    /// (the default) otherwise.
    feedback_layer(parameter_set<T, Backend>& ps, const std::string& prefix, index_t d_ff, index_t n_pos,
                   const model_shape& shape = config_shape<Config>())
        : D(check_shape<Config>(shape, ("feedback_layer '" + prefix + "'").c_str()).d_model),
          d_ff_(d_ff),
          attn_(ps, prefix + ".attn", n_pos, shape),
          feed_forward_(ps, prefix + ".feed_forward", D, d_ff),
          norm_self_attn_(ps, prefix + ".norm_self_attn", D, T(1e-5)),
          norm_ff_(ps, prefix + ".norm_ff", D, T(1e-5)) {
        if constexpr (!KV::shared) {
            key_.emplace(ps, prefix + ".attn.key.linear", D, D, false);
            value_.emplace(ps, prefix + ".attn.value.linear", D, D, true);
        }
    }

    void reset_parameters(rng& r) {
        attn_.reset_parameters(r);
        if constexpr (!KV::shared) {
            key_->reset_parameters(r);
            value_->reset_parameters(r);
        }
        feed_forward_.reset_parameters(r);
        norm_self_attn_.reset_parameters();
        norm_ff_.reset_parameters();
    }

    /// Grows `s` to hold `rows` rows and `attn_elems` attention weights.
    void reserve(acts_type& s, index_t rows, index_t attn_elems) const {
        for (buffer<T, Backend>* b : {&s.z1, &s.q, &s.ctx, &s.hm, &s.z2}) b->ensure(rows * D);
        s.a.ensure(rows * d_ff_);
        for (buffer<T, Backend>* b : {&s.mean1, &s.rstd1, &s.mean2, &s.rstd2}) b->ensure(rows);
        s.attn.ensure(attn_elems);
    }
    void reserve(grads_type& g, index_t rows) const {
        for (buffer<T, Backend>* b : {&g.d_y, &g.d_z2, &g.d_hm, &g.d_q, &g.d_z1}) b->ensure(rows * D);
        g.d_a.ensure(rows * d_ff_);
    }

    /// One step: y [B, D] = layer(x [B, D]) over the t memory slots' keys and values (t = 0: no attention).
    /// Saves its activations at rows r0 … r0 + B of `s` and the attention weights at s.attn + attn_off.
    void forward_step(acts_type& s, index_t r0, index_t attn_off, cview_d x, memory_slots<const T> keys,
                      memory_slots<const T> values, index_t batch, view_d y) {
        const view_d hm = at(s.hm, r0, batch), z2 = at(s.z2, r0, batch);
        if (keys.slots > 0) {
            const view_d z1 = at(s.z1, r0, batch);
            norm_self_attn_.forward(x, z1, norm_stats<T>{s.mean1.data() + r0, s.rstd1.data() + r0});
            attn_.forward(z1, keys, values, batch,
                          {s.q.data() + r0 * D, s.attn.data() + attn_off, s.ctx.data() + r0 * D}, hm);
            residual<T, DM, Backend>::forward(x, hm, hm);
        } else {
            kernels::copy(batch, D, x.data(), x.ld(), hm.data(), D);
        }
        norm_ff_.forward(hm, z2, norm_stats<T>{s.mean2.data() + r0, s.rstd2.data() + r0});
        const view<T, dynamic, Backend> a(s.a.data() + r0 * d_ff_, batch, d_ff_);
        feed_forward_.layer1().forward(z2, a);
        kernels::template activation_forward<relu>(batch * d_ff_, a.data(), a.data());
        feed_forward_.layer2().forward(a, y);
        residual<T, DM, Backend>::forward(hm, y, y);
    }

    /// The per-step half of backward: from d y (rows c0 … c0 + B of g.d_y) to dx [B, D] (assigned);
    /// d_keys, d_values of the t slots +=; R, S, u +=. Saves what the weight half reads at rows c0 of g.
    void backward_step(const acts_type& s, index_t r0, index_t attn_off, grads_type& g, index_t c0, cview_d x,
                       memory_slots<const T> keys, memory_slots<const T> values, memory_slots<T> d_keys,
                       memory_slots<T> d_values, index_t batch, view_d dx) {
        const cview_d dy = at(g.d_y, c0, batch), hm = cat(s.hm, r0, batch);
        const view_d dz2 = at(g.d_z2, c0, batch), d_hm = at(g.d_hm, c0, batch);
        const view<T, dynamic, Backend> da(g.d_a.data() + c0 * d_ff_, batch, d_ff_);
        // y = h' + FFN(LN_ff(h')). ReLU's derivative [h > 0] is read from its output: a > 0 ⇔ h > 0.
        feed_forward_.layer2().backward_input(dy, da);
        kernels::relu_backward(batch * d_ff_, s.a.data() + r0 * d_ff_, da.data(), da.data());
        feed_forward_.layer1().backward_input(view<const T, dynamic, Backend>(da), dz2);
        kernels::copy(batch, D, dy.data(), D, d_hm.data(), D);
        norm_ff_.backward_input(hm, cview_d(dz2), d_hm, stats(s.mean2, s.rstd2, r0), /*accumulate_dx=*/true);
        if (keys.slots > 0) {
            // h' = x + attn(LN_attn(x))
            const view_d dq = at(g.d_q, c0, batch), dz1 = at(g.d_z1, c0, batch);
            attn_.backward_step(keys, values, d_hm, batch,
                                {s.q.data() + r0 * D, s.attn.data() + attn_off, s.ctx.data() + r0 * D}, dq, d_keys,
                                d_values, dz1);
            kernels::copy(batch, D, d_hm.data(), D, dx.data(), dx.ld());
            norm_self_attn_.backward_input(x, cview_d(dz1), dx, stats(s.mean1, s.rstd1, r0), /*accumulate_dx=*/true);
        } else {
            kernels::copy(batch, D, d_hm.data(), D, dx.data(), dx.ld());
        }
    }

    /// The weight half of backward for `n` consecutive steps starting at step `first_step`, whose
    /// activations are at rows r0 … of `s` (x: this layer's input, the same rows) and whose gradients
    /// are at rows 0 … of g. Step 0 has no attention and contributes nothing to its weights.
    void backward_weights(const acts_type& s, const grads_type& g, index_t r0, index_t first_step, index_t n,
                          index_t batch, cview_d x) const {
        const index_t rows = n * batch;
        const view<const T, dynamic, Backend> a(s.a.data() + r0 * d_ff_, rows, d_ff_),
            da(g.d_a.data(), rows, d_ff_);
        feed_forward_.layer2().backward(a, cat(g.d_y, 0, rows), view_d());
        feed_forward_.layer1().backward(cat(s.z2, r0, rows), da, view_d());
        norm_ff_.backward(cat(s.hm, r0, rows), cat(g.d_z2, 0, rows), view_d(), stats(s.mean2, s.rstd2, r0));
        const index_t skip = first_step == 0 ? batch : 0;  // rows of step 0
        const index_t ra = r0 + skip, ca = skip, na = rows - skip;
        if (na <= 0) return;
        attn_.backward_weights(cat(s.z1, ra, na), cat(s.ctx, ra, na), cat(g.d_q, ca, na), cat(g.d_hm, ca, na));
        norm_self_attn_.backward(x.row_range(skip, na), cat(g.d_z1, ca, na), view_d(), stats(s.mean1, s.rstd1, ra));
    }

    index_t d_ff() const { return d_ff_; }
    feedback_attention<T, Config, Backend>& attn() { return attn_; }
    const feedback_attention<T, Config, Backend>& attn() const { return attn_; }
    /// The layer's own key / value projections (per_layer_kv only).
    const linear<T, DM, DM, Backend>& key() const requires(!KV::shared) { return *key_; }
    const linear<T, DM, DM, Backend>& value() const requires(!KV::shared) { return *value_; }

private:
    view_d at(buffer<T, Backend>& b, index_t r0, index_t rows) const { return view_d(b.data() + r0 * D, rows, D); }
    cview_d cat(const buffer<T, Backend>& b, index_t r0, index_t rows) const { return cview_d(b.data() + r0 * D, rows, D); }
    static norm_stats<T> stats(const buffer<T, Backend>& mean, const buffer<T, Backend>& rstd, index_t r0) {
        return {const_cast<T*>(mean.data()) + r0, const_cast<T*>(rstd.data()) + r0};
    }

    index_t d_ff_;
    feedback_attention<T, Config, Backend> attn_;
    std::optional<linear<T, DM, DM, Backend>> key_, value_;  // per_layer_kv only
    feed_forward<T, DM, dynamic, relu, Backend> feed_forward_;
    layer_norm<T, DM, Backend> norm_self_attn_, norm_ff_;
};

template <class Model>
class feedback_generator;

template <class T, class Config, class KV = per_layer_kv, class Backend = cpu>
class feedback_transformer {
    using kernels = checked_ops<Backend>;
    static constexpr std::size_t DM = Config::d_model;

public:
    using value_type = T;
    using config = Config;
    using kv_variant = KV;
    using backend_type = Backend;
    using layer_type = feedback_layer<T, Config, KV, Backend>;
    using view_d = view<T, DM, Backend>;
    using cview_d = view<const T, DM, Backend>;

    explicit feedback_transformer(const feedback_options& o)
        : options_(check(o)),
          D(options_.d_model),
          H(options_.heads),
          embed_(params_, "src_embed", o.vocab, D),
          norm_(params_, "transformer.norm", D, T(1e-5)),
          generator_(params_, "generator", D, o.vocab, true) {
        layers_.reserve(std::size_t(o.n_layers));
        for (index_t l = 0; l < o.n_layers; ++l)
            layers_.emplace_back(params_, "transformer.layers." + std::to_string(l), o.d_ff, o.n_pos, shape());
        weights_ = params_.declare("transformer.weights", {o.n_layers + 1});
        if constexpr (KV::shared) {
            key_.emplace(params_, "transformer.key.linear", D, D, false);
            value_.emplace(params_, "transformer.value.linear", D, D, false);
        }
        params_.allocate();
        weights_.fill(T(1));
        acts_.layers.resize(std::size_t(o.n_layers));
        acts_.y.resize(std::size_t(o.n_layers + 1));
        grads_.resize(std::size_t(o.n_layers));
        keys_.resize(std::size_t(n_kv()));
        values_.resize(std::size_t(n_kv()));
        d_keys_.resize(std::size_t(n_kv()));
        d_values_.resize(std::size_t(n_kv()));
        key_ptrs_.resize(std::size_t(n_kv()));
        value_ptrs_.resize(std::size_t(n_kv()));
        mix_.resize(std::size_t(o.n_layers + 1));
        mix_grad_.resize(std::size_t(o.n_layers + 1));
        mix_host_.resize(std::size_t(o.n_layers + 1));
        mix_inputs_.resize(std::size_t(o.n_layers + 1));
    }
    feedback_transformer(const feedback_transformer&) = delete;
    feedback_transformer& operator=(const feedback_transformer&) = delete;

    /// PyTorch's default initialisation (R, S, u at zero, the layer weights w at one), from a seed.
    void reset_parameters(std::uint64_t seed) {
        rng r(seed);
        embed_.reset_parameters(r);
        for (auto& l : layers_) l.reset_parameters(r);
        if constexpr (KV::shared) {
            key_->reset_parameters(r);
            value_->reset_parameters(r);
        }
        norm_.reset_parameters();
        weights_.fill(T(1));
        generator_.reset_parameters(r);
    }

    /// logits [T·B, vocab] of a sequence: tokens [T·B] sequence-major (step·B + b), starting from an
    /// empty memory. Saves every step's activations for backward. T − 1 <= n_pos.
    view<const T, dynamic, Backend> forward(std::span<const token_t> tokens, index_t batch) {
        return kernels::hold_threads([&]() -> view<const T, dynamic, Backend> {
            MNEMO_CHECK(batch >= 1 && !tokens.empty() && index_t(tokens.size()) % batch == 0, "feedback_transformer: ",
                        tokens.size(), " tokens do not form a whole number of steps of batch ", batch);
            const index_t rows = index_t(tokens.size()), steps = rows / batch;
            MNEMO_CHECK(steps - 1 <= options_.n_pos, "feedback_transformer: a sequence of ", steps, " steps attends to ",
                        steps - 1, " memory slots at its last step, more than the n_pos = ", options_.n_pos,
                        " relative positions; raise n_pos or shorten the sequence");
            batch_ = batch;
            rows_ = rows;
            steps_ = steps;
            has_d_logits_ = false;
            reserve_activations(acts_, rows, attn_offset(steps, batch));
            for (index_t i = 0; i < n_kv(); ++i) {
                key_ptrs_[std::size_t(i)] = keys_[std::size_t(i)].ensure(rows * D);
                value_ptrs_[std::size_t(i)] = values_[std::size_t(i)].ensure(rows * D);
            }
            embed_.forward(tokens, y(acts_, 0, 0, rows));
            update_mix();
            for (index_t t = 0; t < steps; ++t)
                step_forward(acts_, t * batch, attn_offset(t, batch), t, batch, key_ptrs_.data(), value_ptrs_.data(),
                             steps, view_d(acts_.mem.data() + t * D, batch, D, steps * D), /*project=*/t + 1 < steps);
            const view_d hn(hn_.ensure(rows * D), rows, D);
            norm_.forward(y(acts_, options_.n_layers, 0, rows), hn);
            const view<T, dynamic, Backend> logits(logits_.ensure(rows * options_.vocab), rows, options_.vocab);
            generator_.forward(hn, logits);
            return logits;
        });
    }

    /// Mean cross-entropy of the last forward's logits against targets [T·B] (negative: ignored).
    /// With `with_grad`, keeps d loss / d logits for backward().
    double cross_entropy(std::span<const token_t> targets, bool with_grad) {
        queue_cross_entropy(targets, with_grad);
        return read_cross_entropy();
    }

    /// Parameter gradients += d CE / d θ, back through time over the whole sequence (after
    /// cross_entropy(..., true)).
    void backward(std::span<const token_t> tokens) {
        kernels::hold_threads([&] {
            MNEMO_CHECK(has_d_logits_, "feedback_transformer: backward needs cross_entropy(targets, true) first");
            MNEMO_CHECK(index_t(tokens.size()) == rows_, "feedback_transformer: backward with ", tokens.size(),
                        " tokens after a forward over ", rows_);
            const index_t rows = rows_, B = batch_, L = options_.n_layers, v = options_.vocab;
            const view_d hn(hn_.data(), rows, D), d_final(d_final_.ensure(rows * D), rows, D);
            {
                const view_d dhn(dhn_.ensure(rows * D), rows, D);
                generator_.backward(hn, view<const T, dynamic, Backend>(d_logits_.data(), rows, v), dhn);
                norm_.backward(y(acts_, L, 0, rows), cview_d(dhn), d_final);
            }
            for (index_t i = 0; i < n_kv(); ++i) {
                device_memory<Backend>::fill_zero(d_keys_[std::size_t(i)].ensure(rows * D), sizeof(T) * std::size_t(rows * D));
                device_memory<Backend>::fill_zero(d_values_[std::size_t(i)].ensure(rows * D), sizeof(T) * std::size_t(rows * D));
            }
            T* d_mem = d_mem_.ensure(rows * D);
            T* d_emb = d_emb_.ensure(rows * D);
            const index_t chunk = std::min(steps_, std::max<index_t>(1, (options_.grad_flush_rows + B - 1) / B));
            for (index_t l = 0; l < L; ++l) layers_[std::size_t(l)].reserve(grads_[std::size_t(l)], chunk * B);

            for (index_t c1 = steps_; c1 > 0;) {
                const index_t c0 = std::max<index_t>(0, c1 - chunk);
                for (index_t t = c1 - 1; t >= c0; --t) step_backward(t, c0, d_final, d_mem, d_emb);
                flush_weight_gradients(c0, c1);
                c1 = c0;
            }
            // Key/value projections: one GEMM over every slot (batch-major rows; the last slot's gradient is 0).
            for (index_t i = 0; i < n_kv(); ++i) {
                key(i).backward(cview_d(acts_.mem.data(), rows, D), cview_d(d_keys_[std::size_t(i)].data(), rows, D),
                                view_d());
                value(i).backward(cview_d(acts_.mem.data(), rows, D), cview_d(d_values_[std::size_t(i)].data(), rows, D),
                                  view_d());
            }
            embed_.backward(tokens, cview_d(d_emb, rows, D));
            // d w = softmax backward of G_l = Σ ⟨y_l, d mem⟩ over every step: the L + 1 dot products on
            // the backend, the softmax backward of L + 1 numbers on the host (in double), added back.
            T* dots = mix_dots_.ensure(L + 1);
            for (index_t l = 0; l <= L; ++l)
                kernels::gemm_nt(1, 1, rows * D, acts_.y[std::size_t(l)].data(), rows * D, d_mem, rows * D, dots + l, 1);
            device_memory<Backend>::download(mix_host_.data(), dots, sizeof(T) * std::size_t(L + 1));
            double* gl = mix_grad_.data();
            double sg = 0;
            for (index_t l = 0; l <= L; ++l) {
                gl[l] = double(mix_host_[std::size_t(l)]);
                sg += double(mix_[std::size_t(l)]) * gl[l];
            }
            for (index_t l = 0; l <= L; ++l) mix_host_[std::size_t(l)] = T(double(mix_[std::size_t(l)]) * (gl[l] - sg));
            device_memory<Backend>::upload(dots, mix_host_.data(), sizeof(T) * std::size_t(L + 1));
            T* gw = weights_.grad();
            kernels::add(1, L + 1, gw, L + 1, dots, L + 1, gw, L + 1);
            has_d_logits_ = false;
        });
    }

    /// One training sequence: forward, cross-entropy, backward. Returns the mean CE; parameter
    /// gradients +=, the caller zeroes them, clips and steps the optimizer.
    double train_segment(std::span<const token_t> tokens, std::span<const token_t> targets, index_t batch) {
        queue_train_segment(tokens, targets, batch);
        return read_loss();
    }

    /// The same without gradients (evaluation).
    double eval_segment(std::span<const token_t> tokens, std::span<const token_t> targets, index_t batch) {
        queue_eval_segment(tokens, targets, batch);
        return read_loss();
    }

    /// train_segment leaving the loss in backend memory until read_loss() (the mix weights' softmax
    /// still reads L + 1 values on the host in forward and backward).
    void queue_train_segment(std::span<const token_t> tokens, std::span<const token_t> targets, index_t batch) {
        kernels::hold_threads([&] {
            forward(tokens, batch);
            queue_cross_entropy(targets, true);
            backward(tokens);
            loss_queued_ = true;
        });
    }
    /// eval_segment leaving the loss in backend memory until read_loss().
    void queue_eval_segment(std::span<const token_t> tokens, std::span<const token_t> targets, index_t batch) {
        kernels::hold_threads([&] {
            forward(tokens, batch);
            queue_cross_entropy(targets, false);
            loss_queued_ = true;
        });
    }
    /// The mean cross-entropy of the last queued sequence, read from backend memory.
    double read_loss() {
        MNEMO_CHECK(loss_queued_, "feedback_transformer: read_loss without a queued sequence "
                    "(queue_train_segment or queue_eval_segment first)");
        return read_cross_entropy();
    }

    /// A token-by-token generator over this model (see feedback_generator).
    feedback_generator<feedback_transformer> generator(index_t batch) {
        return feedback_generator<feedback_transformer>(*this, batch);
    }

    parameter_set<T, Backend>& parameters() { return params_; }
    const parameter_set<T, Backend>& parameters() const { return params_; }
    /// The options as built (d_model and heads the model's).
    const feedback_options& options() const { return options_; }
    /// d_model and heads: a static config's, or those a runtime-shape model was built with.
    model_shape shape() const { return {options_.d_model, options_.heads, 1}; }
    index_t vocab() const { return options_.vocab; }
    index_t n_layers() const { return options_.n_layers; }
    /// Number of key/value projections: n_layers (per_layer_kv) or 1 (shared_kv).
    index_t n_kv() const { return KV::shared ? 1 : options_.n_layers; }
    /// The last forward's logits [T·B, vocab].
    view<const T, dynamic, Backend> logits() const {
        return view<const T, dynamic, Backend>(logits_.data(), rows_, options_.vocab);
    }
    /// The last forward's cached keys / values of projection i (0 … n_kv − 1) for batch row b, slots
    /// 0 … T − 2 (the last slot is never projected): [T − 1, D].
    cview_d keys(index_t i, index_t b) const {
        return cview_d(keys_[std::size_t(i)].data() + b * steps_ * D, steps_ - 1, D);
    }
    cview_d values(index_t i, index_t b) const {
        return cview_d(values_[std::size_t(i)].data() + b * steps_ * D, steps_ - 1, D);
    }
    layer_type& layer(index_t l) { return layers_[std::size_t(l)]; }

private:
    template <class M>
    friend class feedback_generator;

    // Activations of a whole sequence (training) or of one step (generation).
    struct activations {
        std::vector<feedback_layer_activations<T, Backend>> layers;  // n_layers
        std::vector<buffer<T, Backend>> y;                           // n_layers + 1: y_0 the embedding, y_l layer l's output
        buffer<T, Backend> mem;                                      // [B, T, D] the memory slots (batch-major)
    };

    static feedback_options check(feedback_options o) {
        MNEMO_CHECK(o.vocab >= 1, "feedback_transformer: vocab must be at least 1, got ", o.vocab);
        MNEMO_CHECK(o.n_layers >= 1, "feedback_transformer: n_layers must be at least 1, got ", o.n_layers);
        MNEMO_CHECK(o.d_ff >= 1, "feedback_transformer: d_ff must be at least 1, got ", o.d_ff);
        MNEMO_CHECK(o.n_pos >= 1, "feedback_transformer: n_pos must be at least 1, got ", o.n_pos);
        MNEMO_CHECK(o.grad_flush_rows >= 1, "feedback_transformer: grad_flush_rows must be at least 1, got ",
                    o.grad_flush_rows);
        const model_shape shape =
            check_shape<Config>({o.d_model, o.heads, 0}, "feedback_transformer", "feedback_options::");
        o.d_model = shape.d_model;
        o.heads = shape.heads;
        return o;
    }

    /// Offset of step t's attention weights: steps 1 … t − 1 hold B·H·s each.
    index_t attn_offset(index_t t, index_t batch) const { return batch * H * (t * (t - 1) / 2); }
    index_t kv_index(index_t l) const { return KV::shared ? 0 : l; }

    void reserve_activations(activations& s, index_t rows, index_t attn_elems) {
        for (index_t l = 0; l < options_.n_layers; ++l)
            layers_[std::size_t(l)].reserve(s.layers[std::size_t(l)], rows, attn_elems);
        for (auto& b : s.y) b.ensure(rows * D);
        s.mem.ensure(rows * D);
    }
    view_d y(activations& s, index_t l, index_t r0, index_t rows) const {
        return view_d(s.y[std::size_t(l)].data() + r0 * D, rows, D);
    }

    // softmax(w), computed in double on the host (w: L + 1 numbers over the host path).
    void update_mix() {
        const index_t n = options_.n_layers + 1;
        weights_.download(mix_host_);
        const T* w = mix_host_.data();
        double mx = double(w[0]), sum = 0;
        for (index_t l = 1; l < n; ++l) mx = std::max(mx, double(w[l]));
        for (index_t l = 0; l < n; ++l) sum += std::exp(double(w[l]) - mx);
        for (index_t l = 0; l < n; ++l) mix_[std::size_t(l)] = T(std::exp(double(w[l]) - mx) / sum);
    }

    // Slots 0 … t − 1 of a batch-major [B, cap, D] key/value cache.
    memory_slots<T> slots(T* base, index_t t, index_t cap) const { return {base, t, D, cap * D}; }

    // Step t of the recurrence, its rows at r0 of `s` (y_0 already holds the embedding there), reading
    // slots 0 … t − 1 of the batch-major [B, cap, D] caches keys[i], values[i]. Forms mem_t [B, D] (rows
    // of mem_t, any stride) and, with `project`, appends slot t to the caches.
    void step_forward(activations& s, index_t r0, index_t attn_off, index_t t, index_t batch, T* const* keys,
                      T* const* values, index_t cap, view_d mem_t, bool project) {
        const index_t L = options_.n_layers;
        for (index_t l = 0; l < L; ++l) {
            const index_t i = kv_index(l);
            layers_[std::size_t(l)].forward_step(s.layers[std::size_t(l)], r0, attn_off, y(s, l, r0, batch),
                                                 slots(keys[i], t, cap), slots(values[i], t, cap), batch,
                                                 y(s, l + 1, r0, batch));
        }
        // mem_t = Σ_l softmax(w)_l · y_l
        for (index_t l = 0; l <= L; ++l) mix_inputs_[std::size_t(l)] = s.y[std::size_t(l)].data() + r0 * D;
        kernels::weighted_sum_rows(batch, index_t(D), std::span<const T* const>(mix_inputs_), index_t(D),
                                   std::span<const T>(mix_), mem_t.data(), mem_t.ld());
        if (!project) return;
        for (index_t i = 0; i < n_kv(); ++i) {
            key(i).forward(cview_d(mem_t), view_d(keys[i] + t * D, batch, D, cap * D));
            value(i).forward(cview_d(mem_t), view_d(values[i] + t * D, batch, D, cap * D));
        }
    }

    // Reverse-sweep step t; its per-step gradients go to rows (t − c0)·B of the block buffers.
    void step_backward(index_t t, index_t c0, view_d d_final, T* d_mem_all, T* d_emb) {
        const index_t B = batch_, L = options_.n_layers, r0 = t * B, cr = (t - c0) * B;
        const view_d dm(d_mem_all + r0 * D, B, D);
        const bool has_mem_grad = t + 1 < steps_;  // the last slot is never read
        if (has_mem_grad) {  // slot t of the batch-major gradients: rows t, cap + t, 2·cap + t, …
            const index_t cap = steps_;
            for (index_t i = 0; i < n_kv(); ++i) {
                key(i).backward_input(cview_d(d_keys_[std::size_t(i)].data() + t * D, B, D, cap * D), dm, i > 0);
                value(i).backward_input(cview_d(d_values_[std::size_t(i)].data() + t * D, B, D, cap * D), dm, true);
            }
        } else {
            device_memory<Backend>::fill_zero(dm.data(), sizeof(T) * std::size_t(B * D));
        }
        // d y_L = d final norm + w_L·d mem
        T* dy = grads_[std::size_t(L - 1)].d_y.data() + cr * D;
        kernels::copy(B, D, d_final.row(r0), D, dy, D);
        axpy(B * D, mix_[std::size_t(L)], dm.data(), dy, has_mem_grad);
        for (index_t l = L; l >= 1; --l) {
            const index_t i = kv_index(l - 1);
            T* dx = l > 1 ? grads_[std::size_t(l - 2)].d_y.data() + cr * D : d_emb + r0 * D;
            layers_[std::size_t(l - 1)].backward_step(
                acts_.layers[std::size_t(l - 1)], r0, attn_offset(t, B), grads_[std::size_t(l - 1)], cr,
                y(acts_, l - 1, r0, B), slots(keys_[std::size_t(i)].data(), t, steps_),
                slots(values_[std::size_t(i)].data(), t, steps_),
                slots(d_keys_[std::size_t(i)].data(), t, steps_), slots(d_values_[std::size_t(i)].data(), t, steps_), B,
                view_d(dx, B, D));
            axpy(B * D, mix_[std::size_t(l - 1)], dm.data(), dx, has_mem_grad);
        }
    }

    // Weight gradients of steps [c0, c1): every layer's per-step linears and norms.
    void flush_weight_gradients(index_t c0, index_t c1) {
        const index_t B = batch_, r0 = c0 * B;
        for (index_t l = 0; l < options_.n_layers; ++l)
            layers_[std::size_t(l)].backward_weights(acts_.layers[std::size_t(l)], grads_[std::size_t(l)], r0, c0,
                                                     c1 - c0, B, y(acts_, l, r0, (c1 - c0) * B));
    }

    // y += a·x over n elements (when `apply`).
    static void axpy(index_t n, T a, const T* x, T* y, bool apply) {
        if (apply) kernels::axpy(n, a, x, y);
    }

    const linear<T, DM, DM, Backend>& key(index_t i) const {
        if constexpr (KV::shared) return *key_;
        else return layers_[std::size_t(i)].key();
    }
    const linear<T, DM, DM, Backend>& value(index_t i) const {
        if constexpr (KV::shared) return *value_;
        else return layers_[std::size_t(i)].value();
    }

    feedback_options options_;
    // d_model and heads: compile-time constants for a static config, runtime values for runtime_config.
    [[no_unique_address]] extent_holder<DM> D;
    [[no_unique_address]] extent_holder<Config::heads> H;
    parameter_set<T, Backend> params_;
    embedding<T, DM, Backend> embed_;
    std::vector<layer_type> layers_;
    layer_norm<T, DM, Backend> norm_;
    linear<T, DM, dynamic, Backend> generator_;
    param<T, Backend> weights_;                                   // [L + 1]
    std::optional<linear<T, DM, DM, Backend>> key_, value_;  // shared_kv only
    std::vector<T> mix_;                                 // softmax(w) [L + 1], on the host
    std::vector<double> mix_grad_;                       // G_l = Σ ⟨y_l, d mem⟩ [L + 1]
    std::vector<T> mix_host_;                            // [L + 1]: w, the dots G_l, then dw, over the host path
    std::vector<const T*> mix_inputs_;                   // [L + 1]: y_l's rows of the step being mixed
    buffer<T, Backend> mix_dots_;                        // [L + 1]: G_l, then dw, on the backend
    cross_entropy_loss<T, Backend> ce_;
    buffer<double, Backend> ce_sum_;  // the queued cross-entropy's sum (backend memory)
    index_t ce_counted_ = 0;          // and its counted rows
    bool loss_queued_ = false;

    void queue_cross_entropy(std::span<const token_t> targets, bool with_grad) {
        MNEMO_CHECK(index_t(targets.size()) == rows_, "feedback_transformer: ", targets.size(), " targets for ", rows_,
                    " positions");
        loss_queued_ = false;
        ce_counted_ = ce_.queue(rows_, options_.vocab, logits_.data(), targets, d_logits_.ensure(rows_ * options_.vocab),
                                ce_sum_.ensure(1));
        has_d_logits_ = with_grad;
    }
    double read_cross_entropy() {
        double sum = 0;
        device_memory<Backend>::download(&sum, ce_sum_.data(), sizeof(double));
        return cross_entropy_loss<T, Backend>::mean(sum, ce_counted_);
    }

    index_t batch_ = 0, rows_ = 0, steps_ = 0;
    bool has_d_logits_ = false;
    activations acts_;
    std::vector<feedback_layer_gradients<T, Backend>> grads_;      // per layer, one block of steps
    std::vector<buffer<T, Backend>> keys_, values_;               // per projection: [B, T, D] slots (batch-major)
    std::vector<buffer<T, Backend>> d_keys_, d_values_;           // their gradients [B, T, D], accumulated by later steps
    std::vector<T*> key_ptrs_, value_ptrs_;
    buffer<T, Backend> hn_, logits_, d_logits_, dhn_, d_final_, d_mem_, d_emb_;
};

/// Token-by-token generation from a cache of keys and values (the Feedback Transformer's strength at
/// inference: the memory vectors of earlier steps never change). Each step embeds B tokens, runs
/// every layer over the cached slots 0 … t − 1, forms mem_t and appends its keys and values as slot t:
/// O(t·D) attention plus the fixed [B, D] GEMMs, never a recomputation of earlier steps. The logits
/// of step t equal those of a full forward pass over the same sequence at step t.
///
/// The generator borrows the model: it reads the current parameters at every step and uses the layers'
/// scratch buffers, so it must not run concurrently (from another thread) with the model or another
/// generator of the same model, and the model must outlive it. Its own activations and caches are
/// separate from the model's training buffers. The caches grow geometrically; reserve() avoids
/// reallocation (then a step allocates nothing).
template <class Model>
class feedback_generator {
    using T = typename Model::value_type;
    using Backend = typename Model::backend_type;
    static constexpr std::size_t DM = Model::config::d_model;
    using view_d = view<T, DM, Backend>;
    using cview_d = view<const T, DM, Backend>;
    // d_model and heads: compile-time constants for a static config, the model's for runtime_config.
    [[no_unique_address]] extent_holder<DM> D;
    [[no_unique_address]] extent_holder<Model::config::heads> H;

public:
    feedback_generator(Model& model, index_t batch)
        : D(model.shape().d_model), H(model.shape().heads), m_(&model), batch_(batch) {
        MNEMO_CHECK(batch >= 1, "feedback_generator: batch must be at least 1, got ", batch);
        acts_.layers.resize(std::size_t(model.n_layers()));
        acts_.y.resize(std::size_t(model.n_layers() + 1));
        keys_.resize(std::size_t(model.n_kv()));
        values_.resize(std::size_t(model.n_kv()));
        key_ptrs_.resize(std::size_t(model.n_kv()));
        value_ptrs_.resize(std::size_t(model.n_kv()));
    }

    /// Room for `steps` slots: the caches do not move until then.
    void reserve(index_t steps) {
        if (steps > cap_) grow(steps);
    }

    /// Forgets the memory: the next step is step 0 of a new sequence.
    void reset() {
        t_ = 0;
        projected_rows_ = 0;
    }

    /// Feeds tokens [B] (one per batch row) as step t = length(); returns the logits [B, vocab] of the
    /// next token. Throws when t exceeds n_pos (step t attends to t slots).
    view<const T, dynamic, Backend> step(std::span<const token_t> tokens) {
        return checked_ops<Backend>::hold_threads([&]() -> view<const T, dynamic, Backend> {
            Model& m = *m_;
            const index_t B = batch_, t = t_, L = m.n_layers(), V = m.vocab();
            MNEMO_CHECK(index_t(tokens.size()) == B, "feedback_generator: ", tokens.size(), " tokens for a batch of ", B);
            MNEMO_CHECK(t <= m.options().n_pos, "feedback_generator: step ", t, " would attend to ", t,
                        " memory slots, more than n_pos = ", m.options().n_pos);
            if (t + 1 > cap_) grow(std::max<index_t>({t + 1, 2 * cap_, 16}));
            m.reserve_activations(acts_, B, B * H * t);
            m.embed_.forward(tokens, m.y(acts_, 0, 0, B));
            m.update_mix();
            m.step_forward(acts_, 0, 0, t, B, key_ptrs_.data(), value_ptrs_.data(), cap_, view_d(acts_.mem.data(), B, D),
                           /*project=*/true);
            projected_rows_ += B;
            const view_d hn(hn_.ensure(B * D), B, D);
            m.norm_.forward(m.y(acts_, L, 0, B), hn, norm_stats<T>{mean_.ensure(B), rstd_.ensure(B)});
            const view<T, dynamic, Backend> logits(logits_.ensure(B * V), B, V);
            m.generator_.forward(hn, logits);
            ++t_;
            return logits;
        });
    }

    /// Steps taken = memory slots cached.
    index_t length() const { return t_; }
    index_t batch() const { return batch_; }
    /// Slots the caches hold before they move.
    index_t capacity() const { return cap_; }
    /// Rows projected to keys/values so far (per projection): B per step, never more.
    index_t projected_rows() const { return projected_rows_; }
    /// The cached keys / values of projection i (0 … n_kv − 1) for batch row b: [length, D].
    cview_d keys(index_t i, index_t b) const { return cview_d(key_ptrs_[std::size_t(i)] + b * cap_ * D, t_, D); }
    cview_d values(index_t i, index_t b) const { return cview_d(value_ptrs_[std::size_t(i)] + b * cap_ * D, t_, D); }

private:
    // New capacity for every batch row's slots; the t_ cached slots move along.
    void grow(index_t cap) {
        for (index_t i = 0; i < index_t(keys_.size()); ++i) {
            for (auto* cache : {&keys_[std::size_t(i)], &values_[std::size_t(i)]}) {
                buffer<T, Backend> next;
                next.ensure(batch_ * cap * D);
                for (index_t b = 0; b < batch_ && t_ > 0; ++b)
                    device_memory<Backend>::copy(next.data() + b * cap * D, cache->data() + b * cap_ * D,
                                                 sizeof(T) * std::size_t(t_ * D));
                std::swap(*cache, next);
            }
            key_ptrs_[std::size_t(i)] = keys_[std::size_t(i)].data();
            value_ptrs_[std::size_t(i)] = values_[std::size_t(i)].data();
        }
        cap_ = cap;
    }

    Model* m_;
    index_t batch_, t_ = 0, cap_ = 0, projected_rows_ = 0;
    typename Model::activations acts_;
    std::vector<buffer<T, Backend>> keys_, values_;  // per projection: [B, cap, D] (batch-major)
    std::vector<T*> key_ptrs_, value_ptrs_;
    buffer<T, Backend> hn_, mean_, rstd_, logits_;
};

/// The original Feedback Transformer and the shared key/value variant.
template <class T, class Config, class Backend = cpu>
using feedback_transformer_kv = feedback_transformer<T, Config, shared_kv, Backend>;

}  // namespace mnemo
