#pragma once
// The Compressive Transformer (Rae et al., 2019) as labml's pre-LayerNorm implementation, and
// Transformer-XL (Dai et al., 2019) as its special case without compressed memory.
//
// One layer (state_dict prefix `transformer.layers.<l>`), input x [Q·B, D], memory m and compressed
// memory cm of layer l (constants: the layer's inputs from earlier segments):
//   z   = LN_attn([cm, m, x])                 `norm_self_attn`: one norm, current parameters, for
//                                             memory and segment alike
//   x'  = x + RelAttn(q = z_segment, k = v = z)          `self_attn` (nn/relative_attention.hpp)
//   y   = x' + FFN(LN_ff(x'))                 `norm_ff`, `feed_forward` (Linear–ReLU–Linear)
//   f_c                                       `compress`: compresses this layer's memory
// The model: `src_embed` (no scaling, no positions) → layers → `transformer.norm` → `generator`.
//
// A segment step follows the reference experiment (REFERENCE_NOTES 6-10):
//   forward (reads the memory) → merge the new layer inputs into the memory, compressing with the
//   current weights → cross-entropy + attention-reconstruction loss (only if something was
//   compressed) → backward (parameter gradients +=) → the caller clips and steps the optimizer.
#include <span>
#include <string>
#include <vector>

#include "../core/buffer.hpp"
#include "../core/config.hpp"
#include "../core/parameters.hpp"
#include "../nn/compression.hpp"
#include "../nn/embedding.hpp"
#include "../nn/feed_forward.hpp"
#include "../nn/layer_norm.hpp"
#include "../nn/linear.hpp"
#include "../nn/no_compression.hpp"
#include "../nn/relative_attention.hpp"
#include "../nn/residual.hpp"
#include "../train/attention_reconstruction.hpp"
#include "../train/compressive_memory.hpp"

namespace mnemo {

template <class T, class Config, template <class, std::size_t, std::size_t, class> class Compression,
          class Backend = cpu>
class compressive_layer {
    using K = ops<Backend>;
    static constexpr std::size_t DM = Config::d_model;
    static constexpr index_t D = index_t(DM);

public:
    using compression_type = Compression<T, DM, Config::compression_rate, Backend>;

    compressive_layer(parameter_set<T>& ps, const std::string& prefix, index_t d_ff, index_t n_pos)
        : compress_(ps, prefix + ".compress"),
          self_attn_(ps, prefix + ".self_attn", n_pos),
          feed_forward_(ps, prefix + ".feed_forward", d_ff),
          norm_self_attn_(ps, prefix + ".norm_self_attn"),
          norm_ff_(ps, prefix + ".norm_ff") {}

    void reset_parameters(rng& r) {
        compress_.reset_parameters(r);
        self_attn_.reset_parameters(r);
        feed_forward_.reset_parameters(r);
        norm_self_attn_.reset_parameters();
        norm_ff_.reset_parameters();
    }

    /// y [Q·B, D] = layer(x [Q·B, D]) attending over [c_mem, mem, x]. Saves what backward reads.
    void forward(view<const T, DM, Backend> x, view<const T, DM, Backend> c_mem, view<const T, DM, Backend> mem,
                 index_t batch, view<T, DM, Backend> y) {
        const index_t qb = x.rows(), lb = c_mem.rows() + mem.rows(), kb = lb + qb;
        batch_ = batch;
        mem_rows_ = lb;
        // kv_in = [c_mem, mem, x], oldest first.
        view<T, DM, Backend> kv_in(kv_in_.ensure(kb * D), kb), z(z_.ensure(kb * D), kb);
        K::copy(c_mem.rows(), D, c_mem.data(), c_mem.ld(), kv_in.data(), D);
        K::copy(mem.rows(), D, mem.data(), mem.ld(), kv_in.row(c_mem.rows()), D);
        K::copy(qb, D, x.data(), x.ld(), kv_in.row(lb), D);
        const norm_stats<T> st{mean_.ensure(kb), rstd_.ensure(kb)};
        norm_self_attn_.forward(kv_in, z, st);

        view<T, DM, Backend> a(attn_out_.ensure(qb * D), qb), x_mid(x_mid_.ensure(qb * D), qb),
            z2(z2_.ensure(qb * D), qb), f(ff_out_.ensure(qb * D), qb);
        self_attn_.forward(z.row_range(lb, qb), z, batch, a);
        residual<T, DM, Backend>::forward(x, a, x_mid);
        norm_ff_.forward(x_mid, z2);
        feed_forward_.forward(z2, f);
        residual<T, DM, Backend>::forward(x_mid, f, y);
    }

