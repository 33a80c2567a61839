#pragma once
// Compression functions f_c: R^{n·c × d} → R^{n × d} of the Compressive Transformer (Rae et al., 2019,
// "Compressive Transformers for Long-Range Sequence Modelling"): the oldest n·c memory slots
// become n compressed slots, c = Rate. Memory is sequence-major, row = t·batch + b, features D; slot s
// of the output reads the Rate consecutive memory slots s·c … s·c + c − 1 of the same batch element:
//
//   conv_compression       out[s,b,o] = bias[o] + Σ_{i,t} W[o,i,t] · mem[s·c + t, b, i]
//                          torch.nn.Conv1d(D, D, kernel_size=c, stride=c) over time, as labml's
//                          Conv1dCompression (mem.permute(1, 2, 0) → conv → permute(2, 0, 1)).
//                          `<name>.conv.weight` [D, D, c] (PyTorch [out, in, kernel]), `<name>.conv.bias` [D].
//   max_pool_compression   out[s,b,i] = max_t mem[s·c + t, b, i]        (F.max_pool1d, kernel = stride = c)
//   mean_pool_compression  out[s,b,i] = (Σ_t mem[s·c + t, b, i]) / c    (F.avg_pool1d, kernel = stride = c)
//
// The convolution is one GEMM over an im2col gather X [n·batch, D·c] whose column i·c + t holds
// mem[s·c + t, b, i]: that is W's own memory order, so W [D, D·c] is used as stored:
//   out = X·Wᵀ + b        dW += d_outᵀ·X        db += Σ_rows d_out        dX = d_out·W, scattered back.
// Kernel = stride means each memory slot feeds exactly one output slot, so the scatter assigns.
// Max pooling routes the gradient to the FIRST maximum of each window (PyTorch's CPU kernel: strict
// `>`, and a NaN is taken as the maximum); mean pooling spreads d_out / c over the window.
//
// Backward contract (module.hpp): parameter gradients +=, d_mem assigned (skipped for an empty view).
// Forward keeps what backward reads (conv: X; max: the argmax per output element; mean: nothing), in
// buffers that grow to the largest memory seen and are reused, so steady-state calls do not allocate.
// conv and max backward must follow a forward over the same memory (the shape is checked).
//
// The time-axis gathers and poolings are kernels of ops<Backend> (kernels/cpu/compression.hpp for the
// CPU), as are the GEMMs.
#include <cmath>
#include <cstdint>
#include <string>
#include <string_view>
#include <type_traits>

#include "../core/buffer.hpp"
#include "../core/config.hpp"
#include "../core/rng.hpp"
#include "module.hpp"

namespace mnemo {

namespace detail {

/// The shape rules every compression function shares. `who` names the module in messages, e.g.
/// "conv_compression 'transformer.layers.0.compress'"; `rate` is the compression rate c.
struct compression_shape {
    static std::string who(const char* kind, const std::string& name) { return std::string(kind) + " '" + name + "'"; }

    /// Memory rows → compressed rows, after checking batch > 0 and rows a multiple of rate·batch.
    static index_t compressed_rows(std::string_view who, index_t mem_rows, index_t batch, index_t rate) {
        MNEMO_CHECK(batch > 0, who, ": batch must be positive, got ", batch);
        const index_t window = rate * batch;
        MNEMO_CHECK(mem_rows >= 0 && mem_rows % window == 0, who, ": memory has ", mem_rows,
                    " rows, not a multiple of compression rate ", rate, " x batch ", batch, " = ", window);
        return mem_rows / rate;
    }

    /// mem [n·rate·batch, d] and out [n·batch, d]; returns n·batch.
    template <class M, class O>
    static index_t check_forward(const std::string& who, const M& mem, index_t batch, const O& out,
                                 const char* out_name, index_t d, index_t rate) {
        check_cols(mem, d, who.c_str(), "mem");
        check_cols(out, d, who.c_str(), out_name);
        const index_t rows = compressed_rows(who, mem.rows(), batch, rate);
        MNEMO_CHECK(out.rows() == rows, who, ": ", out_name, " has ", out.rows(), " rows, expected memory rows ",
                    mem.rows(), " / compression rate ", rate, " = ", rows);
        return rows;
    }

