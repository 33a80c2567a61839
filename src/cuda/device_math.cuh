// Device-side helpers the kernels share: math at the precision of T (never the fast intrinsics),
// operations rounded as IEEE rounds them whatever nvcc contracts (to reproduce the CPU's arithmetic
// order), warp reductions, and the deterministic column reduction. Not installed.
#pragma once
#include <cmath>

#include "common.cuh"

namespace mnemo::cuda_detail {

template <class T>
__device__ inline T dev_exp(T x) {
    if constexpr (sizeof(T) == 4) return expf(x);
    else return ::exp(x);
}
template <class T>
__device__ inline T dev_log(T x) {
    if constexpr (sizeof(T) == 4) return logf(x);
    else return ::log(x);
}
template <class T>
__device__ inline T dev_sqrt(T x) {
    if constexpr (sizeof(T) == 4) return sqrtf(x);
    else return ::sqrt(x);
}
template <class T>
__device__ inline T dev_tanh(T x) {
    if constexpr (sizeof(T) == 4) return tanhf(x);
    else return ::tanh(x);
}
template <class T>
__device__ inline T dev_erfc(T x) {
    if constexpr (sizeof(T) == 4) return erfcf(x);
    else return ::erfc(x);
}

// One IEEE operation each, rounded to nearest (no contraction into an FMA).
__device__ inline float fma_rn(float a, float b, float c) { return __fmaf_rn(a, b, c); }
__device__ inline double fma_rn(double a, double b, double c) { return __fma_rn(a, b, c); }
__device__ inline float mul_rn(float a, float b) { return __fmul_rn(a, b); }
__device__ inline double mul_rn(double a, double b) { return __dmul_rn(a, b); }
__device__ inline float div_rn(float a, float b) { return __fdiv_rn(a, b); }
__device__ inline double div_rn(double a, double b) { return __ddiv_rn(a, b); }
__device__ inline float add_rn(float a, float b) { return __fadd_rn(a, b); }
__device__ inline double add_rn(double a, double b) { return __dadd_rn(a, b); }
__device__ inline float sqrt_rn(float a) { return __fsqrt_rn(a); }
__device__ inline double sqrt_rn(double a) { return __dsqrt_rn(a); }

template <class T>
__device__ inline T negative_infinity() {
    return T(-INFINITY);
}

// Butterfly reductions over a warp: every lane ends with the same value, in a fixed order
// (deterministic; a + b == b + a bitwise).
template <class T>
__device__ inline T warp_sum(T v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
template <class T>
__device__ inline T warp_max(T v) {
    for (int o = 16; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// ---- column reductions (deterministic, no atomics) ----------------------------------------------------

// A block owns a tile of col_tile adjacent columns; its row_slices thread rows each sum every
// row_slices-th row (slice s: rows s, s + row_slices, …, in order), then one thread per column adds the
// slices' partial sums in slice order. The order is fixed by the shape alone: bitwise the same run to
// run. Op: K accumulators; op.term(r, c, acc) adds row r's terms of column c, op.finish(c, acc) stores.
constexpr int col_tile = 8, row_slices = 32;

template <class T, int K, class Op>
__global__ void __launch_bounds__(col_tile* row_slices) column_reduce_kernel(index_t rows, index_t cols, Op op) {
    __shared__ T part[K][row_slices][col_tile + 1];
    const int tx = threadIdx.x, ty = threadIdx.y;
    for (index_t c0 = index_t(blockIdx.x) * col_tile; c0 < cols; c0 += index_t(gridDim.x) * col_tile) {
        const index_t c = c0 + tx;
        T acc[K];
        for (int q = 0; q < K; ++q) acc[q] = T(0);
        if (c < cols)
            for (index_t r = ty; r < rows; r += row_slices) op.term(r, c, acc);
        for (int q = 0; q < K; ++q) part[q][ty][tx] = acc[q];
        __syncthreads();
        if (ty == 0 && c < cols) {
            T tot[K];
            for (int q = 0; q < K; ++q) {
                tot[q] = part[q][0][tx];
                for (int s = 1; s < row_slices; ++s) tot[q] += part[q][s][tx];
            }
            op.finish(c, tot);
        }
        __syncthreads();
    }
}

/// Launches column_reduce_kernel over cols columns (nothing when there are none).
template <class T, int K, class Op>
void column_reduce(index_t rows, index_t cols, const Op& op, const char* name) {
    if (cols <= 0) return;
    const dim3 block(col_tile, row_slices);
    column_reduce_kernel<T, K, Op><<<blocks_for(cols, col_tile), block, 0, stream()>>>(rows, cols, op);
    MNEMO_CUDA_LAUNCHED(name);
}

}  // namespace mnemo::cuda_detail
