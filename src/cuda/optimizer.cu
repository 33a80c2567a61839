// The optimizers' and gradient clipping's kernels (kernels/cpu/optimizer.hpp gives the meaning,
// train/optimizer.hpp the formulas and PyTorch's order of roundings): the Adam family's step, SGD's
// step, the cold-block flags of restored moments, and the sum of squares and scaling of a flat gradient
// buffer over its live runs.
//
// Rounding: every operation is written with an explicit IEEE intrinsic (fma, ·, /, sqrt, + rounded to
// nearest) in the CPU's order, so that nvcc neither contracts a product into a later addition nor
// uses an approximate division or square root; with hardware FMA on the host (-march=native) the CPU
// computes the same operations, and the results agree bit for bit.
#include <algorithm>
#include <cstdint>
#include <mutex>

#include "common.cuh"
#include "device_math.cuh"
#include "mnemo/kernels/cuda/kernels.hpp"

namespace mnemo::cuda_kernels {
namespace {

using namespace cuda_detail;  // common.cuh, device_math.cuh

// ---- Adam family --------------------------------------------------------------------------------------------

// One thread block per block of adam_cold_block elements (grid-stride over them), each thread
// adam_cold_block / 256 elements at stride 256 (coalesced).
constexpr unsigned adam_threads = 256;
static_assert(adam_cold_block % adam_threads == 0, "a cold block is a whole number of thread rows");
constexpr int adam_per_thread = int(adam_cold_block / adam_threads);

// One element's update, the CPU's adamw_update / adam_update / labml_update.
template <adam_rule R, class T>
__device__ inline void adam_element(T& p, T g, T& m, T& v, const adam_coefficients<T>& c) {
    T base;  // the parameter the step term is added to
    if constexpr (R == adam_rule::adam) {
        base = p;
        if (c.l2) g = fma_rn(c.wd, p, g);  // grad.add(param, alpha=wd)
    } else {
        base = mul_rn(p, c.decay);  // param.mul_(1 - lr*wd), rounded on its own
    }
    const T mi = fma_rn(c.one_minus_beta1, g, mul_rn(m, c.beta1));              // m.mul_(b1).add_(g, 1-b1)
    const T vi = fma_rn(mul_rn(c.one_minus_beta2, g), g, mul_rn(v, c.beta2));   // v.mul_(b2).addcmul_(g, g, 1-b2)
    m = mi;
    v = vi;
    T denom;
    if constexpr (R == adam_rule::labml) denom = add_rn(sqrt_rn(vi), c.eps);  // v.sqrt().add_(eps)
    else denom = add_rn(div_rn(sqrt_rn(vi), c.bias_correction2_sqrt), c.eps);
    p = add_rn(base, div_rn(mul_rn(c.neg_step_size, mi), denom));  // param.addcdiv_(m, denom, -step_size)
}

// The CPU's blocked loop: a block flagged cold whose gradient is all zero (−0 counts as zero, NaN does
// not) gets only the decay p·(1 − lr·wd); any other block gets the full update, and a cold one is warm
// from then on. (For the decoupled rules the decay alone is bitwise the full update of such an element,
// so the flags change only what is computed, not the result.) Without flags (cold null), every element
// gets the update. The gradients are read once, into registers, before the block decides.
template <adam_rule R, class T>
__global__ void __launch_bounds__(adam_threads)
    adam_kernel(T* __restrict__ params, const T* __restrict__ grads, T* __restrict__ m, T* __restrict__ v, index_t n,
                std::uint8_t* __restrict__ cold, const adam_coefficients<T> c) {
    const index_t blocks = (n + adam_cold_block - 1) / adam_cold_block;
    for (index_t blk = blockIdx.x; blk < blocks; blk += gridDim.x) {
        const index_t base = blk * adam_cold_block + threadIdx.x;
        T g[adam_per_thread];
        int touched = 0;
#pragma unroll
        for (int k = 0; k < adam_per_thread; ++k) {
            const index_t i = base + index_t(k) * adam_threads;
            g[k] = i < n ? grads[i] : T(0);
            touched |= g[k] != T(0);
        }
        bool decay_only = false;
        if (cold != nullptr) {  // uniform over the block
            const bool was_cold = cold[blk] != 0;  // read by every thread before the barrier, written after
            const bool any = __syncthreads_or(touched) != 0;
            decay_only = was_cold && !any;
            if (was_cold && any && threadIdx.x == 0) cold[blk] = 0;
        }
        if (decay_only) {
            if (c.decay != T(1)) {
#pragma unroll
                for (int k = 0; k < adam_per_thread; ++k) {
                    const index_t i = base + index_t(k) * adam_threads;
                    if (i < n) params[i] = mul_rn(params[i], c.decay);
                }
            }
            continue;
        }
#pragma unroll
        for (int k = 0; k < adam_per_thread; ++k) {
            const index_t i = base + index_t(k) * adam_threads;
            if (i < n) {
                T p = params[i], mi = m[i], vi = v[i];
                adam_element<R>(p, g[k], mi, vi, c);
                params[i] = p;
                m[i] = mi;
                v[i] = vi;
            }
        }
    }
}

// cold[b] = whether m and v are exactly zero over block b; the same thread shape as adam_kernel.
template <class T>
__global__ void __launch_bounds__(adam_threads)
    cold_blocks_kernel(const T* __restrict__ m, const T* __restrict__ v, index_t n, std::uint8_t* __restrict__ cold) {
    const index_t blocks = (n + adam_cold_block - 1) / adam_cold_block;
    for (index_t blk = blockIdx.x; blk < blocks; blk += gridDim.x) {
        const index_t base = blk * adam_cold_block + threadIdx.x;
        int zero = 1;
#pragma unroll
        for (int k = 0; k < adam_per_thread; ++k) {
            const index_t i = base + index_t(k) * adam_threads;
            if (i < n) zero &= (m[i] == T(0) && v[i] == T(0));
        }
        const int all = __syncthreads_and(zero);
        if (threadIdx.x == 0) cold[blk] = all ? 1 : 0;
    }
}

// ---- SGD ------------------------------------------------------------------------------------------------------

constexpr unsigned threads = 256;

template <class T>
__global__ void __launch_bounds__(threads) sgd_kernel(const sgd_step_args<T> a) {
    T* __restrict__ params = a.params;
    const T* __restrict__ grads = a.grads;
    T* __restrict__ buf = a.b;
    for (index_t i = global_index(); i < a.n; i += global_stride()) {
        const T p = params[i];
        const T g = a.l2 ? fma_rn(a.wd, p, grads[i]) : grads[i];  // d_p.add(param, alpha=wd)
        T d = g;
        if (buf != nullptr) {
            // First step: buf = clone(d_p). Later: buf.mul_(momentum).add_(d_p, alpha=1-dampening).
            const T bi = a.first ? g : fma_rn(a.one_minus_dampening, g, mul_rn(buf[i], a.momentum));
            buf[i] = bi;
            d = a.nesterov ? fma_rn(a.momentum, bi, g) : bi;  // d_p.add(buf, alpha=momentum)
        }
        params[i] = fma_rn(a.neg_lr, d, p);  // param.add_(d_p, alpha=-lr)
    }
}

// ---- the live runs --------------------------------------------------------------------------------------------

void check_runs(const char* who, std::span<const flat_range> live, index_t n) {
    index_t at = 0;
    for (const flat_range& r : live) {
        MNEMO_CHECK(r.begin >= at && r.end >= r.begin && (n < 0 || r.end <= n), who,
                    ": the live runs must be sorted, disjoint and inside the buffer; got [", r.begin, ", ", r.end,
                    ") after ", at);
        at = r.end;
    }
}

// Σ x² in double over fixed blocks: block b of the grid sums x[b·chunk, min(n, (b + 1)·chunk)), where chunk
// depends on n alone; inside it, element j belongs to thread (j − b·chunk) mod norm_threads, which adds
// its elements' squares (fma) in increasing j, then the block's threads are summed by block_sum's fixed
// tree. Threads visit only the elements inside the live runs: the others are +0, whose fma would leave
// the partial sum as it is, so the result is bitwise that of the dense buffer, whatever the runs.
constexpr unsigned norm_threads = 256;
constexpr index_t norm_max_blocks = 1024;  // also the thread count of the final pass
constexpr index_t norm_min_chunk = 8192;

template <class T>
__global__ void __launch_bounds__(norm_threads)
    sum_squares_blocks(const T* __restrict__ x, index_t n, index_t chunk, const flat_range* __restrict__ runs,
                       index_t count, double* __restrict__ partial) {
    const index_t lo = index_t(blockIdx.x) * chunk, hi = min(n, lo + chunk);
    // The first run that ends after lo (the same for every thread: broadcast loads).
    index_t a = 0, b = count;
    while (a < b) {
        const index_t mid = (a + b) / 2;
        if (runs[mid].end <= lo) a = mid + 1;
        else b = mid;
    }
    double acc = 0.0;
    const index_t tid = threadIdx.x;
    for (index_t q = a; q < count; ++q) {
        const flat_range r = runs[q];
        if (r.begin >= hi) break;
        const index_t s = max(r.begin, lo), e = min(r.end, hi);
        // This thread's first element at or after s.
        const index_t shift = ((tid - (s - lo)) % index_t(norm_threads) + index_t(norm_threads)) % index_t(norm_threads);
        for (index_t j = s + shift; j < e; j += norm_threads) {
            const double v = static_cast<double>(x[j]);
            acc = __fma_rn(v, v, acc);
        }
    }
    const double total = cuda_detail::block_sum(acc);
    if (threadIdx.x == 0) partial[blockIdx.x] = total;
}

// partial[norm_max_blocks] = Σ_b partial[b] over the `blocks` partials (one block, a fixed tree).
__global__ void __launch_bounds__(norm_max_blocks) sum_partials(double* partial, index_t blocks) {
    const double v = index_t(threadIdx.x) < blocks ? partial[threadIdx.x] : 0.0;
    const double total = cuda_detail::block_sum(v);
    if (threadIdx.x == 0) partial[norm_max_blocks] = total;
}

// sum_squares_live's device scratch, allocated on the first call and grown when a call has more runs than
// ever before (so the steady state allocates nothing): the runs, uploaded per call, and the partial sums
// (norm_max_blocks of them, then the total). The lock is held for the whole call, upload to download,
// so two host threads never share it.
struct norm_scratch {
    std::mutex lock;
    flat_range* runs = nullptr;
    std::size_t runs_capacity = 0;
    double* partial = nullptr;
};
norm_scratch& scratch() {
    static norm_scratch s;  // deliberately never freed (as the stream: the driver may be gone at exit)
    return s;
}

// scale_live passes its runs with the launch, at most this many per launch: the start of each run and the
// prefix sums of their lengths (about 2 KiB of kernel parameters).
constexpr int scale_max_runs = 128;
struct run_table {
    index_t count = 0;
    index_t begin[scale_max_runs];
    index_t offset[scale_max_runs + 1];  // offset[q] = live elements before run q; offset[count] = all
};

// x ← x·s over the table's live elements: thread e (grid-stride over the live elements, so neighbouring
// threads touch neighbouring addresses) finds its run by binary search in the shared copy of the table.
template <class T>
__global__ void __launch_bounds__(threads) scale_runs_kernel(T* __restrict__ x, const __grid_constant__ run_table t, T s) {
    __shared__ index_t begin[scale_max_runs], offset[scale_max_runs + 1];
    for (int q = threadIdx.x; q <= t.count; q += blockDim.x) {
        if (q < t.count) begin[q] = t.begin[q];
        offset[q] = t.offset[q];
    }
    __syncthreads();
    const index_t total = offset[t.count];
    for (index_t e = global_index(); e < total; e += global_stride()) {
        int a = 0, b = int(t.count);  // the last run q with offset[q] <= e: it is non-empty
        while (b - a > 1) {
            const int mid = (a + b) / 2;
            if (offset[mid] <= e) a = mid;
            else b = mid;
        }
        T* p = x + begin[a] + (e - offset[a]);
        *p = mul_rn(*p, s);
    }
}

}  // namespace

template <class T>
void adam_step(adam_rule rule, const adam_step_args<T>& a) {
    MNEMO_CHECK(a.deferral == nullptr, "cuda adam_step: given a deferred decay, which this backend never defers");
    MNEMO_CHECK(a.n >= 0, "cuda adam_step: negative size ", a.n);
    if (a.n == 0) return;
    const unsigned grid = blocks_for(a.n, adam_cold_block);
    cudaStream_t st = cuda_detail::stream();
    switch (rule) {
    case adam_rule::adamw:
        adam_kernel<adam_rule::adamw><<<grid, adam_threads, 0, st>>>(a.params, a.grads, a.m, a.v, a.n, a.cold, a.c);
        break;
    case adam_rule::adam:
        adam_kernel<adam_rule::adam><<<grid, adam_threads, 0, st>>>(a.params, a.grads, a.m, a.v, a.n, a.cold, a.c);
        break;
    case adam_rule::labml:
        adam_kernel<adam_rule::labml><<<grid, adam_threads, 0, st>>>(a.params, a.grads, a.m, a.v, a.n, a.cold, a.c);
        break;
    }
    MNEMO_CUDA_LAUNCHED("adam_step");
}

template <class T>
void adam_cold_blocks(const T* m, const T* v, index_t n, std::uint8_t* cold) {
    MNEMO_CHECK(n >= 0, "cuda adam_cold_blocks: negative size ", n);
    if (n == 0) return;
    cold_blocks_kernel<<<blocks_for(n, adam_cold_block), adam_threads, 0, cuda_detail::stream()>>>(m, v, n, cold);
    MNEMO_CUDA_LAUNCHED("adam_cold_blocks");
}

template <class T>
void sgd_step(const sgd_step_args<T>& a) {
    MNEMO_CHECK(a.n >= 0, "cuda sgd_step: negative size ", a.n);
    if (a.n == 0) return;
    sgd_kernel<<<blocks_for(a.n, threads), threads, 0, cuda_detail::stream()>>>(a);
    MNEMO_CUDA_LAUNCHED("sgd_step");
}

template <class T>
double sum_squares_live(const T* x, index_t n, std::span<const flat_range> live) {
    check_runs("cuda sum_squares_live", live, n);
    if (n <= 0 || live.empty()) return 0.0;
    const index_t chunk = std::max(norm_min_chunk, (n + norm_max_blocks - 1) / norm_max_blocks);
    const index_t blocks = (n + chunk - 1) / chunk;  // <= norm_max_blocks
    cudaStream_t st = cuda_detail::stream();
    norm_scratch& sc = scratch();
    std::lock_guard guard(sc.lock);
    if (!sc.partial) MNEMO_CUDA(cudaMalloc(&sc.partial, sizeof(double) * (norm_max_blocks + 1)));
    if (sc.runs_capacity < live.size()) {
        if (sc.runs) {  // a call that threw before its final wait may have left a kernel reading it
            MNEMO_CUDA(cudaStreamSynchronize(st));
            MNEMO_CUDA(cudaFree(sc.runs));
        }
        sc.runs = nullptr;
        sc.runs_capacity = 0;
        const std::size_t capacity = std::max<std::size_t>(live.size(), 256);
        MNEMO_CUDA(cudaMalloc(&sc.runs, sizeof(flat_range) * capacity));
        sc.runs_capacity = capacity;
    }
    // From pageable memory: the driver stages the runs before returning (this call waits at the end anyway).
    MNEMO_CUDA(cudaMemcpyAsync(sc.runs, live.data(), live.size_bytes(), cudaMemcpyHostToDevice, st));
    cuda_detail::count_launch();
    sum_squares_blocks<<<unsigned(blocks), norm_threads, 0, st>>>(x, n, chunk, sc.runs, index_t(live.size()),
                                                                   sc.partial);
    MNEMO_CUDA_LAUNCHED("sum_squares_live");
    sum_partials<<<1, unsigned(norm_max_blocks), 0, st>>>(sc.partial, blocks);
    MNEMO_CUDA_LAUNCHED("sum_squares_live (partials)");
    double total = 0.0;
    MNEMO_CUDA(cudaMemcpyAsync(&total, sc.partial + norm_max_blocks, sizeof(double), cudaMemcpyDeviceToHost, st));
    cuda_detail::count_launch();
    MNEMO_CUDA(cudaStreamSynchronize(st));  // the host needs the norm (kernels.hpp)
    return total;
}

template <class T>
void scale_live(T* x, std::span<const flat_range> live, T s) {
    check_runs("cuda scale_live", live, -1);
    for (std::size_t first = 0; first < live.size(); first += scale_max_runs) {
        run_table t;
        t.count = index_t(std::min<std::size_t>(scale_max_runs, live.size() - first));
        t.offset[0] = 0;
        for (index_t q = 0; q < t.count; ++q) {
            const flat_range& r = live[first + std::size_t(q)];
            t.begin[q] = r.begin;
            t.offset[q + 1] = t.offset[q] + (r.end - r.begin);
        }
        const index_t total = t.offset[t.count];
        if (total == 0) continue;
        scale_runs_kernel<<<blocks_for(total, threads), threads, 0, cuda_detail::stream()>>>(x, t, s);
        MNEMO_CUDA_LAUNCHED("scale_live");
    }
}

#define MNEMO_OPTIMIZER_T(T)                                                          \
    template void adam_step<T>(adam_rule, const adam_step_args<T>&);                  \
    template void adam_cold_blocks<T>(const T*, const T*, index_t, std::uint8_t*);    \
    template void sgd_step<T>(const sgd_step_args<T>&);                               \
    template double sum_squares_live<T>(const T*, index_t, std::span<const flat_range>); \
    template void scale_live<T>(T*, std::span<const flat_range>, T);
MNEMO_CUDA_INSTANTIATE_T(MNEMO_OPTIMIZER_T)
#undef MNEMO_OPTIMIZER_T

}  // namespace mnemo::cuda_kernels
