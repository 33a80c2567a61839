#pragma once
// Layer normalisation over the last axis (Ba et al., 2016), as torch.nn.LayerNorm:
//   μ = mean(x),  σ² = mean((x − μ)²) (biased),  r = 1/sqrt(σ² + eps),  y = (x − μ)·r·w + b
// Backward, with x̂ = (x − μ)·r and g = dy·w:
//   dx = r · (g − mean(g) − x̂ · mean(g·x̂))            (assigned, or added when accumulate_dx)
//   dw += Σ_rows dy·x̂,   db += Σ_rows dy               (accumulated)
// dw/db are reduced over rows in a fixed order (threads split the columns), so the result does not
// depend on the thread count.
#include <cmath>

#include "parallel.hpp"
#include "../../core/shape.hpp"
#include "simd.hpp"

namespace mnemo::cpu_kernels {

struct layer_norm {
    /// ẑ[rows, d] = (x − mean)·rstd with the statistics a forward saved (the normalised input before
    /// the affine scale and shift), as that forward computes it.
    template <class T>
    static void layer_norm_normalize(index_t rows, index_t d, const T* x, index_t ldx, const T* mean, const T* rstd,
                                     T* z, index_t ldz) {
        parallel_range(rows, rows * d >= parallel_min_elements, [&](index_t i_begin, index_t i_end) {
            for (index_t i = i_begin; i < i_end; ++i) {
                const T *xi = x + i * ldx, mu = mean[i], r = rstd[i];
                T* zi = z + i * ldz;
                for (index_t j = 0; j < d; ++j) zi[j] = (xi[j] - mu) * r;
            }
        });
    }

    /// y[rows, d] = LN(x); mean[rows] and rstd[rows] are saved for backward (either may be null). w or
    /// b may be null (no affine scale / shift). With xhat, the normalised rows x̂ = (x − μ)·r are
    /// written there too (bitwise what layer_norm_normalize would give), in the same pass; with y null,
    /// only there. With xhat_batch > 0, x's rows are (position, batch element) pairs, row
    /// p·xhat_batch + b, and x̂'s row for it goes to xhat + b·xhat_ld_batch + p·ldxh: by batch element
    /// (the absorbed attention reads one batch element's memory rows at a time).
    template <class T>
    static void layer_norm_forward(index_t rows, index_t d, const T* x, index_t ldx, const T* w, const T* b, T eps,
                                   T* y, index_t ldy, T* mean, T* rstd, T* xhat = nullptr, index_t ldxh = 0,
                                   index_t xhat_batch = 0, index_t xhat_ld_batch = 0) {
        using B = simd::batch<T>;
        constexpr index_t W = simd::width<T>;
        const index_t nv = simd::full_batches<T>(d);
        // R rows at a time: each row's sums are one chain over its vectors (the latency of a row of
        // a few vectors is the chain's), so interleaving rows runs R chains at once. Every row is
        // summed in the same order whatever R, so the bits do not depend on it.
        auto rows_at_once = [&]<index_t R>(index_t i0) {
            const T* xs[R];
            for (index_t k = 0; k < R; ++k) xs[k] = x + (i0 + k) * ldx;
            B acc[R];
            for (index_t k = 0; k < R; ++k) acc[k] = simd::splat<T>(0);
            for (index_t j = 0; j < nv; j += W)
                for (index_t k = 0; k < R; ++k) acc[k] += simd::load(xs[k] + j);
            T mu[R], r[R];
            for (index_t k = 0; k < R; ++k) {
                T sum = simd::reduce_add(acc[k]);
                for (index_t j = nv; j < d; ++j) sum += xs[k][j];
                mu[k] = sum / T(d);
                acc[k] = simd::splat<T>(0);
            }
            for (index_t j = 0; j < nv; j += W)
                for (index_t k = 0; k < R; ++k) {
                    const B c = simd::load(xs[k] + j) - simd::splat(mu[k]);
                    acc[k] = simd::fma(c, c, acc[k]);
                }
            for (index_t k = 0; k < R; ++k) {
                T ss = simd::reduce_add(acc[k]);
                for (index_t j = nv; j < d; ++j) ss += (xs[k][j] - mu[k]) * (xs[k][j] - mu[k]);
                r[k] = T(1) / std::sqrt(ss / T(d) + eps);
            }
            for (index_t k = 0; k < R; ++k) {
                const index_t i = i0 + k;
                const T* xi = xs[k];
                if (mean) mean[i] = mu[k];
                if (rstd) rstd[i] = r[k];
                const B vmu = simd::splat(mu[k]), vr = simd::splat(r[k]);
                T* yi = y ? y + i * ldy : nullptr;
                T* hi = !xhat            ? nullptr
                        : xhat_batch > 0 ? xhat + (i % xhat_batch) * xhat_ld_batch + (i / xhat_batch) * ldxh
                                         : xhat + i * ldxh;
                index_t j = 0;
                if (!yi) {  // x̂ only (or only the statistics, when xhat is null too)
                    if (!hi) continue;
                    for (; j < nv; j += W) simd::store(hi + j, (simd::load(xi + j) - vmu) * vr);
                    for (; j < d; ++j) hi[j] = (xi[j] - mu[k]) * r[k];
                    continue;
                }
                for (; j < nv; j += W) {
                    B v = (simd::load(xi + j) - vmu) * vr;
                    if (hi) simd::store(hi + j, v);
                    if (w) v *= simd::load(w + j);
                    if (b) v += simd::load(b + j);
                    simd::store(yi + j, v);
                }
                for (; j < d; ++j) {
                    T v = (xi[j] - mu[k]) * r[k];
                    if (hi) hi[j] = v;
                    if (w) v *= w[j];
                    if (b) v += b[j];
                    yi[j] = v;
                }
            }
        };
        parallel_range(rows, rows * d >= parallel_min_elements, [&](index_t i_begin, index_t i_end) {
            index_t i = i_begin;
            for (; i + 4 <= i_end; i += 4) rows_at_once.template operator()<4>(i);
            for (; i < i_end; ++i) rows_at_once.template operator()<1>(i);
        });
    }

