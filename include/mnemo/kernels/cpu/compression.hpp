#pragma once
// The compression functions' time-axis kernels (nn/compression/: conv, pooling, dilated_conv and the
// auto-encoding loss use them): the im2col gather of Rate consecutive memory slots and its scatter,
// max and mean pooling over them, and their backward passes.
#include <cmath>
#include <cstddef>

#include "parallel.hpp"
#include "../../core/shape.hpp"

namespace mnemo::cpu_kernels {


/// Time-axis gathers and poolings of the compression functions. Arguments: `out_rows` = n·batch
/// compressed rows, memory row (s·Rate + t)·batch + b for output row s·batch + b, `d` features,
/// `ld*` row strides in elements. Output rows are independent, so threads split them. Rate may be
/// `dynamic`: the rate is then the last argument, `rate` (ignored for a static Rate).
struct compression {
    /// x[r, i·Rate + t] = mem[(s·Rate + t)·batch + b, i] for r = s·batch + b   (x [out_rows, d·Rate], dense)
    template <std::size_t Rate, class T>
    static void im2col_time(index_t out_rows, index_t batch, index_t d, const T* mem, index_t ldm, T* x,
                            index_t rate = index_t(Rate)) {
        const index_t c = Rate != dynamic ? static_cast<index_t>(Rate) : rate;
        parallel_range(out_rows, out_rows * d * c >= parallel_min_elements, [&](index_t r_begin, index_t r_end) {
        for (index_t r = r_begin; r < r_end; ++r) {
            const index_t s = r / batch, b = r % batch;
            T* xr = x + r * d * c;
            for (index_t t = 0; t < c; ++t) {
                const T* m = mem + ((s * c + t) * batch + b) * ldm;
                for (index_t i = 0; i < d; ++i) xr[i * c + t] = m[i];
            }
        }
        });
    }

    /// The inverse of im2col_time: d_mem[(s·Rate + t)·batch + b, i] = dx[r, i·Rate + t] (assigned).
    template <std::size_t Rate, class T>
    static void col2im_time(index_t out_rows, index_t batch, index_t d, const T* dx, T* d_mem, index_t ldm,
                            index_t rate = index_t(Rate)) {
        const index_t c = Rate != dynamic ? static_cast<index_t>(Rate) : rate;
        parallel_range(out_rows, out_rows * d * c >= parallel_min_elements, [&](index_t r_begin, index_t r_end) {
        for (index_t r = r_begin; r < r_end; ++r) {
            const index_t s = r / batch, b = r % batch;
            const T* xr = dx + r * d * c;
            for (index_t t = 0; t < c; ++t) {
                T* m = d_mem + ((s * c + t) * batch + b) * ldm;
                for (index_t i = 0; i < d; ++i) m[i] = xr[i * c + t];
            }
        }
        });
    }

    /// out[r, i] = max_t mem[(s·Rate + t)·batch + b, i]; arg[r·d + i] = the first t attaining it.
    template <std::size_t Rate, class T, class I>
    static void max_pool_time_forward(index_t out_rows, index_t batch, index_t d, const T* mem, index_t ldm, T* out,
                                      index_t ldo, I* arg, index_t rate = index_t(Rate)) {
        const index_t c = Rate != dynamic ? static_cast<index_t>(Rate) : rate;
        parallel_range(out_rows, out_rows * d * c >= parallel_min_elements, [&](index_t r_begin, index_t r_end) {
        for (index_t r = r_begin; r < r_end; ++r) {
            const index_t s = r / batch, b = r % batch;
            T* o = out + r * ldo;
            I* a = arg + r * d;
            const T* m0 = mem + (s * c * batch + b) * ldm;
            for (index_t i = 0; i < d; ++i) {
                o[i] = m0[i];
                a[i] = I(0);
            }
            for (index_t t = 1; t < c; ++t) {
                const T* m = mem + ((s * c + t) * batch + b) * ldm;
                for (index_t i = 0; i < d; ++i) {
                    if (m[i] > o[i] || std::isnan(m[i])) {  // as PyTorch: ties keep the first, NaN wins
                        o[i] = m[i];
                        a[i] = static_cast<I>(t);
                    }
                }
            }
        }
        });
    }

    /// d_mem[(s·Rate + t)·batch + b, i] = d_out[r, i] where t = arg[r·d + i], else 0 (assigned).
    template <std::size_t Rate, class T, class I>
    static void max_pool_time_backward(index_t out_rows, index_t batch, index_t d, const T* d_out, index_t ldo,
                                       const I* arg, T* d_mem, index_t ldm, index_t rate = index_t(Rate)) {
        const index_t c = Rate != dynamic ? static_cast<index_t>(Rate) : rate;
        parallel_range(out_rows, out_rows * d * c >= parallel_min_elements, [&](index_t r_begin, index_t r_end) {
        for (index_t r = r_begin; r < r_end; ++r) {
            const index_t s = r / batch, b = r % batch;
            const T* g = d_out + r * ldo;
            const I* a = arg + r * d;
            for (index_t t = 0; t < c; ++t) {
                T* m = d_mem + ((s * c + t) * batch + b) * ldm;
                for (index_t i = 0; i < d; ++i) m[i] = static_cast<index_t>(a[i]) == t ? g[i] : T(0);
            }
        }
        });
    }

    /// out[r, i] = (Σ_t mem[(s·Rate + t)·batch + b, i]) / Rate, summed in t order.
    template <std::size_t Rate, class T>
    static void mean_pool_time_forward(index_t out_rows, index_t batch, index_t d, const T* mem, index_t ldm, T* out,
                                       index_t ldo, index_t rate = index_t(Rate)) {
        const index_t c = Rate != dynamic ? static_cast<index_t>(Rate) : rate;
        const T divisor = static_cast<T>(c);
        parallel_range(out_rows, out_rows * d * c >= parallel_min_elements, [&](index_t r_begin, index_t r_end) {
        for (index_t r = r_begin; r < r_end; ++r) {
            const index_t s = r / batch, b = r % batch;
            T* o = out + r * ldo;
            const T* m0 = mem + (s * c * batch + b) * ldm;
            for (index_t i = 0; i < d; ++i) o[i] = m0[i];
            for (index_t t = 1; t < c; ++t) {
                const T* m = mem + ((s * c + t) * batch + b) * ldm;
                for (index_t i = 0; i < d; ++i) o[i] += m[i];
            }
            for (index_t i = 0; i < d; ++i) o[i] /= divisor;
        }
        });
    }

    /// d_mem[(s·Rate + t)·batch + b, i] = d_out[r, i] / Rate for every t (assigned).
    template <std::size_t Rate, class T>
    static void mean_pool_time_backward(index_t out_rows, index_t batch, index_t d, const T* d_out, index_t ldo,
                                        T* d_mem, index_t ldm, index_t rate = index_t(Rate)) {
        const index_t c = Rate != dynamic ? static_cast<index_t>(Rate) : rate;
        const T divisor = static_cast<T>(c);
        parallel_range(out_rows, out_rows * d * c >= parallel_min_elements, [&](index_t r_begin, index_t r_end) {
        for (index_t r = r_begin; r < r_end; ++r) {
            const index_t s = r / batch, b = r % batch;
            const T* g = d_out + r * ldo;
            for (index_t t = 0; t < c; ++t) {
                T* m = d_mem + ((s * c + t) * batch + b) * ldm;
                for (index_t i = 0; i < d; ++i) m[i] = g[i] / divisor;
            }
        }
        });
    }
};

}  // namespace mnemo::cpu_kernels