    /// As check_forward for (mem, d_out), and d_mem [n·rate·batch, d] when it has data; returns n·batch.
    template <class M, class DO, class DM>
    static index_t check_backward(const std::string& who, const M& mem, index_t batch, const DO& d_out,
                                  const DM& d_mem, index_t d, index_t rate) {
        const index_t rows = check_forward(who, mem, batch, d_out, "d_out", d, rate);
        if (d_mem.data()) {
            check_cols(d_mem, d, who.c_str(), "d_mem");
            MNEMO_CHECK(d_mem.rows() == mem.rows(), who, ": d_mem has ", d_mem.rows(), " rows but mem has ",
                        mem.rows());
        }
        return rows;
    }

    /// Backward reads what the last forward kept: it must have been over memory of this shape.
    static void check_saved(const std::string& who, index_t mem_rows, index_t batch, index_t saved_rows,
                            index_t saved_batch) {
        if (mem_rows == saved_rows && batch == saved_batch) return;
        if (saved_rows < 0) detail::fail(who, ": backward called before forward");
        detail::fail(who, ": backward over ", mem_rows, " memory rows with batch ", batch,
                     " but the last forward saw ", saved_rows, " rows with batch ", saved_batch);
    }

    /// The extents a compression function is built with: D and Rate where static (checked), else given.
    template <std::size_t D, std::size_t Rate>
    static void check_extents(const std::string& who, index_t d, index_t rate) {
        check_extent<D>(d, who.c_str(), "d_model");
        check_extent<Rate>(rate, who.c_str(), "compression rate");
    }
};

}  // namespace detail

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
        kernels::gemm_nt(rows, d_, k_, x, k_, weight_.value(), k_, out.data(), out.ld());
        kernels::add_bias_rows(rows, d_, bias_.value(), out.data(), out.ld());
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

/// Max over each window of Rate slots (F.max_pool1d, kernel = stride = Rate). No parameters. D and
/// Rate may be `dynamic` (given at construction).
template <class T, std::size_t D, std::size_t Rate, class Backend = cpu>
class max_pool_compression {
    using kernels = checked_ops<Backend>;
    using shape = detail::compression_shape;
    static_assert(expect_compression_rate<Rate>::value);
    [[no_unique_address]] extent_holder<D> d_;
    [[no_unique_address]] extent_holder<Rate> c_;
    // The position of the maximum within its window, in the smallest type that holds Rate − 1 (a
    // runtime rate: 32 bits).
    using arg_t = std::conditional_t<(Rate <= 256), std::uint8_t, std::uint32_t>;

public:
    static constexpr std::size_t rate = Rate;
    static constexpr std::size_t features = D;
    static constexpr bool has_parameters = false;

    /// Declares nothing; `name` is kept for messages.
    max_pool_compression(parameter_set<T, Backend>& ps, const std::string& name) requires(D != dynamic && Rate != dynamic)
        : max_pool_compression(ps, name, static_cast<index_t>(D), static_cast<index_t>(Rate)) {}
    /// Runtime extents (each must equal the static one where that is fixed).
    max_pool_compression(parameter_set<T, Backend>&, const std::string& name, index_t d, index_t rate)
        : d_(d), c_(rate), name_(name), who_(shape::who("max_pool_compression", name)) {
        shape::check_extents<D, Rate>(who_, d, rate);
    }

    void reset_parameters(rng&) const {}

    static index_t compressed_rows(index_t mem_rows, index_t batch) requires(Rate != dynamic) {
        return shape::compressed_rows("max_pool_compression", mem_rows, batch, static_cast<index_t>(Rate));
    }
    index_t compressed_rows(index_t mem_rows, index_t batch) const requires(Rate == dynamic) {
        return shape::compressed_rows("max_pool_compression", mem_rows, batch, c_);
    }
    index_t compression_rate() const { return c_; }

    /// out [n·batch, D] = max over each window of mem [n·Rate·batch, D]; keeps the argmax for backward.
    template <view_of<T> M, view_of<T> O>
    void forward(const M& mem, index_t batch, const O& out) {
        static_assert(check_view<D, M, axis::d_model, Backend>());
        static_assert(check_view<D, O, axis::d_model, Backend>());
        const index_t rows = shape::check_forward(who_, mem, batch, out, "out", d_, c_);
        kernels::template max_pool_time_forward<Rate>(rows, batch, d_, mem.data(), mem.ld(), out.data(), out.ld(),
                                                arg_.ensure(rows * d_), c_);
        saved_rows_ = mem.rows();
        saved_batch_ = batch;
    }

