#pragma once
// ops<cuda>: the CUDA backend's kernel table. Each member has the CPU kernel's signature (the same
// calls in nn/, models/ and train/ compile over either backend) and forwards to the compiled kernels
// of kernels/cuda/kernels.hpp, turning the compile-time parameters into runtime arguments.
//
// What differs from ops<cpu>, and why:
//   absorbs_memory = false       relative attention always projects the memory's keys and values:
//                                the absorbed route saves multiply-adds on the CPU, where the per-head
//                                products dominate; on a GPU both are one batched GEMM
//   defers_weight_decay = false  the optimizers apply the decoupled decay to every element at every
//                                step (one pass over the flat buffer; the deferral needs per-block
//                                bookkeeping on the host, which would mean a synchronisation per step)
//   scores_grad_scratch = false  the attention's backward writes every head's d scores to the
//                                module's [B, H, Q, K] buffer (one launch over all heads)
//   positional_scratch_from = no_positional_scratch  q·R and d_pos go through the module's
//                                [H, Q·B, W] buffer at every length
//   plain_attention_scratch = false  the reconstruction loss hands plain_attention_forward its
//                                [B, H, Q, n] probabilities buffer always (one batched product over
//                                all heads writes it)
//   parallel_slots(n) = 1, concurrent_pair = false, hold_threads(fn) = fn(): no host threads; the
//                                stream orders everything
//   the *_direct GEMMs are the ordinary ones (cuBLAS decides)
#include <cstdint>
#include <span>
#include <type_traits>

#include "../../core/activation.hpp"
#include "../../core/error.hpp"
#include "../cpu/softmax.hpp"  // softmax_mask (the type only)
#include "kernels.hpp"
#include "runtime.hpp"

namespace mnemo {

template <>
struct ops<cuda> {
    static constexpr bool absorbs_memory = false;
    static constexpr bool defers_weight_decay = false;
    static constexpr bool scores_grad_scratch = false;
    static constexpr index_t positional_scratch_from = no_positional_scratch;
    static constexpr bool plain_attention_scratch = false;
    static constexpr bool splits_key_rows = false;
    /// No host threads to hold: fn().
    template <class F>
    static decltype(auto) hold_threads(F&& fn) {
        return fn();
    }

    // GEMM
    template <class T>
    static void gemm_nn(index_t m, index_t n, index_t k, const T* a, index_t lda, const T* b, index_t ldb, T* c,
                        index_t ldc, T beta = T(0), T alpha = T(1)) {
        cuda_kernels::gemm_nn(m, n, k, a, lda, b, ldb, c, ldc, beta, alpha);
    }
    template <class T>
    static void gemm_nt(index_t m, index_t n, index_t k, const T* a, index_t lda, const T* b, index_t ldb, T* c,
                        index_t ldc, T beta = T(0), T alpha = T(1)) {
        cuda_kernels::gemm_nt(m, n, k, a, lda, b, ldb, c, ldc, beta, alpha);
    }
    template <class T>
    static void gemm_tn(index_t m, index_t n, index_t k, const T* a, index_t lda, const T* b, index_t ldb, T* c,
                        index_t ldc, T beta = T(0), T alpha = T(1)) {
        cuda_kernels::gemm_tn(m, n, k, a, lda, b, ldb, c, ldc, beta, alpha);
    }
    template <class T>
    static void gemm_nn_direct(index_t m, index_t n, index_t k, const T* a, index_t lda, const T* b, index_t ldb, T* c,
                               index_t ldc, T beta = T(0)) {
        cuda_kernels::gemm_nn(m, n, k, a, lda, b, ldb, c, ldc, beta, T(1));
    }
    template <class T>
    static void gemm_nt_direct(index_t m, index_t n, index_t k, const T* a, index_t lda, const T* b, index_t ldb, T* c,
                               index_t ldc, T beta = T(0)) {
        cuda_kernels::gemm_nt(m, n, k, a, lda, b, ldb, c, ldc, beta, T(1));
    }
    static bool concurrent_pair(index_t, index_t, index_t) { return false; }

