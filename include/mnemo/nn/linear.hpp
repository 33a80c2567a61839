#pragma once
// Linear layer, as torch.nn.Linear:  y = x·Wᵀ + b
//   x [rows, In]   W [Out, In] (PyTorch layout, state_dict name `<name>.weight`)   b [Out] (`<name>.bias`)
// Backward:  dW += dyᵀ·x,  db += Σ_rows dy,  dx = dy·W   (dx assigned, or accumulated on request)
// In and Out are compile-time extents, or `dynamic` (e.g. the vocabulary of a generator), in which
// case they are given at construction and checked at run time.
#include <cmath>
#include <string>

#include "../core/rng.hpp"
#include "module.hpp"

namespace mnemo {

template <class T, std::size_t In, std::size_t Out, class Backend = cpu>
class linear {
    using kernels = checked_ops<Backend>;

public:
    static constexpr std::size_t in_features = In;
    static constexpr std::size_t out_features = Out;

    /// Static extents.
    linear(parameter_set<T, Backend>& ps, const std::string& name, bool bias = true)
        requires(In != dynamic && Out != dynamic)
        : linear(ps, name, static_cast<index_t>(In), static_cast<index_t>(Out), bias) {}

    /// Runtime extents (each must equal the static one where that is fixed).
    linear(parameter_set<T, Backend>& ps, const std::string& name, index_t in, index_t out, bool bias)
        : in_(in), out_(out) {
        MNEMO_CHECK(In == dynamic || in == static_cast<index_t>(In), "linear '", name, "': in_features ", in,
                    " given for a layer of static In ", In);
        MNEMO_CHECK(Out == dynamic || out == static_cast<index_t>(Out), "linear '", name, "': out_features ", out,
                    " given for a layer of static Out ", Out);
        MNEMO_CHECK(in > 0 && out > 0, "linear '", name, "': extents must be positive, got ", in, " x ", out);
        weight_ = ps.declare(name + ".weight", {out, in});
        if (bias) bias_ = ps.declare(name + ".bias", {out});
    }

    /// PyTorch's default: W, b ~ U(−1/√In, 1/√In).
    void reset_parameters(rng& r) const {
        const double bound = 1.0 / std::sqrt(static_cast<double>(in_));
        weight_.generate([&] { return r.uniform(-bound, bound); });
        if (bias_)
            bias_.generate([&] { return r.uniform(-bound, bound); });
    }

    /// y[rows, Out] = x[rows, In]·Wᵀ + b
    template <view_of<T> X, view_of<T> Y>
    void forward(const X& x, const Y& y) const {
        static_assert(check_view<In, X, axis::in_features, Backend>());
        static_assert(check_view<Out, Y, axis::out_features, Backend>());
        check_shapes(x, y, "x", "y");
        kernels::linear_forward(x.rows(), in_, out_, x.data(), x.ld(), weight_.value(), bias_ ? bias_.value() : nullptr,
                                y.data(), y.ld());
    }

    /// dW += dyᵀ·x, db += Σ dy; dx = dy·W (+= when accumulate_dx; skipped when dx has no data).
    template <view_of<T> X, view_of<T> DY, view_of<T> DX>
    void backward(const X& x, const DY& dy, const DX& dx, bool accumulate_dx = false) const {
        static_assert(check_view<In, X, axis::in_features, Backend>());
        static_assert(check_view<Out, DY, axis::out_features, Backend>());
        static_assert(check_view<In, DX, axis::in_features, Backend>());
        check_shapes(x, dy, "x", "dy");
        if (dx.data()) check_shapes(dx, dy, "dx", "dy");
        T* gb = bias_ ? bias_.grad() : nullptr;
        kernels::linear_backward(x.rows(), in_, out_, x.data(), x.ld(), dy.data(), dy.ld(), dx.data() ? weight_.value() : nullptr,
                           weight_.grad(), gb, dx.data(), dx.ld(), accumulate_dx);
    }

    /// dx = dy·W only (or += when accumulate_dx): the parameters are read as constants and receive
    /// no gradient (a detached use, as the attention-reconstruction loss makes of them).
    template <view_of<T> DY, view_of<T> DX>
    void backward_input(const DY& dy, const DX& dx, bool accumulate_dx = false) const {
        static_assert(check_view<Out, DY, axis::out_features, Backend>());
        static_assert(check_view<In, DX, axis::in_features, Backend>());
        check_shapes(dx, dy, "dx", "dy");
        kernels::gemm_nn(dy.rows(), in_, out_, dy.data(), dy.ld(), weight_.value(), in_, dx.data(), dx.ld(),
                   accumulate_dx ? T(1) : T(0));
    }

    index_t in() const { return in_; }
    index_t out() const { return out_; }
    const param<T, Backend>& weight() const { return weight_; }
    const param<T, Backend>& bias() const { return bias_; }

private:
    template <class A, class B>
    void check_shapes(const A& a, const B& b, const char* na, const char* nb) const {
        check_cols(a, in_, "linear", na);
        check_cols(b, out_, "linear", nb);
        check_rows(a, b, "linear", na, nb);
    }

    index_t in_, out_;
    param<T, Backend> weight_;  // [Out, In]
    param<T, Backend> bias_;    // [Out], empty without bias
};

}  // namespace mnemo
