#pragma once
// Position-wise feed-forward network (Vaswani et al., 2017), as labml's FeedForward:
//   h = x·W1ᵀ + b1  [rows, Dff]      a = act(h)      y = a·W2ᵀ + b2  [rows, D]
// Parameters `<name>.layer1.{weight,bias}` [Dff, D], [Dff] and `<name>.layer2.{weight,bias}` [D, Dff], [D].
// The module keeps h and a for backward (buffers that grow to the largest rows seen, then are reused).
// Dff may be `dynamic` (given at construction): models read d_ff from a checkpoint at run time. So may
// D (a runtime-shape model).
#include <string>

#include "../core/activation.hpp"
#include "../core/buffer.hpp"
#include "linear.hpp"

namespace mnemo {

template <class T, std::size_t D, std::size_t Dff, class Act = relu, class Backend = cpu>
class feed_forward {
    using kernels = checked_ops<Backend>;

public:
    feed_forward(parameter_set<T, Backend>& ps, const std::string& name) requires(Dff != dynamic && D != dynamic)
        : feed_forward(ps, name, static_cast<index_t>(Dff)) {}
    feed_forward(parameter_set<T, Backend>& ps, const std::string& name, index_t d_ff) requires(D != dynamic)
        : feed_forward(ps, name, static_cast<index_t>(D), d_ff) {}
    /// d_model given too (D `dynamic`: a runtime-shape model; else it must equal D).
    feed_forward(parameter_set<T, Backend>& ps, const std::string& name, index_t d_model, index_t d_ff)
        : d_ff_(d_ff),
          layer1_(ps, name + ".layer1", d_model, d_ff, true),
          layer2_(ps, name + ".layer2", d_ff, d_model, true) {}

    index_t d_ff() const { return d_ff_; }

    void reset_parameters(rng& r) const {
        layer1_.reset_parameters(r);
        layer2_.reset_parameters(r);
    }

    /// y[rows, D] = FFN(x[rows, D]); saves h and a.
    template <view_of<T> X, view_of<T> Y>
    void forward(const X& x, const Y& y) {
        static_assert(check_view<D, X, axis::d_model, Backend>());
        static_assert(check_view<D, Y, axis::d_model, Backend>());
        const index_t rows = x.rows();
        rows_ = rows;
        view<T, Dff, Backend> h(hidden_.ensure(rows * d_ff_), rows, d_ff_), a(act_.ensure(rows * d_ff_), rows, d_ff_);
        layer1_.forward(x, h);
        kernels::template activation_forward<Act>(rows * d_ff_, h.data(), a.data());
        layer2_.forward(a, y);
    }

    /// Parameter grads +=; dx = ∂/∂x (assigned, or += when accumulate_dx). Reads what forward saved.
    template <view_of<T> X, view_of<T> DY, view_of<T> DX>
    void backward(const X& x, const DY& dy, const DX& dx, bool accumulate_dx = false) {
        static_assert(check_view<D, X, axis::d_model, Backend>());
        MNEMO_CHECK(x.rows() == rows_, "feed_forward: backward over ", x.rows(), " rows but forward saw ", rows_);
        const index_t rows = x.rows();
        view<T, Dff, Backend> h(hidden_.data(), rows, d_ff_), a(act_.data(), rows, d_ff_),
            da(grad_.ensure(rows * d_ff_), rows, d_ff_);
        layer2_.backward(a, dy, da);
        kernels::template activation_backward<Act>(rows * d_ff_, h.data(), da.data(), da.data());
        layer1_.backward(x, da, dx, accumulate_dx);
    }

    const linear<T, D, Dff, Backend>& layer1() const { return layer1_; }
    const linear<T, Dff, D, Backend>& layer2() const { return layer2_; }

private:
    index_t d_ff_;
    linear<T, D, Dff, Backend> layer1_;
    linear<T, Dff, D, Backend> layer2_;
    buffer<T, Backend> hidden_, act_, grad_;  // h, a, and dL/da then dL/dh: [rows, Dff] each
    index_t rows_ = 0;
};

}  // namespace mnemo
