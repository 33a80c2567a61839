// The reconstruction losses' kernels on the GPU (kernels/cpu/reconstruction.hpp has the meaning;
// losses/attention_reconstruction.hpp and losses/autoencoding_reconstruction.hpp the callers): the
// masked squared difference with its double sum, the key masks from the memory's padding, and the
// plain (position-free) attention and its backward.
//
// plain attention: q, k, v and out put (b, h) at row offset b·D + h·d_k = (b·H + h)·d_k, so each
// product over every (b, h) is one strided-batched cuBLAS call (stride d_k; the weights [B, H, Q, n]
// stride Q·n), and the softmax is one warp per row.
#include <cstdint>

#include "attention_common.cuh"
#include "common.cuh"
#include "mnemo/kernels/cuda/kernels.hpp"

namespace mnemo {
namespace cuda_detail {
namespace {

constexpr unsigned sum_threads = 1024;

/// diff = a − b on the rows not padded (0 on padded rows), sum[0] = Σ diff² over those rows in
/// double, sum[1] = their number. One block: every thread accumulates its elements (a fixed set for
/// the fixed block size) in order, then block_sum's fixed tree, so the sum is the same on every run.
/// diff may be a's memory (each element is read, then written, by one thread).
template <class T>
__global__ void __launch_bounds__(sum_threads)
    squared_difference_kernel(index_t rows, index_t d, const T* a, index_t lda, const T* b, index_t ldb,
                              const std::uint8_t* __restrict__ pad, T* diff, index_t ldd, double* __restrict__ sum) {
    double s = 0.0, counted = 0.0;
    const index_t n = rows * d;
    for (index_t e = threadIdx.x; e < n; e += blockDim.x) {
        const index_t r = e / d, i = e % d;
        const bool skip = pad && pad[r];
        const T x = skip ? T(0) : a[r * lda + i] - b[r * ldb + i];
        diff[r * ldd + i] = x;
        if (!skip) s += double(x) * double(x);
    }
    for (index_t r = threadIdx.x; r < rows; r += blockDim.x) counted += (pad && pad[r]) ? 0.0 : 1.0;
    s = block_sum(s);
    counted = block_sum(counted);
    if (threadIdx.x == 0) {
        sum[0] = s;
        sum[1] = counted;
    }
}

/// Block b: keep_m [B, m_len], keep_c [B, c_len], any_m, any_c (reconstruction_keep's meaning).
__global__ void reconstruction_keep_kernel(index_t batch, index_t m_len, index_t c_len,
                                           const std::uint8_t* __restrict__ m_pad, std::uint8_t* __restrict__ keep_m,
                                           std::uint8_t* __restrict__ keep_c, std::uint8_t* __restrict__ any_m,
                                           std::uint8_t* __restrict__ any_c) {
    const index_t rate = c_len > 0 ? m_len / c_len : 1;
    for (index_t b = blockIdx.x; b < batch; b += gridDim.x) {
        int am = 0, ac = 0;
        for (index_t s = threadIdx.x; s < m_len; s += blockDim.x) {
            const bool p = m_pad[s * batch + b] != 0;
            keep_m[b * m_len + s] = p ? 0 : 1;
            am |= int(p);
        }
        for (index_t s = threadIdx.x; s < c_len; s += blockDim.x) {
            bool all = true;
            for (index_t t = 0; t < rate; ++t) all = all && m_pad[(s * rate + t) * batch + b] != 0;
            keep_c[b * c_len + s] = all ? 0 : 1;
            ac |= int(all);
        }
        am = __syncthreads_or(am);
        ac = __syncthreads_or(ac);
        if (threadIdx.x == 0) {
            any_m[b] = std::uint8_t(am != 0);
            any_c[b] = std::uint8_t(ac != 0);
        }
    }
}

constexpr unsigned row_threads = 256;
constexpr index_t rows_per_block = row_threads / 32;

/// Row r = (b·H + h)·Q + i of a [B, H, Q, n] (a warp each): softmax(scale·x) in place, keys masked by
/// keep [B, n] where any[b] (keep null: none); a row with no kept key is all zero.
template <class T>
__global__ void __launch_bounds__(row_threads)
    plain_softmax_rows(index_t rows, index_t per_batch, index_t n, T scale, T* __restrict__ x,
                       const std::uint8_t* __restrict__ keep, const std::uint8_t* __restrict__ any) {
    const int lane = threadIdx.x & 31;
    for (index_t r = index_t(blockIdx.x) * rows_per_block + (threadIdx.x >> 5); r < rows;
         r += index_t(gridDim.x) * rows_per_block) {
        const index_t b = r / per_batch;
        const std::uint8_t* kp = keep && any[b] ? keep + b * n : nullptr;
        T* xr = x + r * n;
        T mx = negative_infinity<T>();
        for (index_t j = lane; j < n; j += 32)
            if (!kp || kp[j]) mx = max(mx, scale * xr[j]);
        mx = warp_max(mx);
        T sum = T(0);
        for (index_t j = lane; j < n; j += 32) {
            const T e = !kp || kp[j] ? dev_exp(scale * xr[j] - mx) : T(0);
            xr[j] = e;
            sum += e;
        }
        sum = warp_sum(sum);
        if (sum > T(0)) {
            const T inv = T(1) / sum;
            for (index_t j = lane; j < n; j += 32) xr[j] *= inv;
        }
    }
}

/// Row r of [rows, n] (a warp each), in place on dx: dx = scale·y∘(dy − y·dy).
template <class T>
__global__ void __launch_bounds__(row_threads)
    plain_softmax_backward_rows(index_t rows, index_t n, T scale, const T* __restrict__ y, T* __restrict__ dx) {
    const int lane = threadIdx.x & 31;
    for (index_t r = index_t(blockIdx.x) * rows_per_block + (threadIdx.x >> 5); r < rows;
         r += index_t(gridDim.x) * rows_per_block) {
        const T* yr = y + r * n;
        T* dr = dx + r * n;
        T dot = T(0);
        for (index_t j = lane; j < n; j += 32) dot += yr[j] * dr[j];
        dot = warp_sum(dot);
        for (index_t j = lane; j < n; j += 32) dr[j] = scale * yr[j] * (dr[j] - dot);
    }
}

}  // namespace
}  // namespace cuda_detail

namespace cuda_kernels {

template <class T>
void squared_difference_rows(index_t rows, index_t d, const T* a, index_t lda, const T* b, index_t ldb,
                             const std::uint8_t* pad, T* diff, index_t ldd, double* sum) {
    using namespace cuda_detail;
    if (rows < 0 || d < 0) rows = d = 0;
    // Always launched (also for no rows): sum is written either way.
    squared_difference_kernel<T><<<1, sum_threads, 0, stream()>>>(rows, d, a, lda, b, ldb, pad, diff, ldd, sum);
    MNEMO_CUDA_LAUNCHED("squared_difference_rows");
}

void reconstruction_keep(index_t batch, index_t m_len, index_t c_len, const std::uint8_t* m_pad, std::uint8_t* keep_m,
                         std::uint8_t* keep_c, std::uint8_t* any_m, std::uint8_t* any_c) {
    using namespace cuda_detail;
    if (batch <= 0) return;
    reconstruction_keep_kernel<<<unsigned(batch < 65535 ? batch : 65535), 128, 0, stream()>>>(
        batch, m_len > 0 ? m_len : 0, c_len > 0 ? c_len : 0, m_pad, keep_m, keep_c, any_m, any_c);
    MNEMO_CUDA_LAUNCHED("reconstruction_keep");
}

template <class T>
void plain_attention_forward(index_t batch, index_t heads, index_t d, index_t dk, index_t q_len, index_t n, T scale,
                             const T* q, const T* k, const T* v, T* a, T* out, const std::uint8_t* keep,
                             const std::uint8_t* any) {
    using namespace cuda_detail;
    if (batch <= 0 || heads <= 0 || q_len <= 0 || dk <= 0) return;
    const index_t ld = batch * d;
    if (n <= 0) {  // no keys: every context is zero
        MNEMO_CUDA(cudaMemsetAsync(out, 0, sizeof(T) * std::size_t(q_len * ld), stream()));
        count_launch();
        return;
    }
    const bh_operand<const T> qs{q, ld, d, dk}, ks{k, ld, d, dk}, vs{v, ld, d, dk};
    gemm_bh<T>(bh_op::nt, batch, heads, q_len, n, dk, qs, ks, bh_operand<T>{a, n, heads * q_len * n, q_len * n}, T(0));
    const index_t rows = batch * heads * q_len;
    plain_softmax_rows<T><<<blocks_for(rows, rows_per_block), row_threads, 0, stream()>>>(rows, heads * q_len, n, scale,
                                                                                          a, keep, any);
    MNEMO_CUDA_LAUNCHED("plain_attention_softmax");
    gemm_bh<T>(bh_op::nn, batch, heads, q_len, dk, n, bh_operand<const T>{a, n, heads * q_len * n, q_len * n}, vs,
               bh_operand<T>{out, ld, d, dk}, T(0));
}

template <class T>
void plain_attention_backward(index_t batch, index_t heads, index_t d, index_t dk, index_t q_len, index_t n, T scale,
                              const T* q, const T* v, const T* a, const T* d_out, T* da, T* dk_out, T* dv_out) {
    using namespace cuda_detail;
    if (batch <= 0 || heads <= 0 || q_len <= 0 || dk <= 0 || n <= 0) return;
    const index_t ld = batch * d;
    const bh_operand<const T> qs{q, ld, d, dk}, vs{v, ld, d, dk}, dos{d_out, ld, d, dk},
        as{a, n, heads * q_len * n, q_len * n}, das_in{da, n, heads * q_len * n, q_len * n};
    const bh_operand<T> das{da, n, heads * q_len * n, q_len * n}, dks{dk_out, ld, d, dk}, dvs{dv_out, ld, d, dk};
    gemm_bh<T>(bh_op::nt, batch, heads, q_len, n, dk, dos, vs, das, T(0));  // dA = d_out·vᵀ
    gemm_bh<T>(bh_op::tn, batch, heads, n, dk, q_len, as, dos, dvs, T(0));  // dv = Aᵀ·d_out
    const index_t rows = batch * heads * q_len;
    plain_softmax_backward_rows<T><<<blocks_for(rows, rows_per_block), row_threads, 0, stream()>>>(rows, n, scale, a, da);
    MNEMO_CUDA_LAUNCHED("plain_attention_softmax_backward");
    gemm_bh<T>(bh_op::tn, batch, heads, n, dk, q_len, das_in, qs, dks, T(0));  // dk = dSᵀ·q
}

#define MNEMO_RECONSTRUCTION(T)                                                                                    \
    template void squared_difference_rows<T>(index_t, index_t, const T*, index_t, const T*, index_t,               \
                                             const std::uint8_t*, T*, index_t, double*);                           \
    template void plain_attention_forward<T>(index_t, index_t, index_t, index_t, index_t, index_t, T, const T*,    \
                                             const T*, const T*, T*, T*, const std::uint8_t*, const std::uint8_t*); \
    template void plain_attention_backward<T>(index_t, index_t, index_t, index_t, index_t, index_t, T, const T*,   \
                                              const T*, const T*, const T*, T*, T*, T*);
MNEMO_CUDA_INSTANTIATE_T(MNEMO_RECONSTRUCTION)
#undef MNEMO_RECONSTRUCTION

}  // namespace cuda_kernels
}  // namespace mnemo
