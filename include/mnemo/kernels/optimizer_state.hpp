#pragma once
// What the optimizers and gradient clipping (train/optimizer.hpp, train/clip.hpp) hand their backend's
// kernels: the buffers of one step (backend memory), the step's coefficients (formed once on the host,
// in the order train/optimizer.hpp explains) and the runs of the flat gradient buffer that may hold
// non-zero values (host metadata, as a parameter_set's grad_live_ranges()).
#include <cstdint>
#include <span>

#include "../core/shape.hpp"

namespace mnemo {

/// Which Adam-family update a step applies (train/optimizer.hpp gives each rule's formulas).
///   adamw   decoupled decay, PyTorch's denominator sqrt(v)/sqrt(1 − β2^t) + ε
///   adam    L2 decay added to the gradient, the same denominator
///   labml   decoupled decay, labml's denominator sqrt(v) + ε (the bias correction is in the step size)
enum class adam_rule : std::uint8_t { adamw, adam, labml };

/// Elements per block of the Adam family's cold-block skipping (see adam_step_args::cold).
inline constexpr index_t adam_cold_block = 1024;

template <class T>
struct adam_coefficients {
    T decay = T(1);         // 1 − lr·wd (decoupled rules)
    bool l2 = false;        // adam: add wd·p to the gradient
    T wd = T(0);            // adam's L2 coefficient
    T beta1 = T(0), one_minus_beta1 = T(1);
    T beta2 = T(0), one_minus_beta2 = T(1);
    T bias_correction2_sqrt = T(1);  // adamw, adam: sqrt(1 − β2^t)
    T eps = T(0);
    T neg_step_size = T(0);
};

/// Deferred weight decay (core/parameters.hpp): the decoupled decay of the blocks that a step only
/// decays, logged instead of applied. Block b (adam_cold_block elements) of a deferrable run (inside one
/// row-sparse tensor: the positional tables) owes the factors log[owed_from[b] … logged); paying
/// multiplies its elements by each, in the logged order, which is bitwise what the eager steps compute.
/// values is the set's flat buffer (backend memory); log, owed_from and deferrable are host metadata
/// that the parameter_set keeps. A kernel given a null `deferrable` defers nothing.
template <class T>
struct deferred_decay {
    T* values = nullptr;
    index_t total = 0;                          // elements of values
    const T* log = nullptr;                     // the logged factors, oldest first
    std::uint32_t logged = 0;
    std::uint32_t* owed_from = nullptr;         // per block: the first logged factor it has not had
    const std::uint8_t* deferrable = nullptr;   // per block: 1 = may owe (inside one row-sparse tensor)
};

/// One Adam-family step over n elements of params, grads, m (exp_avg) and v (exp_avg_sq).
/// cold (decoupled rules only; null for adam): one flag per block of adam_cold_block elements, set while
/// the block's moments are exactly zero. A cold block whose gradient is zero gets only the decay
/// (Adam's whole update of such an element); any other block is updated and its flag cleared. The
/// gradient is +0 outside the sorted, disjoint runs `live`, which the kernel may use to skip reads.
template <class T>
struct adam_step_args {
    T* params = nullptr;
    const T* grads = nullptr;
    T* m = nullptr;
    T* v = nullptr;
    index_t n = 0;
    std::uint8_t* cold = nullptr;
    std::span<const flat_range> live;
    adam_coefficients<T> c;
    /// With a deferral (decoupled rules over a parameter_set, its `logged` counting this step's factor
    /// c.decay), a cold deferrable block with zero gradient is left owing that factor, and every block
    /// that is updated or decayed is paid what it owed first.
    const deferred_decay<T>* deferral = nullptr;
};

/// One step of SGD over n elements; b is the momentum buffer (null when momentum == 0).
template <class T>
struct sgd_step_args {
    T* params = nullptr;
    const T* grads = nullptr;
    T* b = nullptr;
    index_t n = 0;
    bool first = false;     // the first step: b ← g (PyTorch's momentum_buffer was None)
    bool l2 = false;
    bool nesterov = false;
    T wd = T(0);
    T momentum = T(0);
    T one_minus_dampening = T(1);
    T neg_lr = T(0);
};

}  // namespace mnemo
