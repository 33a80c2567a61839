// What the attention translation units (attention.cu, feedback.cu, reconstruction.cu) share: the
// per-(batch, head) strided-batched products (device_math.cuh has the reductions and the math).
// Not installed; nothing outside src/cuda includes it.
#pragma once
#include <cmath>

#include "common.cuh"
#include "device_math.cuh"
#include "mnemo/kernels/cuda/kernels.hpp"

namespace mnemo::cuda_detail {

/// One operand of a per-(batch element, head) product: the matrix of (b, h) starts at
/// p + b·per_b + h·per_h, rows ld apart.
template <class T>
struct bh_operand {
    T* p;
    index_t ld, per_b, per_h;
};

enum class bh_op { nn, nt, tn };

/// C_bh = β·C_bh + op(A_bh)·op(B_bh) for every (b, h), as strided-batched cuBLAS calls (row-major
/// m, n, k as cuda_kernels::gemm_*). When every operand's batch step is heads times its head step
/// (q, k, v rows at b·D + h·d_k = (b·H + h)·d_k), the B·H products are one call; otherwise
/// (the relative attention's [k, v] rows at b·2D + h·d_k) one call per value of the smaller of the
/// two indices, batched over the larger: min(B, H) launches.
template <class T>
void gemm_bh(bh_op op, index_t batch, index_t heads, index_t m, index_t n, index_t k, bh_operand<const T> a,
             bh_operand<const T> b, bh_operand<T> c, T beta) {
    if (batch <= 0 || heads <= 0 || m <= 0 || n <= 0) return;
    auto call = [&](index_t count, const T* pa, index_t sa, const T* pb, index_t sb, T* pc, index_t sc) {
        switch (op) {
            case bh_op::nn:
                cuda_kernels::gemm_nn_batched(count, m, n, k, pa, a.ld, sa, pb, b.ld, sb, pc, c.ld, sc, beta, T(1));
                break;
            case bh_op::nt:
                cuda_kernels::gemm_nt_batched(count, m, n, k, pa, a.ld, sa, pb, b.ld, sb, pc, c.ld, sc, beta, T(1));
                break;
            case bh_op::tn:
                cuda_kernels::gemm_tn_batched(count, m, n, k, pa, a.ld, sa, pb, b.ld, sb, pc, c.ld, sc, beta, T(1));
                break;
        }
    };
    const bool uniform = a.per_b == heads * a.per_h && b.per_b == heads * b.per_h && c.per_b == heads * c.per_h;
    if (uniform) {
        call(batch * heads, a.p, a.per_h, b.p, b.per_h, c.p, c.per_h);
    } else if (batch <= heads) {
        for (index_t i = 0; i < batch; ++i)
            call(heads, a.p + i * a.per_b, a.per_h, b.p + i * b.per_b, b.per_h, c.p + i * c.per_b, c.per_h);
    } else {
        for (index_t i = 0; i < heads; ++i)
            call(batch, a.p + i * a.per_h, a.per_b, b.p + i * b.per_h, b.per_b, c.p + i * c.per_h, c.per_b);
    }
}

}  // namespace mnemo::cuda_detail
