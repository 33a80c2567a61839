#pragma once
// Auto-encoding loss of the Compressive Transformer (Rae et al., 2019, §3.2): the paper's alternative
// to the attention-reconstruction loss (attention_reconstruction.hpp). A decoder g reconstructs the
// memory slots a layer just compressed away from their compression; for one layer, with m those
// n·c slots ([n·c·batch rows, D], row = t·batch + b, a constant) and c = Rate:
//
//   cm   = f_c(m)                                     the layer's compression function, current weights
//   m̂    = g(cm)                                      the decoder below
//   loss = mean( (m̂ − m)² )                           F.mse_loss(g(f_c(m)), m), over all n·c·batch·D
//
// Its gradient reaches only f_c's parameters and g's parameters (m is detached):
//   d m̂ = 2 (m̂ − m) / N,  N = n·c·batch·D    →  g.backward  →  d cm  →  f_c.backward (d m not needed)
//
// The decoder g: torch.nn.ConvTranspose1d(D, D, kernel_size=c, stride=c) over time, applied as
// g(cm.permute(1, 2, 0)).permute(2, 0, 1). `<prefix>.weight` [D, D, c] (PyTorch ConvTranspose
// layout [in, out, kernel]), `<prefix>.bias` [D]. Kernel = stride, so each output slot comes from
// exactly one input slot:
//
//   out[(s·c + t)·batch + b, o] = bias[o] + Σ_i cm[s·batch + b, i] · W[i, o, t]
//
// W read as [D, D·c] has column o·c + t, so one GEMM Y = cm·W [n·batch, D·c] holds
// out[(s·c + t)·batch + b, o] at Y[s·batch + b, o·c + t]: exactly the im2col layout of the
// compression functions, and col2im_time scatters it (assigning: every output row is written once).
// Backward gathers d_out the same way, dY = im2col(d_out):
//   dW += cmᵀ·dY        db += Σ_rows d_out        d cm = dY·Wᵀ
// PyTorch's default initialisation (kaiming_uniform(a=√5)): W, b ~ U(−1/√fan_in, 1/√fan_in) with
// fan_in = weight.size(1)·kernel = D·c for a ConvTranspose weight [in, out, kernel].
//
// Calling order (as attention_reconstruction, and compressive_transformer::reconstruction_loss):
// compute after the model's memory merge, over the slots that merge compressed away. compute runs
// f_c.forward on m itself and then, with gradients, f_c.backward at once, so it overwrites whatever
// f_c kept from an earlier forward (the merge's compression, which has no gradient path and needs
// none of it). Do not call it between an f_c.forward and the f_c.backward that should read it.
//
// Backward contract (module.hpp): parameter gradients +=. Buffers grow to the largest memory seen
// and are reused, so steady-state calls do not allocate.
#include <cmath>
#include <string>

#include "../core/buffer.hpp"
#include "../core/rng.hpp"
#include "../nn/compression.hpp"
#include "../nn/module.hpp"

namespace mnemo {

/// ConvTranspose1d(D, D, kernel_size=Rate, stride=Rate) over the time axis, with bias: the decoder
/// of the auto-encoding loss, [n·batch, D] → [n·Rate·batch, D].
/// D and Rate may be `dynamic` (a runtime-shape model): they are then given at construction.
template <class T, std::size_t D, std::size_t Rate, class Backend = cpu>
class conv_transpose_decoder {
    using kernels = checked_ops<Backend>;
    static_assert(expect_compression_rate<Rate>::value);
    [[no_unique_address]] extent_holder<D> d_;
    [[no_unique_address]] extent_holder<Rate> c_;
    // Columns of Y, and of W as [D, D·Rate].
    [[no_unique_address]] extent_holder<D == dynamic || Rate == dynamic ? dynamic : D * Rate> k_;

public:
    static constexpr std::size_t rate = Rate;
    static constexpr std::size_t features = D;

    /// Declares `<prefix>.weight` [D, D, Rate] ([in, out, kernel]) and `<prefix>.bias` [D].
    conv_transpose_decoder(parameter_set<T, Backend>& ps, const std::string& prefix) requires(D != dynamic && Rate != dynamic)
        : conv_transpose_decoder(ps, prefix, static_cast<index_t>(D), static_cast<index_t>(Rate)) {}
    /// Runtime extents (each must equal the static one where that is fixed).
    conv_transpose_decoder(parameter_set<T, Backend>& ps, const std::string& prefix, index_t d, index_t rate)
        : d_(d), c_(rate), k_(d * rate), name_(prefix), who_("conv_transpose_decoder '" + prefix + "'") {
        detail::compression_shape::check_extents<D, Rate>(who_, d, rate);
        weight_ = ps.declare(prefix + ".weight", {d_, d_, c_});
        bias_ = ps.declare(prefix + ".bias", {d_});
    }