    /// dx [Q·B, D] (assigned) from dy; parameter gradients +=. The memory gets no gradient
    /// (stop-gradient), but the attention norm's parameters do get the memory rows' share.
    void backward(view<const T, DM, Backend> dy, view<T, DM, Backend> dx) {
        const index_t qb = dy.rows(), lb = mem_rows_, kb = lb + qb;
        const view<T, DM, Backend> kv_in(kv_in_.data(), kb), z(z_.data(), kb), x_mid(x_mid_.data(), qb),
            z2(z2_.data(), qb);
        view<T, DM, Backend> d_mid(d_mid_.ensure(qb * D), qb), dz2(dz2_.ensure(qb * D), qb), dz(dz_.ensure(kb * D), kb);
        // y = x' + FFN(LN_ff(x'))
        residual<T, DM, Backend>::backward(dy, d_mid, view<T, DM, Backend>());
        feed_forward_.backward(z2, dy, dz2);
        norm_ff_.backward(x_mid, dz2, d_mid, /*accumulate_dx=*/true);
        // x' = x + attn(z): queries are the segment rows of z, keys and values all rows.
        self_attn_.backward(z.row_range(lb, qb), z, d_mid, dz.row_range(lb, qb), dz, /*accumulate_dq=*/true);
        // z = LN([cm, m, x]): parameter gradients from every row, input gradient for the segment only.
        const norm_stats<T> st{mean_.data(), rstd_.data()};
        norm_self_attn_.backward(kv_in.row_range(0, lb), dz.row_range(0, lb), view<T, DM, Backend>(), st);
        residual<T, DM, Backend>::backward(view<const T, DM, Backend>(d_mid), dx, view<T, DM, Backend>());
        norm_self_attn_.backward(kv_in.row_range(lb, qb), dz.row_range(lb, qb), dx,
                                 norm_stats<T>{mean_.data() + lb, rstd_.data() + lb}, /*accumulate_dx=*/true);
    }

    compression_type& compress() { return compress_; }
    const relative_attention<T, Config, Backend>& self_attn() const { return self_attn_; }
    const layer_norm<T, DM, Backend>& norm_self_attn() const { return norm_self_attn_; }

private:
    compression_type compress_;
    relative_attention<T, Config, Backend> self_attn_;
    feed_forward<T, DM, dynamic, relu, Backend> feed_forward_;
    layer_norm<T, DM, Backend> norm_self_attn_, norm_ff_;
    index_t batch_ = 0, mem_rows_ = 0;
    buffer<T> kv_in_, z_, mean_, rstd_, attn_out_, x_mid_, z2_, ff_out_, d_mid_, dz2_, dz_;
};

/// Settings fixed when the model is built (the compile-time ones are in Config).
struct compressive_options {
    index_t vocab = 0;
    index_t n_layers = 0;
    index_t d_ff = 0;
    index_t n_pos = 4096;  // P, the number of relative positions
};

/// Losses of one segment.
struct segment_losses {
    double ce = 0;              // mean cross-entropy (nats)
    double ar = 0;              // attention-reconstruction loss (0 when nothing was compressed)
    index_t compressed = 0;     // memory slots compressed by this segment's merge
};

template <class T, class Config, template <class, std::size_t, std::size_t, class> class Compression = conv_compression,
          class Backend = cpu>
class compressive_transformer {
    using K = ops<Backend>;
    static constexpr std::size_t DM = Config::d_model;
    static constexpr index_t D = index_t(DM);

public:
    using config = Config;
    using layer_type = compressive_layer<T, Config, Compression, Backend>;
    using memory_type = compressive_memory<T, DM, Backend>;
    /// False for Transformer-XL models (no_compression): their memory must have c_mem_len = 0.
    static constexpr bool can_compress =
        !std::is_same_v<typename layer_type::compression_type, no_compression<T, DM, Config::compression_rate, Backend>>;

    explicit compressive_transformer(const compressive_options& o)
        : options_(check(o)), embed_(params_, "src_embed", o.vocab), norm_(params_, "transformer.norm"),
          generator_(params_, "generator", D, o.vocab, true) {
        layers_.reserve(std::size_t(o.n_layers));
        for (index_t l = 0; l < o.n_layers; ++l)
            layers_.emplace_back(params_, "transformer.layers." + std::to_string(l), o.d_ff, o.n_pos);
        params_.allocate();
        xs_.resize(std::size_t(o.n_layers + 1));
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
    }

