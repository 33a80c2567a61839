// The CUDA backend's element-wise and row kernels (kernels/cuda/kernels.hpp): bias rows, column sums,
// adds, copies, gathers and scatters, the activations, dropout and the GRU gate's passes.
//
// Element-wise kernels are grid-stride loops over the flat index of the [rows, n] block (row = e / n),
// 256 threads a block. Column sums (bias gradients) are fixed-order column reductions; the embedding
// scatter gives every table element to one thread, which adds the rows in order: no atomics anywhere,
// so every result is bitwise the same run to run.
#include <cstdint>

#include "common.cuh"
#include "device_math.cuh"
#include "mnemo/kernels/cuda/kernels.hpp"

namespace mnemo::cuda_kernels {
namespace {

using namespace cuda_detail;  // common.cuh, device_math.cuh

constexpr unsigned threads = 256;

/// db[c] += Σ_r dy[r, c]
template <class T>
struct sum_rows_op {
    const T* dy;
    index_t ld;
    T* db;
    __device__ void term(index_t r, index_t c, T* acc) const { acc[0] += dy[r * ld + c]; }
    __device__ void finish(index_t c, const T* acc) const { db[c] += acc[0]; }
};

// ---- [rows, n] blocks ------------------------------------------------------------------------------------------

template <class T>
__global__ void add_bias_rows_kernel(index_t rows, index_t n, const T* b, T* c, index_t ldc) {
    const index_t total = rows * n;
    for (index_t e = global_index(); e < total; e += global_stride()) {
        const index_t i = e / n, j = e - i * n;
        c[i * ldc + j] += b[j];
    }
}

template <class T>
__global__ void add_kernel(index_t rows, index_t n, const T* a, index_t lda, const T* b, index_t ldb, T* y,
                           index_t ldy) {
    const index_t total = rows * n;
    for (index_t e = global_index(); e < total; e += global_stride()) {
        const index_t i = e / n, j = e - i * n;
        y[i * ldy + j] = a[i * lda + j] + b[i * ldb + j];
    }
}

template <class T>
__global__ void copy_kernel(index_t rows, index_t n, const T* x, index_t ldx, T* y, index_t ldy, bool accumulate) {
    const index_t total = rows * n;
    for (index_t e = global_index(); e < total; e += global_stride()) {
        const index_t i = e / n, j = e - i * n;
        const T v = x[i * ldx + j];
        T* p = y + i * ldy + j;
        *p = accumulate ? *p + v : v;
    }
}

template <class T>
__global__ void scale_kernel(index_t rows, index_t n, const T* x, index_t ldx, T s, T* y, index_t ldy) {
    const index_t total = rows * n;
    for (index_t e = global_index(); e < total; e += global_stride()) {
        const index_t i = e / n, j = e - i * n;
        y[i * ldy + j] = x[i * ldx + j] * s;
    }
}

template <class T, class I>
__global__ void gather_rows_kernel(index_t rows, index_t n, const I* ids, const T* table, index_t ldt, T* y,
                                   index_t ldy) {
    const index_t total = rows * n;
    for (index_t e = global_index(); e < total; e += global_stride()) {
        const index_t i = e / n, j = e - i * n;
        y[i * ldy + j] = table[index_t(ids[i]) * ldt + j];
    }
}

// The embedding backward. Thread (column c, slice s) owns the table elements [id, c] with id mod
// scatter_slices = s, and walks all rows in order, adding those whose id it owns: each element gets
// its rows' values in row order (the CPU's order), whatever ids repeat. A warp is 32 columns of one
// slice, so its branch is uniform; the ids are read by every thread (broadcast loads).
constexpr int scatter_cols = 32, scatter_block_slices = 8, scatter_grid_slices = 4,
              scatter_slices = scatter_block_slices * scatter_grid_slices;  // a power of two
static_assert((scatter_slices & (scatter_slices - 1)) == 0);

template <class T, class I>
__global__ void scatter_add_rows_kernel(index_t rows, index_t n, const I* ids, const T* dy, index_t ld, T* table,
                                        index_t ldt) {
    const unsigned s = blockIdx.y * scatter_block_slices + threadIdx.y;
    for (index_t c = index_t(blockIdx.x) * scatter_cols + threadIdx.x; c < n; c += index_t(gridDim.x) * scatter_cols)
        for (index_t i = 0; i < rows; ++i) {
            const I id = ids[i];
            if (id < 0 || (unsigned(id) & (scatter_slices - 1)) != s) continue;
            table[index_t(id) * ldt + c] += dy[i * ld + c];
        }
}

template <class T>
__global__ void scale_shift_rows_kernel(index_t rows, index_t n, const T* x, index_t ldx, const T* g, const T* b, T* y,
                                        index_t ldy) {
    const index_t total = rows * n;
    for (index_t e = global_index(); e < total; e += global_stride()) {
        const index_t i = e / n, j = e - i * n;
        y[i * ldy + j] = x[i * ldx + j] * g[j] + b[j];
    }
}

/// sum[0] = Σ x in double: one block, each thread a strided partial sum, then a fixed tree.
constexpr unsigned sum_threads = 1024;
template <class T>
__global__ void __launch_bounds__(sum_threads) sum_as_double_kernel(index_t n, const T* x, double* sum) {
    double s = 0;
    for (index_t i = threadIdx.x; i < n; i += blockDim.x) s += double(x[i]);
    s = cuda_detail::block_sum(s);
    if (threadIdx.x == 0) *sum = s;
}

/// The factor is formed by each thread from the count in device memory, as the CPU forms it.
template <class T>
__global__ void scale_by_count_kernel(index_t n, T* x, const double* count, index_t per_count, T numerator) {
    const index_t m = index_t(*count) * per_count;
    const T s = m > 0 ? numerator / T(m) : T(0);
    for (index_t e = global_index(); e < n; e += global_stride()) x[e] = x[e] * s;
}

template <class T>
__global__ void axpy_kernel(index_t n, T a, const T* x, T* y) {
    for (index_t e = global_index(); e < n; e += global_stride()) y[e] += a * x[e];
}

/// weighted_sum_rows' inputs, passed by value with the launch.
template <class T>
struct weighted_inputs {
    const T* x[max_weighted_rows];
    T w[max_weighted_rows];
    int count;
};

template <class T>
__global__ void weighted_sum_rows_kernel(index_t rows, index_t d, const weighted_inputs<T> in, index_t ldx, T* y,
                                         index_t ldy) {
    const index_t total = rows * d;
    for (index_t e = global_index(); e < total; e += global_stride()) {
        const index_t r = e / d, k = e - r * d, off = r * ldx + k;
        T m = in.w[0] * in.x[0][off];
        for (int l = 1; l < in.count; ++l) m += in.w[l] * in.x[l][off];
        y[r * ldy + k] = m;
    }
}

// ---- activations ------------------------------------------------------------------------------------------------

// gelu(x) = ½x·erfc(−x/√2); gelu'(x) = ½erfc(−x/√2) + x·exp(−x²/2)/√(2π) (activation.hpp's formulas).
template <class T, bool Gelu>
__global__ void activation_forward_kernel(index_t n, const T* x, T* y) {
    constexpr T rs2 = T(0.70710678118654752440);
    for (index_t e = global_index(); e < n; e += global_stride()) {
        const T v = x[e];
        if constexpr (Gelu) y[e] = T(0.5) * v * dev_erfc(-v * rs2);
        else y[e] = v > T(0) ? v : T(0);
    }
}

template <class T, bool Gelu>
__global__ void activation_backward_kernel(index_t n, const T* x, const T* dy, T* dx) {
    constexpr T rs2 = T(0.70710678118654752440), rs2pi = T(0.39894228040143267794);
    for (index_t e = global_index(); e < n; e += global_stride()) {
        const T v = x[e], g = dy[e];
        if constexpr (Gelu) {
            const T cdf = T(0.5) * dev_erfc(-v * rs2);
            const T pdf = rs2pi * dev_exp(T(-0.5) * v * v);
            dx[e] = g * (cdf + v * pdf);
        } else {
            dx[e] = v > T(0) ? g : T(0);
        }
    }
}

// ---- dropout ----------------------------------------------------------------------------------------------------

/// Philox4x32-10 (core/rng.hpp's philox4x32::generate): counter (c0, c1, 0, 0), key (k0, k1).
__device__ inline uint4 philox(unsigned c0, unsigned c1, unsigned k0, unsigned k1) {
    unsigned c2 = 0, c3 = 0;
#pragma unroll
    for (int r = 0; r < 10; ++r) {
        const unsigned lo0 = 0xD2511F53u * c0, hi0 = __umulhi(0xD2511F53u, c0);
        const unsigned lo1 = 0xCD9E8D57u * c2, hi1 = __umulhi(0xCD9E8D57u, c2);
        const unsigned n0 = hi1 ^ c1 ^ k0, n1 = lo1, n2 = hi0 ^ c3 ^ k1, n3 = lo0;
        c0 = n0;
        c1 = n1;
        c2 = n2;
        c3 = n3;
        if (r < 9) {
            k0 += 0x9E3779B9u;
            k1 += 0xBB67AE85u;
        }
    }
    return make_uint4(c0, c1, c2, c3);
}

// Element i uses the random word of counter offset + i (random_u32): word q of Philox block
// (offset + i) >> 2 is number ((offset + i) & 3). One thread per block of four counters, so each
// Philox evaluation serves four elements; kept iff uniform >= p, scaled by `scale`.
template <class T>
__global__ void dropout_kernel(index_t n, const T* x, T* y, float p, T scale, std::uint64_t seed,
                               std::uint64_t offset) {
    const std::uint64_t first = offset >> 2, last = (offset + std::uint64_t(n) - 1) >> 2;
    const index_t groups = index_t(last - first + 1);
    const unsigned k0 = unsigned(seed), k1 = unsigned(seed >> 32);
    for (index_t g = global_index(); g < groups; g += global_stride()) {
        const std::uint64_t block = first + std::uint64_t(g);
        const uint4 w = philox(unsigned(block), unsigned(block >> 32), k0, k1);
        const unsigned words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
        for (int q = 0; q < 4; ++q) {
            const std::uint64_t counter = block * 4 + std::uint64_t(q);
            if (counter < offset || counter - offset >= std::uint64_t(n)) continue;
            const index_t i = index_t(counter - offset);
            const float u = float(words[q] >> 8) * (1.0f / 16777216.0f);
            y[i] = u >= p ? x[i] * scale : T(0);
        }
    }
}

template <class T>
void dropout_apply(index_t n, const T* x, T* y, float p, std::uint64_t seed, std::uint64_t offset) {
    if (n <= 0) return;
    if (p <= 0.0f) {
        if (x != y) copy(1, n, x, n, y, n, false);
        return;
    }
    const T scale = p >= 1.0f ? T(0) : T(1) / (T(1) - T(p));
    const index_t groups = index_t(((offset + std::uint64_t(n) - 1) >> 2) - (offset >> 2) + 1);
    dropout_kernel<T><<<blocks_for(groups, threads), threads, 0, cuda_detail::stream()>>>(n, x, y, p, scale, seed,
                                                                                          offset);
    MNEMO_CUDA_LAUNCHED("dropout_kernel");
}

// ---- GRU gate ---------------------------------------------------------------------------------------------------

template <class T>
__device__ inline T sigmoid(T a) {
    return T(1) / (T(1) + dev_exp(-a));
}

/// gru.hpp's forward, one thread per (row, j < d).
template <class T>
__global__ void gru_gate_forward_kernel(index_t rows, index_t d, T* gi, T* gh, const T* b_ih, const T* b_hh,
                                        const T* x, T* out, index_t ldo) {
    const index_t total = rows * d;
    for (index_t e = global_index(); e < total; e += global_stride()) {
        const index_t i = e / d, j = e - i * d;
        T* a = gi + i * 3 * d;
        T* h = gh + i * 3 * d;
        const T r = sigmoid(a[j] + b_ih[j] + h[j] + b_hh[j]);
        const T z = sigmoid(a[d + j] + b_ih[d + j] + h[d + j] + b_hh[d + j]);
        const T hn = h[2 * d + j] + b_hh[2 * d + j];
        const T nv = dev_tanh(a[2 * d + j] + b_ih[2 * d + j] + r * hn);
        const T xv = x[i * d + j];
        a[j] = r;
        a[d + j] = z;
        a[2 * d + j] = nv;
        h[2 * d + j] = hn;
        out[i * ldo + j] = nv + z * (xv - nv);
    }
}

/// gru.hpp's backward, one thread per (row, j < d).
template <class T>
__global__ void gru_gate_backward_kernel(index_t rows, index_t d, const T* act, const T* gh, const T* x, const T* g,
                                         index_t ldg, T* dgi, T* dgh, T* dx, index_t ldx, bool accumulate_dx) {
    const index_t total = rows * d;
    for (index_t e = global_index(); e < total; e += global_stride()) {
        const index_t i = e / d, j = e - i * d;
        const T* a = act + i * 3 * d;
        const T r = a[j], z = a[d + j], nv = a[2 * d + j], gv = g[i * ldg + j];
        const T hn = gh[i * 3 * d + 2 * d + j];
        const T a_z = gv * (x[i * d + j] - nv) * z * (T(1) - z);
        const T a_n = gv * (T(1) - z) * (T(1) - nv * nv);
        const T a_r = a_n * hn * r * (T(1) - r);
        T* di = dgi + i * 3 * d;
        T* dh = dgh + i * 3 * d;
        di[j] = a_r;
        di[d + j] = a_z;
        di[2 * d + j] = a_n;
        dh[j] = a_r;
        dh[d + j] = a_z;
        dh[2 * d + j] = a_n * r;
        if (dx) {
            T* p = dx + i * ldx + j;
            *p = accumulate_dx ? *p + gv * z : gv * z;
        }
    }
}

/// kernel<<<…>>>(args…) over `work` items: 256 threads a block, a grid-stride loop beyond the grid.
template <class... P, class... A>
void launch(const char* name, index_t work, void (*kernel)(P...), const A&... args) {
    kernel<<<blocks_for(work, threads), threads, 0, cuda_detail::stream()>>>(args...);
    MNEMO_CUDA_LAUNCHED(name);
}

}  // namespace

// ---- element-wise and rows --------------------------------------------------------------------------------------

template <class T>
void add_bias_rows(index_t rows, index_t n, const T* b, T* c, index_t ldc) {
    if (rows <= 0 || n <= 0) return;
    launch("add_bias_rows_kernel", rows * n, add_bias_rows_kernel<T>, rows, n, b, c, ldc);
}

template <class T>
void sum_rows_accumulate(index_t rows, index_t n, const T* dy, index_t ld, T* db) {
    if (rows <= 0 || n <= 0) return;
    cuda_detail::column_reduce<T, 1>(rows, n, sum_rows_op<T>{dy, ld, db}, "sum_rows_accumulate");
}

template <class T>
void add(index_t rows, index_t n, const T* a, index_t lda, const T* b, index_t ldb, T* y, index_t ldy) {
    if (rows <= 0 || n <= 0) return;
    launch("add_kernel", rows * n, add_kernel<T>, rows, n, a, lda, b, ldb, y, ldy);
}

template <class T>
void copy(index_t rows, index_t n, const T* x, index_t ldx, T* y, index_t ldy, bool accumulate) {
    if (rows <= 0 || n <= 0) return;
    if (!accumulate && x == y && ldx == ldy) return;
    launch("copy_kernel", rows * n, copy_kernel<T>, rows, n, x, ldx, y, ldy, accumulate);
}

template <class T>
void scale(index_t rows, index_t n, const T* x, index_t ldx, T s, T* y, index_t ldy) {
    if (rows <= 0 || n <= 0) return;
    launch("scale_kernel", rows * n, scale_kernel<T>, rows, n, x, ldx, s, y, ldy);
}

template <class T>
void scale_by_count(index_t n, T* x, const double* count, index_t per_count, T numerator) {
    if (n <= 0) return;
    launch("scale_by_count_kernel", n, scale_by_count_kernel<T>, n, x, count, per_count, numerator);
}

template <class T, class I>
void gather_rows(index_t rows, index_t n, const I* ids, const T* table, index_t ldt, T* y, index_t ldy) {
    if (rows <= 0 || n <= 0) return;
    launch("gather_rows_kernel", rows * n, gather_rows_kernel<T, I>, rows, n, ids, table, ldt, y, ldy);
}

template <class T, class I>
void scatter_add_rows(index_t rows, index_t n, const I* ids, const T* dy, index_t ld, T* table, index_t ldt) {
    if (rows <= 0 || n <= 0) return;
    const dim3 block(scatter_cols, scatter_block_slices), grid(blocks_for(n, scatter_cols), scatter_grid_slices);
    scatter_add_rows_kernel<T, I><<<grid, block, 0, cuda_detail::stream()>>>(rows, n, ids, dy, ld, table, ldt);
    MNEMO_CUDA_LAUNCHED("scatter_add_rows_kernel");
}

template <class T>
void scale_shift_rows(index_t rows, index_t n, const T* x, index_t ldx, const T* g, const T* b, T* y, index_t ldy) {
    if (rows <= 0 || n <= 0) return;
    launch("scale_shift_rows_kernel", rows * n, scale_shift_rows_kernel<T>, rows, n, x, ldx, g, b, y, ldy);
}

template <class T>
void sum_as_double(index_t n, const T* x, double* sum) {
    // Launched for n = 0 too: the sum is then written as 0.
    sum_as_double_kernel<T><<<1, sum_threads, 0, cuda_detail::stream()>>>(n < 0 ? 0 : n, x, sum);
    MNEMO_CUDA_LAUNCHED("sum_as_double_kernel");
}

template <class T>
void axpy(index_t n, T a, const T* x, T* y) {
    if (n <= 0) return;
    launch("axpy_kernel", n, axpy_kernel<T>, n, a, x, y);
}

template <class T>
void weighted_sum_rows(index_t rows, index_t d, std::span<const T* const> x, index_t ldx, std::span<const T> w, T* y,
                       index_t ldy) {
    MNEMO_CHECK(!x.empty() && x.size() == w.size() && index_t(x.size()) <= max_weighted_rows,
                "cuda weighted_sum_rows: ", x.size(), " inputs and ", w.size(), " weights (1 to ", max_weighted_rows,
                " of each)");
    if (rows <= 0 || d <= 0) return;
    weighted_inputs<T> in{};
    in.count = int(x.size());
    for (int l = 0; l < in.count; ++l) {
        in.x[l] = x[std::size_t(l)];
        in.w[l] = w[std::size_t(l)];
    }
    launch("weighted_sum_rows_kernel", rows * d, weighted_sum_rows_kernel<T>, rows, d, in, ldx, y, ldy);
}

template <class T>
void activation_forward(activation_kind act, index_t n, const T* x, T* y) {
    if (n <= 0) return;
    if (act == activation_kind::gelu)
        launch("activation_forward_kernel", n, activation_forward_kernel<T, true>, n, x, y);
    else
        launch("activation_forward_kernel", n, activation_forward_kernel<T, false>, n, x, y);
}

template <class T>
void activation_backward(activation_kind act, index_t n, const T* x, const T* dy, T* dx) {
    if (n <= 0) return;
    if (act == activation_kind::gelu)
        launch("activation_backward_kernel", n, activation_backward_kernel<T, true>, n, x, dy, dx);
    else
        launch("activation_backward_kernel", n, activation_backward_kernel<T, false>, n, x, dy, dx);
}

template <class T>
void dropout_forward(index_t n, const T* x, T* y, float p, std::uint64_t seed, std::uint64_t offset) {
    dropout_apply(n, x, y, p, seed, offset);
}

template <class T>
void dropout_backward(index_t n, const T* dy, T* dx, float p, std::uint64_t seed, std::uint64_t offset) {
    dropout_apply(n, dy, dx, p, seed, offset);
}

template <class T>
void gru_gate_forward(index_t rows, index_t d, T* gi, T* gh, const T* b_ih, const T* b_hh, const T* x, T* out,
                      index_t ldo) {
    if (rows <= 0 || d <= 0) return;
    launch("gru_gate_forward_kernel", rows * d, gru_gate_forward_kernel<T>, rows, d, gi, gh, b_ih, b_hh, x, out, ldo);
}

template <class T>
void gru_gate_backward(index_t rows, index_t d, const T* act, const T* gh, const T* x, const T* g, index_t ldg, T* dgi,
                       T* dgh, T* dx, index_t ldx, bool accumulate_dx) {
    if (rows <= 0 || d <= 0) return;
    launch("gru_gate_backward_kernel", rows * d, gru_gate_backward_kernel<T>, rows, d, act, gh, x, g, ldg, dgi, dgh, dx,
           ldx, accumulate_dx);
}

// ---- explicit instantiations ------------------------------------------------------------------------------------

#define MNEMO_ELEMENTWISE(T)                                                                                           \
    template void add_bias_rows<T>(index_t, index_t, const T*, T*, index_t);                                          \
    template void sum_rows_accumulate<T>(index_t, index_t, const T*, index_t, T*);                                    \
    template void add<T>(index_t, index_t, const T*, index_t, const T*, index_t, T*, index_t);                        \
    template void copy<T>(index_t, index_t, const T*, index_t, T*, index_t, bool);                                    \
    template void scale<T>(index_t, index_t, const T*, index_t, T, T*, index_t);                                      \
    template void gather_rows<T, std::int32_t>(index_t, index_t, const std::int32_t*, const T*, index_t, T*, index_t); \
    template void scatter_add_rows<T, std::int32_t>(index_t, index_t, const std::int32_t*, const T*, index_t, T*,     \
                                                    index_t);                                                          \
    template void scale_shift_rows<T>(index_t, index_t, const T*, index_t, const T*, const T*, T*, index_t);          \
    template void sum_as_double<T>(index_t, const T*, double*);                                                        \
    template void scale_by_count<T>(index_t, T*, const double*, index_t, T);                                           \
    template void axpy<T>(index_t, T, const T*, T*);                                                                   \
    template void weighted_sum_rows<T>(index_t, index_t, std::span<const T* const>, index_t, std::span<const T>, T*,  \
                                       index_t);                                                                       \
    template void activation_forward<T>(activation_kind, index_t, const T*, T*);                                      \
    template void activation_backward<T>(activation_kind, index_t, const T*, const T*, T*);                           \
    template void dropout_forward<T>(index_t, const T*, T*, float, std::uint64_t, std::uint64_t);                     \
    template void dropout_backward<T>(index_t, const T*, T*, float, std::uint64_t, std::uint64_t);                    \
    template void gru_gate_forward<T>(index_t, index_t, T*, T*, const T*, const T*, const T*, T*, index_t);           \
    template void gru_gate_backward<T>(index_t, index_t, const T*, const T*, const T*, const T*, index_t, T*, T*, T*, \
                                       index_t, bool);
MNEMO_CUDA_INSTANTIATE_T(MNEMO_ELEMENTWISE)
#undef MNEMO_ELEMENTWISE

}  // namespace mnemo::cuda_kernels
