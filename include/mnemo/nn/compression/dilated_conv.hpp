#pragma once
// A compression function f_c: R^{n·c × d} → R^{n × d} of the Compressive Transformer (Rae et al.,
// 2019), c = Rate, with the interface of the others (common.hpp), so it drops into
// compressive_transformer<T, Config, X>. Memory is sequence-major, row = t·batch + b, features D.
//
//   dilated_conv_compression   the paper's "stack of dilated convolutions reducing by c": log2(c)
//                              layers, each torch.nn.Conv1d(D, D, kernel_size=2, stride=2) over time,
//                              with a ReLU between consecutive layers (none after the last):
//                                h_0 = mem,  h_{k+1}[s] = W_k[:, :, 0]·h_k[2s] + W_k[:, :, 1]·h_k[2s+1] + b_k,
//                                h_{k+1} ← relu(h_{k+1}) for k + 1 < log2(c),  out = h_{log2 c}.
//                              Layer k's kernel taps are 2^k original slots apart (effective dilation
//                              2^k), and output slot s reads exactly the slots s·c … s·c + c − 1.
//                              Rate must be a power of two ≥ 2 (static_assert).
//                              As PyTorch: nn.Sequential(Conv1d, ReLU, Conv1d, …) applied to
//                              mem.permute(1, 2, 0) [batch, D, len], the result permuted (2, 0, 1).
//                              Parameters `<name>.convs.<k>.weight` [D, D, 2] (PyTorch [out, in, kernel])
//                              and `<name>.convs.<k>.bias` [D], k = 0 … log2(c) − 1 (0 reads the memory).
//
// Each dilated layer is one GEMM over the im2col gather of conv.hpp with rate 2
// (the kernel im2col_time<2>): X_k [rows_k, 2D] with column i·2 + t, which is W_k's own
// memory order, so W_k [D, 2D] is used as stored:
//   y_k = X_k·W_kᵀ + b_k     dW_k += dy_kᵀ·X_k     db_k += Σ_rows dy_k     dX_k = dy_k·W_k, scattered back
// (col2im_time<2>; kernel = stride, so the scatter assigns), then through the ReLU of the layer below.
//
// Backward contract (module.hpp): parameter gradients +=, d_mem assigned (skipped for an empty view).
// Forward keeps every X_k and every hidden h_k for backward, in buffers that grow to the largest memory
// seen and are reused, so steady-state calls do not allocate. Backward must follow a forward over the
// same memory (the shape is checked).
#include <array>
#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

#include "../../core/buffer.hpp"
#include "../../core/rng.hpp"
#include "common.hpp"

namespace mnemo {

namespace detail {
/// log2(n) for n a power of two: the number of layers of dilated_conv_compression.
constexpr std::size_t dilated_layer_count(std::size_t n) {
    std::size_t l = 0;
    while (n > 1) {
        n >>= 1;
        ++l;
    }
    return l;
}
}  // namespace detail

/// A stack of log2(Rate) Conv1d(D, D, kernel_size=2, stride=2) over the time axis, ReLU between layers.
/// D and Rate may be `dynamic` (a runtime-shape model): given at construction, the rate checked then.
template <class T, std::size_t D, std::size_t Rate, class Backend = cpu>
class dilated_conv_compression {
    static_assert(Rate == dynamic || (Rate >= 2 && (Rate & (Rate - 1)) == 0),
                  "mnemo: dilated_conv_compression needs a compression rate that is a power of two >= 2 (it is a "
                  "stack of log2(Rate) convolutions of kernel 2 and stride 2)");
    using kernels = checked_ops<Backend>;
    using shape = detail::compression_shape;
    [[no_unique_address]] extent_holder<D> d_;
    [[no_unique_address]] extent_holder<Rate> c_;
    [[no_unique_address]] extent_holder<D == dynamic ? dynamic : 2 * D> k_;  // columns of X_k, and of W_k as [D, 2D]
    // Layer count, log2(Rate): a constant for a static rate.
    [[no_unique_address]] extent_holder<Rate == dynamic ? dynamic : detail::dilated_layer_count(Rate)> n_layers_;
    // Parameters per layer: a fixed array for a static rate, a vector for a runtime one.
    using param_list = std::conditional_t<Rate == dynamic, std::vector<param<T, Backend>>,
                                          std::array<param<T, Backend>, Rate == dynamic ? 1 : detail::dilated_layer_count(Rate)>>;

public:
    static constexpr std::size_t rate = Rate;
    static constexpr std::size_t features = D;
    static constexpr bool has_parameters = true;
    static constexpr bool needs_usage = false;
    /// Number of stacked convolutions, log2(Rate) (`dynamic` for a runtime rate: see n_layers()).
    static constexpr std::size_t layers = Rate == dynamic ? dynamic : detail::dilated_layer_count(Rate);

