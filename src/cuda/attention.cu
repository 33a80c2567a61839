// Relative attention's core on the GPU (kernels/cpu/relative_attention.hpp has the meaning, the
// projected route; nn/attention/relative.hpp the math and the buffers): B batch, H heads, D = H·d_k,
// Q queries, K = M + Q keys, W = K + Q window rows, qb = Q·B query rows (position·B + b).
//
// Forward:   pos[h] = q_h·R_win,hᵀ               one strided-batched GEMM over the heads   [H, qb, W]
//            a[b, h] = (q+u)_bh·k_bhᵀ             per-(b, h) GEMMs (gemm_bh)                [B, H, Q, K]
//            positional terms, clamp, masks, softmax: one warp per score row (b, h, i)
//            ctx_bh = a[b, h]·v_bh                per-(b, h) GEMMs
// Backward:  dA = d_ctx·vᵀ, dv = Aᵀ·d_ctx         per-(b, h) GEMMs
//            softmax backward with the scale, and d_pos's row (the scatter and the clamp sum):
//            one warp per row
//            d(q+u) = dS·k, dk = dSᵀ·(q+u)        per-(b, h) GEMMs
//            dq = d_pos·R_win, dR_win += d_posᵀ·q one strided-batched GEMM each over the heads
//            dS_win += column sums of d_pos       one thread column per (h, window column), fixed order
//
// The [k, v] rows put (b, h) at b·2D + h·d_k, which no single stride over b·H + h reaches, so the
// per-(b, h) products are min(B, H) strided-batched calls each (gemm_bh: over the heads per batch
// element, or over the batch per head, whichever needs fewer calls). cuBLAS keeps every product
// deterministic; nothing here uses atomics. q_len == 1 (a generated token) takes the same path: its
// pos, attn and ctx are what the CPU's one-query pass computes.
#include <cstdint>

#include "attention_common.cuh"
#include "common.cuh"
#include "mnemo/kernels/cuda/kernels.hpp"
#include "mnemo/kernels/relative_attention_state.hpp"

