#pragma once
// The pooling compression functions f_c: R^{n·c × d} → R^{n × d} (c = Rate) of the Compressive
// Transformer (Rae et al., 2019), over sequence-major memory (row = t·batch + b), slot s of the output
// reading the Rate consecutive memory slots s·c … s·c + c − 1 of the same batch element:
//
//   max_pool_compression   out[s,b,i] = max_t mem[s·c + t, b, i]        (F.max_pool1d, kernel = stride = c)
//   mean_pool_compression  out[s,b,i] = (Σ_t mem[s·c + t, b, i]) / c    (F.avg_pool1d, kernel = stride = c)
//
// Max pooling routes the gradient to the FIRST maximum of each window (PyTorch's CPU kernel: strict
// `>`, and a NaN is taken as the maximum); mean pooling spreads d_out / c over the window.
// Backward contract (module.hpp): d_mem assigned (skipped for an empty view). Max pooling's forward
// keeps the argmax per output element for backward, in a buffer that grows to the largest memory seen;
// its backward must follow a forward over the same memory (the shape is checked). The poolings are
// kernels of ops<Backend> (kernels/cpu/compression.hpp for the CPU).
#include <cstdint>
#include <string>

#include "../../core/buffer.hpp"
#include "../../core/config.hpp"
#include "common.hpp"

namespace mnemo {

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
    buffer<arg_t, Backend> arg_;  // [n·batch, D]: window position of each output's maximum, kept by forward
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