    /// PyTorch's ConvTranspose1d default: W, b ~ U(−1/√(D·Rate), 1/√(D·Rate)) (fan_in =
    /// weight.size(1) · kernel = out_channels · Rate). Weight first, then bias.
    void reset_parameters(rng& r) const {
        const double bound = 1.0 / std::sqrt(static_cast<double>(k_));
        weight_.generate([&] { return r.uniform(-bound, bound); });
        bias_.generate([&] { return r.uniform(-bound, bound); });
    }

    /// Rows of the decoded memory for `cm_rows` compressed rows: cm_rows · Rate.
    index_t decoded_rows(index_t cm_rows) const { return cm_rows * c_; }

    /// out [n·Rate·batch, D] = g(cm [n·batch, D]) (assigned). Keeps nothing: backward takes cm again.
    template <view_of<T> CM, view_of<T> O>
    void forward(const CM& cm, index_t batch, const O& out) {
        static_assert(check_view<D, CM, axis::d_model, Backend>());
        static_assert(check_view<D, O, axis::d_model, Backend>());
        const index_t rows = check(cm, batch, out, "out");
        T* y = y_.ensure(rows * k_);  // Y [n·batch, D·Rate], column o·Rate + t
        kernels::gemm_nn(rows, k_, d_, cm.data(), cm.ld(), weight_.value(), k_, y, k_);
        kernels::template col2im_time<Rate>(rows, batch, d_, y, out.data(), out.ld(), c_);
        kernels::add_bias_rows(rows * c_, d_, bias_.value(), out.data(), out.ld());
    }

    /// dW += cmᵀ·im2col(d_out), db += Σ d_out; d_cm = ∂/∂cm (assigned; skipped when d_cm has no
    /// data). cm is the decoder's input of the forward this gradient belongs to.
    template <view_of<T> CM, view_of<T> DO, view_of<T> DC>
    void backward(const CM& cm, index_t batch, const DO& d_out, const DC& d_cm) {
        static_assert(check_view<D, CM, axis::d_model, Backend>());
        static_assert(check_view<D, DO, axis::d_model, Backend>());
        static_assert(check_view<D, DC, axis::d_model, Backend>());
        const index_t rows = check(cm, batch, d_out, "d_out");
        if (d_cm.data()) {
            check_cols(d_cm, d_, who_.c_str(), "d_cm");
            MNEMO_CHECK(d_cm.rows() == rows, who_, ": d_cm has ", d_cm.rows(), " rows but cm has ", rows);
        }
        T* dy = dy_.ensure(rows * k_);  // dY [n·batch, D·Rate]
        kernels::template im2col_time<Rate>(rows, batch, d_, d_out.data(), d_out.ld(), dy, c_);
        kernels::gemm_tn(d_, k_, rows, cm.data(), cm.ld(), dy, k_, weight_.grad(), k_, T(1));
        kernels::sum_rows_accumulate(rows * c_, d_, d_out.data(), d_out.ld(), bias_.grad());
        if (d_cm.data()) kernels::gemm_nt(rows, d_, k_, dy, k_, weight_.value(), k_, d_cm.data(), d_cm.ld());
    }

    const std::string& name() const { return name_; }
    const param<T, Backend>& weight() const { return weight_; }
    const param<T, Backend>& bias() const { return bias_; }

private:
    // cm [n·batch, D] and the decoded side [n·Rate·batch, D]; returns n·batch.
    template <class CM, class O>
    index_t check(const CM& cm, index_t batch, const O& out, const char* out_name) const {
        check_cols(cm, d_, who_.c_str(), "cm");
        check_cols(out, d_, who_.c_str(), out_name);
        MNEMO_CHECK(batch > 0, who_, ": batch must be positive, got ", batch);
        const index_t rows = cm.rows();
        MNEMO_CHECK(rows % batch == 0, who_, ": cm has ", rows, " rows, not a multiple of batch ", batch);
        MNEMO_CHECK(out.rows() == rows * c_, who_, ": ", out_name, " has ", out.rows(), " rows, expected cm rows ",
                    rows, " x rate ", index_t(c_), " = ", rows * c_);
        return rows;
    }

