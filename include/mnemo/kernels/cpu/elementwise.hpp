#pragma once
// Small row-wise helpers: bias broadcast, column sums (bias gradients), adds and copies.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <span>
#include <type_traits>

#include "parallel.hpp"
#include "../../core/shape.hpp"
#include "simd.hpp"

namespace mnemo::cpu_kernels {

struct elementwise {
    /// C[i, :] += b for every row.
    template <class T>
    static void add_bias_rows(index_t rows, index_t n, const T* b, T* c, index_t ldc) {
        const index_t nv = simd::full_batches<T>(n);
        parallel_range(rows, rows * n >= parallel_min_elements, [&](index_t i_begin, index_t i_end) {
        for (index_t i = i_begin; i < i_end; ++i) {
            T* ci = c + i * ldc;
            index_t j = 0;
            for (; j < nv; j += simd::width<T>) simd::store(ci + j, simd::load(ci + j) + simd::load(b + j));
            for (; j < n; ++j) ci[j] += b[j];
        }
        });
    }

    /// db[j] += Σ_i dy[i, j], summed in row order (threads split the columns: deterministic).
    template <class T>
    static void sum_rows_accumulate(index_t rows, index_t n, const T* dy, index_t ld, T* db) {
        constexpr index_t block = 64;
        const index_t nblocks = (n + block - 1) / block;
        parallel_range(nblocks, rows * n >= parallel_min_elements, [&](index_t cb_begin, index_t cb_end) {
        for (index_t cb = cb_begin; cb < cb_end; ++cb) {
            const index_t j0 = cb * block, j1 = std::min(n, j0 + block);
            for (index_t i = 0; i < rows; ++i) {
                const T* di = dy + i * ld;
                for (index_t j = j0; j < j1; ++j) db[j] += di[j];
            }
        }
        });
    }

    /// y[i, :] = a[i, :] + b[i, :]   (y may alias a or b; ldb = 0 adds b's one row to every row)
    template <class T>
    static void add(index_t rows, index_t n, const T* a, index_t lda, const T* b, index_t ldb, T* y, index_t ldy) {
        const index_t nv = simd::full_batches<T>(n);
        parallel_range(rows, rows * n >= parallel_min_elements, [&](index_t i_begin, index_t i_end) {
        for (index_t i = i_begin; i < i_end; ++i) {
            const T* ai = a + i * lda;
            const T* bi = b + i * ldb;
            T* yi = y + i * ldy;
            index_t j = 0;
            for (; j < nv; j += simd::width<T>) simd::store(yi + j, simd::load(ai + j) + simd::load(bi + j));
            for (; j < n; ++j) yi[j] = ai[j] + bi[j];
        }
        });
    }

    /// y[i, :] = x[i, :]∘g + b (one thread: a layer's memory rows, short)
    template <class T>
    static void scale_shift_rows(index_t rows, index_t n, const T* x, index_t ldx, const T* g, const T* b, T* y,
                                 index_t ldy) {
        for (index_t r = 0; r < rows; ++r) {
            const T* xr = x + r * ldx;
            T* yr = y + r * ldy;
#pragma omp simd
            for (index_t i = 0; i < n; ++i) yr[i] = xr[i] * g[i] + b[i];
        }
    }

    /// y[i] += a·x[i] over n elements (one thread).
    template <class T>
    static void axpy(index_t n, T a, const T* x, T* y) {
        for (index_t k = 0; k < n; ++k) y[k] += a * x[k];
    }

    /// y[r, :] = Σ_l w[l]·x_l[r, :] over the n = x.size() inputs x_l (row stride ldx each) with the n
    /// weights w, in the order y = w_0·x_0, then y += w_l·x_l for l = 1 … n − 1 (one thread). x and w
    /// are host metadata (spans: the pointers and the scalars), the rows the backend's memory.
    template <class T>
    static void weighted_sum_rows(index_t rows, index_t d, std::span<const T* const> x, index_t ldx, std::span<const T> w,
                                  T* y, index_t ldy) {
        const index_t n = index_t(x.size());
        for (index_t r = 0; r < rows; ++r) {
            T* m = y + r * ldy;
            const T w0 = w[0];
            const T* x0 = x[0] + r * ldx;
            for (index_t k = 0; k < d; ++k) m[k] = w0 * x0[k];
            for (index_t l = 1; l < n; ++l) {
                const T wl = w[l];
                const T* xl = x[l] + r * ldx;
                for (index_t k = 0; k < d; ++k) m[k] += wl * xl[k];
            }
        }
    }

    /// sum[0] = Σ x[i] in double, in index order (a loss's per-row values).
    template <class T>
    static void sum_as_double(index_t n, const T* x, double* sum) {
        double s = 0;
        for (index_t i = 0; i < n; ++i) s += double(x[i]);
        *sum = s;
    }

