// One feedback attention step on the GPU (kernels/cpu/feedback_attention.hpp has the meaning,
// nn/attention/feedback.hpp the math): B batch rows, one query each, t memory slots, H heads,
// D = H·d_k. A step is small (B·H rows of t scores), so each (batch row, head) is one thread block
// that does the whole row: scores (a warp per slot, lanes over d_k), softmax (block reductions),
// context (threads over d_k, slots in order). Backward likewise per (b, h), then one kernel for the
// positional tables' window gradients, where each element owns its sum over the batch (no atomics).
// Keys and values are memory_slots: slot j of batch row b at data + j·slot_stride + b·batch_stride.
#include <cstdint>

#include "attention_common.cuh"
#include "common.cuh"
#include "mnemo/kernels/cuda/kernels.hpp"
#include "mnemo/kernels/feedback_attention_state.hpp"

namespace mnemo {
namespace cuda_detail {
namespace {

constexpr unsigned feedback_threads = 128;

/// The slots of one tensor as the kernels take them (memory_slots without its host-only members).
template <class T>
struct slots_view {
    T* data;
    index_t slot_stride, batch_stride;
    __device__ T* at(index_t j, index_t b) const { return data + j * slot_stride + b * batch_stride; }
};
template <class T>
slots_view<T> device_slots(const memory_slots<T>& m) {
    return {m.data, m.slot_stride, m.batch_stride};
}

/// Block (b, h): a[j] = (q+u)·k_j + q·R_win[j] + S_win[j·H + h], softmax(scale·a) over the t slots
/// into attn [B, H, t], ctx[b, h·d_k + d] = Σ_j a_j·v_j[d] (assigned).
template <class T>
__global__ void __launch_bounds__(feedback_threads)
    feedback_forward_kernel(index_t batch, index_t heads, index_t dk, index_t t, T scale, const T* __restrict__ q,
                            const T* __restrict__ qu, slots_view<const T> keys, slots_view<const T> values,
                            const T* __restrict__ r_win, const T* __restrict__ s_win, T* __restrict__ attn,
                            T* __restrict__ ctx) {
    const index_t d_model = heads * dk;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    for (index_t bh = blockIdx.x; bh < batch * heads; bh += gridDim.x) {
        const index_t b = bh / heads, h = bh % heads, off = b * d_model + h * dk;
        T* a = attn + bh * t;
        for (index_t j = warp; j < t; j += warps) {
            const T* k = keys.at(j, b) + h * dk;
            const T* r = r_win + j * d_model + h * dk;
            T sum = T(0);
            for (index_t d = lane; d < dk; d += 32) sum += qu[off + d] * k[d] + q[off + d] * r[d];
            sum = warp_sum(sum);
            if (lane == 0) a[j] = sum + s_win[j * heads + h];
        }
        __syncthreads();
        // softmax(scale·a): shift by the largest scaled score, as the CPU's softmax_forward.
        T mx = negative_infinity<T>();
        for (index_t j = threadIdx.x; j < t; j += blockDim.x) mx = max(mx, a[j]);
        mx = block_max(mx);
        T shift = scale * mx;
        if (!(scale > T(0))) {
            T m2 = negative_infinity<T>();
            for (index_t j = threadIdx.x; j < t; j += blockDim.x) m2 = max(m2, scale * a[j]);
            shift = block_max(m2);
        }
        T sum = T(0);
        for (index_t j = threadIdx.x; j < t; j += blockDim.x) {
            const T e = dev_exp(scale * a[j] - shift);
            a[j] = e;
            sum += e;
        }
        sum = block_sum(sum);
        const T inv = T(1) / sum;
        for (index_t j = threadIdx.x; j < t; j += blockDim.x) a[j] *= inv;
        __syncthreads();
        for (index_t d = threadIdx.x; d < dk; d += blockDim.x) {
            T c = T(0);
            for (index_t j = 0; j < t; ++j) c += a[j] * values.at(j, b)[h * dk + d];
            ctx[off + d] = c;
        }
        __syncthreads();  // the next (b, h) reuses nothing, but keeps the block's passes in step
    }
}

/// Block (b, h): dA_j = d_ctx·v_j, dv_j += a_j·d_ctx, dS = scale·a∘(dA − a·dA) into d_scores, then
/// d(q+u) = Σ_j dS_j·k_j and dq = Σ_j dS_j·R_win[j] (assigned), dk_j += dS_j·(q+u).
template <class T>
__global__ void __launch_bounds__(feedback_threads)
    feedback_backward_kernel(index_t batch, index_t heads, index_t dk, index_t t, T scale, const T* __restrict__ qu,
                             slots_view<const T> keys, slots_view<const T> values, const T* __restrict__ r_win,
                             const T* __restrict__ saved_attn, const T* __restrict__ d_ctx, T* __restrict__ d_scores,
                             T* __restrict__ d_qu, T* __restrict__ d_q, slots_view<T> d_keys, slots_view<T> d_values) {
    const index_t d_model = heads * dk;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    for (index_t bh = blockIdx.x; bh < batch * heads; bh += gridDim.x) {
        const index_t b = bh / heads, h = bh % heads, off = b * d_model + h * dk;
        const T* a = saved_attn + bh * t;
        T* ds = d_scores + bh * t;
        const T* dc = d_ctx + off;
        for (index_t j = warp; j < t; j += warps) {
            const T* v = values.at(j, b) + h * dk;
            T sum = T(0);
            for (index_t d = lane; d < dk; d += 32) sum += dc[d] * v[d];
            sum = warp_sum(sum);
            if (lane == 0) ds[j] = sum;
        }
        for (index_t e = threadIdx.x; e < t * dk; e += blockDim.x) {
            const index_t j = e / dk, d = e % dk;
            d_values.at(j, b)[h * dk + d] += a[j] * dc[d];
        }
        __syncthreads();
        T dot = T(0);
        for (index_t j = threadIdx.x; j < t; j += blockDim.x) dot += a[j] * ds[j];
        dot = block_sum(dot);
        for (index_t j = threadIdx.x; j < t; j += blockDim.x) ds[j] = scale * a[j] * (ds[j] - dot);
        __syncthreads();
        for (index_t d = threadIdx.x; d < dk; d += blockDim.x) {
            T gqu = T(0), gq = T(0);
            for (index_t j = 0; j < t; ++j) {
                gqu += ds[j] * keys.at(j, b)[h * dk + d];
                gq += ds[j] * r_win[j * d_model + h * dk + d];
            }
            d_qu[off + d] = gqu;
            d_q[off + d] = gq;
        }
        for (index_t e = threadIdx.x; e < t * dk; e += blockDim.x) {
            const index_t j = e / dk, d = e % dk;
            d_keys.at(j, b)[h * dk + d] += ds[j] * qu[off + d];
        }
        __syncthreads();
    }
}

/// The tables' window gradients: dR_win[j, c] += Σ_b dS[b, h(c), j]·q[b, c] (c = h·d_k + d) over the
/// first t·D elements, then dS_win[j·H + h] += dS[b, h, j] for b in order over the next t·H.
template <class T>
__global__ void feedback_tables_kernel(index_t batch, index_t heads, index_t dk, index_t t, const T* __restrict__ q,
                                       const T* __restrict__ d_scores, T* __restrict__ dr_win, T* __restrict__ ds_win) {
    const index_t d_model = heads * dk, n_r = t * d_model, n = n_r + t * heads;
    for (index_t e = global_index(); e < n; e += global_stride()) {
        if (e < n_r) {
            const index_t j = e / d_model, c = e % d_model, h = c / dk;
            T sum = T(0);
            for (index_t b = 0; b < batch; ++b) sum += d_scores[(b * heads + h) * t + j] * q[b * d_model + c];
            dr_win[e] += sum;
        } else {
            const index_t f = e - n_r, j = f / heads, h = f % heads;
            T acc = ds_win[f];
            for (index_t b = 0; b < batch; ++b) acc += d_scores[(b * heads + h) * t + j];
            ds_win[f] = acc;
        }
    }
}

unsigned block_rows(index_t n) { return unsigned(n < 65535 ? n : 65535); }

}  // namespace
}  // namespace cuda_detail

namespace cuda_kernels {

template <class T>
void feedback_attention_forward(const feedback_attention_state<T>& s) {
    using namespace cuda_detail;
    const index_t B = s.batch, H = s.heads, Dk = s.d_head, t = s.t;
    if (B <= 0 || H <= 0 || t <= 0 || Dk <= 0) return;
    MNEMO_CHECK(s.d_model == H * Dk, "cuda feedback_attention_forward: d_model ", s.d_model, " != heads ", H,
                " · d_head ", Dk);
    feedback_forward_kernel<T><<<block_rows(B * H), feedback_threads, 0, stream()>>>(
        B, H, Dk, t, s.scale, s.q, s.qu, device_slots(s.keys), device_slots(s.values), s.r_win, s.s_win, s.attn, s.ctx);
    MNEMO_CUDA_LAUNCHED("feedback_attention_forward");
}

template <class T>
void feedback_attention_backward(const feedback_attention_state<T>& s) {
    using namespace cuda_detail;
    const index_t B = s.batch, H = s.heads, Dk = s.d_head, t = s.t;
    if (B <= 0 || H <= 0 || t <= 0 || Dk <= 0) return;
    MNEMO_CHECK(s.d_model == H * Dk, "cuda feedback_attention_backward: d_model ", s.d_model, " != heads ", H,
                " · d_head ", Dk);
    feedback_backward_kernel<T><<<block_rows(B * H), feedback_threads, 0, stream()>>>(
        B, H, Dk, t, s.scale, s.qu, device_slots(s.keys), device_slots(s.values), s.r_win, s.saved_attn, s.d_ctx,
        s.d_scores, s.d_qu, s.d_q, device_slots(s.d_keys), device_slots(s.d_values));
    MNEMO_CUDA_LAUNCHED("feedback_attention_backward");
    const index_t n = t * (H * Dk + H);
    feedback_tables_kernel<T><<<blocks_for(n), 256, 0, stream()>>>(B, H, Dk, t, s.q, s.d_scores, s.dr_win, s.ds_win);
    MNEMO_CUDA_LAUNCHED("feedback_attention_tables");
}

#define MNEMO_FEEDBACK_ATTENTION(T)                                                  \
    template void feedback_attention_forward<T>(const feedback_attention_state<T>&); \
    template void feedback_attention_backward<T>(const feedback_attention_state<T>&);
MNEMO_CUDA_INSTANTIATE_T(MNEMO_FEEDBACK_ATTENTION)
#undef MNEMO_FEEDBACK_ATTENTION

}  // namespace cuda_kernels
}  // namespace mnemo
