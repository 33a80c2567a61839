// The compression functions' time-axis kernels (kernels/cpu/compression.hpp, kernels/cpu/most_used.hpp):
// the im2col gather of `rate` consecutive memory slots and its scatter, max and mean pooling over them,
// most-used selection, their backward passes, and the per-key attention mass of most-used compression.
//
// Layouts as on the CPU: out_rows = n·batch compressed rows; output row r = s·batch + b reads memory
// rows (s·rate + t)·batch + b for t in [0, rate); ld* are row strides in elements. The memory rows of
// different (r, t) are different rows (the windows do not overlap: stride = kernel = rate), so every
// kernel here gives each thread its own output element and no two threads write the same address; no
// atomics. Each kernel is one grid-stride launch over its outputs, the feature index fastest, so
// neighbouring threads touch neighbouring addresses of the row-major buffers.
#include <cstdint>

#include "common.cuh"
#include "device_math.cuh"
#include "mnemo/kernels/cuda/kernels.hpp"

namespace mnemo::cuda_kernels {
namespace {

using namespace cuda_detail;  // common.cuh, device_math.cuh

constexpr unsigned threads = 256;

// The memory row that output row r reads at window step t.
__device__ inline index_t memory_row(index_t r, index_t t, index_t rate, index_t batch) {
    const index_t s = r / batch, b = r - s * batch;
    return (s * rate + t) * batch + b;
}

void check_extents(const char* who, index_t rate, index_t out_rows, index_t batch, index_t d) {
    MNEMO_CHECK(rate >= 1 && out_rows >= 0 && d >= 0 && (out_rows == 0 || batch >= 1), who,
                ": bad extents (rate ", rate, ", out_rows ", out_rows, ", batch ", batch, ", d ", d, ")");
}

// ---- forward gathers, one thread per output element (r, i) or (r, i, t) ---------------------------------

// x[r, i·rate + t] = mem[(s·rate + t)·batch + b, i]; x dense [out_rows, d·rate], thread e = x's element e.
template <class T>
__global__ void __launch_bounds__(threads)
    im2col_kernel(index_t total, index_t rate, index_t batch, index_t d, const T* __restrict__ mem, index_t ldm,
                  T* __restrict__ x) {
    const index_t width = d * rate;
    for (index_t e = global_index(); e < total; e += global_stride()) {
        const index_t r = e / width, rem = e - r * width, i = rem / rate, t = rem - i * rate;
        x[e] = mem[memory_row(r, t, rate, batch) * ldm + i];
    }
}

// out[r, i] = max_t, arg[r·d + i] = the first t attaining it (a NaN wins, and a later NaN replaces it).
template <class T, class I>
__global__ void __launch_bounds__(threads)
    max_pool_kernel(index_t total, index_t rate, index_t batch, index_t d, const T* __restrict__ mem, index_t ldm,
                    T* __restrict__ out, index_t ldo, I* __restrict__ arg) {
    for (index_t e = global_index(); e < total; e += global_stride()) {
        const index_t r = e / d, i = e - r * d;
        const T* m = mem + memory_row(r, 0, rate, batch) * ldm + i;
        const index_t step = batch * ldm;  // from window step t to t + 1
        T best = m[0];
        index_t at = 0;
        for (index_t t = 1; t < rate; ++t) {
            const T v = m[t * step];
            if (v > best || isnan(v)) {  // the CPU's test, in its order
                best = v;
                at = t;
            }
        }
        out[r * ldo + i] = best;
        arg[e] = static_cast<I>(at);
    }
}

// out[r, i] = (Σ_t mem[...]) / rate, summed in t order from the first slot, then one division.
template <class T>
__global__ void __launch_bounds__(threads)
    mean_pool_kernel(index_t total, index_t rate, index_t batch, index_t d, const T* __restrict__ mem, index_t ldm,
                     T* __restrict__ out, index_t ldo) {
    const T divisor = static_cast<T>(rate);
    for (index_t e = global_index(); e < total; e += global_stride()) {
        const index_t r = e / d, i = e - r * d;
        const T* m = mem + memory_row(r, 0, rate, batch) * ldm + i;
        const index_t step = batch * ldm;
        T acc = m[0];
        for (index_t t = 1; t < rate; ++t) acc = add_rn(acc, m[t * step]);
        out[r * ldo + i] = div_rn(acc, divisor);
    }
}

// Most-used selection: thread e = (r, i) over out_rows × max(d, 1) (so that arg is written when d = 0).
// Each thread finds its row's slot itself (rate reads of usage, shared through the cache by the row's
// threads); thread i = 0 writes arg[r].
template <class T, class I>
__global__ void __launch_bounds__(threads)
    most_used_kernel(index_t total, index_t rate, index_t batch, index_t d, const T* __restrict__ usage,
                     const T* __restrict__ mem, index_t ldm, T* __restrict__ out, index_t ldo, I* __restrict__ arg) {
    const index_t width = d > 0 ? d : 1;
    for (index_t e = global_index(); e < total; e += global_stride()) {
        const index_t r = e / width, i = e - r * width;
        const index_t first = memory_row(r, 0, rate, batch);
        index_t best = 0;
        T best_u = usage[first];
        for (index_t t = 1; t < rate; ++t) {
            const T u = usage[first + t * batch];
            if (u > best_u || (isnan(best_u) && !isnan(u))) {  // ties keep the first; a NaN never wins
                best = t;
                best_u = u;
            }
        }
        if (i == 0) arg[r] = static_cast<I>(best);
        if (i < d) out[r * ldo + i] = mem[(first + best * batch) * ldm + i];
    }
}

// ---- backward scatters: thread e = (r, t, i) owns d_mem[(s·rate + t)·batch + b, i] and assigns it ----------

struct col2im_value {  // dx[r, i·rate + t]
    template <class T>
    __device__ T operator()(index_t r, index_t t, index_t i, index_t rate, index_t d, const T* g, index_t,
                            const void*) const {
        return g[r * d * rate + i * rate + t];
    }
};
template <class I>
struct max_pool_value {  // d_out[r, i] where arg[r·d + i] = t, else 0
    template <class T>
    __device__ T operator()(index_t r, index_t t, index_t i, index_t, index_t d, const T* g, index_t ldg,
                            const void* arg) const {
        return static_cast<index_t>(static_cast<const I*>(arg)[r * d + i]) == t ? g[r * ldg + i] : T(0);
    }
};
struct mean_pool_value {  // d_out[r, i] / rate
    template <class T>
    __device__ T operator()(index_t r, index_t, index_t i, index_t rate, index_t, const T* g, index_t ldg,
                            const void*) const {
        return div_rn(g[r * ldg + i], static_cast<T>(rate));
    }
};
template <class I>
struct most_used_value {  // d_out[r, i] where arg[r] = t, else 0
    template <class T>
    __device__ T operator()(index_t r, index_t t, index_t i, index_t, index_t, const T* g, index_t ldg,
                            const void* arg) const {
        return static_cast<index_t>(static_cast<const I*>(arg)[r]) == t ? g[r * ldg + i] : T(0);
    }
};

template <class T, class F>
__global__ void __launch_bounds__(threads)
    scatter_kernel(F f, index_t total, index_t rate, index_t batch, index_t d, const T* __restrict__ g, index_t ldg,
                   const void* __restrict__ arg, T* __restrict__ d_mem, index_t ldm) {
    for (index_t e = global_index(); e < total; e += global_stride()) {
        const index_t rt = e / d, i = e - rt * d, r = rt / rate, t = rt - r * rate;
        d_mem[memory_row(r, t, rate, batch) * ldm + i] = f(r, t, i, rate, d, g, ldg, arg);
    }
}

template <class T, class F>
void scatter(const char* name, F f, index_t rate, index_t out_rows, index_t batch, index_t d, const T* g, index_t ldg,
             const void* arg, T* d_mem, index_t ldm) {
    check_extents(name, rate, out_rows, batch, d);
    const index_t total = out_rows * rate * d;
    if (total == 0) return;
    scatter_kernel<T><<<blocks_for(total, threads), threads, 0, cuda_detail::stream()>>>(f, total, rate, batch, d, g,
                                                                                         ldg, arg, d_mem, ldm);
    MNEMO_CUDA_LAUNCHED(name);
}

// usage[j·batch + b] += Σ_h Σ_i probs[((b·heads + h)·q + i)·k + j]: thread e = (b, j) owns usage[j·batch + b]
// and adds the terms to it one at a time, heads outer and queries inner, exactly the CPU's sequence of
// roundings. Neighbouring threads read neighbouring j of one probability row.
template <class T>
__global__ void __launch_bounds__(threads)
    key_usage_kernel(index_t total, index_t batch, index_t heads, index_t q, index_t k, const T* __restrict__ probs,
                     T* __restrict__ usage) {
    const index_t rows = heads * q;  // the (h, i) rows of one batch element, in (h outer, i inner) order
    for (index_t e = global_index(); e < total; e += global_stride()) {
        const index_t b = e / k, j = e - b * k;
        const T* p = probs + b * rows * k + j;
        T acc = usage[j * batch + b];
#pragma unroll 4
        for (index_t row = 0; row < rows; ++row) acc = add_rn(acc, p[row * k]);
        usage[j * batch + b] = acc;
    }
}

}  // namespace

template <class T>
void im2col_time(index_t rate, index_t out_rows, index_t batch, index_t d, const T* mem, index_t ldm, T* x) {
    check_extents("im2col_time", rate, out_rows, batch, d);
    const index_t total = out_rows * d * rate;
    if (total == 0) return;
    im2col_kernel<<<blocks_for(total, threads), threads, 0, cuda_detail::stream()>>>(total, rate, batch, d, mem, ldm, x);
    MNEMO_CUDA_LAUNCHED("im2col_time");
}

template <class T>
void col2im_time(index_t rate, index_t out_rows, index_t batch, index_t d, const T* dx, T* d_mem, index_t ldm) {
    scatter("col2im_time", col2im_value{}, rate, out_rows, batch, d, dx, 0, nullptr, d_mem, ldm);
}

template <class T, class I>
void max_pool_time_forward(index_t rate, index_t out_rows, index_t batch, index_t d, const T* mem, index_t ldm, T* out,
                           index_t ldo, I* arg) {
    check_extents("max_pool_time_forward", rate, out_rows, batch, d);
    const index_t total = out_rows * d;
    if (total == 0) return;
    max_pool_kernel<<<blocks_for(total, threads), threads, 0, cuda_detail::stream()>>>(total, rate, batch, d, mem, ldm,
                                                                                       out, ldo, arg);
    MNEMO_CUDA_LAUNCHED("max_pool_time_forward");
}

template <class T, class I>
void max_pool_time_backward(index_t rate, index_t out_rows, index_t batch, index_t d, const T* d_out, index_t ldo,
                            const I* arg, T* d_mem, index_t ldm) {
    scatter("max_pool_time_backward", max_pool_value<I>{}, rate, out_rows, batch, d, d_out, ldo, arg, d_mem, ldm);
}

template <class T>
void mean_pool_time_forward(index_t rate, index_t out_rows, index_t batch, index_t d, const T* mem, index_t ldm, T* out,
                            index_t ldo) {
    check_extents("mean_pool_time_forward", rate, out_rows, batch, d);
    const index_t total = out_rows * d;
    if (total == 0) return;
    mean_pool_kernel<<<blocks_for(total, threads), threads, 0, cuda_detail::stream()>>>(total, rate, batch, d, mem, ldm,
                                                                                        out, ldo);
    MNEMO_CUDA_LAUNCHED("mean_pool_time_forward");
}

template <class T>
void mean_pool_time_backward(index_t rate, index_t out_rows, index_t batch, index_t d, const T* d_out, index_t ldo,
                             T* d_mem, index_t ldm) {
    scatter("mean_pool_time_backward", mean_pool_value{}, rate, out_rows, batch, d, d_out, ldo, nullptr, d_mem, ldm);
}

template <class T, class I>
void most_used_forward(index_t rate, index_t out_rows, index_t batch, index_t d, const T* usage, const T* mem,
                       index_t ldm, T* out, index_t ldo, I* arg) {
    check_extents("most_used_forward", rate, out_rows, batch, d);
    const index_t total = out_rows * (d > 0 ? d : 1);
    if (total == 0) return;
    most_used_kernel<<<blocks_for(total, threads), threads, 0, cuda_detail::stream()>>>(total, rate, batch, d, usage,
                                                                                        mem, ldm, out, ldo, arg);
    MNEMO_CUDA_LAUNCHED("most_used_forward");
}

template <class T, class I>
void most_used_backward(index_t rate, index_t out_rows, index_t batch, index_t d, const T* d_out, index_t ldo,
                        const I* arg, T* d_mem, index_t ldm) {
    scatter("most_used_backward", most_used_value<I>{}, rate, out_rows, batch, d, d_out, ldo, arg, d_mem, ldm);
}

template <class T>
void accumulate_key_usage(index_t batch, index_t heads, index_t q, index_t k, const T* probs, T* usage) {
    MNEMO_CHECK(batch >= 0 && heads >= 0 && q >= 0 && k >= 0, "accumulate_key_usage: negative extent (batch ", batch,
                ", heads ", heads, ", q ", q, ", k ", k, ")");
    const index_t total = batch * k;
    if (total == 0 || heads * q == 0) return;  // nothing added
    key_usage_kernel<<<blocks_for(total, threads), threads, 0, cuda_detail::stream()>>>(total, batch, heads, q, k, probs,
                                                                                        usage);
    MNEMO_CUDA_LAUNCHED("accumulate_key_usage");
}

#define MNEMO_COMPRESSION_T(T)                                                                                      \
    template void im2col_time<T>(index_t, index_t, index_t, index_t, const T*, index_t, T*);                        \
    template void col2im_time<T>(index_t, index_t, index_t, index_t, const T*, T*, index_t);                        \
    template void mean_pool_time_forward<T>(index_t, index_t, index_t, index_t, const T*, index_t, T*, index_t);    \
    template void mean_pool_time_backward<T>(index_t, index_t, index_t, index_t, const T*, index_t, T*, index_t);   \
    template void accumulate_key_usage<T>(index_t, index_t, index_t, index_t, const T*, T*);
MNEMO_CUDA_INSTANTIATE_T(MNEMO_COMPRESSION_T)
#undef MNEMO_COMPRESSION_T

#define MNEMO_COMPRESSION_TI(T, I)                                                                                  \
    template void max_pool_time_forward<T, I>(index_t, index_t, index_t, index_t, const T*, index_t, T*, index_t,   \
                                              I*);                                                                  \
    template void max_pool_time_backward<T, I>(index_t, index_t, index_t, index_t, const T*, index_t, const I*, T*, \
                                               index_t);                                                            \
    template void most_used_forward<T, I>(index_t, index_t, index_t, index_t, const T*, const T*, index_t, T*,      \
                                          index_t, I*);                                                             \
    template void most_used_backward<T, I>(index_t, index_t, index_t, index_t, const T*, index_t, const I*, T*,     \
                                           index_t);
#define MNEMO_COMPRESSION_I(T)                  \
    MNEMO_COMPRESSION_TI(T, std::uint8_t)       \
    MNEMO_COMPRESSION_TI(T, std::uint32_t)
MNEMO_CUDA_INSTANTIATE_T(MNEMO_COMPRESSION_I)
#undef MNEMO_COMPRESSION_I
#undef MNEMO_COMPRESSION_TI

}  // namespace mnemo::cuda_kernels
