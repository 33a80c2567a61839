#pragma once
// Masked, numerically stable softmax over the rows of a [rows, cols] matrix, and its backward.
//   y[i, j] = exp(s·x[i, j] − m_i) / Σ_{k visible} exp(s·x[i, k] − m_i)   for visible j, else 0
// with m_i = max over visible s·x[i, k]. A row with nothing visible is all zeros (never NaN).
// Backward (y saved from forward): dx[i, j] = s · y[i, j] · (dy[i, j] − Σ_k y[i, k]·dy[i, k]).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "parallel.hpp"
#include "../../core/shape.hpp"
#include "simd.hpp"

namespace mnemo {

/// Which columns of each row a softmax may see. Both conditions apply when both are given.
///  causal: row i sees columns j <= causal_offset + i (keys are [memory, segment] with the memory
///          fully visible: causal_offset = memory length).
///  keep:   an explicit [rows, ld_keep] byte mask, nonzero = visible (padding masks).
struct softmax_mask {
    bool causal = false;
    index_t causal_offset = 0;
    const std::uint8_t* keep = nullptr;
    index_t ld_keep = 0;

    static softmax_mask none() { return {}; }
    static softmax_mask causal_from(index_t offset) { return {true, offset, nullptr, 0}; }
};

namespace cpu_kernels {

struct softmax {
    /// y = masked softmax(scale · x) over each row. x and y may alias.
    template <class T>
    static void softmax_forward(index_t rows, index_t cols, const T* x, index_t ldx, T* y, index_t ldy, T scale,
                                softmax_mask mask = {}) {
        parallel_range(rows, rows * cols >= 16384, [&](index_t i_begin, index_t i_end) {
        for (index_t i = i_begin; i < i_end; ++i) {
            const T* xi = x + i * ldx;
            T* yi = y + i * ldy;
            index_t n = cols;  // visible prefix
            if (mask.causal) n = std::max<index_t>(0, std::min<index_t>(cols, mask.causal_offset + i + 1));
            if (mask.keep) row_keep(xi, yi, cols, n, scale, mask.keep + i * mask.ld_keep);
            else row_prefix(xi, yi, cols, n, scale);
        }
        });
    }

    /// The unmasked softmax(scale · x) of a contiguous block [rows, cols] (row stride cols), in place.
    /// Rows shorter than the SIMD width have their exponentials taken over the whole block as one
    /// array, where row by row they would be all scalar std::exp calls (A's reconstruction loss: rows
    /// of 4 and 8 columns); longer rows go to softmax_forward. Same formula; the exponential is
    /// xsimd's, so the last bit may differ from softmax_forward's scalar tail.
    template <class T>
    static void softmax_contiguous(index_t rows, index_t cols, T* x, T scale) {
        using B = simd::batch<T>;
        constexpr index_t W = simd::width<T>;
        // double (a test type here) keeps the row path: g++ 12 warns inside xsimd's double exp when
        // it is inlined this way.
        if constexpr (!std::is_same_v<T, float>) {
            return softmax_forward(rows, cols, x, cols, x, cols, scale);
        } else {
            if (cols >= W) return softmax_forward(rows, cols, x, cols, x, cols, scale);
            if (cols <= 0) return;
            for (index_t i = 0; i < rows; ++i) {  // shift each row by its largest scaled value
                T* xi = x + i * cols;
                T shift = scale * xi[0];
                for (index_t j = 1; j < cols; ++j) shift = std::max(shift, scale * xi[j]);
                for (index_t j = 0; j < cols; ++j) xi[j] = scale * xi[j] - shift;
            }
            const index_t total = rows * cols, nv = simd::full_batches<T>(total);
            index_t k = 0;
            for (; k < nv; k += W) simd::store(x + k, xsimd::exp(simd::load(x + k)));
            if (k < total) {
                alignas(64) T tail[W];
                for (index_t t = 0; t < W; ++t) tail[t] = k + t < total ? x[k + t] : T(0);
                xsimd::exp(B::load_aligned(tail)).store_aligned(tail);
                for (index_t t = 0; k + t < total; ++t) x[k + t] = tail[t];
            }
            for (index_t i = 0; i < rows; ++i) {
                T* xi = x + i * cols;
                T sum = 0;
                for (index_t j = 0; j < cols; ++j) sum += xi[j];
                const T inv = T(1) / sum;
                for (index_t j = 0; j < cols; ++j) xi[j] *= inv;
            }
        }
    }

