#pragma once
// ops<cpu>: the CPU kernel table. Every kernel takes raw pointers, runtime extents and row strides
// (CUB style), and is a static member of one of the kernel structs below; ops<cpu> gathers them.
#include <utility>

#include "../../core/backend.hpp"
#include "activation.hpp"
#include "compression.hpp"
#include "cross_entropy.hpp"
#include "dropout.hpp"
#include "elementwise.hpp"
#include "feedback_attention.hpp"
#include "gemm.hpp"
#include "gru.hpp"
#include "head_products.hpp"
#include "layer_norm.hpp"
#include "linear_layer.hpp"
#include "most_used.hpp"
#include "optimizer.hpp"
#include "parallel.hpp"
#include "reconstruction.hpp"
#include "relative_attention.hpp"
#include "softmax.hpp"

namespace mnemo {

template <>
struct ops<cpu> : cpu_kernels::gemm,
                  cpu_kernels::head_products,
                  cpu_kernels::softmax,
                  cpu_kernels::layer_norm,
                  cpu_kernels::linear_layer,
                  cpu_kernels::relative_attention_core,
                  cpu_kernels::feedback_attention_core,
                  cpu_kernels::compression,
                  cpu_kernels::attention_usage,
                  cpu_kernels::most_used_selection,
                  cpu_kernels::gru_pointwise,
                  cpu_kernels::reconstruction,
                  cpu_kernels::activation,
                  cpu_kernels::cross_entropy,
                  cpu_kernels::dropout,
                  cpu_kernels::elementwise,
                  cpu_kernels::optimizer {
    static constexpr bool absorbs_memory = true;       // see kernels/kernel_table.hpp
    static constexpr bool defers_weight_decay = true;
    static constexpr bool scores_grad_scratch = true;  // a head's d scores in its thread's score block
    // q·R and d_pos per head in the thread's score block from 16 queries on (relative_attention.hpp)
    static constexpr index_t positional_scratch_from = cpu_kernels::relative_attention_core::positional_scratch_from;
    static constexpr bool plain_attention_scratch = true;  // a head's probabilities in its thread's block
    static constexpr bool splits_key_rows = true;          // one_query_forward (relative_attention.hpp)

    /// fn() with the OpenMP threads held for the parallel loops of the kernels it calls (parallel.hpp).
    template <class F>
    static decltype(auto) hold_threads(F&& fn) {
        return mnemo::hold_threads(std::forward<F>(fn));
    }
};

}  // namespace mnemo
