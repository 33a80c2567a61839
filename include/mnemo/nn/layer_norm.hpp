#pragma once
// Layer normalisation over d_model, as torch.nn.LayerNorm([D]) (Ba et al., 2016):
//   y = (x − μ)/sqrt(σ² + eps) · w + b      w [D] (`<name>.weight`, ones), b [D] (`<name>.bias`, zeros)
// Forward saves μ and 1/sqrt(σ² + eps) per row in a norm_stats; backward reads them.
// Backward: dw += Σ dy·x̂, db += Σ dy, dx = r·(dy·w − mean(dy·w) − x̂·mean(dy·w·x̂)).
//
// The module owns one set of saved statistics for the common case of one call per step; a caller
// that normalises several tensors with the same parameters in one step passes its own norm_stats.
#include <string>
#include <type_traits>

#include "../core/buffer.hpp"
#include "../core/config.hpp"
#include "module.hpp"

namespace mnemo {

/// Per-row statistics saved by a layer-norm forward: mean [rows], rstd [rows].
template <class T>
struct norm_stats {
    T* mean = nullptr;
    T* rstd = nullptr;
};

/// D may be `dynamic` (a runtime-shape model): it is then given at construction.
template <class T, std::size_t D, class Backend = cpu>
class layer_norm {
    using kernels = checked_ops<Backend>;
    [[no_unique_address]] extent_holder<D> d_;

public:
    static constexpr std::size_t features = D;

    layer_norm(parameter_set<T, Backend>& ps, const std::string& name, T eps = T(1e-5)) requires(D != dynamic)
        : layer_norm(ps, name, static_cast<index_t>(D), eps) {}
    /// Runtime extent (must equal D when that is static).
    layer_norm(parameter_set<T, Backend>& ps, const std::string& name, index_t d, T eps) : d_(d), eps_(eps) {
        check_extent<D>(d, ("layer_norm '" + name + "'").c_str(), "d_model");
        MNEMO_CHECK(eps > T(0), "layer_norm '", name, "': eps must be positive, got ", eps);
        weight_ = ps.declare(name + ".weight", {d_});
        bias_ = ps.declare(name + ".bias", {d_});
    }

    /// PyTorch's default: w = 1, b = 0.
    void reset_parameters() const {
        weight_.fill(T(1));
        bias_.fill(T(0));
    }

    /// y = LN(x), statistics saved in `stats` (each [rows]).
    template <view_of<T> X, view_of<T> Y>
    void forward(const X& x, const Y& y, norm_stats<T> stats) const {
        static_assert(check_view<D, X, axis::d_model, Backend>());
        static_assert(check_view<D, Y, axis::d_model, Backend>());
        check_rows(x, y, "layer_norm", "x", "y");
        check_runtime_cols(x, "x");
        check_runtime_cols(y, "y");
        kernels::layer_norm_forward(x.rows(), d_, x.data(), x.ld(), weight_.value(), bias_.value(),
                              eps_, y.data(), y.ld(), stats.mean, stats.rstd);
    }
    /// y = LN(x), and its normalised rows x̂ = (x − μ)·r (before the scale and shift) into xhat, in one
    /// pass; no statistics kept (for rows that need no input gradient: only dw, db read x̂).
    template <view_of<T> X, view_of<T> Y, view_of<T> XH>
    void forward_normalized(const X& x, const Y& y, const XH& xhat) const {
        static_assert(check_view<D, X, axis::d_model, Backend>());
        static_assert(check_view<D, Y, axis::d_model, Backend>());
        static_assert(check_view<D, XH, axis::d_model, Backend>());
        check_rows(x, y, "layer_norm", "x", "y");
        check_rows(x, xhat, "layer_norm", "x", "xhat");
        kernels::layer_norm_forward(x.rows(), d_, x.data(), x.ld(), weight_.value(), bias_.value(),
                              eps_, y.data(), y.ld(), static_cast<T*>(nullptr), static_cast<T*>(nullptr), xhat.data(),
                              xhat.ld());
    }
    /// x̂ = (x − μ)·r alone (no affine, nothing saved): bitwise forward_normalized's x̂.
    template <view_of<T> X, view_of<T> XH>
    void normalized(const X& x, const XH& xhat) const {
        static_assert(check_view<D, X, axis::d_model, Backend>());
        static_assert(check_view<D, XH, axis::d_model, Backend>());
        check_rows(x, xhat, "layer_norm", "x", "xhat");
        kernels::layer_norm_forward(x.rows(), d_, x.data(), x.ld(), weight_.value(), bias_.value(),
                              eps_, static_cast<T*>(nullptr), index_t(0), static_cast<T*>(nullptr),
                              static_cast<T*>(nullptr), xhat.data(), xhat.ld());
    }
    /// normalized with x's rows (position, batch element) pairs, row p·batch + b, and x̂ laid out by
    /// batch element: that row's x̂ at xhat + b·ld_batch + p·ld (ld: xhat's row stride). Backends
    /// whose attention absorbs the memory (kernels::absorbs_memory) only.
    template <view_of<T> X>
    void normalized_by_batch(const X& x, T* xhat, index_t ld, index_t batch, index_t ld_batch) const {
        static_assert(check_view<D, X, axis::d_model, Backend>());
        MNEMO_CHECK(batch > 0 && x.rows() % batch == 0, "layer_norm: ", x.rows(), " rows are not whole positions of ",
                    batch, " batch elements");
        kernels::layer_norm_forward(x.rows(), d_, x.data(), x.ld(), weight_.value(), bias_.value(), eps_,
                                    static_cast<T*>(nullptr), index_t(0), static_cast<T*>(nullptr),
                                    static_cast<T*>(nullptr), xhat, ld, batch, ld_batch);
    }
    /// y = LN(x), statistics saved in the module's own buffers.
    template <view_of<T> X, view_of<T> Y>
    void forward(const X& x, const Y& y) {
        forward(x, y, own_stats(x.rows()));
    }