    /// y[i, :] = x[i, :]   (y += x when accumulate)
    template <class T>
    static void copy(index_t rows, index_t n, const T* x, index_t ldx, T* y, index_t ldy, bool accumulate = false) {
        const index_t nv = simd::full_batches<T>(n);
        parallel_range(rows, rows * n >= parallel_min_elements, [&](index_t i_begin, index_t i_end) {
        for (index_t i = i_begin; i < i_end; ++i) {
            const T* xi = x + i * ldx;
            T* yi = y + i * ldy;
            index_t j = 0;
            if (accumulate) {
                for (; j < nv; j += simd::width<T>) simd::store(yi + j, simd::load(yi + j) + simd::load(xi + j));
                for (; j < n; ++j) yi[j] += xi[j];
            } else {
                for (; j < n; ++j) yi[j] = xi[j];
            }
        }
        });
    }

    /// y[0, n) = x[0, n) on the calling thread, for a block written now and read again much later
    /// (the attention weights forward keeps for backward). With `stream`, float on x86 with AVX,
    /// y's whole 64-byte lines are written with non-temporal stores: they go to memory without
    /// first reading the lines they replace into the caches, and without evicting the caches'
    /// working set. Call copy_fence() before another thread reads y. A copy: the bits are x's
    /// either way.
    template <class T>
    static void copy_block(index_t n, const T* x, T* y, bool stream) {
        index_t j = 0;
        if constexpr (simd::streams<T>) {
            if (stream) {
                constexpr index_t W = simd::width<T>;
                for (; j < n && reinterpret_cast<std::uintptr_t>(y + j) % 64 != 0; ++j) y[j] = x[j];
                for (; j + W <= n; j += W) simd::stream_store(y + j, simd::load(x + j));
            }
        }
        if (j < n) std::memcpy(y + j, x + j, sizeof(T) * std::size_t(n - j));
    }
    /// Orders this thread's copy_block stores before what follows (non-temporal stores are not
    /// ordered by x86's usual rules).
    static void copy_fence() { simd::stream_fence(); }

    /// y[i, :] = s · x[i, :]   (in place when y == x)
    template <class T>
    static void scale(index_t rows, index_t n, const T* x, index_t ldx, T s, T* y, index_t ldy) {
        parallel_range(rows, rows * n >= parallel_min_elements, [&](index_t i_begin, index_t i_end) {
        for (index_t i = i_begin; i < i_end; ++i) {
            const T* xi = x + i * ldx;
            T* yi = y + i * ldy;
            for (index_t j = 0; j < n; ++j) yi[j] = xi[j] * s;
        }
        });
    }

    /// x[i] *= numerator / T(index_t(count[0]) · per_count) for i in [0, n); x = 0 when count[0] is 0.
    /// count is a count kept in backend memory (a reconstruction loss's unpadded rows), so the scale
    /// of a mean's gradient needs no read on the host. The factor is formed in T, then multiplies.
    template <class T>
    static void scale_by_count(index_t n, T* x, const double* count, index_t per_count, T numerator) {
        const index_t m = index_t(count[0]) * per_count;
        const T s = m > 0 ? numerator / T(m) : T(0);
        scale(1, n, x, n, s, x, n);
    }

    /// y[i, :] = table[ids[i], :]   (ids already checked to lie in [0, rows of table))
    template <class T, class I>
    static void gather_rows(index_t rows, index_t n, const I* ids, const T* table, index_t ldt, T* y, index_t ldy) {
        parallel_range(rows, rows * n >= parallel_min_elements, [&](index_t i_begin, index_t i_end) {
        for (index_t i = i_begin; i < i_end; ++i) {
            const T* src = table + static_cast<index_t>(ids[i]) * ldt;
            T* yi = y + i * ldy;
            for (index_t j = 0; j < n; ++j) yi[j] = src[j];
        }
        });
    }

    /// table[ids[i], :] += dy[i, :], in row order (threads split the columns: deterministic, and no
    /// two threads ever add into the same element even when ids repeat).
    template <class T, class I>
    static void scatter_add_rows(index_t rows, index_t n, const I* ids, const T* dy, index_t ld, T* table, index_t ldt) {
        constexpr index_t block = 64;
        const index_t nblocks = (n + block - 1) / block;
        parallel_range(nblocks, rows * n >= parallel_min_elements, [&](index_t cb_begin, index_t cb_end) {
        for (index_t cb = cb_begin; cb < cb_end; ++cb) {
            const index_t j0 = cb * block, j1 = std::min(n, j0 + block);
            for (index_t i = 0; i < rows; ++i) {
                const T* di = dy + i * ld;
                T* ti = table + static_cast<index_t>(ids[i]) * ldt;
                for (index_t j = j0; j < j1; ++j) ti[j] += di[j];
            }
        }
        });
    }
};

}  // namespace mnemo::cpu_kernels
