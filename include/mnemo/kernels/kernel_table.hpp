#pragma once
// The kernel table every backend provides: MNEMO_KERNELS lists, by name, each kernel that nn/,
// models/ and train/ call through ops<Backend>. checked_ops<Backend> is ops<Backend> after a check
// that none is missing, so a new backend that lacks one fails to compile with one line naming it:
//   static assertion failed: mnemo: ops<Backend> has no kernel 'softmax_backward' (kernels/kernel_table.hpp)
// Modules take their kernels as `using ops_t = checked_ops<Backend>;`. The list also lets a wrapping
// backend (the tests' fenced backend) forward every kernel without naming each by hand.
//
// Kernels (arguments: raw pointers, runtime extents, row strides; see each in kernels/cpu/):
//   GEMM          gemm_nt, gemm_nn, gemm_tn (C = αA·B + βC in the three layouts), gemm_nt_direct,
//                 gemm_nn_direct (small products on the calling thread), concurrent_pair (whether two
//                 independent GEMMs of a shape should run side by side)
//   per head      head_gemm_nt, head_gemm_nn, head_gemm_tn, heads_dot_rows, heads_weighted_rows
//   compression   im2col_time, col2im_time, max_pool_time_forward, max_pool_time_backward,
//                 mean_pool_time_forward, mean_pool_time_backward, most_used_forward, most_used_backward,
//                 accumulate_key_usage
//   GRU gate      gru_gate_forward, gru_gate_backward
//   losses        squared_difference_rows, reconstruction_keep, key_value_projections,
//                 plain_attention_forward, plain_attention_backward (the reconstruction losses)
//   softmax       softmax_forward, softmax_backward (masked rows), softmax_contiguous
//   layer norm    layer_norm_forward, layer_norm_backward
//   linear        linear_forward (y = x·Wᵀ + b), linear_backward (weight, bias and input gradients)
//   attention     relative_attention_forward, relative_attention_backward (the core between the
//                 projections: kernels/relative_attention_state.hpp), kv_projection_backward,
//                 frozen_norm_backward, key_padding_keep, parallel_slots (per-thread scratch blocks);
//                 feedback_attention_forward, feedback_attention_backward (one step:
//                 kernels/feedback_attention_state.hpp)
//   activations   activation_forward, activation_backward (tag-dispatched), relu_forward, relu_backward
//   loss          cross_entropy_fused
//   dropout       dropout_forward, dropout_backward
//   element-wise  add_bias_rows, sum_rows_accumulate, add, copy, scale, gather_rows, scatter_add_rows,
//                 scale_shift_rows, sum_as_double, scale_by_count, axpy, weighted_sum_rows
//   optimizers    adam_step (templated on the adam_rule), adam_cold_blocks, sgd_step,
//                 sum_squares_live, scale_live (kernels/optimizer_state.hpp; the global gradient norm),
//                 pay_deferred_decay (the deferred weight decay of rows nothing read)
//
// Besides the kernels, six constants say what a backend does differently (MNEMO_KERNEL_TRAITS, checked
// the same way):
//   absorbs_memory        relative attention may take the absorbed-memory route (nn/attention/relative.hpp)
//   defers_weight_decay   the decoupled optimizers may defer the decay of cold blocks (core/parameters.hpp)
//   scores_grad_scratch   relative_attention_backward keeps the projected route's d scores in scratch of
//                         its own: the module hands it no [B, H, Q, K] buffer (relative_attention_state)
//   positional_scratch_from  from this many queries on, the projected route's attention computes the
//                         positional scores q·R (forward) and their gradient d_pos (backward) in scratch
//                         of its own: the module hands it no [H, Q·B, W] pos buffer
//                         (no_positional_scratch: never)
//   plain_attention_scratch  plain_attention_forward may be handed no probabilities buffer (a null
//                         `a`) where nothing reads them back, and keeps each head's in scratch of its
//                         own: the attention-reconstruction loss's target attention over the memory
//   splits_key_rows       relative_attention_forward of one query position reads the keys and values
//                         of positions [0, kv_split) from kv_lo and the rest from kv
//                         (relative_attention_state): a generation cache may then slide the
//                         compressed memory's rows and the memory's apart instead of copying either
// and one scope (MNEMO_KERNEL_SCOPES), a call that runs the caller's own code:
//   hold_threads(fn)      fn() with the backend's host threads kept ready for the kernels fn calls
//                         (the CPU: one OpenMP region held open around fn, kernels/cpu/parallel.hpp;
//                         CUDA: fn()); a model's entry points (a segment's forward, update_memory,
//                         a training segment) run inside it. Returns what fn returns.
#include "../core/backend.hpp"

