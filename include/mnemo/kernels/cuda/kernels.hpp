#pragma once
// The CUDA backend's kernels as the library mnemo::cuda compiles them (src/cuda/*.cu, nvcc): plain
// host functions that enqueue work on the backend's stream (kernels/cuda/runtime.hpp) and return
// without waiting, unless a comment says a result comes back to the host. Each has the meaning of the
// CPU kernel of the same name (kernels/cpu/), with the CPU kernels' compile-time parameters (a
// compression rate, an activation tag, an optimizer rule, static extents) as runtime arguments, so
// one compiled library serves every model type. Declared for T = float and double (defined and
// explicitly instantiated in the .cu files; any other T does not link).
//
// This header names no CUDA type: code built by the host compiler includes it, the .cu files define it.
#include <cstdint>
#include <span>

#include "../../core/shape.hpp"
#include "../feedback_attention_state.hpp"
#include "../optimizer_state.hpp"
#include "../relative_attention_state.hpp"

namespace mnemo {
struct softmax_mask;
}

namespace mnemo::cuda_kernels {

enum class activation_kind : std::uint8_t { relu, gelu };

/// The masked softmax's mask as the device kernels take it (softmax_mask by value, without the type).
struct row_mask {
    bool causal = false;
    index_t causal_offset = 0;
    const std::uint8_t* keep = nullptr;
    index_t ld_keep = 0;
};

// ---- GEMM (cuBLAS; row-major, as the CPU kernels): C = α·op(A)·op(B) + β·C ----------------------------
template <class T>
void gemm_nn(index_t m, index_t n, index_t k, const T* a, index_t lda, const T* b, index_t ldb, T* c, index_t ldc,
             T beta, T alpha);
template <class T>
void gemm_nt(index_t m, index_t n, index_t k, const T* a, index_t lda, const T* b, index_t ldb, T* c, index_t ldc,
             T beta, T alpha);
template <class T>
void gemm_tn(index_t m, index_t n, index_t k, const T* a, index_t lda, const T* b, index_t ldb, T* c, index_t ldc,
             T beta, T alpha);
/// count products at once: operand i is at a + i·stride_a (strided-batched cuBLAS).
template <class T>
void gemm_nn_batched(index_t count, index_t m, index_t n, index_t k, const T* a, index_t lda, index_t stride_a,
                     const T* b, index_t ldb, index_t stride_b, T* c, index_t ldc, index_t stride_c, T beta, T alpha);
template <class T>
void gemm_nt_batched(index_t count, index_t m, index_t n, index_t k, const T* a, index_t lda, index_t stride_a,
                     const T* b, index_t ldb, index_t stride_b, T* c, index_t ldc, index_t stride_c, T beta, T alpha);
template <class T>
void gemm_tn_batched(index_t count, index_t m, index_t n, index_t k, const T* a, index_t lda, index_t stride_a,
                     const T* b, index_t ldb, index_t stride_b, T* c, index_t ldc, index_t stride_c, T beta, T alpha);

// ---- per-head products (head_products.hpp's meaning: one head of width dk) ------------------------------
template <class T>
void head_gemm_nt(index_t dk, index_t m, index_t n, const T* x, index_t ldx, const T* y, index_t ldy, T* s, index_t lds);
template <class T>
void head_gemm_nn(index_t dk, index_t m, index_t n, const T* a, index_t lda, const T* y, index_t ldy, T* o, index_t ldo,
                  T beta);
template <class T>
void head_gemm_tn(index_t dk, index_t m, index_t n, const T* a, index_t lda, const T* x, index_t ldx, T* o, index_t ldo,
                  T beta);
template <class T>
void heads_dot_rows(index_t dk, index_t heads, index_t r0, index_t r1, const T* x, const T* y, index_t ldy, T* s,
                    index_t lds);
template <class T>
void heads_weighted_rows(index_t dk, index_t h0, index_t h1, index_t n, const T* a, index_t lda, const T* y, index_t ldy,
                         T* o);

// ---- softmax, layer norm, linear, activations ------------------------------------------------------------
template <class T>
void softmax_forward(index_t rows, index_t cols, const T* x, index_t ldx, T* y, index_t ldy, T scale, row_mask mask);
template <class T>
void softmax_backward(index_t rows, index_t cols, const T* y, index_t ldy, const T* dy, index_t lddy, T* dx,
                      index_t lddx, T scale);
template <class T>
void layer_norm_forward(index_t rows, index_t d, const T* x, index_t ldx, const T* w, const T* b, T eps, T* y,
                        index_t ldy, T* mean, T* rstd, T* xhat, index_t ldxh);
template <class T>
void layer_norm_backward(index_t rows, index_t d, const T* x, index_t ldx, const T* w, const T* mean, const T* rstd,
                         const T* dy, index_t lddy, T* dx, index_t lddx, T* dw, T* db, bool accumulate_dx);
template <class T>
void linear_backward(index_t rows, index_t in, index_t out, const T* x, index_t ldx, const T* dy, index_t lddy,
                     const T* w, T* gw, T* gb, T* dx, index_t lddx, bool accumulate_dx);
template <class T>
void activation_forward(activation_kind act, index_t n, const T* x, T* y);
template <class T>
void activation_backward(activation_kind act, index_t n, const T* x, const T* dy, T* dx);

// ---- attention cores --------------------------------------------------------------------------------------
/// The projected route only (ops<cuda>::absorbs_memory is false: the module never asks for the absorbed one).
template <class T>
void relative_attention_forward(const relative_attention_state<T>& s);
template <class T>
void relative_attention_backward(const relative_attention_state<T>& s);
template <class T>
void kv_projection_backward(index_t rows, index_t d, const T* z, index_t ldz, const T* dkv, const T* wk, const T* wv,
                            T* gk, T* gv, T* gbv, bool fused, T* dz, index_t lddz);
template <class T>
void frozen_norm_backward(index_t d, const frozen_key_rows<T>& f, const T* dkv, const T* wk, const T* wv, T* gk, T* gv,
                          T* gbv, T* g, T* c);
void key_padding_keep(index_t batch, index_t k_len, const std::uint8_t* pad, std::uint8_t* keep, std::uint8_t* keep_any);
template <class T>
void feedback_attention_forward(const feedback_attention_state<T>& s);
template <class T>
void feedback_attention_backward(const feedback_attention_state<T>& s);

// ---- compression, usage, GRU ---------------------------------------------------------------------------------
template <class T>
void im2col_time(index_t rate, index_t out_rows, index_t batch, index_t d, const T* mem, index_t ldm, T* x);
template <class T>
void col2im_time(index_t rate, index_t out_rows, index_t batch, index_t d, const T* dx, T* d_mem, index_t ldm);
template <class T, class I>
void max_pool_time_forward(index_t rate, index_t out_rows, index_t batch, index_t d, const T* mem, index_t ldm, T* out,
                           index_t ldo, I* arg);
template <class T, class I>
void max_pool_time_backward(index_t rate, index_t out_rows, index_t batch, index_t d, const T* d_out, index_t ldo,
                            const I* arg, T* d_mem, index_t ldm);
template <class T>
void mean_pool_time_forward(index_t rate, index_t out_rows, index_t batch, index_t d, const T* mem, index_t ldm, T* out,
                            index_t ldo);
template <class T>
void mean_pool_time_backward(index_t rate, index_t out_rows, index_t batch, index_t d, const T* d_out, index_t ldo,
                             T* d_mem, index_t ldm);
template <class T, class I>
void most_used_forward(index_t rate, index_t out_rows, index_t batch, index_t d, const T* usage, const T* mem,
                       index_t ldm, T* out, index_t ldo, I* arg);
template <class T, class I>
void most_used_backward(index_t rate, index_t out_rows, index_t batch, index_t d, const T* d_out, index_t ldo,
                        const I* arg, T* d_mem, index_t ldm);
template <class T>
void accumulate_key_usage(index_t batch, index_t heads, index_t q, index_t k, const T* probs, T* usage);
template <class T>
void gru_gate_forward(index_t rows, index_t d, T* gi, T* gh, const T* b_ih, const T* b_hh, const T* x, T* out,
                      index_t ldo);
template <class T>
void gru_gate_backward(index_t rows, index_t d, const T* act, const T* gh, const T* x, const T* g, index_t ldg, T* dgi,
                       T* dgh, T* dx, index_t ldx, bool accumulate_dx);

// ---- the reconstruction losses ------------------------------------------------------------------------------------
template <class T>
void squared_difference_rows(index_t rows, index_t d, const T* a, index_t lda, const T* b, index_t ldb,
                             const std::uint8_t* pad, T* diff, index_t ldd, double* sum);
void reconstruction_keep(index_t batch, index_t m_len, index_t c_len, const std::uint8_t* m_pad, std::uint8_t* keep_m,
                         std::uint8_t* keep_c, std::uint8_t* any_m, std::uint8_t* any_c);
template <class T>
void key_value_projections(index_t m_rows, index_t c_rows, index_t d, const T* mn, index_t ldmn, const T* cn,
                           index_t ldcn, const T* wk, const T* wv, const T* bv, T* km, T* kc, T* vm, T* vc);
template <class T>
void plain_attention_forward(index_t batch, index_t heads, index_t d, index_t dk, index_t q_len, index_t n, T scale,
                             const T* q, const T* k, const T* v, T* a, T* out, const std::uint8_t* keep,
                             const std::uint8_t* any);
template <class T>
void plain_attention_backward(index_t batch, index_t heads, index_t d, index_t dk, index_t q_len, index_t n, T scale,
                              const T* q, const T* v, const T* a, const T* d_out, T* da, T* dk_out, T* dv_out);

// ---- the language-modelling loss, dropout ----------------------------------------------------------------------
template <class T, class I>
void cross_entropy_fused(index_t rows, index_t vocab, const T* logits, index_t ld, const I* targets, T* losses,
                         T grad_scale, T* dlogits, index_t ldd);
template <class T>
void dropout_forward(index_t n, const T* x, T* y, float p, std::uint64_t seed, std::uint64_t offset);
template <class T>
void dropout_backward(index_t n, const T* dy, T* dx, float p, std::uint64_t seed, std::uint64_t offset);

// ---- element-wise and rows ------------------------------------------------------------------------------------------
template <class T>
void add_bias_rows(index_t rows, index_t n, const T* b, T* c, index_t ldc);
template <class T>
void sum_rows_accumulate(index_t rows, index_t n, const T* dy, index_t ld, T* db);
template <class T>
void add(index_t rows, index_t n, const T* a, index_t lda, const T* b, index_t ldb, T* y, index_t ldy);
template <class T>
void copy(index_t rows, index_t n, const T* x, index_t ldx, T* y, index_t ldy, bool accumulate);
template <class T>
void scale(index_t rows, index_t n, const T* x, index_t ldx, T s, T* y, index_t ldy);
template <class T, class I>
void gather_rows(index_t rows, index_t n, const I* ids, const T* table, index_t ldt, T* y, index_t ldy);
template <class T, class I>
void scatter_add_rows(index_t rows, index_t n, const I* ids, const T* dy, index_t ld, T* table, index_t ldt);
template <class T>
void scale_shift_rows(index_t rows, index_t n, const T* x, index_t ldx, const T* g, const T* b, T* y, index_t ldy);
template <class T>
void sum_as_double(index_t n, const T* x, double* sum);
/// x *= numerator / (index_t(count[0])·per_count), 0 when the count is 0; count in device memory.
template <class T>
void scale_by_count(index_t n, T* x, const double* count, index_t per_count, T numerator);
template <class T>
void axpy(index_t n, T a, const T* x, T* y);
/// y = Σ_i w[i]·x[i] over rows × d; x (device pointers) and w come from the host, at most
/// max_weighted_rows of them (passed by value with the launch).
inline constexpr index_t max_weighted_rows = 64;
template <class T>
void weighted_sum_rows(index_t rows, index_t d, std::span<const T* const> x, index_t ldx, std::span<const T> w, T* y,
                       index_t ldy);

// ---- optimizers -------------------------------------------------------------------------------------------------------
template <class T>
void adam_step(adam_rule rule, const adam_step_args<T>& a);
template <class T>
void adam_cold_blocks(const T* m, const T* v, index_t n, std::uint8_t* cold);
template <class T>
void sgd_step(const sgd_step_args<T>& a);
/// Σ x² over the live runs, in double; waits for the result (the host needs it to clip).
template <class T>
double sum_squares_live(const T* x, index_t n, std::span<const flat_range> live);
template <class T>
void scale_live(T* x, std::span<const flat_range> live, T s);

}  // namespace mnemo::cuda_kernels
