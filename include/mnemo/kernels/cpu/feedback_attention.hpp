#pragma once
// The CPU kernels of one feedback attention step (nn/feedback_attention.hpp has the math,
// kernels/feedback_attention_state.hpp the arguments). The per-(batch row, head) loops are too short
// for a GEMM call to pay off (t × d_k with d_k = 64), so they run as vectorised loops over d_k, a
// compile-time extent for a static config; the rows go to threads when there are enough of them.
#include "parallel.hpp"
#include "../../core/shape.hpp"
#include "../feedback_attention_state.hpp"
#include "gemm.hpp"
#include "softmax.hpp"

namespace mnemo::cpu_kernels {

namespace detail {

template <class T, static_extents E>
class feedback_attention_pass {
    struct K : gemm, softmax {};

public:
    explicit feedback_attention_pass(const feedback_attention_state<T>& state)
        : s(state), H(state.heads), D(state.d_model), Dk(state.d_head) {}

    void forward() const {
        const index_t batch = s.batch, t = s.t;
        const auto& keys = s.keys;
        const auto& values = s.values;
        const T scale = s.scale;
        const T *r_win = s.r_win, *s_win = s.s_win;
        T* attn = s.attn;
        parallel_range(batch * H, batch * H * t >= 4096, [&](index_t bh_begin, index_t bh_end) {
            for (index_t bh = bh_begin; bh < bh_end; ++bh) {
                const index_t b = bh / H, h = bh % H;
                T* a = attn + (b * H + h) * t;  // [t]
                const index_t off = b * D + h * Dk;
                const T *qb = s.q + off, *qub = s.qu + off, *k0 = keys.at(0, b) + h * Dk,
                        *v0 = values.at(0, b) + h * Dk, *r0 = r_win + h * Dk;
                for (index_t j = 0; j < t; ++j)  // (q + u)·k_j + q·R[P − t + j] + S[P − t + j]
                    a[j] = dot2(qub, k0 + j * keys.slot_stride, qb, r0 + j * D) + s_win[j * H + h];
                K::softmax_forward(1, t, a, t, a, t, scale);
                T* c = s.ctx + off;  // Σ_j a_j v_j
                for (index_t d = 0; d < Dk; ++d) c[d] = T(0);
                for (index_t j = 0; j < t; ++j) axpy(a[j], v0 + j * values.slot_stride, c);
            }
        });
    }

    void backward() const {
        const index_t batch = s.batch, t = s.t;
        const auto& keys = s.keys;
        const auto& values = s.values;
        const auto& d_keys = s.d_keys;
        const auto& d_values = s.d_values;
        const T scale = s.scale;
        const T* r_win = s.r_win;
        const T* attn = s.saved_attn;
        T* d_scores = s.d_scores;
        parallel_range(batch * H, batch * H * t >= 4096, [&](index_t bh_begin, index_t bh_end) {
            for (index_t bh = bh_begin; bh < bh_end; ++bh) {
                const index_t b = bh / H, h = bh % H;
                const T* a = attn + (b * H + h) * t;
                T* ds = d_scores + (b * H + h) * t;
                const index_t off = b * D + h * Dk;
                const T *dc = s.d_ctx + off, *qub = s.qu + off, *k0 = keys.at(0, b) + h * Dk,
                        *v0 = values.at(0, b) + h * Dk, *r0 = r_win + h * Dk;
                T *dk0 = d_keys.at(0, b) + h * Dk, *dv0 = d_values.at(0, b) + h * Dk;
                for (index_t j = 0; j < t; ++j) {  // dA_j = d_ctx·v_j,  dv_j += a_j·d_ctx
                    ds[j] = dot(dc, v0 + j * values.slot_stride);
                    axpy(a[j], dc, dv0 + j * d_values.slot_stride);
                }
                K::softmax_backward(1, t, a, t, ds, t, ds, t, scale);  // d raw score (the scale folded in)
                T *dqu = s.d_qu + off, *dq = s.d_q + off;
                for (index_t d = 0; d < Dk; ++d) dqu[d] = dq[d] = T(0);
                for (index_t j = 0; j < t; ++j) {
                    axpy(ds[j], qub, dk0 + j * d_keys.slot_stride);   // dk_j += ds_j·(q + u)
                    axpy(ds[j], k0 + j * keys.slot_stride, dqu);      // d(q + u) += ds_j·k_j
                    axpy(ds[j], r0 + j * D, dq);                      // dq += ds_j·R[P − t + j]
                }
            }
        });
        // Tables, per head: dR[P − t + j] += Σ_b ds[b, h, j]·q[b],  dS[P − t + j] += Σ_b ds[b, h, j].
        for (index_t h = 0; h < H; ++h) {
            K::gemm_tn(t, Dk, batch, d_scores + h * t, H * t, s.q + h * Dk, D, s.dr_win + h * Dk, D, T(1));
            for (index_t b = 0; b < batch; ++b) {
                const T* ds = d_scores + (b * H + h) * t;
                for (index_t j = 0; j < t; ++j) s.ds_win[j * H + h] += ds[j];
            }
        }
    }

private:
    T dot(const T* a, const T* b) const {
        T sum = 0;
#pragma omp simd reduction(+ : sum)
        for (index_t d = 0; d < Dk; ++d) sum += a[d] * b[d];
        return sum;
    }
    // a·b + c·e in one pass.
    T dot2(const T* a, const T* b, const T* c, const T* e) const {
        T sum = 0;
#pragma omp simd reduction(+ : sum)
        for (index_t d = 0; d < Dk; ++d) sum += a[d] * b[d] + c[d] * e[d];
        return sum;
    }
    // y += alpha·x
    void axpy(T alpha, const T* x, T* y) const {
#pragma omp simd
        for (index_t d = 0; d < Dk; ++d) y[d] += alpha * x[d];
    }

    const feedback_attention_state<T>& s;
    [[no_unique_address]] extent_holder<E.heads> H;
    [[no_unique_address]] extent_holder<E.d_model> D;
    [[no_unique_address]] extent_holder<E.d_head> Dk;
};

}  // namespace detail

struct feedback_attention_core {
    /// One step's scores, softmax and context (see feedback_attention_state); E: the compile-time extents.
    template <static_extents E, class T>
    static void feedback_attention_forward(const feedback_attention_state<T>& s) {
        detail::feedback_attention_pass<T, E>(s).forward();
    }
    /// One step's backward, from d context, after forward of the same step.
    template <static_extents E, class T>
    static void feedback_attention_backward(const feedback_attention_state<T>& s) {
        detail::feedback_attention_pass<T, E>(s).backward();
    }
};

}  // namespace mnemo::cpu_kernels