    /// A memory for this model: mem_len uncompressed and c_mem_len compressed slots (0: Transformer-XL).
    memory_type make_memory(index_t mem_len, index_t c_mem_len) const {
        MNEMO_CHECK(c_mem_len == 0 || can_compress, "compressive_transformer: a model without a compression function (Transformer-XL) needs "
                    "c_mem_len = 0, got ", c_mem_len);
        return memory_type(options_.n_layers, mem_len, c_mem_len, index_t(Config::compression_rate));
    }

    /// logits [Q·B, vocab] of a segment: tokens [Q·B] sequence-major (position·B + b), reading (not
    /// changing) the memory. Saves activations for backward and the layer inputs for update_memory.
    view<const T, dynamic, Backend> forward(std::span<const token_t> tokens, index_t batch, const memory_type& mem) {
        MNEMO_CHECK(batch >= 1 && !tokens.empty() && index_t(tokens.size()) % batch == 0, "compressive_transformer: ",
                    tokens.size(), " tokens do not form a whole number of positions of batch ", batch);
        MNEMO_CHECK(mem.n_layers() == options_.n_layers, "compressive_transformer: the memory has ", mem.n_layers(),
                    " layers, the model ", options_.n_layers);
        MNEMO_CHECK(mem.mem_slots() + mem.c_mem_slots() == 0 || mem.batch() == batch, "compressive_transformer: the "
                    "memory holds a batch of ", mem.batch(), " but the segment has batch ", batch);
        const index_t rows = index_t(tokens.size());
        batch_ = batch;
        rows_ = rows;
        for (auto& x : xs_) x.ensure(rows * D);
        embed_.forward(tokens, x(0));
        for (index_t l = 0; l < options_.n_layers; ++l)
            layers_[std::size_t(l)].forward(x(l), mem.c_mem(l), mem.mem(l), batch, x(l + 1));
        view<T, DM, Backend> hn(hn_.ensure(rows * D), rows);
        norm_.forward(x(options_.n_layers), hn);
        view<T, dynamic, Backend> logits(logits_.ensure(rows * options_.vocab), rows, options_.vocab);
        generator_.forward(hn, logits);
        return logits;
    }

    /// Merges this segment's layer inputs into the memory, compressing with the current weights
    /// (no gradient). Returns the number of slots compressed. Call after forward.
    index_t update_memory(memory_type& mem) {
        if (mem.mem_slots() + mem.c_mem_slots() == 0 && mem.batch() != batch_) mem.reset(batch_, rows_ / batch_);
        return mem.merge([&](index_t l) { return view<const T, DM, Backend>(x(l)); },
                         [&](index_t l, view<const T, DM, Backend> in, view<T, DM, Backend> out) {
                             layers_[std::size_t(l)].compress().forward(in, batch_, out);
                         });
    }

    /// Mean cross-entropy of the last forward's logits against targets [Q·B] (negative: ignored).
    /// With `with_grad`, keeps d loss / d logits for backward().
    double cross_entropy(std::span<const token_t> targets, bool with_grad) {
        MNEMO_CHECK(index_t(targets.size()) == rows_, "compressive_transformer: ", targets.size(), " targets for ",
                    rows_, " positions");
        const index_t v = options_.vocab;
        K::cross_entropy_check_targets(rows_, v, targets.data());
        index_t counted = 0;
        for (token_t t : targets) counted += t >= 0;
        const T scale = counted > 0 ? T(1) / T(counted) : T(0);
        T* losses = ce_rows_.ensure(rows_);
        K::cross_entropy_fused(rows_, v, logits_.data(), v, targets.data(), losses, scale,
                               d_logits_.ensure(rows_ * v), v);
        has_d_logits_ = with_grad;
        double sum = 0;
        for (index_t i = 0; i < rows_; ++i) sum += double(losses[i]);
        return counted > 0 ? sum / double(counted) : 0.0;
    }

