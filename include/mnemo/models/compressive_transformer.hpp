#pragma once
// The Compressive Transformer (Rae et al., 2019) as labml's pre-LayerNorm implementation, and
// Transformer-XL (Dai et al., 2019) as its special case without compressed memory.
//
// One layer (state_dict prefix `transformer.layers.<l>`), input x [Q·B, D], memory m and compressed
// memory cm of layer l (constants: the layer's inputs from earlier segments):
//   z   = LN_attn([cm, m, x])                 `norm_self_attn`: one norm, current parameters, for
//                                             memory and segment alike
//   x'  = x + RelAttn(q = z_segment, k = v = z)          `self_attn` (nn/attention/relative.hpp)
//   y   = x' + FFN(LN_ff(x'))                 `norm_ff`, `feed_forward` (Linear–ReLU–Linear)
//   f_c                                       `compress`: compresses this layer's memory
// The model: `src_embed` (no scaling, no positions) → layers → `transformer.norm` → `generator`.
//
// A segment step follows the reference experiment (docs/reference.md §6-10):
//   forward (reads the memory) → merge the new layer inputs into the memory, compressing with the
//   current weights → cross-entropy + attention-reconstruction loss (only if something was
//   compressed) → backward (parameter gradients +=) → the caller clips and steps the optimizer.
//
// Variants (compressive_options; each off by default, and then the model is exactly the above):
//
// residual_kind::gru (lucidrains' gru_gated_residual, Parisotto et al. 2019): both residual
//   connections become GRU gates (nn/gru_gate.hpp), out = GRU(input = sub-layer output, hidden =
//   stream), as the seed's GRUGating(dim, fn) computes gru(fn(x), x):
//     x' = gate_attn(x, RelAttn(...))      y = gate_ff(x', FFN(LN_ff(x')))
//   `transformer.layers.<l>.gate_attn.{weight_ih,weight_hh,bias_ih,bias_hh}` and `.gate_ff.*`.
//
// norm_kind::post (the paper's and Transformer-XL's Post-LayerNorm): the norms come after each
//   residual (or gate), and attention reads the raw memory and segment:
//     a  = RelAttn(q = x, k = v = [cm, m, x])        no norm on queries, keys or values
//     x' = LN_attn(x ⊕ a)                           `norm_self_attn` (the norm after attention)
//     y  = LN_ff(x' ⊕ FFN(x'))                      `norm_ff`        (the norm after the FFN)
//   ⊕ is + or the GRU gate (the norm then applies to the gate's output). The memory is still the
//   layer's input (the embedding for layer 0, else the previous layer's normalised output), stored
//   as is. The attention-reconstruction loss then attends over the raw h, m and f_c(m) (no norm), as
//   the layer does. `transformer.norm` is kept before the generator in both kinds, so the two have
//   the same tensors (in post-LN it re-normalises an already normalised stream: one extra affine map).
//
// memory_layers (lucidrains' memory_layers, Rae & Razavi 2020): only the listed layers keep memory
//   and compressed memory; the others attend within the segment only, have no `compress` (nor
//   `decoder`) tensors, and hold no memory state: the memory (make_memory) has one slot per memory
//   layer, in increasing layer order (memory_slot(l) maps a layer to it). The reconstruction loss
//   sums over the memory layers. Empty (the default): every layer.
//
// reconstruction_kind::autoencoding (the paper's alternative loss, losses/autoencoding_reconstruction.hpp):
//   mean((g(f_c(m)) − m)²) with a ConvTranspose1d decoder g per memory layer,
//   `transformer.layers.<l>.decoder.{weight,bias}`; only f_c and g receive its gradient.
//
// Compression functions needing the attention usage of the memory (most_used_compression,
// compression_needs_usage): the memory then also carries, per memory row, the attention mass it has
// received (summed over heads and queries, accumulated over every segment since the row entered the
// memory as part of a segment); see compressive_memory_with_usage below.
#include <algorithm>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "../core/buffer.hpp"
#include "../core/config.hpp"
#include "../core/parameters.hpp"
#include "../nn/compression.hpp"
#include "../nn/embedding.hpp"
#include "../nn/feed_forward.hpp"
#include "../nn/gru_gate.hpp"
#include "../nn/layer_norm.hpp"
#include "../nn/linear.hpp"
#include "../nn/attention/relative.hpp"
#include "../nn/residual.hpp"
#include "../losses/attention_reconstruction.hpp"
#include "../losses/autoencoding_reconstruction.hpp"
#include "../losses/cross_entropy.hpp"
#include "compressive_memory.hpp"

namespace mnemo {

/// The residual connections of a layer: x + f (the reference), or a GRU gate (seed 002).
enum class residual_kind { add, gru };
/// Where the layer norms sit: before each sub-layer (labml, the reference) or after each residual (the paper).
enum class norm_kind { pre, post };
/// The compression function's auxiliary loss: attention reconstruction (labml) or auto-encoding (the paper).
enum class reconstruction_kind { attention, autoencoding };

/// Which memory a layer's forward reads: the memory's epoch and the ids of its oldest compressed and
/// uncompressed slots (compressive_memory: the same epoch and id mean the same contents); epoch 0:
/// not known. A layer on the absorbed route keeps its normalised memory rows ẑ under these ids and
/// normalises only the slots it has not seen (compressive_layer::forward).
struct memory_identity {
    std::uint64_t epoch = 0;
    std::int64_t c_first = 0, m_first = 0;
};

/// What one compressive_layer is built with (compressive_transformer derives it from its options).
struct compressive_layer_options {
    residual_kind residual = residual_kind::add;
    norm_kind norm = norm_kind::pre;
    bool memory = true;    // keeps memory: declares `compress`
    bool decoder = false;  // declares the auto-encoding decoder `decoder` (needs memory)
    /// d_model, heads and compression rate of a runtime-shape layer (runtime_config); zeros: the
    /// static config's own.
    model_shape shape = {};
};

template <class T, class Config, template <class, std::size_t, std::size_t, class> class Compression,
          class Backend = cpu>
class compressive_layer {
    using kernels = checked_ops<Backend>;
    static constexpr std::size_t DM = Config::d_model;

public:
    using compression_type = Compression<T, DM, Config::compression_rate, Backend>;
    using decoder_type = conv_transpose_decoder<T, DM, Config::compression_rate, Backend>;
    using gate_type = gru_gate<T, DM, Backend>;

    compressive_layer(parameter_set<T, Backend>& ps, const std::string& prefix, index_t d_ff, index_t n_pos,
                      const compressive_layer_options& o = {})
        : options_(check(o, prefix)),
          D(options_.shape.d_model),
          compress_(o.memory ? std::optional<compression_type>(std::in_place, ps, prefix + ".compress", D, rate())
                             : std::nullopt),
          self_attn_(ps, prefix + ".self_attn", n_pos, options_.shape),
          feed_forward_(ps, prefix + ".feed_forward", D, d_ff),
          norm_self_attn_(ps, prefix + ".norm_self_attn", D, T(1e-5)),
          norm_ff_(ps, prefix + ".norm_ff", D, T(1e-5)),
          gate_attn_(o.residual == residual_kind::gru
                         ? std::optional<gate_type>(std::in_place, ps, prefix + ".gate_attn", D)
                         : std::nullopt),
          gate_ff_(o.residual == residual_kind::gru ? std::optional<gate_type>(std::in_place, ps, prefix + ".gate_ff", D)
                                                    : std::nullopt),
          decoder_(o.decoder ? std::optional<decoder_type>(std::in_place, ps, prefix + ".decoder", D, rate())
                             : std::nullopt) {}

    void reset_parameters(rng& r) {
        if (compress_) compress_->reset_parameters(r);
        self_attn_.reset_parameters(r);
        feed_forward_.reset_parameters(r);
        norm_self_attn_.reset_parameters();
        norm_ff_.reset_parameters();
        if (gate_attn_) gate_attn_->reset_parameters(r);
        if (gate_ff_) gate_ff_->reset_parameters(r);
        if (decoder_) decoder_->reset_parameters(r);
    }