#define MNEMO_KERNELS(X)                                                                                     \
    X(gemm_nt) X(gemm_nn) X(gemm_tn) X(gemm_nt_direct) X(gemm_nn_direct) X(concurrent_pair)                 \
    X(head_gemm_nt) X(head_gemm_nn) X(head_gemm_tn) X(heads_dot_rows) X(heads_weighted_rows)                \
    X(softmax_forward) X(softmax_backward) X(softmax_contiguous)                                            \
    X(layer_norm_forward) X(layer_norm_backward) X(linear_forward) X(linear_backward)                      \
    X(activation_forward) X(activation_backward) X(relu_forward) X(relu_backward)                           \
    X(relative_attention_forward) X(relative_attention_backward) X(kv_projection_backward)                 \
    X(frozen_norm_backward) X(key_padding_keep) X(parallel_slots)                                           \
    X(feedback_attention_forward) X(feedback_attention_backward)                                            \
    X(im2col_time) X(col2im_time) X(max_pool_time_forward) X(max_pool_time_backward)                        \
    X(mean_pool_time_forward) X(mean_pool_time_backward) X(most_used_forward) X(most_used_backward)         \
    X(accumulate_key_usage) X(gru_gate_forward) X(gru_gate_backward)                                        \
    X(squared_difference_rows) X(reconstruction_keep) X(key_value_projections)                              \
    X(plain_attention_forward) X(plain_attention_backward)                                                  \
    X(cross_entropy_fused)                                                   \
    X(dropout_forward) X(dropout_backward)                                                                  \
    X(add_bias_rows) X(sum_rows_accumulate) X(add) X(copy) X(scale) X(gather_rows) X(scatter_add_rows)   \
    X(scale_shift_rows) X(sum_as_double) X(scale_by_count) X(axpy) X(weighted_sum_rows)                    \
    X(adam_step) X(adam_cold_blocks) X(sgd_step) X(sum_squares_live) X(scale_live) X(pay_deferred_decay)

#define MNEMO_KERNEL_TRAITS(X) X(absorbs_memory) X(defers_weight_decay) X(scores_grad_scratch) X(positional_scratch_from) \
    X(plain_attention_scratch) X(splits_key_rows)

#define MNEMO_KERNEL_SCOPES(X) X(hold_threads)

namespace mnemo {
namespace detail::kernel_probe {
// has_<name><Ops>: Ops has a member called <name>, whatever its kind (function, template, overload set).
// A class deriving from Ops and from a probe that declares <name> too finds the name ambiguous exactly
// when Ops declares it.
#define MNEMO_KERNEL_PROBE(name)                                   \
    struct probe_##name {                                          \
        int name;                                                  \
    };                                                             \
    template <class Ops>                                           \
    struct both_##name : Ops, probe_##name {};                     \
    template <class Ops>                                           \
    concept has_##name = !requires { &both_##name<Ops>::name; };
MNEMO_KERNELS(MNEMO_KERNEL_PROBE)
MNEMO_KERNEL_TRAITS(MNEMO_KERNEL_PROBE)
MNEMO_KERNEL_SCOPES(MNEMO_KERNEL_PROBE)
#undef MNEMO_KERNEL_PROBE
}  // namespace detail::kernel_probe

/// Every kernel of MNEMO_KERNELS is a member of ops<Backend>.
template <class Backend>
constexpr bool check_kernel_table() {
#define MNEMO_KERNEL_ASSERT(name)                                                   \
    static_assert(detail::kernel_probe::has_##name<ops<Backend>>,                   \
                  "mnemo: ops<Backend> has no kernel '" #name "' (kernels/kernel_table.hpp)");
    MNEMO_KERNELS(MNEMO_KERNEL_ASSERT)
#undef MNEMO_KERNEL_ASSERT
#define MNEMO_KERNEL_TRAIT_ASSERT(name)                                                                    \
    static_assert(detail::kernel_probe::has_##name<ops<Backend>>,                                          \
                  "mnemo: ops<Backend> does not say '" #name "' (a constexpr bool; kernels/kernel_table.hpp)");
    MNEMO_KERNEL_TRAITS(MNEMO_KERNEL_TRAIT_ASSERT)
#undef MNEMO_KERNEL_TRAIT_ASSERT
#define MNEMO_KERNEL_SCOPE_ASSERT(name)                                      \
    static_assert(detail::kernel_probe::has_##name<ops<Backend>>,            \
                  "mnemo: ops<Backend> has no scope '" #name "' (kernels/kernel_table.hpp)");
    MNEMO_KERNEL_SCOPES(MNEMO_KERNEL_SCOPE_ASSERT)
#undef MNEMO_KERNEL_SCOPE_ASSERT
    return true;
}

/// ops<Backend>, once check_kernel_table has found every kernel in it.
template <class Backend>
using checked_ops = std::conditional_t<check_kernel_table<Backend>(), ops<Backend>, void>;

}  // namespace mnemo