    /// Attention-reconstruction loss summed over layers, for the slots the last merge compressed
    /// (0 when none). With `with_grad`, only the compression functions' gradients +=.
    double reconstruction_loss(const memory_type& mem, bool with_grad) {
        if (mem.compressed_away_slots() == 0) return 0.0;
        double total = 0;
        for (index_t l = 0; l < options_.n_layers; ++l) {
            auto& layer = layers_[std::size_t(l)];
            total += double(ar_.compute(layer.norm_self_attn(), layer.self_attn(), layer.compress(),
                                        view<const T, DM, Backend>(x(l)), mem.compressed_away(l), batch_, with_grad));
        }
        return total;
    }

    /// Parameter gradients += d CE / d θ through the whole model (after cross_entropy(..., true)).
    void backward(std::span<const token_t> tokens) {
        MNEMO_CHECK(has_d_logits_, "compressive_transformer: backward needs cross_entropy(targets, true) first");
        const index_t rows = rows_, v = options_.vocab;
        view<T, DM, Backend> hn(hn_.data(), rows), dhn(dhn_.ensure(rows * D), rows);
        view<T, DM, Backend> d0(dx_[0].ensure(rows * D), rows), d1(dx_[1].ensure(rows * D), rows);
        generator_.backward(hn, view<const T, dynamic, Backend>(d_logits_.data(), rows, v), dhn);
        norm_.backward(x(options_.n_layers), dhn, d0);
        for (index_t l = options_.n_layers - 1; l >= 0; --l) {
            layers_[std::size_t(l)].backward(d0, d1);
            std::swap(d0, d1);
        }
        embed_.backward(tokens, d0);
        has_d_logits_ = false;
    }

    /// One training segment as the reference experiment: forward, memory merge, CE + AR, backward.
    /// Parameter gradients +=; the caller zeroes them, clips and steps the optimizer.
    segment_losses train_segment(std::span<const token_t> tokens, std::span<const token_t> targets, index_t batch,
                                 memory_type& mem) {
        forward(tokens, batch, mem);
        segment_losses out;
        out.compressed = update_memory(mem);
        out.ce = cross_entropy(targets, true);
        out.ar = reconstruction_loss(mem, true);
        backward(tokens);
        return out;
    }

    /// The same without gradients (evaluation): the memory is still carried and compressed.
    segment_losses eval_segment(std::span<const token_t> tokens, std::span<const token_t> targets, index_t batch,
                                memory_type& mem) {
        forward(tokens, batch, mem);
        segment_losses out;
        out.compressed = update_memory(mem);
        out.ce = cross_entropy(targets, false);
        out.ar = reconstruction_loss(mem, false);
        return out;
    }

    parameter_set<T>& parameters() { return params_; }
    const parameter_set<T>& parameters() const { return params_; }
    const compressive_options& options() const { return options_; }
    index_t vocab() const { return options_.vocab; }
    index_t n_layers() const { return options_.n_layers; }
    /// The last forward's logits [Q·B, vocab].
    view<const T, dynamic, Backend> logits() const {
        return view<const T, dynamic, Backend>(logits_.data(), rows_, options_.vocab);
    }
    layer_type& layer(index_t l) { return layers_[std::size_t(l)]; }

private:
    static const compressive_options& check(const compressive_options& o) {
        MNEMO_CHECK(o.vocab >= 1, "compressive_transformer: vocab must be at least 1, got ", o.vocab);
        MNEMO_CHECK(o.n_layers >= 1, "compressive_transformer: n_layers must be at least 1, got ", o.n_layers);
        MNEMO_CHECK(o.d_ff >= 1, "compressive_transformer: d_ff must be at least 1, got ", o.d_ff);
        MNEMO_CHECK(o.n_pos >= 1, "compressive_transformer: n_pos must be at least 1, got ", o.n_pos);
        return o;
    }
    view<T, DM, Backend> x(index_t l) { return view<T, DM, Backend>(xs_[std::size_t(l)].data(), rows_); }

    compressive_options options_;
    parameter_set<T> params_;
    embedding<T, DM, Backend> embed_;
    std::vector<layer_type> layers_;
    layer_norm<T, DM, Backend> norm_;
    linear<T, DM, dynamic, Backend> generator_;
    attention_reconstruction<T, Config, Backend> ar_;
    index_t batch_ = 0, rows_ = 0;
    bool has_d_logits_ = false;
    std::vector<buffer<T>> xs_;  // layer inputs [Q·B, D]; xs_[L] is the last layer's output
    buffer<T> hn_, logits_, ce_rows_, d_logits_, dhn_;
    buffer<T> dx_[2];
};

}  // namespace mnemo