    /// y [Q·B, D] = layer(x [Q·B, D]) attending over [c_mem, mem, x]. Saves what backward reads.
    /// `reuse` names memory positions whose keys and values the attention may keep from the last call;
    /// `ids` says which memory c_mem and mem are (the normalised rows of slots seen before are kept).
    void forward(view<const T, DM, Backend> x, view<const T, DM, Backend> c_mem, view<const T, DM, Backend> mem,
                 index_t batch, view<T, DM, Backend> y, const kv_reuse& reuse = {}, const memory_identity& ids = {}) {
        forward_grad_ = grad_enabled_;
        if (options_.norm == norm_kind::post) return forward_post(x, c_mem, mem, batch, y, reuse);
        const index_t qb = x.rows(), lc = c_mem.rows(), lb = lc + mem.rows(), kb = lb + qb;
        batch_ = batch;
        mem_rows_ = lb;
        batch_q_rows_ = qb;
        // z = LN([c_mem, mem, x]), oldest first. The memory rows need no input gradient, only their
        // normalised values ẑ (the norm's parameter gradients, frozen_key_rows): they are normalised
        // straight from the memory, ẑ kept. The segment's rows are kept with their statistics.
        // Without gradients (generation), the rows whose keys and values the attention reuses are
        // not read at all: only the others are normalised.
        // When the attention takes the absorbed route, which reads the memory through ẑ alone, the
        // memory rows of z are not written at all (normalised_memory_rows fills them on demand), and
        // ẑ is laid out by batch element (frozen_key_rows::ld_batch), the way that route reads it,
        // in a window sliding over each batch element's slab of positions (keep_normalised_memory):
        // the slots the last forward normalised keep their rows, and only the others are normalised.
        z_mem_unwritten_ = grad_enabled_ && !reuse.n && self_attn_.would_absorb(qb / batch, kb / batch);
        // Memory positions [0, kept) hold the last forward's ẑ.
        const index_t kept = z_mem_unwritten_ ? keep_normalised_memory(lc / batch, (lb - lc) / batch, batch, ids) : 0;
        if (!z_mem_unwritten_) zhat_ids_ = {};
        view<T, DM, Backend> x_in(kv_in_.ensure(qb * D), qb, D), z(z_.ensure(kb * D), kb, D),
            zhat(zhat_.ensure(lb * D), lb, D);
        auto normalise_part = [&](view<const T, DM, Backend> src, index_t first, index_t b0, index_t b1) {
            if (b0 >= b1) return;  // rows [b0, b1) of z, from src, which holds z's rows from `first` on
            const auto in = src.row_range(b0 - first, b1 - b0);
            if (z_mem_unwritten_) {
                if constexpr (kernels::absorbs_memory)  // rows [b0, b1) are whole positions (c_mem, mem)
                    norm_self_attn_.normalized_by_batch(in, zhat_rows() + b0 / batch * D, index_t(D), batch,
                                                        zhat_ld_batch());
            } else if (grad_enabled_) norm_self_attn_.forward_normalized(in, z.row_range(b0, b1 - b0), zhat.row_range(b0, b1 - b0));
            else norm_self_attn_.forward(in, z.row_range(b0, b1 - b0), norm_stats<T>{});
        };
        auto normalise = [&](index_t r0, index_t r1) {  // memory rows [r0, r1) of [c_mem, mem]
            normalise_part(c_mem, 0, r0, std::min(r1, lc));
            normalise_part(mem, lc, std::max(r0, lc), r1);
        };
        c_rows_ = lc;
        all_normalised_ = grad_enabled_ || !reuse.n;
        if (all_normalised_) normalise(kept * batch, lb);
        else reuse.for_each_gap(lb / batch, [&](index_t p0, index_t p1) { normalise(p0 * batch, p1 * batch); });
        kernels::copy(qb, D, x.data(), x.ld(), x_in.data(), D);
        norm_self_attn_.forward(x_in, z.row_range(lb, qb), norm_stats<T>{mean_.ensure(qb), rstd_.ensure(qb)});

        view<T, DM, Backend> a(attn_out_.ensure(qb * D), qb, D), x_mid(x_mid_.ensure(qb * D), qb, D),
            z2(z2_.ensure(qb * D), qb, D), f(ff_out_.ensure(qb * D), qb, D);
        // With gradients the memory rows are ẑ∘γ + β with ẑ kept: the attention may work from ẑ (the
        // same rows backward gives it as frozen).
        frozen_key_rows<T> norm_rows;
        if (grad_enabled_)
            norm_rows = {lb, zhat_rows(), D, norm_self_attn_.weight().value(), norm_self_attn_.bias().value(),
                         nullptr, nullptr, z_mem_unwritten_, zhat_ld_batch()};
        self_attn_.forward(z.row_range(lb, qb), z, batch, a, reuse, norm_rows);
        join(gate_attn_, x, a, x_mid);
        norm_ff_.forward(x_mid, z2);
        feed_forward_.forward(z2, f);
        join(gate_ff_, x_mid, f, y);
    }

    /// dx [Q·B, D] (assigned) from dy; parameter gradients +=. The memory gets no gradient
    /// (stop-gradient), but the attention norm's parameters do get the memory rows' share.
    void backward(view<const T, DM, Backend> dy, view<T, DM, Backend> dx) {
        MNEMO_CHECK(forward_grad_, "compressive_layer: backward after a forward with gradients disabled "
                    "(set_grad_enabled(false)); run forward again with gradients enabled");
        if (options_.norm == norm_kind::post) return backward_post(dy, dx);
        const index_t qb = dy.rows(), lb = mem_rows_, kb = lb + qb;
        const view<T, DM, Backend> x_in(kv_in_.data(), qb, D), z(z_.data(), kb, D), x_mid(x_mid_.data(), qb, D),
            z2(z2_.data(), qb, D);
        view<T, DM, Backend> d_mid(d_mid_.ensure(qb * D), qb, D), dz2(dz2_.ensure(qb * D), qb, D),
            dz(dz_.ensure(kb * D), kb, D);
        // y = x' + FFN(LN_ff(x'))   (or gate_ff(x', FFN(LN_ff(x'))))
        if (gate_ff_) {
            view<T, DM, Backend> df(d_sub_.ensure(qb * D), qb, D);
            gate_ff_->backward(dy, d_mid, df);
            feed_forward_.backward(z2, df, dz2);
        } else {
            residual<T, DM, Backend>::backward(dy, d_mid, view<T, DM, Backend>());
            feed_forward_.backward(z2, dy, dz2);
        }
        norm_ff_.backward(x_mid, dz2, d_mid, /*accumulate_dx=*/true);
        // x' = x + attn(z): queries are the segment rows of z, keys and values all rows.
        view<const T, DM, Backend> da = d_mid;
        if (gate_attn_) {
            const view<T, DM, Backend> dsub(d_sub_.ensure(qb * D), qb, D);
            gate_attn_->backward(d_mid, dx, dsub);
            da = dsub;
        }
        // z = LN([cm, m, x]): the memory rows need no input gradient, only the norm's parameter
        // gradients, which the attention takes from their normalised values ẑ (saved by forward).
        const frozen_key_rows<T> frozen{lb, zhat_rows(), D, norm_self_attn_.weight().value(),
                                        norm_self_attn_.bias().value(), norm_self_attn_.weight().grad(),
                                        norm_self_attn_.bias().grad(), false, zhat_ld_batch()};
        self_attn_.backward(z.row_range(lb, qb), z, da, dz.row_range(lb, qb), dz, /*accumulate_dq=*/true, frozen);
        if (!gate_attn_) residual<T, DM, Backend>::backward(view<const T, DM, Backend>(d_mid), dx, view<T, DM, Backend>());
        norm_self_attn_.backward(x_in, dz.row_range(lb, qb), dx, norm_stats<T>{mean_.data(), rstd_.data()},
                                 /*accumulate_dx=*/true);
    }