    /// dx = LN backward (assigned, or added when accumulate_dx; may be null); dw, db accumulated (may be null).
    template <class T>
    static void layer_norm_backward(index_t rows, index_t d, const T* x, index_t ldx, const T* w, const T* mean,
                                    const T* rstd, const T* dy, index_t lddy, T* dx, index_t lddx, T* dw, T* db,
                                    bool accumulate_dx = false) {
        using B = simd::batch<T>;
        const index_t nv = simd::full_batches<T>(d);
        if (dx) {
            parallel_range(rows, rows * d >= parallel_min_elements, [&](index_t i_begin, index_t i_end) {
            for (index_t i = i_begin; i < i_end; ++i) {
                const T* xi = x + i * ldx;
                const T* dyi = dy + i * lddy;
                T* dxi = dx + i * lddx;
                const T mu = mean[i], r = rstd[i];
                const B vmu = simd::splat(mu), vr = simd::splat(r);
                B sg = simd::splat<T>(0), sgx = simd::splat<T>(0);
                index_t j = 0;
                for (; j < nv; j += simd::width<T>) {
                    B g = simd::load(dyi + j);
                    if (w) g *= simd::load(w + j);
                    const B xh = (simd::load(xi + j) - vmu) * vr;
                    sg += g;
                    sgx = simd::fma(g, xh, sgx);
                }
                T mg = simd::reduce_add(sg), mgx = simd::reduce_add(sgx);
                for (; j < d; ++j) {
                    const T g = w ? dyi[j] * w[j] : dyi[j];
                    mg += g;
                    mgx += g * (xi[j] - mu) * r;
                }
                mg /= T(d);
                mgx /= T(d);
                const B vmg = simd::splat(mg), vmgx = simd::splat(mgx);
                for (j = 0; j < nv; j += simd::width<T>) {
                    B g = simd::load(dyi + j);
                    if (w) g *= simd::load(w + j);
                    const B xh = (simd::load(xi + j) - vmu) * vr;
                    B v = vr * (g - vmg - xh * vmgx);
                    if (accumulate_dx) v += simd::load(dxi + j);
                    simd::store(dxi + j, v);
                }
                for (; j < d; ++j) {
                    const T g = w ? dyi[j] * w[j] : dyi[j];
                    const T v = r * (g - mg - (xi[j] - mu) * r * mgx);
                    dxi[j] = accumulate_dx ? dxi[j] + v : v;
                }
            }
            });
        }
        if (dw || db) {
            // Threads own column blocks; each sums its columns over all rows in row order.
            constexpr index_t block = 64;
            const index_t nblocks = (d + block - 1) / block;
            parallel_range(nblocks, rows * d >= parallel_min_elements, [&](index_t cb_begin, index_t cb_end) {
            for (index_t cb = cb_begin; cb < cb_end; ++cb) {
                const index_t j0 = cb * block, j1 = std::min(d, j0 + block);
                for (index_t i = 0; i < rows; ++i) {
                    const T* xi = x + i * ldx;
                    const T* dyi = dy + i * lddy;
                    const T mu = mean[i], r = rstd[i];
                    for (index_t j = j0; j < j1; ++j) {
                        if (dw) dw[j] += dyi[j] * ((xi[j] - mu) * r);
                        if (db) db[j] += dyi[j];
                    }
                }
            }
            });
        }
    }
};

}  // namespace mnemo::cpu_kernels
