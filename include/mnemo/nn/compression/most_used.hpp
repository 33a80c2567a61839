#pragma once
// most_used_compression, a compression function f_c: R^{n·c × d} → R^{n × d} (c = Rate) of the
// Compressive Transformer (Rae et al., 2019) with the interface of the others (common.hpp), over
// sequence-major memory (row = t·batch + b):
//
//   most_used_compression      keeps, of each group of c consecutive slots of one batch element, the
//                              slot that received the most attention (the paper's "most-used"
//                              compression): out[s, b] = mem[s·c + t*, b] with
//                              t* = argmax_t usage[(s·c + t)·batch + b], ties → the first (oldest) slot,
//                              a NaN usage counts as the least. No parameters. The usage (one value per
//                              memory row, accumulated attention mass, see accumulate_key_usage) is given
//                              by set_usage() before forward; compression_needs_usage<C> says whether a
//                              compression function needs it.
//
// Backward contract (module.hpp): d_mem assigned (skipped for an empty view): the gradient of each
// output row goes to the slot it kept. Forward keeps the chosen slot per output row, in a buffer that
// grows to the largest memory seen; backward must follow a forward over the same memory (the shape is
// checked). The selection kernels and the attention-usage sum are kernels of ops<Backend>
// (kernels/cpu/most_used.hpp for the CPU).
#include <cstdint>
#include <string>
#include <type_traits>

#include "../../core/buffer.hpp"
#include "common.hpp"

namespace mnemo {

/// Keeps the most-attended slot of each window of Rate slots. No parameters; needs set_usage(). D and
/// Rate may be `dynamic` (given at construction).
template <class T, std::size_t D, std::size_t Rate, class Backend = cpu>
class most_used_compression {
    static_assert(expect_compression_rate<Rate>::value);
    using kernels = checked_ops<Backend>;
    using shape = detail::compression_shape;
    [[no_unique_address]] extent_holder<D> d_;
    [[no_unique_address]] extent_holder<Rate> c_;
    using arg_t = std::conditional_t<(Rate <= 256), std::uint8_t, std::uint32_t>;

public:
    static constexpr std::size_t rate = Rate;
    static constexpr std::size_t features = D;
    static constexpr bool has_parameters = false;
    static constexpr bool needs_usage = true;

    /// Declares nothing; `name` is kept for messages.
    most_used_compression(parameter_set<T, Backend>& ps, const std::string& name) requires(D != dynamic && Rate != dynamic)
        : most_used_compression(ps, name, static_cast<index_t>(D), static_cast<index_t>(Rate)) {}
    /// Runtime extents (each must equal the static one where that is fixed).
    most_used_compression(parameter_set<T, Backend>&, const std::string& name, index_t d, index_t rate)
        : d_(d), c_(rate), name_(name), who_(shape::who("most_used_compression", name)) {
        shape::check_extents<D, Rate>(who_, d, rate);
    }

    void reset_parameters(rng&) const {}

    static index_t compressed_rows(index_t mem_rows, index_t batch) requires(Rate != dynamic) {
        return shape::compressed_rows("most_used_compression", mem_rows, batch, static_cast<index_t>(Rate));
    }
    index_t compressed_rows(index_t mem_rows, index_t batch) const requires(Rate == dynamic) {
        return shape::compressed_rows("most_used_compression", mem_rows, batch, c_);
    }
    index_t compression_rate() const { return c_; }

    /// The usage of the memory the next forward compresses: usage[t·batch + b] is the attention mass
    /// memory row t·batch + b received (e.g. summed with accumulate_key_usage); `rows` entries, one per
    /// memory row, in the backend's memory. Copied (into a buffer that grows and is reused); it stays in effect, for every
    /// forward over `rows` memory rows, until the next set_usage or clear_usage.
    void set_usage(const T* usage, index_t rows) {
        MNEMO_CHECK(rows >= 0, who_, ": set_usage with a negative row count ", rows);
        MNEMO_CHECK(rows == 0 || usage != nullptr, who_, ": set_usage with no data for ", rows, " rows");
        T* u = usage_.ensure(rows);
        device_memory<Backend>::copy(u, usage, sizeof(T) * static_cast<std::size_t>(rows));
        usage_rows_ = rows;
    }
    void clear_usage() { usage_rows_ = -1; }
    bool has_usage() const { return usage_rows_ >= 0; }
    /// Memory rows the current usage covers (−1 when none was set).
    index_t usage_rows() const { return usage_rows_; }

    /// out [n·batch, D] = the most-used slot of each window of mem [n·Rate·batch, D]; keeps the choice.
    template <view_of<T> M, view_of<T> O>
    void forward(const M& mem, index_t batch, const O& out) {
        static_assert(check_view<D, M, axis::d_model, Backend>());
        static_assert(check_view<D, O, axis::d_model, Backend>());
        const index_t rows = shape::check_forward(who_, mem, batch, out, "out", d_, c_);
        MNEMO_CHECK(usage_rows_ >= 0, who_, ": no usage was set: call set_usage(usage, ", mem.rows(),
                    ") with the attention mass of each memory row before forward");
        MNEMO_CHECK(usage_rows_ == mem.rows(), who_, ": the usage was set for ", usage_rows_,
                    " memory rows but forward got ", mem.rows(), " memory rows");
        kernels::template most_used_forward<Rate>(rows, batch, d_, usage_.data(), mem.data(), mem.ld(), out.data(),
                                             out.ld(), arg_.ensure(rows), c_);
        saved_rows_ = mem.rows();
        saved_batch_ = batch;
    }

    /// d_mem = d_out at each window's chosen slot, 0 elsewhere (assigned; skipped when d_mem has no
    /// data). Reads the choice kept by the last forward, which must have been over this mem.
    template <view_of<T> M, view_of<T> DO, view_of<T> DM>
    void backward(const M& mem, index_t batch, const DO& d_out, const DM& d_mem) {
        static_assert(check_view<D, M, axis::d_model, Backend>());
        static_assert(check_view<D, DO, axis::d_model, Backend>());
        static_assert(check_view<D, DM, axis::d_model, Backend>());
        const index_t rows = shape::check_backward(who_, mem, batch, d_out, d_mem, d_, c_);
        shape::check_saved(who_, mem.rows(), batch, saved_rows_, saved_batch_);
        if (d_mem.data())
            kernels::template most_used_backward<Rate>(rows, batch, d_, d_out.data(), d_out.ld(), arg_.data(),
                                                  d_mem.data(), d_mem.ld(), c_);
    }

    const std::string& name() const { return name_; }

private:
    std::string name_, who_;
    buffer<T, Backend> usage_;      // [usage_rows_], copied by set_usage
    buffer<arg_t, Backend> arg_;    // [n·batch]: window position chosen per output row, kept by forward
    index_t usage_rows_ = -1;
    index_t saved_rows_ = -1, saved_batch_ = 0;
};

}  // namespace mnemo