    std::string name_, who_;
    param<T, Backend> weight_;  // [D, D, Rate] = [in, out, kernel], read as [D, D·Rate] with column o·Rate + t
    param<T, Backend> bias_;    // [D]
    buffer<T, Backend> y_;      // Y  [n·batch, D·Rate], forward scratch
    buffer<T, Backend> dy_;     // dY [n·batch, D·Rate], backward scratch
};

/// The auto-encoding loss of one layer: mean((g(f_c(m)) − m)²), gradients into f_c and g only.
template <class T, std::size_t D, std::size_t Rate, class Backend = cpu>
class autoencoding_reconstruction {
    [[no_unique_address]] extent_holder<D> d_;
    [[no_unique_address]] extent_holder<Rate> c_;

public:
    using decoder_type = conv_transpose_decoder<T, D, Rate, Backend>;

    autoencoding_reconstruction() requires(D != dynamic && Rate != dynamic) = default;
    /// Runtime extents (D and Rate `dynamic`: a runtime-shape model).
    autoencoding_reconstruction(index_t d, index_t rate) : d_(d), c_(rate) {}

    /// The loss for m [n·Rate·batch, D] (the slots just compressed away; rows a multiple of
    /// Rate·batch); 0 for an empty m. When `with_grad`, g's and f_c's parameter gradients +=
    /// d loss / d θ; no other gradient is touched. Runs f_c.forward, overwriting what f_c kept (see
    /// the header comment: call after the memory merge). queue() and loss() with one read on the host.
    template <class Compression>
    double compute(Compression& f_c, decoder_type& g, view<const T, D, Backend> m, index_t batch, bool with_grad) {
        const index_t n = queue(f_c, g, m, batch, with_grad, sum_.ensure(2));
        double sum = 0;  // the host path: the loss is returned now
        if (n > 0) device_memory<Backend>::download(&sum, sum_.data(), sizeof(double));
        return loss(sum, n);
    }

    /// compute() leaving the loss in backend memory: `sums` (two doubles of Backend's memory) get the
    /// squared differences' sum (sums[0]) and a row count; returns the number of elements N the mean
    /// runs over (known on the host; 0 for an empty m, when nothing is written). The loss is
    /// loss(sums[0], N) once the caller reads the sum.
    template <class Compression>
    index_t queue(Compression& f_c, decoder_type& g, view<const T, D, Backend> m, index_t batch, bool with_grad,
                  double* sums) {
        static_assert(Compression::rate == Rate, "mnemo: autoencoding_reconstruction: the compression function's "
                                                 "rate differs from the decoder's");
        static_assert(Compression::features == D, "mnemo: autoencoding_reconstruction: the compression function's "
                                                  "d_model differs from the decoder's");
        // Checked here rather than through Compression::compressed_rows, which builds a std::string
        // for its message on every call (a heap allocation for names past the short-string buffer).
        const index_t mb = m.rows();
        MNEMO_CHECK(batch > 0, "autoencoding_reconstruction: batch must be positive, got ", batch);
        MNEMO_CHECK(mb % (c_ * batch) == 0, "autoencoding_reconstruction: memory has ", mb,
                    " rows, not a multiple of compression rate ", index_t(c_), " x batch ", batch, " = ", c_ * batch);
        if (mb == 0) return 0;
        const index_t cb = mb / c_;
        view<T, D, Backend> cm(cm_.ensure(cb * d_), cb, d_), y(y_.ensure(mb * d_), mb, d_);
        f_c.forward(m, batch, cm);
        g.forward(view<const T, D, Backend>(cm), batch, y);

        // MSE, summed in double in a fixed order; y becomes y − m.
        const index_t n = mb * d_;
        kernels::squared_difference_rows(mb, index_t(d_), y.data(), y.ld(), m.data(), m.ld(), nullptr, y.data(), y.ld(),
                                   sums);
        if (!with_grad) return n;

        const T scale = static_cast<T>(2.0 / double(n));
        kernels::scale(mb, index_t(d_), y.data(), y.ld(), scale, y.data(), y.ld());  // now d loss / d y
        if constexpr (Compression::has_parameters) {
            view<T, D, Backend> dcm(dcm_.ensure(cb * d_), cb, d_);
            g.backward(view<const T, D, Backend>(cm), batch, view<const T, D, Backend>(y), dcm);
            f_c.backward(m, batch, view<const T, D, Backend>(dcm), view<T, D, Backend>());
        } else {
            g.backward(view<const T, D, Backend>(cm), batch, view<const T, D, Backend>(y), view<T, D, Backend>());
        }
        return n;
    }

    /// The loss from queue()'s sum (read on the host) and element count.
    static double loss(double sum, index_t n) { return n > 0 ? sum / double(n) : 0.0; }

private:
    using kernels = checked_ops<Backend>;
    buffer<T, Backend> cm_, y_, dcm_;  // f_c(m) [n·batch, D], g(cm) then its gradient [n·Rate·batch, D], d cm
    buffer<double, Backend> sum_;      // compute()'s sums (the squared differences' sum, the rows)
};

}  // namespace mnemo