namespace mnemo {
namespace cuda_detail {
namespace {

constexpr unsigned row_threads = 256;  // 8 warps, one score row each
constexpr index_t rows_per_block = row_threads / 32;

/// Keys j < clamped_keys(i) of query i are farther than clamp_len (0 when clamping is off).
__device__ inline index_t clamped_keys(index_t i, index_t q_len, index_t k_len, index_t clamp_len) {
    if (clamp_len <= 0) return 0;
    const index_t j0 = k_len - q_len + i - clamp_len;
    return j0 > 0 ? j0 : 0;
}

/// Per score row r = (b·H + h)·Q + i (a warp each), over its content scores a [K] in place:
///   a[j] = scale·(a[j] + pos[h][i·B + b][Q + j − i] + S[(Q − i + j)·H + h])   for j < M + i + 1
/// (keys farther than clamp_len read window column and S row K − clamp_len), then the masked softmax
/// (causal: j ≤ M + i; keep [B, K] where keep_any[b]): visible weights, zero elsewhere, and an
/// all-zero row when no visible key is kept. Each lane owns the columns j ≡ lane (mod 32) in every
/// pass, so no lane reads another's writes.
template <class T>
__global__ void __launch_bounds__(row_threads)
    relative_scores_softmax(index_t batch, index_t heads, index_t q_len, index_t k_len, index_t clamp_len, T scale,
                            const T* __restrict__ pos, const T* __restrict__ s_win, const std::uint8_t* __restrict__ keep,
                            const std::uint8_t* __restrict__ keep_any, T* __restrict__ attn) {
    const int lane = threadIdx.x & 31;
    const index_t rows = batch * heads * q_len, w = k_len + q_len, mem = k_len - q_len;
    for (index_t r = index_t(blockIdx.x) * rows_per_block + (threadIdx.x >> 5); r < rows;
         r += index_t(gridDim.x) * rows_per_block) {
        const index_t i = r % q_len, bh = r / q_len, h = bh % heads, b = bh / heads;
        const index_t visible = mem + i + 1, j0 = clamped_keys(i, q_len, k_len, clamp_len);
        T* a = attn + r * k_len;
        const T* p = pos + (h * q_len * batch + i * batch + b) * w;  // row i·B + b of head h's [qb, W]
        const std::uint8_t* kp = keep && keep_any[b] ? keep + b * k_len : nullptr;
        T pc = T(0), sc = T(0);
        if (j0 > 0) {
            pc = p[k_len - clamp_len];
            sc = s_win[(k_len - clamp_len) * heads + h];
        }
        T mx = negative_infinity<T>();
        for (index_t j = lane; j < visible; j += 32) {
            const T x = j < j0 ? scale * (a[j] + pc + sc)
                               : scale * (a[j] + p[q_len + j - i] + s_win[(q_len - i + j) * heads + h]);
            a[j] = x;
            if (!kp || kp[j]) mx = max(mx, x);
        }
        mx = warp_max(mx);
        T sum = T(0);
        for (index_t j = lane; j < k_len; j += 32) {
            const T e = j < visible && (!kp || kp[j]) ? dev_exp(a[j] - mx) : T(0);
            a[j] = e;
            sum += e;
        }
        sum = warp_sum(sum);
        if (sum > T(0)) {  // nothing visible and kept: the row stays all zero
            const T inv = T(1) / sum;
            for (index_t j = lane; j < visible; j += 32) a[j] *= inv;
        }
    }
}

/// Per score row r = (b·H + h)·Q + i (a warp each): the softmax's backward in place on d_scores,
///   dS[j] = scale·a[j]·(dA[j] − Σ_k a[k]·dA[k]),
/// then row i·B + b of head h's d_pos [qb, W] (all W columns written): column Q + j − i holds dS[j]
/// for the unclamped visible keys, and column K − clamp_len adds the clamped keys' Σ dS (it is the
/// column of key j0, the first unclamped one).
template <class T>
__global__ void __launch_bounds__(row_threads)
    relative_scores_backward(index_t batch, index_t heads, index_t q_len, index_t k_len, index_t clamp_len, T scale,
                             const T* __restrict__ attn, T* __restrict__ d_scores, T* __restrict__ d_pos) {
    const int lane = threadIdx.x & 31;
    const index_t rows = batch * heads * q_len, w = k_len + q_len, mem = k_len - q_len;
    for (index_t r = index_t(blockIdx.x) * rows_per_block + (threadIdx.x >> 5); r < rows;
         r += index_t(gridDim.x) * rows_per_block) {
        const index_t i = r % q_len, bh = r / q_len, h = bh % heads, b = bh / heads;
        const index_t visible = mem + i + 1, j0 = clamped_keys(i, q_len, k_len, clamp_len);
        const T* y = attn + r * k_len;
        T* ds = d_scores + r * k_len;
        T dot = T(0);
        for (index_t j = lane; j < k_len; j += 32) dot += y[j] * ds[j];
        dot = warp_sum(dot);
        T clamp_sum = T(0);
        for (index_t j = lane; j < k_len; j += 32) {
            const T dx = scale * y[j] * (ds[j] - dot);
            ds[j] = dx;
            if (j < j0) clamp_sum += dx;
        }
        clamp_sum = warp_sum(clamp_sum);
        __syncwarp();  // the scatter below reads other lanes' dS
        T* dp = d_pos + (h * q_len * batch + i * batch + b) * w;
        for (index_t c = lane; c < w; c += 32) {
            const index_t j = c - q_len + i;
            T v = j >= j0 && j < visible ? ds[j] : T(0);
            if (j0 > 0 && c == k_len - clamp_len) v += clamp_sum;
            dp[c] = v;
        }
    }
}

constexpr unsigned col_threads_x = 32, col_threads_y = 8;

/// ds_win[c·H + h] += Σ_rows d_pos[h][row, c]: a block covers 32 window columns of one head; its 8
/// thread rows sum rows ≡ ty (mod 8) in order, then thread row 0 adds the 8 partial sums in order.
template <class T>
__global__ void __launch_bounds__(col_threads_x* col_threads_y)
    relative_window_column_sums(index_t rows, index_t w, index_t heads, const T* __restrict__ d_pos,
                                T* __restrict__ ds_win) {
    __shared__ T partial[col_threads_y][col_threads_x];
    const index_t h = blockIdx.y;
    const index_t c = index_t(blockIdx.x) * col_threads_x + threadIdx.x;
    T sum = T(0);
    if (c < w) {
        const T* ph = d_pos + h * rows * w + c;
        for (index_t row = threadIdx.y; row < rows; row += col_threads_y) sum += ph[row * w];
    }
    partial[threadIdx.y][threadIdx.x] = sum;
    __syncthreads();
    if (threadIdx.y == 0 && c < w) {
        T total = partial[0][threadIdx.x];
        for (unsigned k = 1; k < col_threads_y; ++k) total += partial[k][threadIdx.x];
        ds_win[c * heads + h] += total;
    }
}

/// keep [B, K] and keep_any [B] from pad [K·B]: a block per batch element, threads over its keys.
__global__ void key_padding_keep_kernel(index_t batch, index_t k_len, const std::uint8_t* __restrict__ pad,
                                        std::uint8_t* __restrict__ keep, std::uint8_t* __restrict__ keep_any) {
    for (index_t b = blockIdx.x; b < batch; b += gridDim.x) {
        int any = 0;
        for (index_t j = threadIdx.x; j < k_len; j += blockDim.x) {
            const bool padded = pad[j * batch + b] != 0;
            keep[b * k_len + j] = padded ? 0 : 1;
            any |= int(padded);
        }
        any = __syncthreads_or(any);
        if (threadIdx.x == 0) keep_any[b] = std::uint8_t(any != 0);
    }
}

template <class T>
void check_projected(const relative_attention_state<T>& s) {
    MNEMO_CHECK(!s.absorbed, "cuda relative_attention: the absorbed-memory route is not implemented on this backend "
                             "(ops<cuda>::absorbs_memory is false)");
}

}  // namespace
}  // namespace cuda_detail

namespace cuda_kernels {

template <class T>
void relative_attention_forward(const relative_attention_state<T>& s) {
    using namespace cuda_detail;
    check_projected(s);
    const index_t B = s.batch, H = s.heads, D = s.d_model, Dk = s.d_head, Q = s.q_len, K = s.k_len;
    if (B <= 0 || H <= 0 || Q <= 0 || K <= 0) return;
    MNEMO_CHECK(Dk >= 1 && D == H * Dk && K >= Q, "cuda relative_attention_forward: bad shape");
    const index_t qb = Q * B, w = K + Q;
    // q·R over the window, per head: pos[h] [qb, W] = q_h [qb, d_k] · R_win,h [W, d_k]ᵀ.
    gemm_nt_batched(H, qb, w, Dk, s.q, D, Dk, s.r_win, D, Dk, s.pos, w, qb * w, T(0), T(1));
    // Content scores (q+u)·kᵀ per (b, h) into attn [B, H, Q, K].
    const bh_operand<const T> qu{s.qu, B * D, D, Dk}, keys{s.kv, B * 2 * D, 2 * D, Dk},
        values{s.kv + D, B * 2 * D, 2 * D, Dk};
    const bh_operand<T> attn{s.attn, K, H * Q * K, Q * K};
    gemm_bh<T>(bh_op::nt, B, H, Q, K, Dk, qu, keys, attn, T(0));
    const index_t rows = B * H * Q;
    relative_scores_softmax<T><<<blocks_for(rows, rows_per_block), row_threads, 0, stream()>>>(
        B, H, Q, K, s.clamp_len, s.scale, s.pos, s.s_win, s.keep, s.keep_any, s.attn);
    MNEMO_CUDA_LAUNCHED("relative_scores_softmax");
    // Context per (b, h): ctx_bh [Q, d_k] = a [Q, K] · v_bh [K, d_k].
    gemm_bh<T>(bh_op::nn, B, H, Q, Dk, K, bh_operand<const T>{s.attn, K, H * Q * K, Q * K}, values,
               bh_operand<T>{s.ctx, B * D, D, Dk}, T(0));
}

template <class T>
void relative_attention_backward(const relative_attention_state<T>& s) {
    using namespace cuda_detail;
    check_projected(s);
    const index_t B = s.batch, H = s.heads, D = s.d_model, Dk = s.d_head, Q = s.q_len, K = s.k_len;
    if (B <= 0 || H <= 0 || Q <= 0 || K <= 0) return;
    MNEMO_CHECK(Dk >= 1 && D == H * Dk && K >= Q, "cuda relative_attention_backward: bad shape");
    const index_t qb = Q * B, w = K + Q;
    const bh_operand<const T> attn{s.attn, K, H * Q * K, Q * K}, d_ctx{s.d_ctx, B * D, D, Dk},
        keys{s.kv, B * 2 * D, 2 * D, Dk}, values{s.kv + D, B * 2 * D, 2 * D, Dk}, qu{s.qu, B * D, D, Dk},
        ds_in{s.d_scores, K, H * Q * K, Q * K};
    const bh_operand<T> ds{s.d_scores, K, H * Q * K, Q * K}, dk{s.dkv, B * 2 * D, 2 * D, Dk},
        dv{s.dkv + D, B * 2 * D, 2 * D, Dk}, dqu{s.dqu, B * D, D, Dk};
    gemm_bh<T>(bh_op::nt, B, H, Q, K, Dk, d_ctx, values, ds, T(0));  // dA [Q, K] = d_ctx·vᵀ
    gemm_bh<T>(bh_op::tn, B, H, K, Dk, Q, attn, d_ctx, dv, T(0));    // dv [K, d_k] = Aᵀ·d_ctx
    const index_t rows = B * H * Q;
    relative_scores_backward<T><<<blocks_for(rows, rows_per_block), row_threads, 0, stream()>>>(
        B, H, Q, K, s.clamp_len, s.scale, s.attn, s.d_scores, s.pos);
    MNEMO_CUDA_LAUNCHED("relative_scores_backward");
    gemm_bh<T>(bh_op::nn, B, H, Q, Dk, K, ds_in, keys, dqu, T(0));  // d(q+u) [Q, d_k] = dS·k
    gemm_bh<T>(bh_op::tn, B, H, K, Dk, Q, ds_in, qu, dk, T(0));     // dk [K, d_k] = dSᵀ·(q+u)
    // Per head over the window: dq = d_pos·R_win (assigned), dR_win += d_posᵀ·q.
    gemm_nn_batched(H, qb, Dk, w, static_cast<const T*>(s.pos), w, qb * w, s.r_win, D, Dk, s.dq, D, Dk, T(0), T(1));
    gemm_tn_batched(H, w, Dk, qb, static_cast<const T*>(s.pos), w, qb * w, s.q, D, Dk, s.dr_win, D, Dk, T(1), T(1));
    const dim3 grid(unsigned((w + col_threads_x - 1) / col_threads_x), unsigned(H));
    relative_window_column_sums<T><<<grid, dim3(col_threads_x, col_threads_y), 0, stream()>>>(qb, w, H, s.pos, s.ds_win);
    MNEMO_CUDA_LAUNCHED("relative_window_column_sums");
}

void key_padding_keep(index_t batch, index_t k_len, const std::uint8_t* pad, std::uint8_t* keep,
                      std::uint8_t* keep_any) {
    using namespace cuda_detail;
    if (batch <= 0) return;
    if (k_len <= 0) {
        MNEMO_CUDA(cudaMemsetAsync(keep_any, 0, std::size_t(batch), stream()));
        count_launch();
        return;
    }
    key_padding_keep_kernel<<<unsigned(batch < 65535 ? batch : 65535), 128, 0, stream()>>>(batch, k_len, pad, keep,
                                                                                           keep_any);
    MNEMO_CUDA_LAUNCHED("key_padding_keep");
}

#define MNEMO_RELATIVE_ATTENTION(T)                                                  \
    template void relative_attention_forward<T>(const relative_attention_state<T>&); \
    template void relative_attention_backward<T>(const relative_attention_state<T>&);
MNEMO_CUDA_INSTANTIATE_T(MNEMO_RELATIVE_ATTENTION)
#undef MNEMO_RELATIVE_ATTENTION

}  // namespace cuda_kernels
}  // namespace mnemo
