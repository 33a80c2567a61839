#pragma once
// A linear layer y = x·Wᵀ + b: its forward (the bias added as the product stores y, where the GEMM
// path allows) and its backward as one kernel each, so the choice of running the backward's two
// independent halves side by side is the kernel's, not the module's.
#include "parallel.hpp"
#include "../../core/shape.hpp"
#include "elementwise.hpp"
#include "gemm.hpp"

namespace mnemo::cpu_kernels {

struct linear_layer {
    /// y [rows, out] = x [rows, in]·Wᵀ + b, W [out, in] (row stride in), b [out] (null: no bias).
    /// Bitwise gemm_nt followed by add_bias_rows (gemm::gemm_nt_bias).
    template <class T>
    static void linear_forward(index_t rows, index_t in, index_t out, const T* x, index_t ldx, const T* w, const T* b,
                               T* y, index_t ldy) {
        gemm::gemm_nt_bias(rows, out, in, x, ldx, w, in, b, y, ldy);
    }

    /// gw [out, in] += dyᵀ·x and gb [out] += Σ rows dy (gb null: no bias); dx [rows, in] = dy·W, or
    /// += with accumulate_dx (dx null: not wanted, W not read). W is [out, in] with row stride in.
    /// The weight gradient and dx are independent: at mid sizes (gemm::concurrent_pair) they run at the
    /// same time, one per thread; each is the same computation either way. The bias's row sum goes
    /// with dx: dW's transposed-A product is the slower of the two (configuration A's step on the
    /// 2-core Zen 3 VM, tools/gomp_regions.c: this region's work 14.6% of the step on dW's thread
    /// against 12.3% on dx's with the sum beside dW, 12.7% against 12.0% with it beside dx).
    template <class T>
    static void linear_backward(index_t rows, index_t in, index_t out, const T* x, index_t ldx, const T* dy,
                                index_t lddy, const T* w, T* gw, T* gb, T* dx, index_t lddx, bool accumulate_dx) {
        auto weight_grads = [&] { gemm::gemm_tn(out, in, rows, dy, lddy, x, ldx, gw, in, T(1)); };
        auto input_grad = [&] {
            if (dx) gemm::gemm_nn(rows, in, out, dy, lddy, w, in, dx, lddx, accumulate_dx ? T(1) : T(0));
            if (gb) elementwise::sum_rows_accumulate(rows, out, dy, lddy, gb);
        };
        parallel_invoke(dx && gemm::concurrent_pair(rows, in, out), weight_grads, input_grad);
    }
};

}  // namespace mnemo::cpu_kernels