    /// Rows [c_mem rows, c_mem rows + rows) of the last pre-LN forward's z = LN([c_mem, mem, x]): the
    /// normalised memory and segment, oldest first (the attention-reconstruction loss's LN(m) for the
    /// rows the merge compresses away). Null when that forward did not normalise them all (post-LN, or
    /// reused rows skipped without gradients) or holds fewer rows.
    /// (Memory rows the forward left unwritten are filled here from ẑ: z = ẑ∘γ + β.)
    const T* normalised_memory_rows(index_t rows) {
        if (options_.norm != norm_kind::pre || !all_normalised_ || rows > mem_rows_ - c_rows_ + batch_q_rows_)
            return nullptr;
        T* z = z_.data() + c_rows_ * D;
        if (z_mem_unwritten_) {  // ẑ by batch element: batch element b's rows of positions [c_mem, c_mem + n)
            const index_t n = std::min(rows, mem_rows_ - c_rows_), c0 = c_rows_ / batch_;
            MNEMO_CHECK(n % batch_ == 0, "compressive_layer: ", n, " memory rows are not whole positions of ", batch_,
                        " batch elements");
            for (index_t b = 0; b < batch_; ++b)
                kernels::scale_shift_rows(n / batch_, index_t(D), zhat_rows() + b * zhat_ld_batch() + c0 * D, index_t(D),
                                          norm_self_attn_.weight().value(), norm_self_attn_.bias().value(), z + b * D,
                                          batch_ * index_t(D));
        }
        return z;
    }
    /// ẑ's batch stride (frozen_key_rows::ld_batch): by batch element, a slab of zhat_slab_
    /// positions each, when the last forward left the memory rows of z unwritten (the absorbed
    /// route); 0, by position, otherwise.
    index_t zhat_ld_batch() const { return z_mem_unwritten_ ? zhat_slab_ * index_t(D) : 0; }
    /// The last forward's ẑ: its first memory position (of batch element 0 when by batch element).
    T* zhat_rows() { return zhat_.data() + (z_mem_unwritten_ ? zhat_win_ * index_t(D) : 0); }
    /// Whether this layer keeps memory (and has a compression function).
    bool has_memory() const { return compress_.has_value(); }
    /// Key padding flags [K·B] for the next forward (relative_attention::set_key_padding); null: none.
    void set_key_padding(const std::uint8_t* pad) { self_attn_.set_key_padding(pad); }
    /// relative_attention::set_clamp_len (<= 0: off).
    void set_clamp_len(index_t clamp_len) { self_attn_.set_clamp_len(clamp_len); }
    /// relative_attention::set_memory_attention and keep_projections.
    void set_memory_attention(memory_attention mode) { self_attn_.set_memory_attention(mode); }
    void keep_projections(bool on) { self_attn_.keep_projections(on); }
    /// Off: forward saves nothing for backward that it would not read itself (backward is then an error).
    void set_grad_enabled(bool on) { grad_enabled_ = on; }
    const compressive_layer_options& options() const { return options_; }
    compression_type& compress() {
        MNEMO_CHECK(compress_.has_value(), "compressive_layer: this layer keeps no memory and has no compression function");
        return *compress_;
    }
    decoder_type& decoder() {
        MNEMO_CHECK(decoder_.has_value(), "compressive_layer: this layer has no auto-encoding decoder");
        return *decoder_;
    }
    const relative_attention<T, Config, Backend>& self_attn() const { return self_attn_; }
    const layer_norm<T, DM, Backend>& norm_self_attn() const { return norm_self_attn_; }
    /// The norm the attention reads its inputs through: norm_self_attn (pre-LN), or none (post-LN).
    const layer_norm<T, DM, Backend>* attention_input_norm() const {
        return options_.norm == norm_kind::pre ? &norm_self_attn_ : nullptr;
    }

private:
    static compressive_layer_options check(compressive_layer_options o, const std::string& prefix) {
        MNEMO_CHECK(!o.decoder || o.memory, "compressive_layer '", prefix, "': a decoder needs a layer with memory");
        o.shape = check_shape<Config>(o.shape, ("compressive_layer '" + prefix + "'").c_str());
        return o;
    }
    index_t rate() const { return options_.shape.compression_rate; }

    /// Places this forward's ẑ window (absorbed route: cc compressed and mc uncompressed slots of the
    /// memory `ids`, batch elements of `batch`) and returns how many of its first positions hold the
    /// rows the last forward left there: normalising a row again gives the same bits (each row's
    /// statistics are its own), so only the others need it. The compressed slots held before and now
    /// stay where
    /// they were: the window starts as many positions later as slots were dropped from the front
    /// (a merge adds slots at the end of each part). The uncompressed slots kept are reused when
    /// their positions then line up, which they do when the merge drops none (mem_len > seq,
    /// nothing compressed yet); a segment of mem_len tokens replaces them all. A window that would
    /// run past its slab starts at the front again, all rows normalised (every few segments: the
    /// slab holds twice the positions). Configuration A normalises 12 of its 136 positions a segment.
    index_t keep_normalised_memory(index_t cc, index_t mc, index_t batch, const memory_identity& ids) {
        const index_t p = cc + mc;
        const memory_identity last = zhat_ids_;
        const bool reuse = last.epoch != 0 && ids.epoch == last.epoch && batch == zhat_batch_ && 2 * p <= zhat_slab_;
        if (2 * p > zhat_slab_) zhat_slab_ = 2 * p;  // grows while the memory fills; the kept rows' layout changes
        zhat_.ensure(batch * zhat_slab_ * index_t(D));
        index_t win = 0, kept = 0;
        if (reuse) {
            const std::int64_t c_hi = std::min(ids.c_first + cc, last.c_first + zhat_c_slots_);
            if (cc == 0 && zhat_c_slots_ == 0) {  // no compressed memory: the uncompressed slots slide it
                win = zhat_win_ + index_t(ids.m_first - last.m_first);
            } else if (c_hi > ids.c_first) {  // compressed slots [0, c_hi − c_first) kept
                win = zhat_win_ + index_t(ids.c_first - last.c_first);
                kept = index_t(c_hi - ids.c_first);
            }
            // (Ids only grow within an epoch: the slots kept are the oldest now.) Uncompressed slot id x
            // sits at window position cc + x − m_first now, zhat_c_slots_ + x − last.m_first then:
            // kept when the absolute positions agree and the compressed ones are all kept.
            const std::int64_t m_hi = std::min(ids.m_first + mc, last.m_first + zhat_m_slots_);
            if (m_hi > ids.m_first && kept == cc && win + cc - ids.m_first == zhat_win_ + zhat_c_slots_ - last.m_first)
                kept = cc + index_t(m_hi - ids.m_first);
            if (win + p > zhat_slab_) win = kept = 0;
        }
        zhat_win_ = win;
        zhat_ids_ = ids;
        zhat_c_slots_ = cc;
        zhat_m_slots_ = mc;
        zhat_batch_ = batch;
        return kept;
    }

    /// out = x + f, or gate(x, f) (out may not alias x or f in the gate's case: the gate copies them first).
    static void join(std::optional<gate_type>& gate, view<const T, DM, Backend> x, view<const T, DM, Backend> f,
                     view<T, DM, Backend> out) {
        if (gate) gate->forward(x, f, out);
        else residual<T, DM, Backend>::forward(x, f, out);
    }

    // Post-LN: a = attn(x, [cm, m, x]), s1 = x ⊕ a, x' = LN_attn(s1), s2 = x' ⊕ FFN(x'), y = LN_ff(s2).
    void forward_post(view<const T, DM, Backend> x, view<const T, DM, Backend> c_mem, view<const T, DM, Backend> mem,
                      index_t batch, view<T, DM, Backend> y, const kv_reuse& reuse) {
        const index_t qb = x.rows(), lb = c_mem.rows() + mem.rows(), kb = lb + qb;
        batch_ = batch;
        mem_rows_ = lb;
        view<T, DM, Backend> kv_in(kv_in_.ensure(kb * D), kb, D);
        kernels::copy(c_mem.rows(), D, c_mem.data(), c_mem.ld(), kv_in.data(), D);
        kernels::copy(mem.rows(), D, mem.data(), mem.ld(), kv_in.row(c_mem.rows()), D);
        kernels::copy(qb, D, x.data(), x.ld(), kv_in.row(lb), D);
        view<T, DM, Backend> a(attn_out_.ensure(qb * D), qb, D), s1(z_.ensure(qb * D), qb, D),
            x_mid(x_mid_.ensure(qb * D), qb, D), f(ff_out_.ensure(qb * D), qb, D), s2(z2_.ensure(qb * D), qb, D);
        self_attn_.forward(kv_in.row_range(lb, qb), kv_in, batch, a, reuse);
        join(gate_attn_, x, a, s1);
        norm_self_attn_.forward(s1, x_mid, norm_stats<T>{mean_.ensure(qb), rstd_.ensure(qb)});
        feed_forward_.forward(x_mid, f);
        join(gate_ff_, x_mid, f, s2);
        norm_ff_.forward(s2, y);
    }