    // Per-head products: the head width as a template argument (a static config's) or at runtime.
    template <index_t Dk, class T>
    static void head_gemm_nt(index_t m, index_t n, const T* x, index_t ldx, const T* y, index_t ldy, T* s, index_t lds) {
        cuda_kernels::head_gemm_nt(Dk, m, n, x, ldx, y, ldy, s, lds);
    }
    template <class T>
    static void head_gemm_nt(index_t dk, index_t m, index_t n, const T* x, index_t ldx, const T* y, index_t ldy, T* s,
                             index_t lds) {
        cuda_kernels::head_gemm_nt(dk, m, n, x, ldx, y, ldy, s, lds);
    }
    template <index_t Dk, class T>
    static void head_gemm_nn(index_t m, index_t n, const T* a, index_t lda, const T* y, index_t ldy, T* o, index_t ldo,
                             T beta = T(0)) {
        cuda_kernels::head_gemm_nn(Dk, m, n, a, lda, y, ldy, o, ldo, beta);
    }
    template <class T>
    static void head_gemm_nn(index_t dk, index_t m, index_t n, const T* a, index_t lda, const T* y, index_t ldy, T* o,
                             index_t ldo, T beta = T(0)) {
        cuda_kernels::head_gemm_nn(dk, m, n, a, lda, y, ldy, o, ldo, beta);
    }
    template <index_t Dk, class T>
    static void head_gemm_tn(index_t m, index_t n, const T* a, index_t lda, const T* x, index_t ldx, T* o, index_t ldo,
                             T beta = T(0)) {
        cuda_kernels::head_gemm_tn(Dk, m, n, a, lda, x, ldx, o, ldo, beta);
    }
    template <class T>
    static void head_gemm_tn(index_t dk, index_t m, index_t n, const T* a, index_t lda, const T* x, index_t ldx, T* o,
                             index_t ldo, T beta = T(0)) {
        cuda_kernels::head_gemm_tn(dk, m, n, a, lda, x, ldx, o, ldo, beta);
    }
    template <index_t Dk, class T>
    static void heads_dot_rows(index_t heads, index_t r0, index_t r1, const T* x, const T* y, index_t ldy, T* s,
                               index_t lds) {
        cuda_kernels::heads_dot_rows(Dk, heads, r0, r1, x, y, ldy, s, lds);
    }
    template <class T>
    static void heads_dot_rows(index_t dk, index_t heads, index_t r0, index_t r1, const T* x, const T* y, index_t ldy,
                               T* s, index_t lds) {
        cuda_kernels::heads_dot_rows(dk, heads, r0, r1, x, y, ldy, s, lds);
    }
    template <index_t Dk, class T>
    static void heads_weighted_rows(index_t h0, index_t h1, index_t n, const T* a, index_t lda, const T* y,
                                    index_t ldy, T* o) {
        cuda_kernels::heads_weighted_rows(Dk, h0, h1, n, a, lda, y, ldy, o);
    }
    template <class T>
    static void heads_weighted_rows(index_t dk, index_t h0, index_t h1, index_t n, const T* a, index_t lda, const T* y,
                                    index_t ldy, T* o) {
        cuda_kernels::heads_weighted_rows(dk, h0, h1, n, a, lda, y, ldy, o);
    }

    // Softmax
    template <class T>
    static void softmax_forward(index_t rows, index_t cols, const T* x, index_t ldx, T* y, index_t ldy, T scale,
                                softmax_mask mask = {}) {
        cuda_kernels::softmax_forward(rows, cols, x, ldx, y, ldy, scale,
                                      cuda_kernels::row_mask{mask.causal, mask.causal_offset, mask.keep, mask.ld_keep});
    }
    template <class T>
    static void softmax_backward(index_t rows, index_t cols, const T* y, index_t ldy, const T* dy, index_t lddy, T* dx,
                                 index_t lddx, T scale) {
        cuda_kernels::softmax_backward(rows, cols, y, ldy, dy, lddy, dx, lddx, scale);
    }
    template <class T>
    static void softmax_contiguous(index_t rows, index_t cols, T* x, T scale) {
        cuda_kernels::softmax_forward(rows, cols, x, cols, x, cols, scale, cuda_kernels::row_mask{});
    }

