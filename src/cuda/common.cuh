// Shared by the CUDA backend's translation units: the stream and cuBLAS handle, error checks, launch
// shapes. Not installed; nothing outside src/cuda includes it.
#pragma once
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <sstream>
#include <string>

#include "mnemo/core/error.hpp"
#include "mnemo/core/shape.hpp"

namespace mnemo::cuda_detail {

/// The backend's stream and its cuBLAS handle (created on first use, on the current device).
cudaStream_t stream();
cublasHandle_t blas();
/// Counts one launch (kernel or library call) for cuda_runtime::launches().
void count_launch() noexcept;

[[noreturn]] void fail(const char* what, const char* file, int line, const std::string& message);

inline void check(cudaError_t e, const char* what, const char* file, int line) {
    if (e != cudaSuccess) fail(what, file, line, std::string(cudaGetErrorName(e)) + ": " + cudaGetErrorString(e));
}
inline void check(cublasStatus_t s, const char* what, const char* file, int line) {
    if (s != CUBLAS_STATUS_SUCCESS)
        fail(what, file, line, std::string(cublasGetStatusName(s)) + ": " + cublasGetStatusString(s));
}

}  // namespace mnemo::cuda_detail

/// MNEMO_CUDA(call): throws mnemo::error naming the call, the file and CUDA's (or cuBLAS's) message.
#define MNEMO_CUDA(call) ::mnemo::cuda_detail::check((call), #call, __FILE__, __LINE__)
/// After a <<<...>>> launch: the launch's own error (a bad configuration), and one more launch counted.
#define MNEMO_CUDA_LAUNCHED(name)                                                        \
    do {                                                                                 \
        ::mnemo::cuda_detail::check(cudaGetLastError(), name, __FILE__, __LINE__);       \
        ::mnemo::cuda_detail::count_launch();                                            \
    } while (0)

namespace mnemo::cuda_detail {

/// Blocks of `threads` covering n items (at least one block; a grid-stride loop covers the rest).
inline unsigned blocks_for(index_t n, unsigned threads = 256, index_t max_blocks = 65535) {
    index_t b = (n + threads - 1) / threads;
    if (b < 1) b = 1;
    if (b > max_blocks) b = max_blocks;
    return unsigned(b);
}

/// Grid-stride loop index helpers (64-bit).
__device__ inline index_t global_index() { return index_t(blockIdx.x) * blockDim.x + threadIdx.x; }
__device__ inline index_t global_stride() { return index_t(gridDim.x) * blockDim.x; }

/// Block-wide sum of one value per thread (blockDim.x a multiple of 32, at most 1024); every thread
/// gets the result. Deterministic: a fixed tree for a fixed block size.
template <class T>
__device__ inline T block_sum(T v) {
    __shared__ T partial[32];
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = (blockDim.x + 31) >> 5;
    __syncthreads();  // partial may still be read by a previous call
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    v = lane < warps ? partial[lane] : T(0);
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

/// Block-wide maximum, as block_sum.
template <class T>
__device__ inline T block_max(T v) {
    __shared__ T partial[32];
    for (int o = 16; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(0xffffffffu, v, o));
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = (blockDim.x + 31) >> 5;
    __syncthreads();
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    v = lane < warps ? partial[lane] : -INFINITY;
    for (int o = 16; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

}  // namespace mnemo::cuda_detail

/// Explicit instantiation for float and double of a function template F declared in kernels.hpp.
#define MNEMO_CUDA_INSTANTIATE_T(F) \
    F(float)                        \
    F(double)