    void backward_post(view<const T, DM, Backend> dy, view<T, DM, Backend> dx) {
        const index_t qb = dy.rows(), lb = mem_rows_, kb = lb + qb;
        const view<T, DM, Backend> kv_in(kv_in_.data(), kb, D), s1(z_.data(), qb, D), x_mid(x_mid_.data(), qb, D),
            s2(z2_.data(), qb, D);
        view<T, DM, Backend> d_mid(d_mid_.ensure(qb * D), qb, D), ds(dz2_.ensure(qb * D), qb, D),
            dkv(dz_.ensure(kb * D), kb, D), dsub(d_sub_.ensure(qb * D), qb, D);
        // y = LN_ff(s2), s2 = x' ⊕ f, f = FFN(x')
        norm_ff_.backward(s2, dy, ds);
        view<const T, DM, Backend> df = ds;
        if (gate_ff_) {
            gate_ff_->backward(ds, d_mid, dsub);
            df = dsub;
        } else {
            residual<T, DM, Backend>::backward(view<const T, DM, Backend>(ds), d_mid, view<T, DM, Backend>());
        }
        feed_forward_.backward(x_mid, df, d_mid, /*accumulate_dx=*/true);
        // x' = LN_attn(s1), s1 = x ⊕ a, a = attn(x, [cm, m, x])
        norm_self_attn_.backward(s1, d_mid, ds, norm_stats<T>{mean_.data(), rstd_.data()});
        view<const T, DM, Backend> da = ds;
        if (gate_attn_) {
            gate_attn_->backward(ds, dx, dsub);
            da = dsub;
        } else {
            residual<T, DM, Backend>::backward(view<const T, DM, Backend>(ds), dx, view<T, DM, Backend>());
        }
        // The memory rows (raw inputs here) need no input gradient: frozen without a norm.
        self_attn_.backward(kv_in.row_range(lb, qb), kv_in, da, dkv.row_range(lb, qb), dkv, /*accumulate_dq=*/true,
                            frozen_key_rows<T>{lb});
        kernels::add(qb, D, dx.data(), dx.ld(), dkv.row(lb), D, dx.data(), dx.ld());
    }

    compressive_layer_options options_;  // its shape checked (a static config's own filled in)
    [[no_unique_address]] extent_holder<DM> D;  // d_model: a constant for a static config
    std::optional<compression_type> compress_;  // memory layers only
    relative_attention<T, Config, Backend> self_attn_;
    feed_forward<T, DM, dynamic, relu, Backend> feed_forward_;
    layer_norm<T, DM, Backend> norm_self_attn_, norm_ff_;
    std::optional<gate_type> gate_attn_, gate_ff_;  // residual_kind::gru only
    std::optional<decoder_type> decoder_;           // reconstruction_kind::autoencoding, memory layers only
    index_t batch_ = 0, mem_rows_ = 0;
    bool grad_enabled_ = true, forward_grad_ = true;  // the setting, and the one the last forward ran with
    index_t c_rows_ = 0, batch_q_rows_ = 0;            // the last pre-LN forward's c_mem rows and query rows
    bool all_normalised_ = false;                      // ... and whether it normalised every row of z
    bool z_mem_unwritten_ = false;                     // ... or only ẑ for its memory rows (absorbed route)
    // ẑ by batch element (absorbed route): slabs of zhat_slab_ positions, the last forward's rows at
    // positions [zhat_win_, zhat_win_ + c_slots + m_slots) of each, for the memory `zhat_ids_`
    // (epoch 0: none reusable) of batch zhat_batch_.
    index_t zhat_slab_ = 0, zhat_win_ = 0, zhat_c_slots_ = 0, zhat_m_slots_ = 0, zhat_batch_ = 0;
    memory_identity zhat_ids_;
    buffer<T, Backend> kv_in_, z_, zhat_, mean_, rstd_, attn_out_, x_mid_, z2_, ff_out_, d_mid_, dz2_, dz_, d_sub_;
};

/// Settings fixed when the model is built (the compile-time ones are in Config; with runtime_config,
/// d_model, heads and the compression rate are here too). Every variant is
/// off by default: the model is then labml's pre-LN Compressive Transformer (see the top of the file).
struct compressive_options {
    index_t vocab = 0;
    index_t n_layers = 0;
    index_t d_ff = 0;
    index_t n_pos = 4096;  // P, the number of relative positions
    residual_kind residual = residual_kind::add;
    norm_kind norm = norm_kind::pre;
    /// The layers that keep memory (any order, no repeats); empty: every layer.
    std::vector<index_t> memory_layers = {};
    reconstruction_kind reconstruction = reconstruction_kind::attention;
    /// The shape of a runtime-shape model (config<dynamic, dynamic, dynamic>): d_model and heads (>= 1,
    /// heads dividing d_model) and the compression rate (>= 1; Transformer-XL: 0 means 1). For a
    /// static config, 0 (its own) or its own value; the model's options() report its own.
    index_t d_model = 0;
    index_t heads = 0;
    index_t compression_rate = 0;
};

/// Losses of one segment.
struct segment_losses {
    double ce = 0;              // mean cross-entropy (nats)
    double ar = 0;              // reconstruction loss: attention or auto-encoding (0 when nothing was compressed)
    index_t compressed = 0;     // memory slots compressed by this segment's merge
};

/// A compressive_memory that also carries, per memory row (slot·batch + b), the attention mass the row
/// has received: what most_used_compression selects by. The usage rows (in Backend's memory) are kept
/// parallel to the memory rows: compressive_transformer::update_memory adds the segment's attention to
/// the rows already held and appends the new rows' usage (add_usage), lets the merge compress the
/// oldest rows (reading their usage) and then drops exactly the rows the merge dropped (drop_usage).
template <class T, std::size_t D, class Backend = cpu>
class compressive_memory_with_usage : public compressive_memory<T, D, Backend> {
    using base = compressive_memory<T, D, Backend>;

public:
    compressive_memory_with_usage(index_t n_layers, index_t mem_len, index_t c_mem_len, index_t rate)
        requires(D != dynamic)
        : compressive_memory_with_usage(n_layers, mem_len, c_mem_len, rate, static_cast<index_t>(D)) {}
    /// d_model given too (must equal D when that is static).
    compressive_memory_with_usage(index_t n_layers, index_t mem_len, index_t c_mem_len, index_t rate, index_t d_model)
        : base(n_layers, mem_len, c_mem_len, rate, d_model), usage_(std::size_t(n_layers)) {}

    /// As compressive_memory::reset; the usage is emptied too.
    void reset(index_t batch, index_t max_segment = 0) {
        base::reset(batch, max_segment);
        for (auto& u : usage_) u.reset(2 * (this->mem_len() + max_segment + this->rate()) * batch);
    }
    /// As compressive_memory::resize; the usage of every row is then 0 until written (usage_data).
    void resize(index_t mem_slots, index_t c_mem_slots) {
        base::resize(mem_slots, c_mem_slots);
        for (auto& u : usage_) {
            u.assign_size(mem_slots * this->batch());
            device_memory<Backend>::fill_zero(u.data(), sizeof(T) * std::size_t(u.size()));
        }
    }
    /// Usage of memory slot l's rows [mem_slots·batch] (oldest first, as mem(l)), in Backend's memory.
    const T* usage(index_t l) const { return usage_[std::size_t(l)].data(); }
    /// Mutable access for loading a saved state (after resize).
    T* usage_data(index_t l) { return usage_[std::size_t(l)].data(); }
    /// The number of usage rows slot l holds (mem_slots·batch between merges).
    index_t usage_rows(index_t l) const { return usage_[std::size_t(l)].size(); }
    /// Before a merge: slot l's held rows gain add[0, held) and the segment's new rows append
    /// add[held, held + new_rows) (add in Backend's memory).
    void add_usage(index_t l, const T* add, index_t new_rows) {
        auto& u = usage_[std::size_t(l)];
        const index_t held = u.size();
        if (held > 0) checked_ops<Backend>::add(1, held, u.data(), held, add, held, u.data(), held);
        if (new_rows > 0) device_memory<Backend>::copy(u.grow(new_rows), add + held, sizeof(T) * std::size_t(new_rows));
    }
    /// After a merge: every slot drops the usage of its oldest `rows` rows (those the merge dropped).
    void drop_usage(index_t rows) {
        for (auto& u : usage_) u.drop_front(rows);
    }

private:
    std::vector<detail::sliding_window<T, Backend>> usage_;
};

template <class T, class Config, template <class, std::size_t, std::size_t, class> class Compression = conv_compression,
          class Backend = cpu>
class compressive_transformer {
    using kernels = checked_ops<Backend>;
    static constexpr std::size_t DM = Config::d_model;

public:
    using value_type = T;
    using config = Config;
    using backend_type = Backend;
    using layer_type = compressive_layer<T, Config, Compression, Backend>;
    /// True when the compression function selects by attention usage (most_used_compression).
    static constexpr bool needs_usage = compression_needs_usage<typename layer_type::compression_type>;
    using memory_type = std::conditional_t<needs_usage, compressive_memory_with_usage<T, DM, Backend>,
                                           compressive_memory<T, DM, Backend>>;
    /// False for Transformer-XL models (no_compression): their memory must have c_mem_len = 0.
    static constexpr bool can_compress =
        !std::is_same_v<typename layer_type::compression_type, no_compression<T, DM, Config::compression_rate, Backend>>;