    /// dx = softmax backward given the forward output y and upstream dy. dx may alias dy. With a causal
    /// mask (its keep part is not needed: y is zero there), dy is read over each row's visible prefix
    /// only and dx is zero past it; the sums are those over the whole row (the zeros of y add
    /// nothing to a lane), so the bits do not depend on the mask.
    template <class T>
    static void softmax_backward(index_t rows, index_t cols, const T* y, index_t ldy, const T* dy, index_t lddy, T* dx,
                                 index_t lddx, T scale, softmax_mask mask = {}) {
        using B = simd::batch<T>;
        constexpr index_t W = simd::width<T>;
        const index_t nv = simd::full_batches<T>(cols);
        parallel_range(rows, rows * cols >= 16384, [&](index_t i_begin, index_t i_end) {
        for (index_t i = i_begin; i < i_end; ++i) {
            const T* yi = y + i * ldy;
            const T* dyi = dy + i * lddy;
            T* dxi = dx + i * lddx;
            const index_t n = mask.causal ? std::clamp<index_t>(mask.causal_offset + i + 1, 0, cols) : cols;
            const index_t nvn = simd::full_batches<T>(n);  // whole vectors inside the visible prefix
            B acc = simd::splat<T>(0);
            index_t j = 0;
            for (; j < nvn; j += W) acc = simd::fma(simd::load(yi + j), simd::load(dyi + j), acc);
            if (j < n && j < nv) {  // the vector the prefix ends in, zero past n (where y is zero)
                alignas(64) T ty[W] = {}, tdy[W] = {};
                for (index_t t = 0; j + t < n; ++t) {
                    ty[t] = yi[j + t];
                    tdy[t] = dyi[j + t];
                }
                acc = simd::fma(B::load_aligned(ty), B::load_aligned(tdy), acc);
                j += W;
            }
            T dot = simd::reduce_add(acc);
            // One explicit FMA a term: left to the compiler, the loop's bits would depend on its trip
            // count (g++ vectorizes long in-order reductions as products, then adds, unfused).
            for (j = std::max(j, nv); j < n; ++j) dot = std::fma(yi[j], dyi[j], dot);
            const B vdot = simd::splat(dot), vs = simd::splat(scale);
            for (j = 0; j < nvn; j += W) simd::store(dxi + j, vs * simd::load(yi + j) * (simd::load(dyi + j) - vdot));
            for (; j < n; ++j) dxi[j] = scale * yi[j] * (dyi[j] - dot);
            for (; j < cols; ++j) dxi[j] = T(0);
        }
        });
    }

private:
    // Columns [0, n) visible, [n, cols) masked.
    template <class T>
    static void row_prefix(const T* x, T* y, index_t cols, index_t n, T scale) {
        using B = simd::batch<T>;
        const index_t nv = simd::full_batches<T>(n);
        if (n == 0) {
            for (index_t j = 0; j < cols; ++j) y[j] = T(0);
            return;
        }
        B vmax = simd::splat(-std::numeric_limits<T>::infinity());
        index_t j = 0;
        for (; j < nv; j += simd::width<T>) vmax = xsimd::max(vmax, simd::load(x + j));
        T mx = simd::reduce_max(vmax);
        for (; j < n; ++j) mx = std::max(mx, x[j]);
        // max of scale·x is scale·max x for scale > 0, scale·min x otherwise; recompute for scale <= 0.
        T shift = scale * mx;
        if (!(scale > T(0))) {
            shift = scale * x[0];
            for (j = 1; j < n; ++j) shift = std::max(shift, scale * x[j]);
        }
        const B vs = simd::splat(scale), vshift = simd::splat(shift);
        B vsum = simd::splat<T>(0);
        for (j = 0; j < nv; j += simd::width<T>) {
            const B e = xsimd::exp(simd::fms(vs, simd::load(x + j), vshift));
            simd::store(y + j, e);
            vsum += e;
        }
        T sum = simd::reduce_add(vsum);
        for (; j < n; ++j) {
            y[j] = std::exp(scale * x[j] - shift);
            sum += y[j];
        }
        const T inv = T(1) / sum;
        const B vinv = simd::splat(inv);
        for (j = 0; j < nv; j += simd::width<T>) simd::store(y + j, simd::load(y + j) * vinv);
        for (; j < n; ++j) y[j] *= inv;
        for (j = n; j < cols; ++j) y[j] = T(0);
    }

    // Prefix [0, n) and an explicit keep mask (scalar: padding masks are the uncommon path).
    template <class T>
    static void row_keep(const T* x, T* y, index_t cols, index_t n, T scale, const std::uint8_t* keep) {
        T shift = -std::numeric_limits<T>::infinity();
        bool any = false;
        for (index_t j = 0; j < n; ++j)
            if (keep[j]) { shift = any ? std::max(shift, scale * x[j]) : scale * x[j]; any = true; }
        T sum = 0;
        for (index_t j = 0; j < cols; ++j) {
            const T e = (j < n && keep[j]) ? std::exp(scale * x[j] - shift) : T(0);
            y[j] = e;
            sum += e;
        }
        if (!any) return;
        const T inv = T(1) / sum;
        for (index_t j = 0; j < n; ++j) y[j] *= inv;
    }
};

}  // namespace cpu_kernels
}  // namespace mnemo
