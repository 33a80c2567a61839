#pragma once
// conv_compression, the Compressive Transformer's (Rae et al., 2019, "Compressive Transformers for
// Long-Range Sequence Modelling") and labml's compression function f_c: R^{n·c × d} → R^{n × d}: the
// oldest n·c memory slots become n compressed slots, c = Rate. Memory is sequence-major, row =
// t·batch + b, features D; slot s of the output reads the Rate consecutive memory slots
// s·c … s·c + c − 1 of the same batch element:
//
//   out[s,b,o] = bias[o] + Σ_{i,t} W[o,i,t] · mem[s·c + t, b, i]
//
// torch.nn.Conv1d(D, D, kernel_size=c, stride=c) over time, as labml's Conv1dCompression
// (mem.permute(1, 2, 0) → conv → permute(2, 0, 1)). Parameters `<name>.conv.weight` [D, D, c]
// (PyTorch [out, in, kernel]) and `<name>.conv.bias` [D].
//
// The convolution is one GEMM over an im2col gather X [n·batch, D·c] whose column i·c + t holds
// mem[s·c + t, b, i]: that is W's own memory order, so W [D, D·c] is used as stored:
//   out = X·Wᵀ + b        dW += d_outᵀ·X        db += Σ_rows d_out        dX = d_out·W, scattered back.
// Kernel = stride means each memory slot feeds exactly one output slot, so the scatter assigns.
//
// Backward contract (module.hpp): parameter gradients +=, d_mem assigned (skipped for an empty view).
// Forward keeps X for backward, in a buffer that grows to the largest memory seen and is reused, so
// steady-state calls do not allocate; backward must follow a forward over the same memory (the shape
// is checked). The time-axis gather and scatter are kernels of ops<Backend> (kernels/cpu/compression.hpp
// for the CPU), as are the GEMMs.
#include <cmath>
#include <cstdint>
#include <string>

#include "../../core/buffer.hpp"
#include "../../core/config.hpp"
#include "../../core/rng.hpp"
#include "common.hpp"

namespace mnemo {

/// Conv1d(D, D, kernel_size=Rate, stride=Rate) over the time axis, with bias. D and Rate may be
/// `dynamic` (a runtime-shape model): they are then given at construction.
template <class T, std::size_t D, std::size_t Rate, class Backend = cpu>
class conv_compression {
    using kernels = checked_ops<Backend>;
    using shape = detail::compression_shape;
    static_assert(expect_compression_rate<Rate>::value);
    [[no_unique_address]] extent_holder<D> d_;
    [[no_unique_address]] extent_holder<Rate> c_;
    index_t k() const { return d_ * c_; }  // columns of X, and of W as [D, D·Rate]

public:
    static constexpr std::size_t rate = Rate;
    static constexpr std::size_t features = D;
    static constexpr bool has_parameters = true;

    /// Declares `<name>.conv.weight` [D, D, Rate] and `<name>.conv.bias` [D].
    conv_compression(parameter_set<T, Backend>& ps, const std::string& name) requires(D != dynamic && Rate != dynamic)
        : conv_compression(ps, name, static_cast<index_t>(D), static_cast<index_t>(Rate)) {}
    /// Runtime extents (each must equal the static one where that is fixed).
    conv_compression(parameter_set<T, Backend>& ps, const std::string& name, index_t d, index_t rate)
        : d_(d), c_(rate), name_(name), who_(shape::who("conv_compression", name)) {
        shape::check_extents<D, Rate>(who_, d, rate);
        weight_ = ps.declare(name + ".conv.weight", {d_, d_, c_});
        bias_ = ps.declare(name + ".conv.bias", {d_});
    }

    /// PyTorch's Conv1d default: W, b ~ U(−1/√(D·Rate), 1/√(D·Rate)) (fan_in = in_channels · kernel).
    void reset_parameters(rng& r) const {
        const double bound = 1.0 / std::sqrt(static_cast<double>(k()));
        weight_.generate([&] { return r.uniform(-bound, bound); });
        bias_.generate([&] { return r.uniform(-bound, bound); });
    }

    /// Rows of the compressed memory for `mem_rows` memory rows (checked: a multiple of Rate·batch).
    static index_t compressed_rows(index_t mem_rows, index_t batch) requires(Rate != dynamic) {
        return shape::compressed_rows("conv_compression", mem_rows, batch, static_cast<index_t>(Rate));
    }
    index_t compressed_rows(index_t mem_rows, index_t batch) const requires(Rate == dynamic) {
        return shape::compressed_rows("conv_compression", mem_rows, batch, c_);
    }
    index_t compression_rate() const { return c_; }

    /// out [n·batch, D] = f_c(mem [n·Rate·batch, D]); keeps X for backward.
    template <view_of<T> M, view_of<T> O>
    void forward(const M& mem, index_t batch, const O& out) {
        static_assert(check_view<D, M, axis::d_model, Backend>());
        static_assert(check_view<D, O, axis::d_model, Backend>());
        const index_t rows = shape::check_forward(who_, mem, batch, out, "out", d_, c_);
        const index_t k_ = k();
        T* x = x_.ensure(rows * k_);  // X [n·batch, D·Rate]
        kernels::template im2col_time<Rate>(rows, batch, d_, mem.data(), mem.ld(), x, c_);
        kernels::linear_forward(rows, k_, d_, x, k_, weight_.value(), bias_.value(), out.data(), out.ld());
        saved_rows_ = mem.rows();
        saved_batch_ = batch;
    }

    /// dW += d_outᵀ·X, db += Σ d_out; d_mem = ∂/∂mem (assigned; skipped when d_mem has no data).
    /// Reads the X kept by the last forward, which must have been over this mem.
    template <view_of<T> M, view_of<T> DO, view_of<T> DM>
    void backward(const M& mem, index_t batch, const DO& d_out, const DM& d_mem) {
        static_assert(check_view<D, M, axis::d_model, Backend>());
        static_assert(check_view<D, DO, axis::d_model, Backend>());
        static_assert(check_view<D, DM, axis::d_model, Backend>());
        const index_t rows = shape::check_backward(who_, mem, batch, d_out, d_mem, d_, c_);
        shape::check_saved(who_, mem.rows(), batch, saved_rows_, saved_batch_);
        const index_t k_ = k();
        const T* x = x_.data();  // X [n·batch, D·Rate]
        kernels::gemm_tn(d_, k_, rows, d_out.data(), d_out.ld(), x, k_, weight_.grad(), k_, T(1));
        kernels::sum_rows_accumulate(rows, d_, d_out.data(), d_out.ld(), bias_.grad());
        if (d_mem.data()) {
            T* dx = dx_.ensure(rows * k_);  // dX [n·batch, D·Rate]
            kernels::gemm_nn(rows, k_, d_, d_out.data(), d_out.ld(), weight_.value(), k_, dx, k_);
            kernels::template col2im_time<Rate>(rows, batch, d_, dx, d_mem.data(), d_mem.ld(), c_);
        }
    }

    const std::string& name() const { return name_; }
    const param<T, Backend>& weight() const { return weight_; }
    const param<T, Backend>& bias() const { return bias_; }

private:
    std::string name_, who_;
    param<T, Backend> weight_;  // [D, D, Rate], read as [D, D·Rate] with column i·Rate + t
    param<T, Backend> bias_;    // [D]
    buffer<T, Backend> x_;      // X  [n·batch, D·Rate], kept by forward
    buffer<T, Backend> dx_;     // dX [n·batch, D·Rate], backward scratch
    index_t saved_rows_ = -1, saved_batch_ = 0;
};

}  // namespace mnemo
