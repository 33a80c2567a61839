#pragma once
// The CUDA backend's runtime, as the library mnemo::cuda compiles it (src/cuda/runtime.cu): whether a
// GPU is there, the one stream every kernel of the backend runs on (with its cuBLAS handle), and
// device_memory<cuda>, the backend's storage and its host path.
//
// One non-blocking stream per process (created on the first use, on the current device) orders all
// of the backend's work; a kernel call returns once its work is enqueued. download waits for the
// stream (the host needs the bytes); upload from host memory returns once the source may be reused
// (CUDA stages pageable memory); nothing else waits. Errors (a failed launch, an allocation that does
// not fit, no device at all) throw mnemo::error naming the call and CUDA's message; an error of a
// kernel that ran asynchronously surfaces at the next call that waits (download, synchronize).
#include <cstddef>
#include <string>

#include "../../core/backend.hpp"

namespace mnemo {

namespace cuda_runtime {

/// Whether this process can run the CUDA backend: a CUDA device and a driver that serves this build's
/// runtime. Never throws.
bool available() noexcept;
/// Why not (CUDA's own message, e.g. "no CUDA-capable device is detected"), or the device's name and
/// compute capability when it is available.
std::string describe();
/// Waits until every kernel enqueued so far has finished; throws the first asynchronous error.
void synchronize();
/// Bytes of device memory the backend holds now and at most so far (its own allocations).
std::size_t bytes_in_use() noexcept;
std::size_t peak_bytes() noexcept;
/// Starts a new peak from what is in use now.
void reset_peak() noexcept;
/// Kernel launches and cuBLAS calls enqueued since the process started (the benchmarks' launches per step).
std::size_t launches() noexcept;

}  // namespace cuda_runtime

/// device_memory<cuda>: cudaMalloc'd blocks; copy within the device (overlapping ranges allowed),
/// upload and download over the backend's stream (see above).
template <>
struct device_memory<cuda> {
    static void* allocate(std::size_t bytes);
    static void deallocate(void* p, std::size_t bytes) noexcept;
    static void fill_zero(void* p, std::size_t bytes);
    static void copy(void* dst, const void* src, std::size_t bytes);
    static void upload(void* dst, const void* host, std::size_t bytes);
    static void download(void* host, const void* src, std::size_t bytes);
};

}  // namespace mnemo