    explicit compressive_transformer(const compressive_options& o)
        : options_(normalize(o)),
          D(options_.d_model),
          embed_(params_, "src_embed", o.vocab, D),
          norm_(params_, "transformer.norm", D, T(1e-5)),
          generator_(params_, "generator", D, o.vocab, true),
          ar_(shape()),
          ae_(D, options_.compression_rate) {
        layers_.reserve(std::size_t(o.n_layers));
        memory_slot_.assign(std::size_t(o.n_layers), -1);
        for (std::size_t s = 0; s < options_.memory_layers.size(); ++s)
            memory_slot_[std::size_t(options_.memory_layers[s])] = index_t(s);
        for (index_t l = 0; l < o.n_layers; ++l) {
            const bool memory = memory_slot_[std::size_t(l)] >= 0;
            const compressive_layer_options lo{
                .residual = o.residual,
                .norm = o.norm,
                .memory = memory,
                .decoder = memory && can_compress && o.reconstruction == reconstruction_kind::autoencoding,
                .shape = shape()};
            layers_.emplace_back(params_, "transformer.layers." + std::to_string(l), o.d_ff, o.n_pos, lo);
        }
        params_.allocate();
        xs_.resize(std::size_t(o.n_layers + 1));
        usage_.resize(options_.memory_layers.size());
        usage_offset_.assign(options_.memory_layers.size(), 0);
        usage_rows_.assign(options_.memory_layers.size(), 0);
    }
    compressive_transformer(const compressive_transformer&) = delete;
    compressive_transformer& operator=(const compressive_transformer&) = delete;

    /// PyTorch's default initialisation (R, S, u at zero), from a seed.
    void reset_parameters(std::uint64_t seed) {
        rng r(seed);
        embed_.reset_parameters(r);
        for (auto& l : layers_) l.reset_parameters(r);
        norm_.reset_parameters();
        generator_.reset_parameters(r);
        params_.mark_changed();
    }

    /// Generation cache: while on, forward keeps the projected keys and values of memory slots it has
    /// already seen (same memory object and epoch, same slot ids, parameters unchanged by
    /// parameter_set::values() or mark_changed()) and projects only the new ones, so a token costs
    /// O(new slots) projections instead of O(memory). Off by default: code that writes parameters
    /// through raw pointers kept from earlier (finite differences) must call parameters().mark_changed().
    void cache_memory_projections(bool on) {
        cache_projections_ = on;
        last_.valid = false;
        for (auto& l : layers_) l.keep_projections(on);  // the cache reuses projected memory keys
    }
    /// How every layer's attention computes the memory's share (relative_attention's memory_attention;
    /// automatic by default). Both routes compute the same function up to float rounding.
    void set_memory_attention(memory_attention mode) {
        for (auto& l : layers_) l.set_memory_attention(mode);
    }
    bool caches_memory_projections() const { return cache_projections_; }
    /// Gradients enabled (the default): forward saves what backward needs. Off, for inference
    /// (generation, evaluation): forward skips that work (with the generation cache on, the memory
    /// rows whose projections it reuses are not even normalised), and backward or train_segment
    /// after such a forward is an error. Logits and losses are the same either way.
    void set_grad_enabled(bool on) {
        grad_enabled_ = on;
        for (auto& l : layers_) l.set_grad_enabled(on);
    }
    bool grad_enabled() const { return grad_enabled_; }

    /// A memory for this model: mem_len uncompressed and c_mem_len compressed slots (0: Transformer-XL),
    /// for each memory layer (memory_layers(); slot s holds layer memory_layers()[s]).
    memory_type make_memory(index_t mem_len, index_t c_mem_len) const {
        MNEMO_CHECK(c_mem_len == 0 || can_compress, "compressive_transformer: a model without a compression function (Transformer-XL) needs "
                    "c_mem_len = 0, got ", c_mem_len);
        return memory_type(n_memory_layers(), mem_len, c_mem_len, options_.compression_rate, D);
    }

    /// logits [Q·B, vocab] of a segment: tokens [Q·B] sequence-major (position·B + b), reading (not
    /// changing) the memory. Saves activations for backward and the layer inputs for update_memory.
    view<const T, dynamic, Backend> forward(std::span<const token_t> tokens, index_t batch, const memory_type& mem) {
        return kernels::hold_threads([&]() -> view<const T, dynamic, Backend> {
            MNEMO_CHECK(batch >= 1 && !tokens.empty() && index_t(tokens.size()) % batch == 0, "compressive_transformer: ",
                        tokens.size(), " tokens do not form a whole number of positions of batch ", batch);
            MNEMO_CHECK(mem.n_layers() == n_memory_layers(), "compressive_transformer: the memory has ", mem.n_layers(),
                        " layers, the model ", n_memory_layers(), " memory layers");
            MNEMO_CHECK(mem.mem_slots() + mem.c_mem_slots() == 0 || mem.batch() == batch, "compressive_transformer: the "
                        "memory holds a batch of ", mem.batch(), " but the segment has batch ", batch);
            const index_t rows = index_t(tokens.size());
            batch_ = batch;
            rows_ = rows;
            for (auto& x : xs_) x.ensure(rows * D);
            prepare_padding(mem, batch, rows);
            const kv_reuse reuse = memory_reuse(mem, batch);
            const memory_identity ids{mem.epoch(), mem.c_mem_first_id(), mem.mem_first_id()};
            forward_grad_ = grad_enabled_;
            embed_.forward(tokens, x(0));
            for (index_t l = 0; l < options_.n_layers; ++l) {
                const index_t s = memory_slot_[std::size_t(l)];
                auto& layer = layers_[std::size_t(l)];
                if (s < 0) {
                    layer.forward(x(l), view<const T, DM, Backend>(), view<const T, DM, Backend>(), batch, x(l + 1));
                    continue;
                }
                layer.forward(x(l), mem.c_mem(s), mem.mem(s), batch, x(l + 1), reuse, ids);
                if constexpr (needs_usage) segment_usage(s, layer, mem);
            }
            last_ = {true, mem.epoch(), params_.version(), mem.c_mem_first_id(), mem.mem_first_id(), mem.c_mem_slots(),
                     mem.mem_slots(), rows / batch, batch};
            view<T, DM, Backend> hn(hn_.ensure(rows * D), rows, D);
            norm_.forward(x(options_.n_layers), hn);
            view<T, dynamic, Backend> logits(logits_.ensure(rows * options_.vocab), rows, options_.vocab);
            generator_.forward(hn, logits);
            return logits;
        });
    }