    /// Declares `<name>.convs.<k>.weight` [D, D, 2] and `<name>.convs.<k>.bias` [D] for k = 0 … layers − 1.
    dilated_conv_compression(parameter_set<T, Backend>& ps, const std::string& name) requires(D != dynamic && Rate != dynamic)
        : dilated_conv_compression(ps, name, static_cast<index_t>(D), static_cast<index_t>(Rate)) {}
    /// Runtime extents (each must equal the static one where that is fixed; the rate a power of two >= 2).
    dilated_conv_compression(parameter_set<T, Backend>& ps, const std::string& name, index_t d, index_t rate)
        : d_(d), c_(rate), k_(2 * d), n_layers_(index_t(detail::dilated_layer_count(std::size_t(rate > 0 ? rate : 1)))),
          name_(name), who_(shape::who("dilated_conv_compression", name)) {
        shape::check_extents<D, Rate>(who_, d, rate);
        MNEMO_CHECK(rate >= 2 && (rate & (rate - 1)) == 0, who_, ": the compression rate must be a power of two >= 2 "
                    "(a stack of log2(rate) convolutions of kernel 2 and stride 2), got ", rate);
        if constexpr (Rate == dynamic) {
            weight_.resize(std::size_t(n_layers_));
            bias_.resize(std::size_t(n_layers_));
        }
        for (index_t k = 0; k < n_layers_; ++k) {
            const std::string p = name + ".convs." + std::to_string(k);
            weight_[std::size_t(k)] = ps.declare(p + ".weight", {d_, d_, 2});
            bias_[std::size_t(k)] = ps.declare(p + ".bias", {d_});
        }
    }

    /// log2(rate): the number of stacked convolutions.
    index_t n_layers() const { return n_layers_; }
    index_t compression_rate() const { return c_; }

    /// PyTorch's Conv1d default per layer: W, b ~ U(−1/√(2D), 1/√(2D)) (fan_in = in_channels · kernel).
    void reset_parameters(rng& r) const {
        const double bound = 1.0 / std::sqrt(static_cast<double>(k_));
        for (index_t k = 0; k < n_layers_; ++k) {
            const param<T, Backend>& w = weight_[std::size_t(k)];
            const param<T, Backend>& b = bias_[std::size_t(k)];
            w.generate([&] { return r.uniform(-bound, bound); });
            b.generate([&] { return r.uniform(-bound, bound); });
        }
    }

    /// Rows of the compressed memory for `mem_rows` memory rows (checked: a multiple of Rate·batch).
    static index_t compressed_rows(index_t mem_rows, index_t batch) requires(Rate != dynamic) {
        return shape::compressed_rows("dilated_conv_compression", mem_rows, batch, static_cast<index_t>(Rate));
    }
    index_t compressed_rows(index_t mem_rows, index_t batch) const requires(Rate == dynamic) {
        return shape::compressed_rows("dilated_conv_compression", mem_rows, batch, c_);
    }

    /// out [n·batch, D] = f_c(mem [n·Rate·batch, D]); keeps every X_k and hidden h_k for backward.
    template <view_of<T> M, view_of<T> O>
    void forward(const M& mem, index_t batch, const O& out) {
        static_assert(check_view<D, M, axis::d_model, Backend>());
        static_assert(check_view<D, O, axis::d_model, Backend>());
        shape::check_forward(who_, mem, batch, out, "out", d_, c_);
        const index_t mem_rows = mem.rows();
        // X_k [mem_rows / 2^(k+1), 2D] holds mem_rows·D / 2^k elements; h_(k+1) [mem_rows / 2^(k+1), D].
        T* x = x_.ensure(x_total(mem_rows));
        T* h = h_.ensure(h_total(mem_rows));
        const T* in = mem.data();
        index_t ld_in = mem.ld(), rows_in = mem_rows;
        for (index_t k = 0; k < n_layers_; ++k) {
            const index_t rows = rows_in / 2;
            T* xk = x + x_offset(mem_rows, k);
            kernels::template im2col_time<2>(rows, batch, d_, in, ld_in, xk);
            const bool last = k + 1 == n_layers_;
            T* y = last ? out.data() : h + h_offset(mem_rows, k + 1);
            const index_t ldy = last ? out.ld() : index_t(d_);
            kernels::linear_forward(rows, k_, d_, xk, k_, weight_[std::size_t(k)].value(), bias_[std::size_t(k)].value(), y, ldy);
            if (!last) kernels::relu_forward(rows * d_, y, y);  // dense: ldy = D
            in = y;
            ld_in = ldy;
            rows_in = rows;
        }
        saved_rows_ = mem_rows;
        saved_batch_ = batch;
    }

