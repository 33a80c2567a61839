#pragma once
// no_compression: the compression function of a model that never compresses (Transformer-XL, i.e.
// a compressive_transformer used with c_mem_len = 0). It has no parameters, so checkpoints of such a
// model hold no `compress.*` tensors, as the reference's Transformer-XL; calling it is an error.
#include <string>

#include "common.hpp"

namespace mnemo {

template <class T, std::size_t D, std::size_t Rate, class Backend = cpu>
class no_compression {
public:
    static constexpr std::size_t rate = Rate;
    static constexpr bool has_parameters = false;

    no_compression(parameter_set<T, Backend>&, const std::string& name) : name_(name) {}
    /// The constructor of the other compression functions (extents unused; D and Rate may be `dynamic`).
    no_compression(parameter_set<T, Backend>&, const std::string& name, index_t, index_t rate)
        : name_(name), rate_(rate > 0 ? rate : 1) {}
    void reset_parameters(rng&) const {}

    static index_t compressed_rows(index_t mem_rows, index_t) requires(Rate != dynamic) {
        return mem_rows / index_t(Rate);
    }
    index_t compressed_rows(index_t mem_rows, index_t) const requires(Rate == dynamic) { return mem_rows / rate_; }

    template <view_of<T> M, view_of<T> O>
    void forward(const M&, index_t, const O&) {
        detail::fail("no_compression '", name_, "': this model has no compression function; use c_mem_len = 0 "
                     "(Transformer-XL) or a model built with conv_compression, max_pool_compression or "
                     "mean_pool_compression");
    }
    template <view_of<T> M, view_of<T> DO, view_of<T> DM>
    void backward(const M& m, index_t b, const DO&, const DM&) {
        forward(m, b, m);
    }

private:
    std::string name_;
    index_t rate_ = Rate == dynamic ? 1 : index_t(Rate);
};

}  // namespace mnemo