    /// Merges this segment's layer inputs into the memory, compressing with the current weights
    /// (no gradient). Returns the number of slots compressed. Call after forward.
    index_t update_memory(memory_type& mem) {
        return kernels::hold_threads([&]() -> index_t {
            if (mem.mem_slots() + mem.c_mem_slots() == 0 && mem.batch() != batch_) mem.reset(batch_, rows_ / batch_);
            if constexpr (needs_usage) {
                // The rows held gain this segment's attention; the new rows start with theirs.
                for (index_t s = 0; s < n_memory_layers(); ++s) {
                    const index_t held = mem.usage_rows(s);
                    MNEMO_CHECK(held == mem.mem_slots() * mem.batch() && usage_rows_[std::size_t(s)] == held + rows_,
                                "compressive_transformer: the memory's usage does not match the last forward (call "
                                "update_memory once after each forward, with the memory forward read)");
                    mem.add_usage(s, usage_[std::size_t(s)].data() + usage_offset_[std::size_t(s)], rows_);
                }
            }
            const index_t before = mem.mem_slots();
            const index_t n_old = mem.merge(
                [&](index_t s) { return view<const T, DM, Backend>(x(memory_layer(s))); },
                [&](index_t s, view<const T, DM, Backend> in, view<T, DM, Backend> out) {
                    auto& f_c = layers_[std::size_t(memory_layer(s))].compress();
                    if constexpr (needs_usage) f_c.set_usage(mem.usage(s), in.rows());
                    f_c.forward(in, batch_, out);
                },
                seg_padded_ ? seg_pad_.data() : nullptr);
            if constexpr (needs_usage) {
                // Drop the usage of the rows the merge dropped: the oldest (held + new − kept) slots.
                mem.drop_usage((before + rows_ / batch_ - mem.mem_slots()) * batch_);
            }
            return n_old;
        });
    }

    /// Mean cross-entropy of the last forward's logits against targets [Q·B] (negative: ignored).
    /// With `with_grad`, keeps d loss / d logits for backward().
    double cross_entropy(std::span<const token_t> targets, bool with_grad) {
        queue_cross_entropy(targets, with_grad);
        double sum = 0;
        device_memory<Backend>::download(&sum, loss_sums_.data(), sizeof(double));
        return cross_entropy_loss<T, Backend>::mean(sum, pending_.ce_counted);
    }

    /// The reconstruction loss (attention reconstruction, or auto-encoding with
    /// reconstruction_kind::autoencoding) summed over the memory layers, for the slots the last merge
    /// compressed (0 when none). With `with_grad`, only the compression functions' (and the decoders')
    /// gradients +=.
    double reconstruction_loss(const memory_type& mem, bool with_grad) {
        queue_reconstruction(mem, with_grad);
        if (!pending_.ar) return 0.0;
        device_memory<Backend>::download(loss_host_.data() + 1, loss_sums_.data() + 1,
                                         sizeof(double) * std::size_t(2 * n_memory_layers()));
        return reconstruction_total();
    }

    /// Parameter gradients += d CE / d θ through the whole model (after cross_entropy(..., true)).
    void backward(std::span<const token_t> tokens) {
        kernels::hold_threads([&] {
            MNEMO_CHECK(has_d_logits_, "compressive_transformer: backward needs cross_entropy(targets, true) first");
            MNEMO_CHECK(forward_grad_, "compressive_transformer: backward after a forward with gradients disabled "
                        "(set_grad_enabled(false)); run forward again with gradients enabled");
            const index_t rows = rows_, v = options_.vocab;
            view<T, DM, Backend> hn(hn_.data(), rows, D), dhn(dhn_.ensure(rows * D), rows, D);
            view<T, DM, Backend> d0(dx_[0].ensure(rows * D), rows, D), d1(dx_[1].ensure(rows * D), rows, D);
            generator_.backward(hn, view<const T, dynamic, Backend>(d_logits_.data(), rows, v), dhn);
            norm_.backward(x(options_.n_layers), dhn, d0);
            for (index_t l = options_.n_layers - 1; l >= 0; --l) {
                layers_[std::size_t(l)].backward(d0, d1);
                std::swap(d0, d1);
            }
            embed_.backward(tokens, d0);
            has_d_logits_ = false;
        });
    }

    /// One training segment as the reference experiment: forward, memory merge, CE + AR, backward.
    /// Parameter gradients +=; the caller zeroes them, clips and steps the optimizer.
    segment_losses train_segment(std::span<const token_t> tokens, std::span<const token_t> targets, index_t batch,
                                 memory_type& mem) {
        queue_train_segment(tokens, targets, batch, mem);
        return read_losses();
    }

    /// The same without gradients (evaluation): the memory is still carried and compressed.
    segment_losses eval_segment(std::span<const token_t> tokens, std::span<const token_t> targets, index_t batch,
                                memory_type& mem) {
        queue_eval_segment(tokens, targets, batch, mem);
        return read_losses();
    }

    /// train_segment leaving the losses in backend memory: nothing is read on the host (no wait for a
    /// GPU) until read_losses(). train_segment is this and read_losses().
    void queue_train_segment(std::span<const token_t> tokens, std::span<const token_t> targets, index_t batch,
                             memory_type& mem) {
        MNEMO_CHECK(grad_enabled_, "compressive_transformer: train_segment with gradients disabled "
                    "(set_grad_enabled(false)); enable them first");
        kernels::hold_threads([&] {  // one hold for the whole segment (the calls below then hold nothing)
            forward(tokens, batch, mem);
            const index_t compressed = update_memory(mem);
            queue_cross_entropy(targets, true);
            queue_reconstruction(mem, true);
            pending_.compressed = compressed;
            pending_.segment = true;
            backward(tokens);
        });
    }

    /// eval_segment leaving the losses in backend memory until read_losses().
    void queue_eval_segment(std::span<const token_t> tokens, std::span<const token_t> targets, index_t batch,
                            memory_type& mem) {
        kernels::hold_threads([&] {
            forward(tokens, batch, mem);
            const index_t compressed = update_memory(mem);
            queue_cross_entropy(targets, false);
            queue_reconstruction(mem, false);
            pending_.compressed = compressed;
            pending_.segment = true;
        });
    }

    /// The losses of the last queued segment (queue_train_segment, queue_eval_segment), read in one
    /// transfer from backend memory: bitwise what train_segment / eval_segment return.
    segment_losses read_losses() {
        MNEMO_CHECK(pending_.segment, "compressive_transformer: read_losses without a queued segment "
                    "(queue_train_segment or queue_eval_segment first)");
        const std::size_t n = pending_.ar ? std::size_t(1 + 2 * n_memory_layers()) : 1;
        device_memory<Backend>::download(loss_host_.data(), loss_sums_.data(), sizeof(double) * n);
        return {.ce = cross_entropy_loss<T, Backend>::mean(loss_host_[0], pending_.ce_counted),
                .ar = pending_.ar ? reconstruction_total() : 0.0,
                .compressed = pending_.compressed};
    }

    // Padding (a pad mask that travels with the tokens into the memory and the compressed memory):
    //   pad [Q·B] in token order (position·B + b), nonzero = a padding position. Attention never attends
    //   to a padded key (segment, memory or compressed memory); the memory keeps the flags per slot
    //   (compressive_memory: a compressed slot is padding iff all its `rate` sources are). A padded
    //   query with no real key visible attends to nothing: its attention context is zero (the
    //   sub-layer yields the output projection's bias; see relative_attention), never NaN. The
    //   attention-reconstruction loss leaves padded queries and padded slots out (see
    //   losses/attention_reconstruction.hpp); the auto-encoding loss does not read the mask. The
    //   cross-entropy does not read the mask either: pass target −1 (ignored) at padded positions.
    //   Without a mask (or an all-zero one, with no padded slot in the memory) everything is bitwise as
    //   without padding.

