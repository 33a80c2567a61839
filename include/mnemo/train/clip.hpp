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
#include <algorithm>
#include <array>
#include <cmath>

#include "../core/parallel.hpp"
#include "../core/error.hpp"
#include "../core/parameters.hpp"
#include "../core/shape.hpp"

namespace mnemo {

namespace detail::optim {

// Element-wise loops over the parameter buffers run on one thread below this many elements: starting
// a parallel region costs a few microseconds, about what one thread needs for this many elements.
// A round number, not a tuned one.
inline constexpr index_t elementwise_parallel_threshold = index_t{1} << 15;

// Fixed reduction layout: at most this many blocks, each of at least this many elements.
inline constexpr index_t norm_max_blocks = 256;
inline constexpr index_t norm_min_block = 4096;

// Σ x_i² over one block in double, eight interleaved partial sums (so the compiler can vectorise
// without reassociating) combined pairwise in a fixed order.
template <class T>
double sum_of_squares_block(const T* x, index_t n) {
    double acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    index_t i = 0;
    for (; i + 8 <= n; i += 8) {
        for (int k = 0; k < 8; ++k) {
            const double v = static_cast<double>(x[i + k]);
            acc[k] += v * v;
        }
    }
    for (int k = 0; i < n; ++i, ++k) {
        const double v = static_cast<double>(x[i]);
        acc[k] += v * v;
    }
    return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

// Σ x_i² over x[0, n) in double. Block boundaries depend only on n; threads fill one partial sum per
// block and the partials are added in block order, so the result does not depend on the thread count.
template <class T>
double sum_of_squares(const T* x, index_t n) {
    if (n <= 0) return 0.0;
    const index_t block = std::max(norm_min_block, (n + norm_max_blocks - 1) / norm_max_blocks);
    const index_t blocks = (n + block - 1) / block;  // <= norm_max_blocks
    std::array<double, norm_max_blocks> partial{};
    parallel_range(blocks, blocks > 1, [&](index_t b_begin, index_t b_end) {
    for (index_t b = b_begin; b < b_end; ++b) {
        const index_t begin = b * block;
        const index_t len = std::min(block, n - begin);
        partial[static_cast<std::size_t>(b)] = sum_of_squares_block(x + begin, len);
    }
    });
    double total = 0.0;
    for (index_t b = 0; b < blocks; ++b) total += partial[static_cast<std::size_t>(b)];
    return total;
}

template <class T>
void check_grad_buffer(const T* grads, index_t n, const char* who) {
    MNEMO_CHECK(n >= 0, who, ": the number of elements must be >= 0, got ", n);
    MNEMO_CHECK(grads != nullptr || n == 0, who, ": the gradient buffer is null but n = ", n);
}

}  // namespace detail::optim

/// ‖grads‖₂ over grads[0, n), accumulated in double.
template <class T>
double grad_norm(const T* grads, index_t n) {
    detail::optim::check_grad_buffer(grads, n, "grad_norm");
    return std::sqrt(detail::optim::sum_of_squares(grads, n));
}

/// The global gradient norm of a parameter set (the alignment gaps hold zeros and add nothing).
template <class T>
double grad_norm(const parameter_set<T>& set) {
    return grad_norm(set.grads(), set.size());
}

/// torch.nn.utils.clip_grad_norm_(params, max_norm) over grads[0, n): scales the gradients so that
/// their global L2 norm is at most max_norm (up to the 1e-6 guard) and returns the norm before clipping.
template <class T>
double clip_grad_norm(T* grads, index_t n, double max_norm) {
    detail::optim::check_grad_buffer(grads, n, "clip_grad_norm");
    MNEMO_CHECK(std::isfinite(max_norm) && max_norm > 0.0,
                "clip_grad_norm: max_norm must be finite and > 0, got ", max_norm);
    const double total = std::sqrt(detail::optim::sum_of_squares(grads, n));
    const T coef = (T(1) / (static_cast<T>(total) + static_cast<T>(1e-6))) * static_cast<T>(max_norm);
    if (!(coef >= T(1))) {  // also taken for NaN, which then propagates as in PyTorch
        parallel_range(n, n >= detail::optim::elementwise_parallel_threshold, [&](index_t begin, index_t end) {
#pragma omp simd
            for (index_t i = begin; i < end; ++i) grads[i] *= coef;
        });
    }
    return total;
}

/// clip_grad_norm over every gradient of a parameter set (PyTorch's model.parameters()).
template <class T>
double clip_grad_norm(parameter_set<T>& set, double max_norm) {
    return clip_grad_norm(set.grads(), set.size(), max_norm);
}

}  // namespace mnemo
