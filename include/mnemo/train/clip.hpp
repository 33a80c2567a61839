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
#include <algorithm>
#include <array>
#include <cmath>
#include <span>
#include <utility>

#include "../kernels/cpu/parallel.hpp"
#include "../core/error.hpp"
#include "../core/parameters.hpp"
#include "../core/shape.hpp"

namespace mnemo {

#if !defined(MNEMO_HAS_FAST_FMA)
#if defined(__FMA__) || defined(__ARM_FEATURE_FMA) || defined(__aarch64__)
#define MNEMO_HAS_FAST_FMA 1
#else
#define MNEMO_HAS_FAST_FMA 0
#endif
#endif

namespace detail::optim {

// a·b + c with PyTorch's rounding (see optimizer.hpp). std::fma is one instruction where the target
// has FMA and a slow library call where it does not, hence the fallback.
template <class T>
inline T fmadd(T a, T b, T c) {
#if MNEMO_HAS_FAST_FMA
    return std::fma(a, b, c);
#else
    return a * b + c;
#endif
}

// a·b rounded once, and kept out of any later addition. g++'s default -ffp-contract=fast fuses a product
// into an addition that consumes it even across statements (and __builtin_assoc_barrier does not survive
// its vectoriser), whereas PyTorch rounds p·(1 − lr·wd) in one kernel and adds in another. fma(a, b, −0)
// is exactly round(a·b), sign of zero included, and its result cannot be fused again. Without hardware
// FMA there is nothing to fuse into, and a plain product is the same value.
template <class T>
inline T product(T a, T b) {
#if MNEMO_HAS_FAST_FMA
    return std::fma(a, b, T(-0.0));
#else
    return a * b;
#endif
}

// Element-wise loops over the parameter buffers run on one thread below this many elements: starting
// a parallel region costs a few microseconds, about what one thread needs for this many elements.
// A round number, not a tuned one.
inline constexpr index_t elementwise_parallel_threshold = index_t{1} << 15;

// Fixed reduction layout: at most this many blocks, each of at least this many elements.
inline constexpr index_t norm_max_blocks = 256;
inline constexpr index_t norm_min_block = 4096;

// Adds x_j² for j in [j0, j1) of one block (x is the block's start) to eight interleaved partial sums,
// element j to acc[j % 8] (so the compiler can vectorise without reassociating), each partial sum
// receiving its elements in increasing order. The update is an explicit fmadd so that it rounds the same
// way wherever a range starts: the partial sums over parts of a block are then those over the whole
// block, whose other elements are +0 and would add nothing.
template <class T>
void accumulate_squares(double (&partials)[8], const T* x, index_t j0, index_t j1) {
    // A local copy: the loops keep it in registers (through the reference they would have to assume
    // that x may alias it, and g++ then does not vectorise them).
    double acc[8] = {partials[0], partials[1], partials[2], partials[3], partials[4], partials[5], partials[6], partials[7]};
    index_t j = j0;
    for (; j < j1 && (j & 7) != 0; ++j) {
        const double v = static_cast<double>(x[j]);
        acc[j & 7] = fmadd(v, v, acc[j & 7]);
    }
    for (; j + 8 <= j1; j += 8) {
        for (int k = 0; k < 8; ++k) {
            const double v = static_cast<double>(x[j + k]);
            acc[k] = fmadd(v, v, acc[k]);
        }
    }
    for (; j < j1; ++j) {
        const double v = static_cast<double>(x[j]);
        acc[j & 7] = fmadd(v, v, acc[j & 7]);
    }
    for (int k = 0; k < 8; ++k) partials[k] = acc[k];
}

// The eight partial sums combined pairwise in a fixed order.
inline double combine_partials(const double (&acc)[8]) {
    return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

// The first of the sorted, disjoint runs `live` that ends after `at`.
inline const flat_range* first_live_after(std::span<const flat_range> live, index_t at) {
    return std::partition_point(live.data(), live.data() + live.size(), [&](const flat_range& r) { return r.end <= at; });
}

// Σ x_i² over x[0, n) in double, where x is +0 outside the sorted, disjoint runs `live` (all of [0, n)
// for a dense buffer). Block boundaries depend only on n; threads fill one partial sum per block, only
// from the live elements (the +0 others would add nothing), and the partials are added in block order,
// so the result depends neither on the thread count nor on `live`.
template <class T>
double sum_of_squares(const T* x, index_t n, std::span<const flat_range> live) {
    if (n <= 0) return 0.0;
    const index_t block = std::max(norm_min_block, (n + norm_max_blocks - 1) / norm_max_blocks);
    const index_t blocks = (n + block - 1) / block;  // <= norm_max_blocks
    std::array<double, norm_max_blocks> partial{};
    const flat_range* live_end = live.data() + live.size();
    parallel_range(blocks, blocks > 1, [&](index_t b_begin, index_t b_end) {
    const flat_range* r = first_live_after(live, b_begin * block);
    for (index_t b = b_begin; b < b_end; ++b) {
        const index_t begin = b * block, end = std::min(n, begin + block);
        double acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        for (; r != live_end && r->begin < end; ++r) {
            accumulate_squares(acc, x + begin, std::max(r->begin, begin) - begin, std::min(r->end, end) - begin);
            if (r->end > end) break;  // the run goes on into the next block
        }
        partial[static_cast<std::size_t>(b)] = combine_partials(acc);
    }
    });
    double total = 0.0;
    for (index_t b = 0; b < blocks; ++b) total += partial[static_cast<std::size_t>(b)];
    return total;
}

// Σ x_i² over x[0, n).
template <class T>
double sum_of_squares(const T* x, index_t n) {
    const flat_range all{0, n};
    return sum_of_squares(x, n, std::span<const flat_range>(&all, 1));
}

// x_i ← x_i · s over the runs `live`, split over threads by live elements.
template <class T>
void scale_live(T* x, std::span<const flat_range> live, T s) {
    index_t total = 0;
    for (const flat_range& r : live) total += r.end - r.begin;
    parallel_range(total, total >= elementwise_parallel_threshold, [&](index_t begin, index_t end) {
        // [begin, end) counts live elements; walk the runs to the ones that hold them.
        index_t skipped = 0;
        for (const flat_range& r : live) {
            const index_t len = r.end - r.begin;
            const index_t a = std::max(begin, skipped), e = std::min(end, skipped + len);
            if (a < e) {
                T* p = x + r.begin + (a - skipped);
#pragma omp simd
                for (index_t i = 0; i < e - a; ++i) p[i] *= s;
            }
            skipped += len;
            if (skipped >= end) break;
        }
    });
}

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

/// ‖grads‖₂ over grads[0, n), accumulated in double.
template <class T>
double grad_norm(const T* grads, index_t n) {
    detail::optim::check_grad_buffer(grads, n, "grad_norm");
    return std::sqrt(detail::optim::sum_of_squares(grads, n));
}

/// The global gradient norm of a parameter set (the alignment gaps hold zeros and add nothing); reads
/// only the gradient's live ranges, with the result of the dense sum.
template <class T>
double grad_norm(const parameter_set<T>& set) {
    return std::sqrt(detail::optim::sum_of_squares(set.grads(), set.size(), set.grad_live_ranges()));
}

/// torch.nn.utils.clip_grad_norm_(params, max_norm) over grads[0, n): scales the gradients so that
/// their global L2 norm is at most max_norm (up to the 1e-6 guard) and returns the norm before clipping.
template <class T>
double clip_grad_norm(T* grads, index_t n, double max_norm) {
    detail::optim::check_grad_buffer(grads, n, "clip_grad_norm");
    detail::optim::check_max_norm(max_norm);
    const double total = std::sqrt(detail::optim::sum_of_squares(grads, n));
    const T coef = detail::optim::clip_coefficient<T>(total, max_norm);
    if (!(coef >= T(1))) {  // also taken for NaN, which then propagates as in PyTorch
        parallel_range(n, n >= detail::optim::elementwise_parallel_threshold, [&](index_t begin, index_t end) {
#pragma omp simd
            for (index_t i = begin; i < end; ++i) grads[i] *= coef;
        });
    }
    return total;
}

/// clip_grad_norm over every gradient of a parameter set (PyTorch's model.parameters()). Reads and
/// scales only the live ranges (parameter_set::grad_live_ranges()); bitwise the result of the dense loop.
template <class T>
double clip_grad_norm(parameter_set<T>& set, double max_norm) {
    detail::optim::check_max_norm(max_norm);
    const index_t n = set.size();
    const std::span<const flat_range> live = std::as_const(set).grad_live_ranges();
    T* grads = set.grads_preserving_zeros();
    const double total = std::sqrt(detail::optim::sum_of_squares(grads, n, live));
    const T coef = detail::optim::clip_coefficient<T>(total, max_norm);
    if (!(coef >= T(1))) {
        if (coef == coef) {
            detail::optim::scale_live(grads, live, coef);  // coef in [0, 1): +0 stays +0 outside `live`
        } else {  // NaN: every gradient becomes NaN, as in the dense loop and in PyTorch
            set.touch_all_grads();
            const flat_range all{0, n};
            detail::optim::scale_live(grads, std::span<const flat_range>(&all, 1), coef);
        }
    }
    return total;
}

}  // namespace mnemo