    // Layer norm, linear
    template <class T>
    static void layer_norm_forward(index_t rows, index_t d, const T* x, index_t ldx, const T* w, const T* b, T eps, T* y,
                                   index_t ldy, T* mean, T* rstd, T* xhat = nullptr, index_t ldxh = 0) {
        cuda_kernels::layer_norm_forward(rows, d, x, ldx, w, b, eps, y, ldy, mean, rstd, xhat, ldxh);
    }
    template <class T>
    static void layer_norm_backward(index_t rows, index_t d, const T* x, index_t ldx, const T* w, const T* mean,
                                    const T* rstd, const T* dy, index_t lddy, T* dx, index_t lddx, T* dw, T* db,
                                    bool accumulate_dx = false) {
        cuda_kernels::layer_norm_backward(rows, d, x, ldx, w, mean, rstd, dy, lddy, dx, lddx, dw, db, accumulate_dx);
    }
    /// y = x·Wᵀ + b (b null: none): cuBLAS's product, then the bias.
    template <class T>
    static void linear_forward(index_t rows, index_t in, index_t out, const T* x, index_t ldx, const T* w, const T* b,
                               T* y, index_t ldy) {
        cuda_kernels::gemm_nt(rows, out, in, x, ldx, w, in, y, ldy, T(0), T(1));
        if (b) cuda_kernels::add_bias_rows(rows, out, b, y, ldy);
    }
    template <class T>
    static void linear_backward(index_t rows, index_t in, index_t out, const T* x, index_t ldx, const T* dy,
                                index_t lddy, const T* w, T* gw, T* gb, T* dx, index_t lddx, bool accumulate_dx) {
        cuda_kernels::linear_backward(rows, in, out, x, ldx, dy, lddy, w, gw, gb, dx, lddx, accumulate_dx);
    }

    // Activations
    template <class Act>
    static constexpr cuda_kernels::activation_kind kind_of() {
        if constexpr (std::is_same_v<Act, relu>) return cuda_kernels::activation_kind::relu;
        else if constexpr (std::is_same_v<Act, gelu>) return cuda_kernels::activation_kind::gelu;
        else static_assert(dependent_false<Act>, "mnemo: ops<cuda> has no kernel for this activation tag");
    }
    template <class Act, class T>
    static void activation_forward(index_t n, const T* x, T* y) {
        cuda_kernels::activation_forward(kind_of<Act>(), n, x, y);
    }
    template <class Act, class T>
    static void activation_backward(index_t n, const T* x, const T* dy, T* dx) {
        cuda_kernels::activation_backward(kind_of<Act>(), n, x, dy, dx);
    }
    template <class T>
    static void relu_forward(index_t n, const T* x, T* y) {
        cuda_kernels::activation_forward(cuda_kernels::activation_kind::relu, n, x, y);
    }
    template <class T>
    static void relu_backward(index_t n, const T* x, const T* dy, T* dx) {
        cuda_kernels::activation_backward(cuda_kernels::activation_kind::relu, n, x, dy, dx);
    }

    // Attention cores
    template <static_extents E, class T>
    static void relative_attention_forward(const relative_attention_state<T>& s) {
        cuda_kernels::relative_attention_forward(s);
    }
    template <static_extents E, class T>
    static void relative_attention_backward(const relative_attention_state<T>& s) {
        cuda_kernels::relative_attention_backward(s);
    }
    template <class T>
    static void kv_projection_backward(index_t rows, index_t d, const T* z, index_t ldz, const T* dkv, const T* wk,
                                       const T* wv, T* gk, T* gv, T* gbv, bool fused, T* dz, index_t lddz) {
        cuda_kernels::kv_projection_backward(rows, d, z, ldz, dkv, wk, wv, gk, gv, gbv, fused, dz, lddz);
    }
    template <class T>
    static void frozen_norm_backward(index_t d, const frozen_key_rows<T>& f, const T* dkv, const T* wk, const T* wv,
                                     T* gk, T* gv, T* gbv, T* g, T* c) {
        cuda_kernels::frozen_norm_backward(d, f, dkv, wk, wv, gk, gv, gbv, g, c);
    }
    static void key_padding_keep(index_t batch, index_t k_len, const std::uint8_t* pad, std::uint8_t* keep,
                                 std::uint8_t* keep_any) {
        cuda_kernels::key_padding_keep(batch, k_len, pad, keep, keep_any);
    }
    static index_t parallel_slots(index_t n) { return n > 0 ? 1 : 0; }
    template <static_extents E, class T>
    static void feedback_attention_forward(const feedback_attention_state<T>& s) {
        cuda_kernels::feedback_attention_forward(s);
    }
    template <static_extents E, class T>
    static void feedback_attention_backward(const feedback_attention_state<T>& s) {
        cuda_kernels::feedback_attention_backward(s);
    }

