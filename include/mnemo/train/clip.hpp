#pragma once
// Gradient clipping by global L2 norm, as torch.nn.utils.clip_grad_norm_ (norm_type = 2) in PyTorch 1.13:
//
//   total     = ‖g‖₂ = sqrt(Σ_i g_i²)          over every gradient element of every parameter
//   clip_coef = max_norm / (total + 1e-6)
//   g        ← g · min(clip_coef, 1)
//   returns total (before clipping)
//
// PyTorch computes one norm per tensor and then the norm of those norms, each reduction in the tensor's
// dtype; mnemo sums squares over the flat buffer in double. Mathematically the same; in float32
// PyTorch's result carries its own rounding (a few ulp), so the two agree to float precision, not bit
// for bit. Double accumulation is the more accurate of the two, and reducing over fixed blocks whose
// size depends on n alone makes the result independent of the number of OpenMP threads.
//
// The coefficient is formed the way PyTorch forms it, in the gradients' type T:
// clip_coef = (1 / (T(total) + T(1e-6))) · T(max_norm) (Tensor.__rtruediv__ is reciprocal() * other),
// so once the norms agree the clipped gradients agree too. PyTorch clamps the coefficient to 1 and
// always multiplies; multiplying by exactly 1 changes nothing, so the pass is skipped then. A NaN norm
// propagates NaN into the gradients exactly as in PyTorch (error_if_nonfinite = False, its 1.13
// default); callers that want to skip such a step check the returned norm first.
//
// Over a parameter_set, both the sum and the scaling visit only the gradient's live ranges
// (parameter_set::grad_live_ranges(); elsewhere the gradient is +0): the blocks and the order of every
// partial sum are those of the whole buffer, and adding +0 to a partial sum changes nothing, so the
// norm and the clipped gradients are bitwise those of the dense loops. A NaN norm scales the whole
// buffer, as the dense loop does (0 · NaN is NaN), and the set then counts every gradient as touched.
#include <cmath>
#include <span>
#include <utility>

#include "../core/error.hpp"
#include "../core/parameters.hpp"
#include "../core/shape.hpp"
#include "../kernels/cpu/ops.hpp"  // the CPU kernels; other backends add their ops<> specialisation
#include "../kernels/kernel_table.hpp"

namespace mnemo {

namespace detail::optim {

// The clipping coefficient in T, formed as PyTorch forms it (see the header comment).
template <class T>
T clip_coefficient(double total, double max_norm) {
    return (T(1) / (static_cast<T>(total) + static_cast<T>(1e-6))) * static_cast<T>(max_norm);
}

inline void check_max_norm(double max_norm) {
    MNEMO_CHECK(std::isfinite(max_norm) && max_norm > 0.0,
                "clip_grad_norm: max_norm must be finite and > 0, got ", max_norm);
}

template <class T>
void check_grad_buffer(const T* grads, index_t n, const char* who) {
    MNEMO_CHECK(n >= 0, who, ": the number of elements must be >= 0, got ", n);
    MNEMO_CHECK(grads != nullptr || n == 0, who, ": the gradient buffer is null but n = ", n);
}

}  // namespace detail::optim

/// ‖grads‖₂ over grads[0, n) (memory of Backend), accumulated in double.
template <class T, class Backend = cpu>
double grad_norm(const T* grads, index_t n) {
    detail::optim::check_grad_buffer(grads, n, "grad_norm");
    const flat_range all{0, n};
    return std::sqrt(checked_ops<Backend>::sum_squares_live(grads, n, std::span<const flat_range>(&all, 1)));
}

/// The global gradient norm of a parameter set (the alignment gaps hold zeros and add nothing); reads
/// only the gradient's live ranges, with the result of the dense sum.
template <class T, class Backend>
double grad_norm(const parameter_set<T, Backend>& set) {
    return std::sqrt(checked_ops<Backend>::sum_squares_live(set.grads(), set.size(), set.grad_live_ranges()));
}

/// torch.nn.utils.clip_grad_norm_(params, max_norm) over grads[0, n) (memory of Backend): scales the
/// gradients so that their global L2 norm is at most max_norm (up to the 1e-6 guard) and returns the
/// norm before clipping.
template <class T, class Backend = cpu>
double clip_grad_norm(T* grads, index_t n, double max_norm) {
    using kernels = checked_ops<Backend>;
    detail::optim::check_grad_buffer(grads, n, "clip_grad_norm");
    detail::optim::check_max_norm(max_norm);
    const flat_range all{0, n};
    const std::span<const flat_range> whole(&all, 1);
    const double total = std::sqrt(kernels::sum_squares_live(grads, n, whole));
    const T coef = detail::optim::clip_coefficient<T>(total, max_norm);
    if (!(coef >= T(1))) kernels::scale_live(grads, whole, coef);  // also for NaN, which propagates as in PyTorch
    return total;
}

/// clip_grad_norm over every gradient of a parameter set (PyTorch's model.parameters()). Reads and
/// scales only the live ranges (parameter_set::grad_live_ranges()); bitwise the result of the dense loop.
template <class T, class Backend>
double clip_grad_norm(parameter_set<T, Backend>& set, double max_norm) {
    using kernels = checked_ops<Backend>;
    detail::optim::check_max_norm(max_norm);
    const index_t n = set.size();
    const std::span<const flat_range> live = std::as_const(set).grad_live_ranges();
    T* grads = set.grads_preserving_zeros();
    const double total = std::sqrt(kernels::sum_squares_live(grads, n, live));
    const T coef = detail::optim::clip_coefficient<T>(total, max_norm);
    if (!(coef >= T(1))) {
        if (coef == coef) {
            kernels::scale_live(grads, live, coef);  // coef in [0, 1): +0 stays +0 outside `live`
        } else {  // NaN: every gradient becomes NaN, as in the dense loop and in PyTorch
            set.touch_all_grads();
            const flat_range all{0, n};
            kernels::scale_live(grads, std::span<const flat_range>(&all, 1), coef);
        }
    }
    return total;
}

}  // namespace mnemo