    /// dw += Σ dy·x̂, db += Σ dy, dx = ∂/∂x (dx assigned, or added when accumulate_dx — the pre-LN
    /// residual stream's case; skipped when dx has no data).
    template <view_of<T> X, view_of<T> DY, view_of<T> DX>
    void backward(const X& x, const DY& dy, const DX& dx, norm_stats<T> stats, bool accumulate_dx = false) const {
        static_assert(check_view<D, X, axis::d_model, Backend>());
        static_assert(check_view<D, DY, axis::d_model, Backend>());
        static_assert(check_view<D, DX, axis::d_model, Backend>());
        check_rows(x, dy, "layer_norm", "x", "dy");
        if (dx.data()) check_rows(x, dx, "layer_norm", "x", "dx");
        kernels::layer_norm_backward(x.rows(), d_, x.data(), x.ld(), weight_.value(), stats.mean,
                               stats.rstd, dy.data(), dy.ld(), dx.data(), dx.ld(), weight_.grad(), bias_.grad(),
                               accumulate_dx);
    }
    template <view_of<T> X, view_of<T> DY, view_of<T> DX>
    void backward(const X& x, const DY& dy, const DX& dx, bool accumulate_dx = false) const {
        MNEMO_CHECK(x.rows() <= saved_rows_, "layer_norm: backward over ", x.rows(), " rows but forward saved ",
                    saved_rows_);
        backward(x, dy, dx, norm_stats<T>{const_cast<T*>(mean_.data()), const_cast<T*>(rstd_.data())}, accumulate_dx);
    }

    /// dx only (assigned, or added when accumulate_dx): w and b are read as constants and receive no
    /// gradient (a detached use, as the attention-reconstruction loss makes of them).
    template <view_of<T> X, view_of<T> DY, view_of<T> DX>
    void backward_input(const X& x, const DY& dy, const DX& dx, norm_stats<T> stats, bool accumulate_dx = false) const {
        static_assert(check_view<D, X, axis::d_model, Backend>());
        static_assert(check_view<D, DY, axis::d_model, Backend>());
        static_assert(check_view<D, DX, axis::d_model, Backend>());
        check_rows(x, dy, "layer_norm", "x", "dy");
        check_rows(x, dx, "layer_norm", "x", "dx");
        kernels::layer_norm_backward(x.rows(), d_, x.data(), x.ld(), weight_.value(), stats.mean,
                               stats.rstd, dy.data(), dy.ld(), dx.data(), dx.ld(), static_cast<T*>(nullptr),
                               static_cast<T*>(nullptr), accumulate_dx);
    }

    /// Statistics buffers owned by the module, grown to `rows`.
    norm_stats<T> own_stats(index_t rows) {
        saved_rows_ = rows;
        return {mean_.ensure(rows), rstd_.ensure(rows)};
    }

    T eps() const { return eps_; }
    const param<T, Backend>& weight() const { return weight_; }
    const param<T, Backend>& bias() const { return bias_; }

private:
    /// A view of runtime features (a runtime-shape model's) must have d_model of them; a static view's
    /// were checked at compile time.
    template <class V>
    void check_runtime_cols(const V& v, const char* what) const {
        if constexpr (std::remove_cvref_t<V>::features == dynamic) check_cols(v, d_, "layer_norm", what);
    }

    T eps_;
    param<T, Backend> weight_;  // [D]
    param<T, Backend> bias_;    // [D]
    buffer<T, Backend> mean_, rstd_;
    index_t saved_rows_ = 0;
};

}  // namespace mnemo