    // Compression, usage, GRU
    template <std::size_t Rate, class T>
    static void im2col_time(index_t out_rows, index_t batch, index_t d, const T* mem, index_t ldm, T* x,
                            index_t rate = index_t(Rate)) {
        cuda_kernels::im2col_time(rate, out_rows, batch, d, mem, ldm, x);
    }
    template <std::size_t Rate, class T>
    static void col2im_time(index_t out_rows, index_t batch, index_t d, const T* dx, T* d_mem, index_t ldm,
                            index_t rate = index_t(Rate)) {
        cuda_kernels::col2im_time(rate, out_rows, batch, d, dx, d_mem, ldm);
    }
    template <std::size_t Rate, class T, class I>
    static void max_pool_time_forward(index_t out_rows, index_t batch, index_t d, const T* mem, index_t ldm, T* out,
                                      index_t ldo, I* arg, index_t rate = index_t(Rate)) {
        cuda_kernels::max_pool_time_forward(rate, out_rows, batch, d, mem, ldm, out, ldo, arg);
    }
    template <std::size_t Rate, class T, class I>
    static void max_pool_time_backward(index_t out_rows, index_t batch, index_t d, const T* d_out, index_t ldo,
                                       const I* arg, T* d_mem, index_t ldm, index_t rate = index_t(Rate)) {
        cuda_kernels::max_pool_time_backward(rate, out_rows, batch, d, d_out, ldo, arg, d_mem, ldm);
    }
    template <std::size_t Rate, class T>
    static void mean_pool_time_forward(index_t out_rows, index_t batch, index_t d, const T* mem, index_t ldm, T* out,
                                       index_t ldo, index_t rate = index_t(Rate)) {
        cuda_kernels::mean_pool_time_forward(rate, out_rows, batch, d, mem, ldm, out, ldo);
    }
    template <std::size_t Rate, class T>
    static void mean_pool_time_backward(index_t out_rows, index_t batch, index_t d, const T* d_out, index_t ldo,
                                        T* d_mem, index_t ldm, index_t rate = index_t(Rate)) {
        cuda_kernels::mean_pool_time_backward(rate, out_rows, batch, d, d_out, ldo, d_mem, ldm);
    }
    template <std::size_t Rate, class T, class I>
    static void most_used_forward(index_t out_rows, index_t batch, index_t d, const T* usage, const T* mem, index_t ldm,
                                  T* out, index_t ldo, I* arg, index_t rate = index_t(Rate)) {
        cuda_kernels::most_used_forward(rate, out_rows, batch, d, usage, mem, ldm, out, ldo, arg);
    }
    template <std::size_t Rate, class T, class I>
    static void most_used_backward(index_t out_rows, index_t batch, index_t d, const T* d_out, index_t ldo,
                                   const I* arg, T* d_mem, index_t ldm, index_t rate = index_t(Rate)) {
        cuda_kernels::most_used_backward(rate, out_rows, batch, d, d_out, ldo, arg, d_mem, ldm);
    }
    template <class T>
    static void accumulate_key_usage(index_t batch, index_t heads, index_t q, index_t k, const T* probs, T* usage) {
        cuda_kernels::accumulate_key_usage(batch, heads, q, k, probs, usage);
    }
    template <class T>
    static void gru_gate_forward(index_t rows, index_t d, T* gi, T* gh, const T* b_ih, const T* b_hh, const T* x, T* out,
                                 index_t ldo) {
        cuda_kernels::gru_gate_forward(rows, d, gi, gh, b_ih, b_hh, x, out, ldo);
    }
    template <class T>
    static void gru_gate_backward(index_t rows, index_t d, const T* act, const T* gh, const T* x, const T* g,
                                  index_t ldg, T* dgi, T* dgh, T* dx, index_t ldx, bool accumulate_dx) {
        cuda_kernels::gru_gate_backward(rows, d, act, gh, x, g, ldg, dgi, dgh, dx, ldx, accumulate_dx);
    }

