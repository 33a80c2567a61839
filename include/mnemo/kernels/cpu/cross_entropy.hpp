#pragma once
// Softmax cross-entropy over the rows of logits [rows, V] with integer targets, fused with its
// gradient (as llm.c's fused classifier): the row is read once while it is in cache.
//   lse_i  = log Σ_j exp(x[i, j])         loss_i = lse_i − x[i, t_i]
//   dx[i, j] = g_i · (softmax(x_i)_j − [j = t_i])
// A negative target marks a row to ignore (loss 0, gradient 0), as PyTorch's ignore_index.
// Targets >= V are rejected by the caller (check_targets, nn/module.hpp, on the host input) before
// any kernel runs.
#include <cmath>
#include <cstdint>
#include <limits>

#include "parallel.hpp"
#include "../../core/error.hpp"
#include "../../core/shape.hpp"
#include "simd.hpp"

namespace mnemo::cpu_kernels {

struct cross_entropy {
    /// losses[i] = cross-entropy of row i; lse[i] (may be null) saved for backward.
    template <class T, class I>
    static void cross_entropy_forward(index_t rows, index_t vocab, const T* logits, index_t ld, const I* targets,
                                      T* losses, T* lse) {
        parallel_range(rows, rows * vocab >= 16384, [&](index_t i_begin, index_t i_end) {
        for (index_t i = i_begin; i < i_end; ++i) {
            const T* xi = logits + i * ld;
            const T l = log_sum_exp(xi, vocab);
            if (lse) lse[i] = l;
            losses[i] = targets[i] < 0 ? T(0) : l - xi[targets[i]];
        }
        });
    }

    /// dlogits[i, :] = grad_scale[i] · (softmax(x_i) − onehot(t_i)), or grad_scale_all when
    /// grad_scale is null (e.g. 1/count for a mean). Assigned. dlogits may alias logits.
    template <class T, class I>
    static void cross_entropy_backward(index_t rows, index_t vocab, const T* logits, index_t ld, const I* targets,
                                       const T* lse, const T* grad_scale, T grad_scale_all, T* dlogits, index_t ldd) {
        parallel_range(rows, rows * vocab >= 16384, [&](index_t begin, index_t end) {
            for (index_t i = begin; i < end; ++i)
                row_backward(logits + i * ld, vocab, targets[i], lse[i], grad_scale ? grad_scale[i] : grad_scale_all,
                             dlogits + i * ldd);
        });
    }

    /// Fused: losses and dlogits in one pass over each row.
    template <class T, class I>
    static void cross_entropy_fused(index_t rows, index_t vocab, const T* logits, index_t ld, const I* targets,
                                    T* losses, T grad_scale, T* dlogits, index_t ldd) {
        parallel_range(rows, rows * vocab >= 16384, [&](index_t i_begin, index_t i_end) {
        for (index_t i = i_begin; i < i_end; ++i) {
            const T* xi = logits + i * ld;
            const T l = log_sum_exp(xi, vocab);
            losses[i] = targets[i] < 0 ? T(0) : l - xi[targets[i]];
            row_backward(xi, vocab, targets[i], l, grad_scale, dlogits + i * ldd);
        }
        });
    }

private:
    template <class T>
    static T log_sum_exp(const T* x, index_t n) {
        using B = simd::batch<T>;
        const index_t nv = simd::full_batches<T>(n);
        B vmax = simd::splat(-std::numeric_limits<T>::infinity());
        index_t j = 0;
        for (; j < nv; j += simd::width<T>) vmax = xsimd::max(vmax, simd::load(x + j));
        T mx = nv > 0 ? simd::reduce_max(vmax) : -std::numeric_limits<T>::infinity();
        for (; j < n; ++j) mx = std::max(mx, x[j]);
        const B vm = simd::splat(mx);
        B vsum = simd::splat<T>(0);
        for (j = 0; j < nv; j += simd::width<T>) vsum += xsimd::exp(simd::load(x + j) - vm);
        T sum = simd::reduce_add(vsum);
        for (; j < n; ++j) sum += std::exp(x[j] - mx);
        return mx + std::log(sum);
    }

    template <class T, class I>
    static void row_backward(const T* x, index_t n, I target, T lse, T scale, T* dx) {
        using B = simd::batch<T>;
        const index_t nv = simd::full_batches<T>(n);
        if (target < 0) {
            for (index_t j = 0; j < n; ++j) dx[j] = T(0);
            return;
        }
        const B vl = simd::splat(lse), vs = simd::splat(scale);
        index_t j = 0;
        for (; j < nv; j += simd::width<T>) simd::store(dx + j, vs * xsimd::exp(simd::load(x + j) - vl));
        for (; j < n; ++j) dx[j] = scale * std::exp(x[j] - lse);
        dx[target] -= scale;
    }
};

}  // namespace mnemo::cpu_kernels
