#pragma once
// Element-wise activations and their derivatives (contiguous n elements; y may alias x, dx may alias dy).
//   relu(x) = max(x, 0),                        relu'(x) = [x > 0]
//   gelu(x) = x·Φ(x) = ½x·erfc(−x/√2)             (exact GELU, PyTorch's default; erfc rather than
//                                                1 + erf keeps full precision for negative x)
//   gelu'(x) = Φ(x) + x·φ(x),  φ(x) = exp(−x²/2)/√(2π)
// erfc is simd::erfc: vectorised for float, libm's lane by lane for double (xsimd's double erfc is a
// float-grade fit; simd.hpp says by how much).
#include <cmath>
#include <type_traits>

#include "parallel.hpp"
#include "../../core/activation.hpp"
#include "../../core/backend.hpp"
#include "../../core/shape.hpp"
#include "simd.hpp"

namespace mnemo::cpu_kernels {

struct activation {
    /// f(j) for each full SIMD batch j = 0, width, 2·width, … < nv, over threads when nv is large.
    template <class T, class F>
    static void over_batches(index_t nv, F&& f) {
        constexpr index_t w = simd::width<T>;
        parallel_range(nv / w, nv >= parallel_min_elements, [&](index_t begin, index_t end) {
            for (index_t b = begin; b < end; ++b) f(b * w);
        });
    }

    template <class T>
    static void relu_forward(index_t n, const T* x, T* y) {
        using B = simd::batch<T>;
        const index_t nv = simd::full_batches<T>(n);
        const B zero = simd::splat<T>(0);
        over_batches<T>(nv, [&](index_t j) { simd::store(y + j, xsimd::max(simd::load(x + j), zero)); });
        for (index_t j = nv; j < n; ++j) y[j] = x[j] > T(0) ? x[j] : T(0);
    }
    /// dx = dy·[x > 0]
    template <class T>
    static void relu_backward(index_t n, const T* x, const T* dy, T* dx) {
        using B = simd::batch<T>;
        const index_t nv = simd::full_batches<T>(n);
        const B zero = simd::splat<T>(0);
        over_batches<T>(nv, [&](index_t j) {
            simd::store(dx + j, xsimd::select(simd::load(x + j) > zero, simd::load(dy + j), zero));
        });
        for (index_t j = nv; j < n; ++j) dx[j] = x[j] > T(0) ? dy[j] : T(0);
    }

    template <class T>
    static void gelu_forward(index_t n, const T* x, T* y) {
        using B = simd::batch<T>;
        const index_t nv = simd::full_batches<T>(n);
        const B half = simd::splat<T>(0.5), rs2 = simd::splat<T>(T(0.70710678118654752440));
        over_batches<T>(nv, [&](index_t j) {
            const B v = simd::load(x + j);
            simd::store(y + j, half * v * simd::erfc(-v * rs2));
        });
        for (index_t j = nv; j < n; ++j) y[j] = T(0.5) * x[j] * std::erfc(-x[j] * T(0.70710678118654752440));
    }
    /// dx = dy·gelu'(x)
    template <class T>
    static void gelu_backward(index_t n, const T* x, const T* dy, T* dx) {
        using B = simd::batch<T>;
        const index_t nv = simd::full_batches<T>(n);
        constexpr T rs2 = T(0.70710678118654752440), rs2pi = T(0.39894228040143267794);
        const B half = simd::splat<T>(0.5), vrs2 = simd::splat(rs2), vrs2pi = simd::splat(rs2pi);
        over_batches<T>(nv, [&](index_t j) {
            const B v = simd::load(x + j);
            const B cdf = half * simd::erfc(-v * vrs2);
            const B pdf = vrs2pi * xsimd::exp(-half * v * v);
            simd::store(dx + j, simd::load(dy + j) * (cdf + v * pdf));
        });
        for (index_t j = nv; j < n; ++j) {
            const T cdf = T(0.5) * std::erfc(-x[j] * rs2);
            const T pdf = rs2pi * std::exp(T(-0.5) * x[j] * x[j]);
            dx[j] = dy[j] * (cdf + x[j] * pdf);
        }
    }

    /// Dispatch on an activation tag.
    template <class Act, class T>
    static void activation_forward(index_t n, const T* x, T* y) {
        if constexpr (std::is_same_v<Act, mnemo::relu>) relu_forward(n, x, y);
        else if constexpr (std::is_same_v<Act, mnemo::gelu>) gelu_forward(n, x, y);
        else static_assert(dependent_false<Act>, "mnemo: unknown activation tag (mnemo::relu, mnemo::gelu)");
    }
    template <class Act, class T>
    static void activation_backward(index_t n, const T* x, const T* dy, T* dx) {
        if constexpr (std::is_same_v<Act, mnemo::relu>) relu_backward(n, x, dy, dx);
        else if constexpr (std::is_same_v<Act, mnemo::gelu>) gelu_backward(n, x, dy, dx);
        else static_assert(dependent_false<Act>, "mnemo: unknown activation tag (mnemo::relu, mnemo::gelu)");
    }
};

}  // namespace mnemo::cpu_kernels