    // The reconstruction losses
    template <class T>
    static void squared_difference_rows(index_t rows, index_t d, const T* a, index_t lda, const T* b, index_t ldb,
                                        const std::uint8_t* pad, T* diff, index_t ldd, double* sum) {
        cuda_kernels::squared_difference_rows(rows, d, a, lda, b, ldb, pad, diff, ldd, sum);
    }
    static void reconstruction_keep(index_t batch, index_t m_len, index_t c_len, const std::uint8_t* m_pad,
                                    std::uint8_t* keep_m, std::uint8_t* keep_c, std::uint8_t* any_m,
                                    std::uint8_t* any_c) {
        cuda_kernels::reconstruction_keep(batch, m_len, c_len, m_pad, keep_m, keep_c, any_m, any_c);
    }
    template <class T>
    static void key_value_projections(index_t m_rows, index_t c_rows, index_t d, const T* mn, index_t ldmn, const T* cn,
                                      index_t ldcn, const T* wk, const T* wv, const T* bv, T* km, T* kc, T* vm, T* vc) {
        cuda_kernels::key_value_projections(m_rows, c_rows, d, mn, ldmn, cn, ldcn, wk, wv, bv, km, kc, vm, vc);
    }
    template <static_extents E, class T>
    static void plain_attention_forward(index_t batch, index_t heads, index_t d, index_t dk, index_t q_len, index_t n,
                                        T scale, const T* q, const T* k, const T* v, T* a, T* out,
                                        const std::uint8_t* keep, const std::uint8_t* any) {
        cuda_kernels::plain_attention_forward(batch, heads, d, dk, q_len, n, scale, q, k, v, a, out, keep, any);
    }
    template <static_extents E, class T>
    static void plain_attention_backward(index_t batch, index_t heads, index_t d, index_t dk, index_t q_len, index_t n,
                                         T scale, const T* q, const T* v, const T* a, const T* d_out, T* da, T* dk_out,
                                         T* dv_out) {
        cuda_kernels::plain_attention_backward(batch, heads, d, dk, q_len, n, scale, q, v, a, d_out, da, dk_out, dv_out);
    }

    // Loss, dropout
    template <class T, class I>
    static void cross_entropy_fused(index_t rows, index_t vocab, const T* logits, index_t ld, const I* targets,
                                    T* losses, T grad_scale, T* dlogits, index_t ldd) {
        cuda_kernels::cross_entropy_fused(rows, vocab, logits, ld, targets, losses, grad_scale, dlogits, ldd);
    }
    template <class T>
    static void dropout_forward(index_t n, const T* x, T* y, float p, std::uint64_t seed, std::uint64_t offset) {
        cuda_kernels::dropout_forward(n, x, y, p, seed, offset);
    }
    template <class T>
    static void dropout_backward(index_t n, const T* dy, T* dx, float p, std::uint64_t seed, std::uint64_t offset) {
        cuda_kernels::dropout_backward(n, dy, dx, p, seed, offset);
    }

