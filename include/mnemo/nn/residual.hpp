#pragma once
// Residual connection (He et al., 2016):  y = x + f(x)
// Backward: dx = dy and df = dy (both assigned, or added on request: the stream's gradient usually
// already holds the contribution of the sub-layer that read it).
#include "module.hpp"

namespace mnemo {

/// D may be `dynamic` (a runtime-shape model): the width is then the views' own (checked to agree).
template <class T, std::size_t D, class Backend = cpu>
struct residual {
    using kernels = checked_ops<Backend>;

    /// The features of v: D, or v's own for a runtime D.
    template <class V>
    static index_t width(const V& v) {
        if constexpr (D != dynamic) return static_cast<index_t>(D);
        else return v.cols();
    }

    /// y = x + f (y may alias x or f)
    template <view_of<T> X, view_of<T> F, view_of<T> Y>
    static void forward(const X& x, const F& f, const Y& y) {
        static_assert(check_view<D, X, axis::d_model, Backend>());
        static_assert(check_view<D, F, axis::d_model, Backend>());
        static_assert(check_view<D, Y, axis::d_model, Backend>());
        check_rows(x, f, "residual", "x", "f");
        check_rows(x, y, "residual", "x", "y");
        if constexpr (D == dynamic) {
            check_cols(f, x.cols(), "residual", "f");
            check_cols(y, x.cols(), "residual", "y");
        }
        kernels::add(x.rows(), width(x), x.data(), x.ld(), f.data(), f.ld(), y.data(), y.ld());
    }

    /// dx (= or +=) dy, df (= or +=) dy; either may be an empty view to skip it.
    template <view_of<T> DY, view_of<T> DX, view_of<T> DF>
    static void backward(const DY& dy, const DX& dx, const DF& df, bool accumulate = false) {
        static_assert(check_view<D, DY, axis::d_model, Backend>());
        static_assert(check_view<D, DX, axis::d_model, Backend>());
        static_assert(check_view<D, DF, axis::d_model, Backend>());
        if (dx.data()) {
            check_rows(dy, dx, "residual", "dy", "dx");
            if constexpr (D == dynamic) check_cols(dx, dy.cols(), "residual", "dx");
            if (dx.data() != dy.data() || accumulate)
                kernels::copy(dy.rows(), width(dy), dy.data(), dy.ld(), dx.data(), dx.ld(), accumulate);
        }
        if (df.data()) {
            check_rows(dy, df, "residual", "dy", "df");
            if constexpr (D == dynamic) check_cols(df, dy.cols(), "residual", "df");
            if (df.data() != dy.data() || accumulate)
                kernels::copy(dy.rows(), width(dy), dy.data(), dy.ld(), df.data(), df.ld(), accumulate);
        }
    }
};

}  // namespace mnemo
