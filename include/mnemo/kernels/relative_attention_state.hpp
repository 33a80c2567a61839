#pragma once
// What relative_attention (nn/relative_attention.hpp) hands its backend's attention kernels: the
// shapes of one call and the pointers into backend memory it has laid out (the module does shape and
// pointer arithmetic only; kernels/cpu/relative_attention.hpp computes). The symbols follow the
// module's header comment: B batch, H heads, D = H·d_k, Q queries, K = M + Q keys, W = K + Q window rows.
#include <cstdint>

#include "../core/shape.hpp"

namespace mnemo {

/// Key rows that need no input gradient (a detached memory), given to relative_attention::backward.
/// Their keys and values still give the projections their weight gradients. When they are the output
/// of a layer norm, z = ẑ∘γ + β (zhat given), the norm's parameter gradients from those rows are
/// added too (dgamma, dbeta), without forming d z for them:
///   with G = dkvᵀ·ẑ [2D, D] and c = Σ_rows dkv [2D] over those rows, and W = [W_k; W_v] [2D, D]:
///   dW += G·diag(γ) + c ⊗ β,   dγ_i += Σ_j W[j, i]·G[j, i],   dβ += cᵀ·W
/// (z's rows enter dW as ẑ∘γ + β; dz = dkv·W, so Σ_r dz[r, i]·ẑ[r, i] and Σ_r dz[r, i] reduce to G and c).
/// That saves the [rows, 2D] × [2D, D] GEMM of d z, about a third of the projections' work when most
/// keys are memory. With zhat null, the rows are plain inputs: dW as usual, no d z.
template <class T>
struct frozen_key_rows {
    index_t rows = 0;  // the first `rows` rows of z_kv
    const T* zhat = nullptr;
    index_t ld_zhat = 0;
    const T* gamma = nullptr;
    const T* beta = nullptr;
    T* dgamma = nullptr;
    T* dbeta = nullptr;
    /// Given to forward: the memory rows of z_kv were not written, only ẑ (the caller asked
    /// would_absorb first); forward fails rather than read them.
    bool z_unwritten = false;
    /// ẑ's layout. 0: row r = j·B + b (position j, batch element b) at zhat + r·ld_zhat, as z_kv's.
    /// > 0: by batch element, row (j, b) at zhat + b·ld_batch + j·ld_zhat; only the absorbed route
    /// reads that layout (it reads one batch element's memory rows at a time: from rows B·ld_zhat
    /// apart, its products ran at about 2/3 of their speed over contiguous ones).
    index_t ld_batch = 0;
};

/// A backend's positional_scratch_from (kernels/kernel_table.hpp) when the attention always needs the
/// module's pos buffer.
inline constexpr index_t no_positional_scratch = index_t(1) << 62;

/// One call of the attention core: everything between the projections (scores, positional terms,
/// masks, softmax, context) and, for backward, back to d(q+u), dq's positional part, dk, dv and the
/// positional tables' window gradients. Pointers not used by the route taken may be null.
template <class T>
struct relative_attention_state {
    // Shape.
    index_t batch = 0, heads = 0, d_model = 0, d_head = 0, q_len = 0, k_len = 0;
    index_t clamp_len = 0;  // 0: off
    bool absorbed = false;  // the memory's share folded into the queries and the context (absorbed route)
    T scale = T(1);         // 1/sqrt(d_k)

    // Forward's inputs.
    const T* q = nullptr;      // [Q·B, D] queries, without u
    const T* qu = nullptr;     // [Q·B, D] q + u
    const T* kv = nullptr;     // [K·B, 2D] rows [k, v] (absorbed: only the segment's rows are read)
    // One query position over projected keys, on a backend with splits_key_rows only: the rows of
    // positions [0, kv_split) are read from kv_lo instead (row j·B + b at kv_lo + (j·B + b)·2D, as in
    // kv). 0: every row from kv.
    const T* kv_lo = nullptr;
    index_t kv_split = 0;
    const T* r_win = nullptr;  // R's window rows [P − K, P + Q): [W, H·d_k]
    const T* s_win = nullptr;  // S's window rows: [W, H]
    const std::uint8_t* keep = nullptr;      // [B, K], 1 = visible; null: no padding
    const std::uint8_t* keep_any = nullptr;  // [B]: batch element b has a padded key
    // Absorbed route: the memory's rows of z_kv (row j·B + b), the key and value projections, and the
    // memory as a layer norm's output ẑ∘γ + β (hat.zhat null: not used).
    const T* z = nullptr;
    index_t ldz = 0;
    const T *wk = nullptr, *wv = nullptr, *bv = nullptr;
    frozen_key_rows<T> hat;

    // Saved by forward (read by backward).
    // [H, Q·B, W]: q·R over the window; backward's d_pos. Null on the projected route from the
    // backend's positional_scratch_from queries on (it keeps a head's rows in scratch of its own).
    T* pos = nullptr;
    T* attn = nullptr;  // [B, H, Q, K] attention weights
    T* ctx = nullptr;   // [Q·B, D] context
    // Absorbed route, [H·Q, B, D] each: the queries with W_k folded in, q̃ = (q+u)_h·W_k,h (scores are
    // q̃·z); the attention-weighted memory inputs U = A_mem·z (the context is U·W_v,hᵀ + …); with
    // the norm rows (hat), Û = A_mem·ẑ instead of U (mem_mix null: the CPU backend takes U = Û∘γ +
    // (Σ a)⊗β into the weights' side of the products that read it).
    T *q_absorbed = nullptr, *mem_mix = nullptr, *mem_mix_hat = nullptr;
    T* row_mass = nullptr;                              // absorbed: Σ_{j<M} a [B, H, Q]
    T* thread_blocks = nullptr;  // hat: parallel_slots(B) blocks of H·Q·(D + 1)

    // Backward.
    const T* d_ctx = nullptr;  // [Q·B, D]
    T* d_scores = nullptr;     // [B, H, Q, K] scratch; null on the projected route of a backend with scores_grad_scratch
    T* dqu = nullptr;          // [Q·B, D] d(q+u), assigned
    T* dq = nullptr;           // [Q·B, D] dq's positional part, assigned
    T* dkv = nullptr;          // [K·B, 2D] [dk, dv], assigned over the projected rows
    T *dr_win = nullptr, *ds_win = nullptr;  // R's and S's window gradient rows, +=
    T* col_sums = nullptr;  // [H, W] scratch: forward S's window by head, backward d_pos's column sums
    // Absorbed backward.
    T *gk = nullptr, *gv = nullptr, *gbv = nullptr;  // W_k, W_v, b_v gradients, +=
    T *d_mem_mix = nullptr, *d_q_absorbed = nullptr;  // dU, d q̃: [H·Q·B, D] each
    T* d_bias_score = nullptr;                       // [B, H, Q]
    T* dz_blocks = nullptr;     // parallel_slots(B) blocks of [M, D]: memory rows' d z (null: not needed)
    T* norm_partial = nullptr;  // [B, 2D] (null: no frozen norm rows)
    bool hat_backward = false;  // forward's hat rows are the frozen rows: no d z at all
    frozen_key_rows<T> frozen;
    T* d_zkv = nullptr;  // rows of d z_kv for the memory rows that are not frozen (null: not wanted)
    index_t ld_dzkv = 0;
};

}  // namespace mnemo
