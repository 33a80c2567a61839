#pragma once
// Inverted dropout with a counter-based mask: element i is kept iff uniform(seed, offset + i) >= p,
// and kept elements are scaled by 1/(1 − p) (as torch.nn.Dropout in training). Backward re-derives
// the same mask from (seed, offset), so nothing is stored. p = 0 is the identity; p = 1 zeroes.
#include <cstdint>

#include "parallel.hpp"
#include "../../core/rng.hpp"
#include "../../core/shape.hpp"

namespace mnemo::cpu_kernels {

struct dropout {
    /// y = dropout(x); y may alias x. Uses counters [offset, offset + n) of stream `seed`.
    template <class T>
    static void dropout_forward(index_t n, const T* x, T* y, float p, std::uint64_t seed, std::uint64_t offset) {
        apply(n, x, y, p, seed, offset);
    }
    /// dx = dy masked and scaled exactly as the forward with the same (p, seed, offset).
    template <class T>
    static void dropout_backward(index_t n, const T* dy, T* dx, float p, std::uint64_t seed, std::uint64_t offset) {
        apply(n, dy, dx, p, seed, offset);
    }

private:
    template <class T>
    static void apply(index_t n, const T* x, T* y, float p, std::uint64_t seed, std::uint64_t offset) {
        if (p <= 0.0f) {
            if (x != y)
                for (index_t i = 0; i < n; ++i) y[i] = x[i];
            return;
        }
        const T scale = p >= 1.0f ? T(0) : T(1) / (T(1) - T(p));
        parallel_range(n, n >= parallel_min_elements, [&](index_t begin, index_t end) {
            for (index_t i = begin; i < end; ++i)
                y[i] = random_uniform(seed, offset + static_cast<std::uint64_t>(i)) >= p ? x[i] * scale : T(0);
        });
    }
};

}  // namespace mnemo::cpu_kernels