    /// d_mem = d_out at each window's first maximum, 0 elsewhere (assigned; skipped when d_mem has
    /// no data). Reads the argmax kept by the last forward, which must have been over this mem.
    template <view_of<T> M, view_of<T> DO, view_of<T> DM>
    void backward(const M& mem, index_t batch, const DO& d_out, const DM& d_mem) {
        static_assert(check_view<D, M, axis::d_model, Backend>());
        static_assert(check_view<D, DO, axis::d_model, Backend>());
        static_assert(check_view<D, DM, axis::d_model, Backend>());
        const index_t rows = shape::check_backward(who_, mem, batch, d_out, d_mem, d_, c_);
        shape::check_saved(who_, mem.rows(), batch, saved_rows_, saved_batch_);
        if (d_mem.data())
            kernels::template max_pool_time_backward<Rate>(rows, batch, d_, d_out.data(), d_out.ld(), arg_.data(),
                                                     d_mem.data(), d_mem.ld(), c_);
    }

    const std::string& name() const { return name_; }

private:
    std::string name_, who_;
    buffer<arg_t> arg_;  // [n·batch, D]: window position of each output's maximum, kept by forward
    index_t saved_rows_ = -1, saved_batch_ = 0;
};

/// Mean over each window of Rate slots (F.avg_pool1d, kernel = stride = Rate). No parameters and no
/// saved state: backward needs only the shapes. D and Rate may be `dynamic` (given at construction).
template <class T, std::size_t D, std::size_t Rate, class Backend = cpu>
class mean_pool_compression {
    using kernels = checked_ops<Backend>;
    using shape = detail::compression_shape;
    static_assert(expect_compression_rate<Rate>::value);
    [[no_unique_address]] extent_holder<D> d_;
    [[no_unique_address]] extent_holder<Rate> c_;

public:
    static constexpr std::size_t rate = Rate;
    static constexpr std::size_t features = D;
    static constexpr bool has_parameters = false;

    /// Declares nothing; `name` is kept for messages.
    mean_pool_compression(parameter_set<T, Backend>& ps, const std::string& name) requires(D != dynamic && Rate != dynamic)
        : mean_pool_compression(ps, name, static_cast<index_t>(D), static_cast<index_t>(Rate)) {}
    /// Runtime extents (each must equal the static one where that is fixed).
    mean_pool_compression(parameter_set<T, Backend>&, const std::string& name, index_t d, index_t rate)
        : d_(d), c_(rate), name_(name), who_(shape::who("mean_pool_compression", name)) {
        shape::check_extents<D, Rate>(who_, d, rate);
    }

    void reset_parameters(rng&) const {}

    static index_t compressed_rows(index_t mem_rows, index_t batch) requires(Rate != dynamic) {
        return shape::compressed_rows("mean_pool_compression", mem_rows, batch, static_cast<index_t>(Rate));
    }
    index_t compressed_rows(index_t mem_rows, index_t batch) const requires(Rate == dynamic) {
        return shape::compressed_rows("mean_pool_compression", mem_rows, batch, c_);
    }
    index_t compression_rate() const { return c_; }

    /// out [n·batch, D] = mean over each window of mem [n·Rate·batch, D].
    template <view_of<T> M, view_of<T> O>
    void forward(const M& mem, index_t batch, const O& out) const {
        static_assert(check_view<D, M, axis::d_model, Backend>());
        static_assert(check_view<D, O, axis::d_model, Backend>());
        const index_t rows = shape::check_forward(who_, mem, batch, out, "out", d_, c_);
        kernels::template mean_pool_time_forward<Rate>(rows, batch, d_, mem.data(), mem.ld(), out.data(), out.ld(), c_);
    }

    /// d_mem = d_out / Rate over each window (assigned; skipped when d_mem has no data).
    template <view_of<T> M, view_of<T> DO, view_of<T> DM>
    void backward(const M& mem, index_t batch, const DO& d_out, const DM& d_mem) const {
        static_assert(check_view<D, M, axis::d_model, Backend>());
        static_assert(check_view<D, DO, axis::d_model, Backend>());
        static_assert(check_view<D, DM, axis::d_model, Backend>());
        const index_t rows = shape::check_backward(who_, mem, batch, d_out, d_mem, d_, c_);
        if (d_mem.data())
            kernels::template mean_pool_time_backward<Rate>(rows, batch, d_, d_out.data(), d_out.ld(), d_mem.data(),
                                                      d_mem.ld(), c_);
    }

    const std::string& name() const { return name_; }

private:
    std::string name_, who_;
};

}  // namespace mnemo