    /// forward with a pad mask (see above); the 3-argument forward is the same with no padding.
    view<const T, dynamic, Backend> forward(std::span<const token_t> tokens, index_t batch, const memory_type& mem,
                                            std::span<const std::uint8_t> pad) {
        next_pad_ = pad;
        next_pad_set_ = true;
        return forward(tokens, batch, mem);
    }
    /// train_segment with a pad mask (targets at padded positions should be −1).
    segment_losses train_segment(std::span<const token_t> tokens, std::span<const token_t> targets, index_t batch,
                                 memory_type& mem, std::span<const std::uint8_t> pad) {
        next_pad_ = pad;
        next_pad_set_ = true;
        return train_segment(tokens, targets, batch, mem);
    }
    /// eval_segment with a pad mask (targets at padded positions should be −1).
    segment_losses eval_segment(std::span<const token_t> tokens, std::span<const token_t> targets, index_t batch,
                                memory_type& mem, std::span<const std::uint8_t> pad) {
        next_pad_ = pad;
        next_pad_set_ = true;
        return eval_segment(tokens, targets, batch, mem);
    }
    /// queue_train_segment with a pad mask.
    void queue_train_segment(std::span<const token_t> tokens, std::span<const token_t> targets, index_t batch,
                             memory_type& mem, std::span<const std::uint8_t> pad) {
        next_pad_ = pad;
        next_pad_set_ = true;
        queue_train_segment(tokens, targets, batch, mem);
    }
    /// queue_eval_segment with a pad mask.
    void queue_eval_segment(std::span<const token_t> tokens, std::span<const token_t> targets, index_t batch,
                            memory_type& mem, std::span<const std::uint8_t> pad) {
        next_pad_ = pad;
        next_pad_set_ = true;
        queue_eval_segment(tokens, targets, batch, mem);
    }
    /// Transformer-XL's clamp_len for every layer: relative distances above it use the embedding of
    /// distance clamp_len (relative_attention::set_clamp_len); <= 0: off (the default). A runtime
    /// setting: the parameters do not depend on it.
    void set_clamp_len(index_t clamp_len) {
        clamp_len_ = clamp_len > 0 ? clamp_len : 0;
        for (auto& l : layers_) l.set_clamp_len(clamp_len_);
    }
    index_t clamp_len() const { return clamp_len_; }
    /// Whether the last forward had any padding (in its segment or its memory).
    bool last_forward_padded() const { return padding_active_; }

    parameter_set<T, Backend>& parameters() { return params_; }
    const parameter_set<T, Backend>& parameters() const { return params_; }
    /// The options as built (memory_layers listed in full, increasing; d_model, heads and
    /// compression_rate the model's).
    const compressive_options& options() const { return options_; }
    /// d_model, heads and the compression rate: a static config's, or those a runtime-shape model was built with.
    model_shape shape() const { return {options_.d_model, options_.heads, options_.compression_rate}; }
    index_t vocab() const { return options_.vocab; }
    index_t n_layers() const { return options_.n_layers; }
    /// The layers that keep memory, increasing; memory slot s holds layer memory_layers()[s].
    const std::vector<index_t>& memory_layers() const { return options_.memory_layers; }
    index_t n_memory_layers() const { return index_t(options_.memory_layers.size()); }
    /// The memory slot of layer l, or −1 for a layer without memory.
    index_t memory_slot(index_t l) const { return memory_slot_[std::size_t(l)]; }
    /// The layer of memory slot s.
    index_t memory_layer(index_t s) const { return options_.memory_layers[std::size_t(s)]; }
    /// The last forward's logits [Q·B, vocab].
    view<const T, dynamic, Backend> logits() const {
        return view<const T, dynamic, Backend>(logits_.data(), rows_, options_.vocab);
    }
    /// The last forward's input of layer l [Q·B, D] (l = n_layers: the last layer's output).
    view<const T, DM, Backend> layer_input(index_t l) const {
        MNEMO_CHECK(l >= 0 && l <= options_.n_layers, "compressive_transformer: layer_input(", l, ") out of [0, ",
                    options_.n_layers, "]");
        return view<const T, DM, Backend>(xs_[std::size_t(l)].data(), rows_, D);
    }
    layer_type& layer(index_t l) { return layers_[std::size_t(l)]; }

private:
    static compressive_options normalize(compressive_options o) {
        MNEMO_CHECK(o.vocab >= 1, "compressive_transformer: vocab must be at least 1, got ", o.vocab);
        MNEMO_CHECK(o.n_layers >= 1, "compressive_transformer: n_layers must be at least 1, got ", o.n_layers);
        MNEMO_CHECK(o.d_ff >= 1, "compressive_transformer: d_ff must be at least 1, got ", o.d_ff);
        MNEMO_CHECK(o.n_pos >= 1, "compressive_transformer: n_pos must be at least 1, got ", o.n_pos);
        const model_shape shape = check_shape<Config>({o.d_model, o.heads, o.compression_rate},
                                                      "compressive_transformer", "compressive_options::",
                                                      /*rate_required=*/can_compress);
        o.d_model = shape.d_model;
        o.heads = shape.heads;
        o.compression_rate = shape.compression_rate;
        auto& m = o.memory_layers;
        if (m.empty())
            for (index_t l = 0; l < o.n_layers; ++l) m.push_back(l);
        std::sort(m.begin(), m.end());
        for (std::size_t i = 0; i < m.size(); ++i) {
            MNEMO_CHECK(m[i] >= 0 && m[i] < o.n_layers, "compressive_transformer: memory layer ", m[i],
                        " is not a layer of a model with ", o.n_layers, " layers (0 … ", o.n_layers - 1, ")");
            MNEMO_CHECK(i == 0 || m[i] != m[i - 1], "compressive_transformer: memory layer ", m[i], " is listed twice");
        }
        return o;
    }
    view<T, DM, Backend> x(index_t l) { return view<T, DM, Backend>(xs_[std::size_t(l)].data(), rows_, D); }

    /// Most-used compression: the attention mass memory slot s's layer just gave each of its memory
    /// rows and each of the segment's rows (the rows update_memory appends), summed over heads and
    /// queries: usage_[s] from usage_offset_[s], usage_rows_[s] = (mem_slots + Q)·batch rows, key-row order.
    void segment_usage(index_t s, const layer_type& layer, const memory_type& mem) {
        const auto& attn = layer.self_attn();
        static_assert(requires { attn.attention_weights(); },
                      "mnemo: most-used compression needs relative_attention::attention_weights() (the softmax "
                      "output [batch][heads][Q][K])");
        const index_t q = rows_ / batch_, c = mem.c_mem_slots(), k = c + mem.mem_slots() + q;
        T* all = usage_[std::size_t(s)].ensure(k * batch_);
        device_memory<Backend>::fill_zero(all, sizeof(T) * std::size_t(k * batch_));
        checked_ops<Backend>::accumulate_key_usage(batch_, options_.heads, q, k, attn.attention_weights(), all);
        usage_offset_[std::size_t(s)] = c * batch_;  // the compressed slots' rows are not the memory's
        usage_rows_[std::size_t(s)] = (k - c) * batch_;
    }

    compressive_options options_;
    [[no_unique_address]] extent_holder<DM> D;  // d_model: a constant for a static config
    parameter_set<T, Backend> params_;
    embedding<T, DM, Backend> embed_;
    std::vector<layer_type> layers_;
    layer_norm<T, DM, Backend> norm_;
    linear<T, DM, dynamic, Backend> generator_;
    attention_reconstruction<T, Config, Backend> ar_;
    autoencoding_reconstruction<T, DM, Config::compression_rate, Backend> ae_;
    std::vector<index_t> memory_slot_;  // per layer: its memory slot, or −1
    index_t batch_ = 0, rows_ = 0;
    // Padding: the mask handed to the next forward; the last forward's segment flags [Q·B] and key
    // flags [(c_mem + mem)·B + Q·B] ([c_mem, mem, segment]), formed on the host (seg_pad_, key_pad_host_)
    // and uploaded for the kernels (seg_pad_dev_, key_pad_; away_pad_: the slots the merge compressed
    // away, for the reconstruction loss).
    std::span<const std::uint8_t> next_pad_;
    bool next_pad_set_ = false, seg_padded_ = false, padding_active_ = false;
    std::vector<std::uint8_t> seg_pad_, key_pad_host_;
    buffer<std::uint8_t, Backend> seg_pad_dev_, key_pad_, away_pad_;
    index_t clamp_len_ = 0;

