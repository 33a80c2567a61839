// The CUDA backend's row-normalising kernels (kernels/cuda/kernels.hpp): the masked softmax and its
// backward, layer norm forward and backward, and the fused softmax cross-entropy.
//
// Softmax and layer norm give one warp to a row (8 warps a block, a grid-stride loop over the rows):
// attention rows and model rows are tens to a few thousand columns, which a warp covers in a few
// strided passes, and the row's reductions are register shuffles. Each lane owns the columns
// lane, lane + 32, … in every pass, so y may alias x (a lane reads its own elements before it writes
// them). The cross-entropy gives a block to a row (vocabularies are long). The weight and bias
// gradients of layer norm are fixed-order column reductions. Every reduction has a fixed order for a
// given shape and there are no atomics: results are bitwise the same run to run.
#include <cstdint>

#include "common.cuh"
#include "device_math.cuh"
#include "mnemo/kernels/cuda/kernels.hpp"

namespace mnemo::cuda_kernels {
namespace {

using namespace cuda_detail;  // common.cuh, device_math.cuh

constexpr unsigned threads = 256;

// ---- softmax ----------------------------------------------------------------------------------------------------

/// softmax.hpp's masked softmax: row i sees columns [0, n) (n = cols, or the causal prefix
/// causal_offset + i + 1) that keep marks; y = exp(s·x − m)/Σ over those, 0 elsewhere; a row that
/// sees nothing is all zeros.
template <class T>
__global__ void softmax_forward_kernel(index_t rows, index_t cols, const T* x, index_t ldx, T* y, index_t ldy, T scale,
                                       row_mask mask) {
    const int lane = threadIdx.x & 31;
    const index_t warps = global_stride() >> 5;
    for (index_t i = global_index() >> 5; i < rows; i += warps) {
        const T* xi = x + i * ldx;
        T* yi = y + i * ldy;
        index_t n = cols;
        if (mask.causal) n = max(index_t(0), min(cols, mask.causal_offset + i + 1));
        const std::uint8_t* keep = mask.keep ? mask.keep + i * mask.ld_keep : nullptr;
        T shift = -INFINITY;
        bool seen = false;
        for (index_t j = lane; j < n; j += 32)
            if (!keep || keep[j]) {
                shift = max(shift, scale * xi[j]);
                seen = true;
            }
        shift = warp_max(shift);
        if (!__any_sync(0xffffffffu, seen)) {
            for (index_t j = lane; j < cols; j += 32) yi[j] = T(0);
            continue;
        }
        T sum = T(0);
        for (index_t j = lane; j < n; j += 32)
            if (!keep || keep[j]) sum += dev_exp(fma(scale, xi[j], -shift));
        sum = warp_sum(sum);
        const T inv = T(1) / sum;
        for (index_t j = lane; j < cols; j += 32) {
            const bool visible = j < n && (!keep || keep[j]);
            yi[j] = visible ? dev_exp(fma(scale, xi[j], -shift)) * inv : T(0);
        }
    }
}

/// dx = s·y·(dy − Σ_k y_k·dy_k) per row; dx may alias dy.
template <class T>
__global__ void softmax_backward_kernel(index_t rows, index_t cols, const T* y, index_t ldy, const T* dy,
                                        index_t lddy, T* dx, index_t lddx, T scale) {
    const int lane = threadIdx.x & 31;
    const index_t warps = global_stride() >> 5;
    for (index_t i = global_index() >> 5; i < rows; i += warps) {
        const T* yi = y + i * ldy;
        const T* dyi = dy + i * lddy;
        T* dxi = dx + i * lddx;
        T dot = T(0);
        for (index_t j = lane; j < cols; j += 32) dot = fma(yi[j], dyi[j], dot);
        dot = warp_sum(dot);
        for (index_t j = lane; j < cols; j += 32) dxi[j] = scale * yi[j] * (dyi[j] - dot);
    }
}

// ---- layer norm -------------------------------------------------------------------------------------------------

/// layer_norm.hpp's forward: μ, r = 1/sqrt(mean((x − μ)²) + eps), x̂ = (x − μ)·r, y = x̂·w + b.
template <class T>
__global__ void layer_norm_forward_kernel(index_t rows, index_t d, const T* x, index_t ldx, const T* w, const T* b,
                                          T eps, T* y, index_t ldy, T* mean, T* rstd, T* xhat, index_t ldxh) {
    const int lane = threadIdx.x & 31;
    const index_t warps = global_stride() >> 5;
    for (index_t i = global_index() >> 5; i < rows; i += warps) {
        const T* xi = x + i * ldx;
        T s = T(0);
        for (index_t j = lane; j < d; j += 32) s += xi[j];
        const T mu = warp_sum(s) / T(d);
        T ss = T(0);
        for (index_t j = lane; j < d; j += 32) {
            const T c = xi[j] - mu;
            ss = fma(c, c, ss);
        }
        const T r = T(1) / dev_sqrt(warp_sum(ss) / T(d) + eps);
        if (lane == 0) {
            if (mean) mean[i] = mu;
            if (rstd) rstd[i] = r;
        }
        T* yi = y ? y + i * ldy : nullptr;
        T* hi = xhat ? xhat + i * ldxh : nullptr;
        for (index_t j = lane; j < d; j += 32) {
            T v = (xi[j] - mu) * r;
            if (hi) hi[j] = v;
            if (!yi) continue;
            if (w) v *= w[j];
            if (b) v += b[j];
            yi[j] = v;
        }
    }
}

/// layer_norm.hpp's dx: g = dy·w, dx = r·(g − mean(g) − x̂·mean(g·x̂)) (assigned or added).
template <class T>
__global__ void layer_norm_dx_kernel(index_t rows, index_t d, const T* x, index_t ldx, const T* w, const T* mean,
                                     const T* rstd, const T* dy, index_t lddy, T* dx, index_t lddx,
                                     bool accumulate_dx) {
    const int lane = threadIdx.x & 31;
    const index_t warps = global_stride() >> 5;
    for (index_t i = global_index() >> 5; i < rows; i += warps) {
        const T* xi = x + i * ldx;
        const T* dyi = dy + i * lddy;
        T* dxi = dx + i * lddx;
        const T mu = mean[i], r = rstd[i];
        T sg = T(0), sgx = T(0);
        for (index_t j = lane; j < d; j += 32) {
            const T g = w ? dyi[j] * w[j] : dyi[j];
            const T xh = (xi[j] - mu) * r;
            sg += g;
            sgx = fma(g, xh, sgx);
        }
        const T mg = warp_sum(sg) / T(d), mgx = warp_sum(sgx) / T(d);
        for (index_t j = lane; j < d; j += 32) {
            const T g = w ? dyi[j] * w[j] : dyi[j];
            const T xh = (xi[j] - mu) * r;
            const T v = r * (g - mg - xh * mgx);
            dxi[j] = accumulate_dx ? dxi[j] + v : v;
        }
    }
}

/// dw[j] += Σ_i dy[i, j]·x̂[i, j], db[j] += Σ_i dy[i, j] (either may be null): a column reduction.
template <class T>
struct layer_norm_params_op {
    const T *x, *mean, *rstd, *dy;
    index_t ldx, lddy;
    T *dw, *db;
    __device__ void term(index_t i, index_t j, T* acc) const {
        const T g = dy[i * lddy + j];
        if (dw) acc[0] += g * ((x[i * ldx + j] - mean[i]) * rstd[i]);
        acc[1] += g;
    }
    __device__ void finish(index_t j, const T* acc) const {
        if (dw) dw[j] += acc[0];
        if (db) db[j] += acc[1];
    }
};

// ---- cross-entropy ----------------------------------------------------------------------------------------------

/// cross_entropy.hpp's fused loss and gradient, one block a row: lse = log Σ exp(x), loss = lse − x_t,
/// dx = g·(softmax(x) − onehot(t)); a negative target gives loss 0 and a zero gradient row. The
/// target logit is read before the block's first barrier and every other element is written by the
/// thread that read it after the last one, so dlogits may alias logits.
constexpr unsigned ce_threads = 256;
template <class T, class I>
__global__ void __launch_bounds__(ce_threads)
    cross_entropy_fused_kernel(index_t rows, index_t vocab, const T* logits, index_t ld, const I* targets, T* losses,
                               T grad_scale, T* dlogits, index_t ldd) {
    for (index_t i = blockIdx.x; i < rows; i += gridDim.x) {
        const T* xi = logits + i * ld;
        T* di = dlogits + i * ldd;
        const I t = targets[i];
        const T xt = (t >= 0 && threadIdx.x == 0) ? xi[t] : T(0);
        T mx = -INFINITY;
        for (index_t j = threadIdx.x; j < vocab; j += blockDim.x) mx = max(mx, xi[j]);
        mx = cuda_detail::block_max(mx);
        T s = T(0);
        for (index_t j = threadIdx.x; j < vocab; j += blockDim.x) s += dev_exp(xi[j] - mx);
        s = cuda_detail::block_sum(s);
        const T lse = mx + dev_log(s);
        if (threadIdx.x == 0) losses[i] = t < 0 ? T(0) : lse - xt;
        for (index_t j = threadIdx.x; j < vocab; j += blockDim.x) {
            T v = T(0);
            if (t >= 0) {
                v = grad_scale * dev_exp(xi[j] - lse);
                if (j == index_t(t)) v -= grad_scale;
            }
            di[j] = v;
        }
    }
}

template <class T>
unsigned warp_rows_blocks(index_t rows) {
    return blocks_for(rows * 32, threads);
}

}  // namespace

template <class T>
void softmax_forward(index_t rows, index_t cols, const T* x, index_t ldx, T* y, index_t ldy, T scale, row_mask mask) {
    if (rows <= 0 || cols <= 0) return;
    softmax_forward_kernel<T><<<warp_rows_blocks<T>(rows), threads, 0, cuda_detail::stream()>>>(rows, cols, x, ldx, y,
                                                                                                ldy, scale, mask);
    MNEMO_CUDA_LAUNCHED("softmax_forward_kernel");
}

template <class T>
void softmax_backward(index_t rows, index_t cols, const T* y, index_t ldy, const T* dy, index_t lddy, T* dx,
                      index_t lddx, T scale) {
    if (rows <= 0 || cols <= 0) return;
    softmax_backward_kernel<T><<<warp_rows_blocks<T>(rows), threads, 0, cuda_detail::stream()>>>(
        rows, cols, y, ldy, dy, lddy, dx, lddx, scale);
    MNEMO_CUDA_LAUNCHED("softmax_backward_kernel");
}

template <class T>
void layer_norm_forward(index_t rows, index_t d, const T* x, index_t ldx, const T* w, const T* b, T eps, T* y,
                        index_t ldy, T* mean, T* rstd, T* xhat, index_t ldxh) {
    if (rows <= 0 || d <= 0) return;
    layer_norm_forward_kernel<T><<<warp_rows_blocks<T>(rows), threads, 0, cuda_detail::stream()>>>(
        rows, d, x, ldx, w, b, eps, y, ldy, mean, rstd, xhat, ldxh);
    MNEMO_CUDA_LAUNCHED("layer_norm_forward_kernel");
}

template <class T>
void layer_norm_backward(index_t rows, index_t d, const T* x, index_t ldx, const T* w, const T* mean, const T* rstd,
                         const T* dy, index_t lddy, T* dx, index_t lddx, T* dw, T* db, bool accumulate_dx) {
    if (rows <= 0 || d <= 0) return;
    if (dx) {
        layer_norm_dx_kernel<T><<<warp_rows_blocks<T>(rows), threads, 0, cuda_detail::stream()>>>(
            rows, d, x, ldx, w, mean, rstd, dy, lddy, dx, lddx, accumulate_dx);
        MNEMO_CUDA_LAUNCHED("layer_norm_dx_kernel");
    }
    if (dw || db)
        column_reduce<T, 2>(rows, d, layer_norm_params_op<T>{x, mean, rstd, dy, ldx, lddy, dw, db}, "layer_norm_params");
}

template <class T, class I>
void cross_entropy_fused(index_t rows, index_t vocab, const T* logits, index_t ld, const I* targets, T* losses,
                         T grad_scale, T* dlogits, index_t ldd) {
    if (rows <= 0) return;
    const unsigned blocks = unsigned(rows < 65535 ? rows : 65535);
    cross_entropy_fused_kernel<T, I><<<blocks, ce_threads, 0, cuda_detail::stream()>>>(
        rows, vocab, logits, ld, targets, losses, grad_scale, dlogits, ldd);
    MNEMO_CUDA_LAUNCHED("cross_entropy_fused_kernel");
}

// ---- explicit instantiations ------------------------------------------------------------------------------------

#define MNEMO_NORM(T)                                                                                                  \
    template void softmax_forward<T>(index_t, index_t, const T*, index_t, T*, index_t, T, row_mask);                  \
    template void softmax_backward<T>(index_t, index_t, const T*, index_t, const T*, index_t, T*, index_t, T);        \
    template void layer_norm_forward<T>(index_t, index_t, const T*, index_t, const T*, const T*, T, T*, index_t, T*,  \
                                        T*, T*, index_t);                                                              \
    template void layer_norm_backward<T>(index_t, index_t, const T*, index_t, const T*, const T*, const T*, const T*, \
                                         index_t, T*, index_t, T*, T*, bool);                                          \
    template void cross_entropy_fused<T, std::int32_t>(index_t, index_t, const T*, index_t, const std::int32_t*, T*,  \
                                                       T, T*, index_t);
MNEMO_CUDA_INSTANTIATE_T(MNEMO_NORM)
#undef MNEMO_NORM

}  // namespace mnemo::cuda_kernels
