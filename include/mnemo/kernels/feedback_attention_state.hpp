#pragma once
// What feedback_attention (nn/feedback_attention.hpp) hands its backend's kernels for one step: the
// shapes and the pointers into backend memory it has laid out (kernels/cpu/feedback_attention.hpp
// computes). B batch rows, H heads, D = H·d_k, t memory slots.
#include <type_traits>

#include "../core/shape.hpp"

namespace mnemo {

/// Projected keys or values of t memory slots: slot j of batch row b holds D contiguous features at
/// data + j·slot_stride + b·batch_stride. Sequence-major [t, B, D]: slot_stride = B·D, batch_stride = D;
/// batch-major [B, capacity, D]: slot_stride = D, batch_stride = capacity·D.
template <class T>
struct memory_slots {
    T* data = nullptr;
    index_t slots = 0;
    index_t slot_stride = 0;
    index_t batch_stride = 0;

    memory_slots() = default;
    memory_slots(T* d, index_t n, index_t slot_stride_, index_t batch_stride_)
        : data(d), slots(n), slot_stride(slot_stride_), batch_stride(batch_stride_) {}
    /// Mutable -> const, implicitly (as view's).
    template <class U>
        requires(std::is_same_v<const U, T> && !std::is_same_v<U, T>)
    memory_slots(const memory_slots<U>& o)  // NOLINT(google-explicit-constructor)
        : data(o.data), slots(o.slots), slot_stride(o.slot_stride), batch_stride(o.batch_stride) {}

    /// Slot `slot` of batch row b (pointer arithmetic only).
    T* at(index_t slot, index_t b) const { return data + slot * slot_stride + b * batch_stride; }
};

/// One step of feedback attention: scores over the t slots with the positional terms, softmax and
/// context (forward); d scores, d keys, d values, d(q+u), dq's positional part and the tables'
/// window gradients (backward).
template <class T>
struct feedback_attention_state {
    index_t batch = 0, heads = 0, d_model = 0, d_head = 0, t = 0;
    T scale = T(1);  // 1/sqrt(d_k)
    const T* q = nullptr;   // [B, D] queries, without u
    const T* qu = nullptr;  // [B, D] q + u
    memory_slots<const T> keys, values;
    const T* r_win = nullptr;  // R's rows [P − t, P): [t, H·d_k]
    const T* s_win = nullptr;  // S's rows [P − t, P): [t, H]
    T* attn = nullptr;         // [B, H, t] softmax weights, written by forward
    T* ctx = nullptr;          // [B, D]
    // Backward.
    const T* saved_attn = nullptr;     // [B, H, t]: forward's weights
    const T* d_ctx = nullptr;          // [B, D]
    T* d_scores = nullptr;             // [B, H, t]
    T* d_qu = nullptr;                 // [B, D] assigned
    T* d_q = nullptr;                  // [B, D] dq's positional part, assigned
    memory_slots<T> d_keys, d_values;  // +=
    T *dr_win = nullptr, *ds_win = nullptr;  // +=
};

}  // namespace mnemo