    /// Reads (and clears) the pending pad mask; sets every layer's key padding for this forward.
    void prepare_padding(const memory_type& mem, index_t batch, index_t rows) {
        const bool given = next_pad_set_;
        const std::span<const std::uint8_t> pad = next_pad_;
        next_pad_set_ = false;
        next_pad_ = {};
        seg_padded_ = false;
        if (given) {
            MNEMO_CHECK(index_t(pad.size()) == rows, "compressive_transformer: the pad mask has ", pad.size(),
                        " entries for ", rows, " tokens (one per token, in the same order)");
            seg_pad_.assign(pad.begin(), pad.end());
            for (std::uint8_t f : pad) seg_padded_ = seg_padded_ || f != 0;
        }
        const bool mem_padded = mem.mem_slots() + mem.c_mem_slots() > 0 && mem.has_padding();
        padding_active_ = seg_padded_ || mem_padded;
        if (!padding_active_) {
            for (auto& l : layers_) l.set_key_padding(nullptr);
            return;
        }
        if (!seg_padded_) seg_pad_.assign(std::size_t(rows), 0);
        const index_t c = mem.c_mem_slots() * batch, m = mem.mem_slots() * batch;
        key_pad_host_.assign(mem.c_mem_pad(), mem.c_mem_pad() + c);
        key_pad_host_.insert(key_pad_host_.end(), mem.mem_pad(), mem.mem_pad() + m);
        key_pad_host_.insert(key_pad_host_.end(), seg_pad_.begin(), seg_pad_.end());
        const std::uint8_t* keys = key_pad_.upload(key_pad_host_);
        if (seg_padded_) seg_pad_dev_.upload(seg_pad_);
        for (index_t l = 0; l < options_.n_layers; ++l)
            layers_[std::size_t(l)].set_key_padding(memory_slot_[std::size_t(l)] >= 0 ? keys : keys + c + m);
    }
    bool has_d_logits_ = false;
    // The generation cache: what the last forward's keys and values were computed from.
    struct projected_memory {
        bool valid = false;
        std::uint64_t epoch = 0, version = 0;
        std::int64_t c_first = 0, m_first = 0;
        index_t c_slots = 0, m_slots = 0, q = 0, batch = 0;
    };
    bool cache_projections_ = false, grad_enabled_ = true, forward_grad_ = true;
    projected_memory last_;

    /// Key positions of this forward ([c_mem, mem, segment]) already projected by the last one: the
    /// compressed slots both hold, and the memory slots that were the last forward's memory or its
    /// segment (which the merge in between appended to the memory).
    // The losses wait in loss_sums_ (backend memory): [0] the cross-entropy's sum, then per memory
    // layer s the reconstruction's two sums at [1 + 2s, 3 + 2s). pending_ keeps, on the host, what
    // turns them into losses; read_losses() reads them in one transfer into loss_host_.
    struct pending_losses {
        bool segment = false;        // a whole segment was queued (read_losses may read)
        bool ar = false;             // the reconstruction sums were written (something was compressed)
        index_t ce_counted = 0;      // the cross-entropy's counted rows
        index_t compressed = 0;      // the merge's compressed slots
        std::vector<index_t> ae_elements;  // per memory layer, the auto-encoding mean's element count
    };

    void ensure_loss_slots() {
        const std::size_t n = std::size_t(1 + 2 * n_memory_layers());
        loss_sums_.ensure(index_t(n));
        loss_host_.resize(n);
        pending_.ae_elements.resize(std::size_t(n_memory_layers()));
    }

    void queue_cross_entropy(std::span<const token_t> targets, bool with_grad) {
        MNEMO_CHECK(index_t(targets.size()) == rows_, "compressive_transformer: ", targets.size(), " targets for ",
                    rows_, " positions");
        ensure_loss_slots();
        pending_.segment = false;  // until a whole segment is queued again
        pending_.ce_counted = ce_.queue(rows_, options_.vocab, logits_.data(), targets,
                                        d_logits_.ensure(rows_ * options_.vocab), loss_sums_.data());
        has_d_logits_ = with_grad;
    }

    // Queues every memory layer's reconstruction loss for the slots the last merge compressed.
    void queue_reconstruction(const memory_type& mem, bool with_grad) {
        ensure_loss_slots();
        pending_.ar = mem.compressed_away_slots() > 0;
        if (!pending_.ar) return;
        for (index_t s = 0; s < n_memory_layers(); ++s) {
            const index_t l = memory_layer(s);
            auto& layer = layers_[std::size_t(l)];
            double* sums = loss_sums_.data() + 1 + 2 * s;
            if (options_.reconstruction == reconstruction_kind::autoencoding) {
                pending_.ae_elements[std::size_t(s)] = 0;  // no element: a loss of 0, the sums unread
                if constexpr (can_compress)
                    pending_.ae_elements[std::size_t(s)] =
                        ae_.queue(layer.compress(), layer.decoder(), mem.compressed_away(s), batch_, with_grad, sums);
            } else {
                // h is this layer's input of the last forward, whose queries the attention kept (the
                // parameters unchanged since). When the merge since that forward compressed the oldest
                // slots of its [mem, x], the layer kept their normalised values too (pre-LN).
                const auto away = mem.compressed_away(s);
                typename decltype(ar_)::saved_forward saved{};
                if (params_.version() == last_.version) {
                    saved.queries = layer.self_attn().queries();
                    if (mem.epoch() == last_.epoch && mem.batch() == last_.batch &&
                        mem.mem_first_id() - mem.compressed_away_slots() == last_.m_first)
                        saved.normalized_m = layer.normalised_memory_rows(away.rows());
                }
                ar_.queue(layer.attention_input_norm(), layer.self_attn(), layer.compress(),
                          view<const T, DM, Backend>(x(l)), away, batch_, with_grad, sums,
                          seg_padded_ ? seg_pad_dev_.data() : nullptr,
                          padding_active_ ? away_pad_.upload({mem.compressed_away_pad(), std::size_t(away.rows())})
                                          : nullptr,
                          saved);
            }
        }
    }

    // Σ over the memory layers of their reconstruction losses, from the sums in loss_host_.
    double reconstruction_total() const {
        double total = 0;
        for (index_t s = 0; s < n_memory_layers(); ++s) {
            const double* sums = loss_host_.data() + 1 + 2 * s;
            if (options_.reconstruction == reconstruction_kind::autoencoding)
                total += decltype(ae_)::loss(sums[0], pending_.ae_elements[std::size_t(s)]);
            else
                total += double(ar_.loss(sums));
        }
        return total;
    }

    kv_reuse memory_reuse(const memory_type& mem, index_t batch) const {
        kv_reuse r;
        if (!cache_projections_ || !last_.valid || last_.epoch != mem.epoch() || last_.version != params_.version() ||
            last_.batch != batch)
            return r;
        const std::int64_t cf = mem.c_mem_first_id(), mf = mem.mem_first_id();
        const index_t cc = mem.c_mem_slots(), mc = mem.mem_slots();
        {  // compressed slots: positions [0, cc) now, [0, last c_slots) then
            const std::int64_t lo = std::max(cf, last_.c_first), hi = std::min(cf + cc, last_.c_first + last_.c_slots);
            if (hi > lo) r.add(index_t(lo - cf), index_t(lo - last_.c_first), index_t(hi - lo));
        }
        {  // memory slots: positions cc + (id − mf) now; then cc_last + (id − mf_last) over memory + segment
            const std::int64_t lo = std::max(mf, last_.m_first),
                               hi = std::min(mf + mc, last_.m_first + last_.m_slots + last_.q);
            if (hi > lo) r.add(cc + index_t(lo - mf), last_.c_slots + index_t(lo - last_.m_first), index_t(hi - lo));
        }
        // Without gradients no backward reads the keys: the compressed slots' may slide apart from the
        // memory's (relative_attention::reuse_kv), and neither is copied when the memory compresses.
        if (!grad_enabled_) r.split = cc;
        return r;
    }
    std::vector<buffer<T, Backend>> xs_;  // layer inputs [Q·B, D]; xs_[L] is the last layer's output
    buffer<T, Backend> hn_, logits_, d_logits_, dhn_;
    cross_entropy_loss<T, Backend> ce_;
    buffer<double, Backend> loss_sums_;
    std::vector<double> loss_host_;
    pending_losses pending_;
    buffer<T, Backend> dx_[2];
    // Most-used: per memory slot, the last forward's usage of every key row [(c_mem + mem + Q)·B], of
    // which the memory's rows start at usage_offset_ and number usage_rows_.
    std::vector<buffer<T, Backend>> usage_;
    std::vector<index_t> usage_offset_, usage_rows_;
};

}  // namespace mnemo
