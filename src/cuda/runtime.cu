// The CUDA backend's runtime (kernels/cuda/runtime.hpp): availability, the stream and cuBLAS handle,
// device memory and its host path.
#include <atomic>
#include <cstring>
#include <mutex>
#include <string>

#include "common.cuh"
#include "mnemo/kernels/cuda/runtime.hpp"

namespace mnemo {
namespace cuda_detail {
namespace {

struct context {
    cudaStream_t stream = nullptr;
    cublasHandle_t blas = nullptr;
    context() {
        MNEMO_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
        MNEMO_CUDA(cublasCreate(&blas));
        MNEMO_CUDA(cublasSetStream(blas, stream));
        // FP32 stays FP32 (no TF32): the results are checked against the CPU's and PyTorch's.
        MNEMO_CUDA(cublasSetMathMode(blas, CUBLAS_DEFAULT_MATH));
        // cuBLAS uses its default workspace pool (allocated with the handle); capturing a step in a CUDA
        // graph will need cublasSetWorkspace with a buffer of our own.
    }
    // Deliberately not destroyed: at process exit the driver may already be gone.
};

context& the_context() {
    static context c;
    return c;
}

std::atomic<std::size_t> in_use{0}, peak{0}, launch_count{0};

// Scratch for copies whose ranges overlap.
struct overlap_scratch {
    std::mutex lock;
    void* p = nullptr;
    std::size_t bytes = 0;
};
overlap_scratch& scratch() {
    static overlap_scratch s;
    return s;
}

}  // namespace

cudaStream_t stream() { return the_context().stream; }
cublasHandle_t blas() { return the_context().blas; }
void count_launch() noexcept { launch_count.fetch_add(1, std::memory_order_relaxed); }

void fail(const char* what, const char* file, int line, const std::string& message) {
    const char* base = std::strrchr(file, '/');
    throw error(std::string("mnemo cuda: ") + what + " failed (" + (base ? base + 1 : file) + ":" +
                std::to_string(line) + "): " + message);
}

}  // namespace cuda_detail

namespace cuda_runtime {

bool available() noexcept {
    int n = 0;
    const cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess) (void)cudaGetLastError();  // clear it
    return e == cudaSuccess && n > 0;
}

std::string describe() {
    int n = 0;
    const cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        return std::string("no usable CUDA device: ") + cudaGetErrorString(e);
    }
    if (n == 0) return "no CUDA device";
    int dev = 0;
    MNEMO_CUDA(cudaGetDevice(&dev));
    cudaDeviceProp p{};
    MNEMO_CUDA(cudaGetDeviceProperties(&p, dev));
    return std::string(p.name) + " (sm_" + std::to_string(p.major) + std::to_string(p.minor) + ", " +
           std::to_string(p.totalGlobalMem >> 20) + " MiB)";
}

void synchronize() { MNEMO_CUDA(cudaStreamSynchronize(cuda_detail::stream())); }
std::size_t bytes_in_use() noexcept { return cuda_detail::in_use.load(); }
std::size_t peak_bytes() noexcept { return cuda_detail::peak.load(); }
void reset_peak() noexcept { cuda_detail::peak.store(cuda_detail::in_use.load()); }
std::size_t launches() noexcept { return cuda_detail::launch_count.load(); }

}  // namespace cuda_runtime

void* device_memory<cuda>::allocate(std::size_t bytes) {
    (void)cuda_detail::stream();  // the context first: a missing device fails here with CUDA's message
    void* p = nullptr;
    MNEMO_CUDA(cudaMalloc(&p, bytes ? bytes : 1));
    const std::size_t now = cuda_detail::in_use.fetch_add(bytes) + bytes;
    std::size_t old = cuda_detail::peak.load();
    while (now > old && !cuda_detail::peak.compare_exchange_weak(old, now)) {
    }
    return p;
}

void device_memory<cuda>::deallocate(void* p, std::size_t bytes) noexcept {
    if (!p) return;
    // cudaFree waits for the device; the stream's work on this block is then done.
    (void)cudaFree(p);
    cuda_detail::in_use.fetch_sub(bytes);
}

void device_memory<cuda>::fill_zero(void* p, std::size_t bytes) {
    if (!bytes) return;
    MNEMO_CUDA(cudaMemsetAsync(p, 0, bytes, cuda_detail::stream()));
    cuda_detail::count_launch();
}

void device_memory<cuda>::copy(void* dst, const void* src, std::size_t bytes) {
    if (!bytes || dst == src) return;
    const auto d = reinterpret_cast<std::uintptr_t>(dst), s = reinterpret_cast<std::uintptr_t>(src);
    const bool overlap = d < s + bytes && s < d + bytes;
    cudaStream_t st = cuda_detail::stream();
    if (!overlap) {
        MNEMO_CUDA(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, st));
        cuda_detail::count_launch();
        return;
    }
    // Overlapping (memmove): through a scratch block, two copies in stream order.
    auto& sc = cuda_detail::scratch();
    std::lock_guard g(sc.lock);
    if (sc.bytes < bytes) {
        // The old block may still be read by copies enqueued earlier (by any thread): wait for them
        // explicitly rather than rely on cudaFree's implicit synchronisation. Capacity 0 until the new
        // block is there, so a failed cudaMalloc leaves no null pointer with a stale size behind.
        if (sc.p) {
            MNEMO_CUDA(cudaStreamSynchronize(st));
            MNEMO_CUDA(cudaFree(sc.p));
        }
        sc.p = nullptr;
        sc.bytes = 0;
        MNEMO_CUDA(cudaMalloc(&sc.p, bytes));
        sc.bytes = bytes;
    }
    MNEMO_CUDA(cudaMemcpyAsync(sc.p, src, bytes, cudaMemcpyDeviceToDevice, st));
    MNEMO_CUDA(cudaMemcpyAsync(dst, sc.p, bytes, cudaMemcpyDeviceToDevice, st));
    cuda_detail::count_launch();
    cuda_detail::count_launch();
}

void device_memory<cuda>::upload(void* dst, const void* host, std::size_t bytes) {
    if (!bytes) return;
    MNEMO_CUDA(cudaMemcpyAsync(dst, host, bytes, cudaMemcpyHostToDevice, cuda_detail::stream()));
    cuda_detail::count_launch();
}

void device_memory<cuda>::download(void* host, const void* src, std::size_t bytes) {
    if (!bytes) return;
    cudaStream_t st = cuda_detail::stream();
    MNEMO_CUDA(cudaMemcpyAsync(host, src, bytes, cudaMemcpyDeviceToHost, st));
    MNEMO_CUDA(cudaStreamSynchronize(st));
    cuda_detail::count_launch();
}

}  // namespace mnemo
