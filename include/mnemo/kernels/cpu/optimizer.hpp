#pragma once
// CPU kernels of the optimizers and of gradient clipping: the Adam family's update (adam_step), SGD's
// (sgd_step), the cold-block flags of restored moments (adam_cold_blocks), and the global gradient
// norm's sum of squares and scaling over the live runs of a flat gradient buffer (sum_squares_live,
// scale_live). train/optimizer.hpp and train/clip.hpp give the formulas and why each operation is
// rounded as it is (bitwise PyTorch's order); this file keeps that order.
//
// Speed: under the default -fmath-errno, std::sqrt may set errno, so neither g++ 12 nor clang 14
// vectorises the Adam-family loops. -fno-math-errno (PyTorch builds with it) changes no result and
// makes them vectorise: AdamW float step, n = 4M, one thread: g++ 12 -O3 -march=native 3.6-5.2 ->
// 0.64 ns/element, clang 14 2.8 -> 0.47 ns/element (measured on the AMD EPYC development machine). Those
// loops therefore run without `simd`, left to the auto-vectoriser, so that clang does not warn about a
// forced vectorisation it cannot do; the loops without sqrt keep `simd`. Each Adam loop is a function
// that gets its buffers and coefficients as arguments: written inside the lambda it runs in, it read
// them through the lambda's captures, memory that every store to params, m or v might alias, and g++ 12
// gave up on the 30 run-time alias checks that needed (its limit is 10) and left the loop scalar even
// under -fno-math-errno. Vectorised, each element still sees the same IEEE operations (fma, ·, /,
// sqrt, +), so the results are the same bits.
//
// Threads: every element's update is independent, and the norm's partial sums have fixed blocks that
// depend on n alone, so no result depends on the OpenMP thread count.
#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstdint>
#include <span>
#include <type_traits>

#include "../../core/shape.hpp"
#include "../optimizer_state.hpp"
#include "deferred_decay.hpp"
#include "parallel.hpp"

#if !defined(MNEMO_HAS_FAST_FMA)
#if defined(__FMA__) || defined(__ARM_FEATURE_FMA) || defined(__aarch64__)
#define MNEMO_HAS_FAST_FMA 1
#else
#define MNEMO_HAS_FAST_FMA 0
#endif
#endif