    // Element-wise and rows
    template <class T>
    static void add_bias_rows(index_t rows, index_t n, const T* b, T* c, index_t ldc) {
        cuda_kernels::add_bias_rows(rows, n, b, c, ldc);
    }
    template <class T>
    static void sum_rows_accumulate(index_t rows, index_t n, const T* dy, index_t ld, T* db) {
        cuda_kernels::sum_rows_accumulate(rows, n, dy, ld, db);
    }
    template <class T>
    static void add(index_t rows, index_t n, const T* a, index_t lda, const T* b, index_t ldb, T* y, index_t ldy) {
        cuda_kernels::add(rows, n, a, lda, b, ldb, y, ldy);
    }
    template <class T>
    static void copy(index_t rows, index_t n, const T* x, index_t ldx, T* y, index_t ldy, bool accumulate = false) {
        cuda_kernels::copy(rows, n, x, ldx, y, ldy, accumulate);
    }
    template <class T>
    static void scale(index_t rows, index_t n, const T* x, index_t ldx, T s, T* y, index_t ldy) {
        cuda_kernels::scale(rows, n, x, ldx, s, y, ldy);
    }
    template <class T, class I>
    static void gather_rows(index_t rows, index_t n, const I* ids, const T* table, index_t ldt, T* y, index_t ldy) {
        cuda_kernels::gather_rows(rows, n, ids, table, ldt, y, ldy);
    }
    template <class T, class I>
    static void scatter_add_rows(index_t rows, index_t n, const I* ids, const T* dy, index_t ld, T* table, index_t ldt) {
        cuda_kernels::scatter_add_rows(rows, n, ids, dy, ld, table, ldt);
    }
    template <class T>
    static void scale_shift_rows(index_t rows, index_t n, const T* x, index_t ldx, const T* g, const T* b, T* y,
                                 index_t ldy) {
        cuda_kernels::scale_shift_rows(rows, n, x, ldx, g, b, y, ldy);
    }
    template <class T>
    static void sum_as_double(index_t n, const T* x, double* sum) {
        cuda_kernels::sum_as_double(n, x, sum);
    }
    template <class T>
    static void scale_by_count(index_t n, T* x, const double* count, index_t per_count, T numerator) {
        cuda_kernels::scale_by_count(n, x, count, per_count, numerator);
    }
    template <class T>
    static void axpy(index_t n, T a, const T* x, T* y) {
        cuda_kernels::axpy(n, a, x, y);
    }
    template <class T>
    static void weighted_sum_rows(index_t rows, index_t d, std::span<const T* const> x, index_t ldx,
                                  std::span<const T> w, T* y, index_t ldy) {
        MNEMO_CHECK(index_t(x.size()) <= cuda_kernels::max_weighted_rows, "ops<cuda>::weighted_sum_rows: ", x.size(),
                    " inputs, at most ", cuda_kernels::max_weighted_rows);
        cuda_kernels::weighted_sum_rows(rows, d, x, ldx, w, y, ldy);
    }

    // Optimizers
    template <adam_rule Rule, class T>
    static void adam_step(const adam_step_args<T>& a) {
        MNEMO_CHECK(a.deferral == nullptr, "ops<cuda>::adam_step: given a deferred decay (defers_weight_decay is false)");
        cuda_kernels::adam_step(Rule, a);
    }
    template <class T>
    static void adam_cold_blocks(const T* m, const T* v, index_t n, std::uint8_t* cold) {
        cuda_kernels::adam_cold_blocks(m, v, n, cold);
    }
    template <class T>
    static void sgd_step(const sgd_step_args<T>& a) {
        cuda_kernels::sgd_step(a);
    }
    template <class T>
    static double sum_squares_live(const T* x, index_t n, std::span<const flat_range> live) {
        return cuda_kernels::sum_squares_live(x, n, live);
    }
    template <class T>
    static void scale_live(T* x, std::span<const flat_range> live, T s) {
        cuda_kernels::scale_live(x, live, s);
    }
    /// Nothing is ever deferred on this backend (defers_weight_decay): a log here is a bug upstream.
    template <class T>
    static void pay_deferred_decay(const deferred_decay<T>& d, index_t, index_t) {
        MNEMO_CHECK(d.logged == 0, "ops<cuda>::pay_deferred_decay: the parameter set logged deferred decay, "
                                   "which this backend never defers");
    }
};

}  // namespace mnemo