    /// dW_k += …, db_k += … for every layer; d_mem = ∂/∂mem (assigned; skipped when d_mem has no data).
    /// Reads what the last forward kept, which must have been over this mem.
    template <view_of<T> M, view_of<T> DO, view_of<T> DM>
    void backward(const M& mem, index_t batch, const DO& d_out, const DM& d_mem) {
        static_assert(check_view<D, M, axis::d_model, Backend>());
        static_assert(check_view<D, DO, axis::d_model, Backend>());
        static_assert(check_view<D, DM, axis::d_model, Backend>());
        shape::check_backward(who_, mem, batch, d_out, d_mem, d_, c_);
        shape::check_saved(who_, mem.rows(), batch, saved_rows_, saved_batch_);
        const index_t mem_rows = mem.rows();
        const bool want_dmem = d_mem.data() != nullptr;
        T* dx = (n_layers_ > 1 || want_dmem) ? dx_.ensure(mem_rows * d_) : nullptr;  // dX_k, largest at k = 0
        T* dh = n_layers_ > 1 ? dh_.ensure(mem_rows / 2 * d_) : nullptr;             // dh_k, largest at k = 1
        const T* x = x_.data();
        const T* h = h_.data();
        const T* g = d_out.data();  // gradient of layer k's output (pre-activation)
        index_t ldg = d_out.ld();
        for (index_t k = n_layers_ - 1; k >= 0; --k) {
            const index_t rows = mem_rows >> (k + 1);
            const T* xk = x + x_offset(mem_rows, k);
            const param<T, Backend>& w = weight_[std::size_t(k)];
            kernels::gemm_tn(d_, k_, rows, g, ldg, xk, k_, w.grad(), k_, T(1));
            kernels::sum_rows_accumulate(rows, d_, g, ldg, bias_[std::size_t(k)].grad());
            if (k == 0 && !want_dmem) break;
            kernels::gemm_nn(rows, k_, d_, g, ldg, w.value(), k_, dx, k_);
            if (k == 0) {
                kernels::template col2im_time<2>(rows, batch, d_, dx, d_mem.data(), d_mem.ld());
            } else {
                // d h_k, then through the ReLU that made h_k (relu'(y) = [relu(y) > 0]); g was read above.
                kernels::template col2im_time<2>(rows, batch, d_, dx, dh, d_);
                kernels::relu_backward(2 * rows * d_, h + h_offset(mem_rows, k), dh, dh);
                g = dh;
                ldg = d_;
            }
        }
    }

    const std::string& name() const { return name_; }
    /// Layer k's weight [D, D, 2] and bias [D], k < layers.
    const param<T, Backend>& weight(index_t k) const { return weight_[std::size_t(checked_layer(k))]; }
    const param<T, Backend>& bias(index_t k) const { return bias_[std::size_t(checked_layer(k))]; }

private:
    index_t checked_layer(index_t k) const {
        MNEMO_CHECK(k >= 0 && k < n_layers_, who_, ": layer ", k, " out of range [0, ", index_t(n_layers_), ")");
        return k;
    }
    // X_k starts after X_0 … X_(k−1), of mem_rows·D / 2^j elements each.
    index_t x_offset(index_t mem_rows, index_t k) const {
        index_t off = 0;
        for (index_t j = 0; j < k; ++j) off += (mem_rows >> (j + 1)) * k_;
        return off;
    }
    index_t x_total(index_t mem_rows) const { return x_offset(mem_rows, n_layers_); }
    // h_k (k = 1 … layers − 1, the hidden outputs) starts after h_1 … h_(k−1) of mem_rows / 2^j rows each.
    index_t h_offset(index_t mem_rows, index_t k) const {
        index_t off = 0;
        for (index_t j = 1; j < k; ++j) off += (mem_rows >> j) * d_;
        return off;
    }
    index_t h_total(index_t mem_rows) const { return h_offset(mem_rows, n_layers_); }

    std::string name_, who_;
    param_list weight_;  // [D, D, 2] each, read as [D, 2D] with column i·2 + t
    param_list bias_;    // [D] each
    buffer<T, Backend> x_;        // X_0 … X_(L−1), kept by forward
    buffer<T, Backend> h_;        // h_1 … h_(L−1) (after ReLU), kept by forward
    buffer<T, Backend> dx_, dh_;  // backward scratch
    index_t saved_rows_ = -1, saved_batch_ = 0;
};

}  // namespace mnemo