namespace mnemo {

namespace detail::optim {

// a·b + c with PyTorch's rounding (see train/optimizer.hpp). std::fma is one instruction where the
// target has FMA and a slow library call where it does not, hence the fallback.
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

// Fixed reduction layout of the norm: at most this many blocks, each of at least this many elements.
inline constexpr index_t norm_max_blocks = 256;
inline constexpr index_t norm_min_block = 4096;

// Whether x[0, n) is all ±0 (as x_i == 0 for every i): an OR of the bits without the sign, which
// vectorises where a chain of `zero &= x_i == 0` does not. NaN and every other value have bits left.
template <class T>
bool all_zero(const T* x, index_t n) {
    using U = std::conditional_t<sizeof(T) == 4, std::uint32_t, std::uint64_t>;
    static_assert(sizeof(U) == sizeof(T));
    U bits = 0;
    for (index_t i = 0; i < n; ++i) bits |= std::bit_cast<U>(x[i]) << 1;
    return bits == 0;
}

// The first of the sorted, disjoint runs `live` that ends after `at`.
inline const flat_range* first_live_after(std::span<const flat_range> live, index_t at) {
    return std::partition_point(live.data(), live.data() + live.size(), [&](const flat_range& r) { return r.end <= at; });
}

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

// The element updates of one block [i_begin, i_end), one function per rule (buffers and coefficients
// as arguments, for the vectoriser: see Speed above).
template <class T>
void adamw_update(T* params, const T* grads, T* m, T* v, index_t i_begin, index_t i_end, const adam_coefficients<T> c) {
    for (index_t i = i_begin; i < i_end; ++i) {
        const T g = grads[i];
        const T p = product(params[i], c.decay);                        // param.mul_(1 - lr*wd)
        const T mi = fmadd(c.one_minus_beta1, g, m[i] * c.beta1);       // m.mul_(b1).add_(g, 1-b1)
        const T vi = fmadd(c.one_minus_beta2 * g, g, v[i] * c.beta2);   // v.mul_(b2).addcmul_(g, g, 1-b2)
        m[i] = mi;
        v[i] = vi;
        const T denom = std::sqrt(vi) / c.bias_correction2_sqrt + c.eps;
        params[i] = p + (c.neg_step_size * mi) / denom;  // param.addcdiv_(m, denom, -step_size)
    }
}
template <class T>
void adam_update(T* params, const T* grads, T* m, T* v, index_t i_begin, index_t i_end, const adam_coefficients<T> c) {
    for (index_t i = i_begin; i < i_end; ++i) {
        const T p = params[i];
        const T g = c.l2 ? fmadd(c.wd, p, grads[i]) : grads[i];  // grad.add(param, alpha=wd)
        const T mi = fmadd(c.one_minus_beta1, g, m[i] * c.beta1);
        const T vi = fmadd(c.one_minus_beta2 * g, g, v[i] * c.beta2);
        m[i] = mi;
        v[i] = vi;
        const T denom = std::sqrt(vi) / c.bias_correction2_sqrt + c.eps;
        params[i] = p + (c.neg_step_size * mi) / denom;
    }
}
template <class T>
void labml_update(T* params, const T* grads, T* m, T* v, index_t i_begin, index_t i_end, const adam_coefficients<T> c) {
    for (index_t i = i_begin; i < i_end; ++i) {
        const T g = grads[i];
        const T p = product(params[i], c.decay);  // WeightDecay: param.mul_(1 - lr*wd), first
        const T mi = fmadd(c.one_minus_beta1, g, m[i] * c.beta1);
        const T vi = fmadd(c.one_minus_beta2 * g, g, v[i] * c.beta2);
        m[i] = mi;
        v[i] = vi;
        const T denom = std::sqrt(vi) + c.eps;  // v.sqrt().add_(eps)
        params[i] = p + (c.neg_step_size * mi) / denom;
    }
}

// The whole update of a cold block with zero gradient: p ← p·(1 − lr·wd), as the full loop computes it.
template <class T>
void decay_only(T* params, index_t i_begin, index_t i_end, T decay) {
    if (decay != T(1))
        for (index_t i = i_begin; i < i_end; ++i) params[i] = product(params[i], decay);
}

}  // namespace detail::optim

namespace cpu_kernels {

struct optimizer : deferred_decay_payment {
    /// One Adam-family step (kernels/optimizer_state.hpp). With cold flags (decoupled rules), by blocks
    /// of adam_cold_block elements: a cold block whose gradient is all zero gets only the decay, which
    /// for such an element is exactly Adam's update (m and v stay 0 and the step term is ±0 / ε); every
    /// other block gets the update and is warm from then on. The gradient of a cold block that no live
    /// run meets is known zero without being read. Bitwise the plain loop's result; the saving is the
    /// traffic over parameters that never receive gradient, such as the rows of the relative-position
    /// tables outside the window a model's lengths ever reach.
    template <adam_rule Rule, class T>
    static void adam_step(const adam_step_args<T>& a) {
        using namespace mnemo::detail::optim;
        const auto update = [&](index_t i0, index_t i1) {
            if constexpr (Rule == adam_rule::adamw) adamw_update(a.params, a.grads, a.m, a.v, i0, i1, a.c);
            else if constexpr (Rule == adam_rule::adam) adam_update(a.params, a.grads, a.m, a.v, i0, i1, a.c);
            else labml_update(a.params, a.grads, a.m, a.v, i0, i1, a.c);
        };
        const index_t n = a.n;
        if (!a.cold) {
            parallel_range(n, n >= elementwise_parallel_threshold, update);
            return;
        }
        const index_t blocks = (n + adam_cold_block - 1) / adam_cold_block;
        const flat_range* live_end = a.live.data() + a.live.size();
        parallel_range(blocks, n >= elementwise_parallel_threshold, [&](index_t b0, index_t b1) {
            const flat_range* r = first_live_after(a.live, b0 * adam_cold_block);
            for (index_t b = b0; b < b1; ++b) {
                const index_t i0 = b * adam_cold_block, i1 = std::min(n, i0 + adam_cold_block);
                while (r != live_end && r->end <= i0) ++r;  // r: the first run that ends after i0
                if (a.cold[b]) {
                    bool zero = true;
                    for (const flat_range* q = r; q != live_end && q->begin < i1 && zero; ++q) {
                        const index_t lo = std::max(i0, q->begin), hi = std::min(i1, q->end);
                        zero = all_zero(a.grads + lo, hi - lo);
                    }
                    if (zero) {
                        if (a.deferral && a.deferral->deferrable && a.deferral->deferrable[b]) continue;  // owes it
                        decay_only(a.params, i0, i1, a.c.decay);
                        continue;
                    }
                    a.cold[b] = 0;
                }
                if (a.deferral) {  // what it owed from before this step; the update applies this step's factor
                    deferred_decay_payment::pay_block(*a.deferral, b, a.deferral->logged - 1);
                    if (a.deferral->deferrable && a.deferral->deferrable[b]) a.deferral->owed_from[b] = a.deferral->logged;
                }
                update(i0, i1);
            }
        });
    }

    /// cold[b] = whether m and v are exactly zero over block b (adam_cold_block elements): the flags of
    /// moments restored from a checkpoint.
    template <class T>
    static void adam_cold_blocks(const T* m, const T* v, index_t n, std::uint8_t* cold) {
        const index_t blocks = (n + adam_cold_block - 1) / adam_cold_block;
        for (index_t b = 0; b < blocks; ++b) {
            const index_t i0 = b * adam_cold_block, i1 = std::min(n, i0 + adam_cold_block);
            bool zero = true;
            for (index_t i = i0; i < i1 && zero; ++i) zero = m[i] == T(0) && v[i] == T(0);
            cold[b] = zero;
        }
    }

    /// One SGD step (kernels/optimizer_state.hpp; the formulas in train/optimizer.hpp).
    template <class T>
    static void sgd_step(const sgd_step_args<T>& a) {
        using namespace mnemo::detail::optim;
        T* params = a.params;
        const T* grads = a.grads;
        const bool l2 = a.l2;
        const T wd = a.wd, neg_lr = a.neg_lr;
        if (!a.b) {
            parallel_range(a.n, a.n >= elementwise_parallel_threshold, [&](index_t i_begin, index_t i_end) {
#pragma omp simd
                for (index_t i = i_begin; i < i_end; ++i) {
                    const T p = params[i];
                    const T g = l2 ? fmadd(wd, p, grads[i]) : grads[i];  // d_p.add(param, alpha=wd)
                    params[i] = fmadd(neg_lr, g, p);                      // param.add_(d_p, alpha=-lr)
                }
            });
            return;
        }
        T* b = a.b;
        const bool first = a.first, nesterov = a.nesterov;
        const T momentum = a.momentum, one_minus_dampening = a.one_minus_dampening;
        parallel_range(a.n, a.n >= elementwise_parallel_threshold, [&](index_t i_begin, index_t i_end) {
#pragma omp simd
            for (index_t i = i_begin; i < i_end; ++i) {
                const T p = params[i];
                const T g = l2 ? fmadd(wd, p, grads[i]) : grads[i];
                // First step: buf = clone(d_p). Later: buf.mul_(momentum).add_(d_p, alpha=1-dampening).
                const T bi = first ? g : fmadd(one_minus_dampening, g, b[i] * momentum);
                b[i] = bi;
                const T d = nesterov ? fmadd(momentum, bi, g) : bi;  // d_p.add(buf, alpha=momentum)
                params[i] = fmadd(neg_lr, d, p);
            }
        });
    }

    /// Σ x_i² over x[0, n) in double, where x is +0 outside the sorted, disjoint runs `live` (all of
    /// [0, n) for a dense buffer). Block boundaries depend only on n; threads fill one partial sum per
    /// block, only from the live elements (the +0 others would add nothing), and the partials are added
    /// in block order, so the result depends neither on the thread count nor on `live`.
    template <class T>
    static double sum_squares_live(const T* x, index_t n, std::span<const flat_range> live) {
        using namespace mnemo::detail::optim;
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

    /// x_i ← x_i · s over the runs `live`, split over threads by live elements.
    template <class T>
    static void scale_live(T* x, std::span<const flat_range> live, T s) {
        index_t total = 0;
        for (const flat_range& r : live) total += r.end - r.begin;
        parallel_range(total, total >= mnemo::detail::optim::elementwise_parallel_threshold, [&](index_t begin, index_t end) {
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
};

}  // namespace cpu_kernels
}  // namespace mnemo
