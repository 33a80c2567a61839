#pragma once
// The reconstruction losses' kernels (losses/attention_reconstruction.hpp,
// losses/autoencoding_reconstruction.hpp): the masked squared difference and its double-precision sum,
// the plain (position-free) attention over the memory and over its compression with its backward,
// the key masks from the memory's padding, and the key/value projections of both key sets.
#include <cstdint>
#include <vector>

#include <Eigen/Core>

#include "parallel.hpp"
#include "../../core/shape.hpp"
#include "elementwise.hpp"
#include "gemm.hpp"
#include "head_products.hpp"
#include "softmax.hpp"

namespace mnemo::cpu_kernels {

struct reconstruction {
    /// diff[r, :] = a[r, :] − b[r, :] (0 on rows r with pad[r] != 0; pad null: none) and
    /// sum[0] = Σ diff² over the other rows, in double: each row's sum in eight partial sums (SIMD
    /// lanes), the rows' sums added in row order (diff may be a's memory); sum[1] = the number of
    /// those rows. One chain of double adds over all elements took 4 cycles an element, serial:
    /// 0.7-1% of configurations A's and B's training steps.
    template <class T>
    static void squared_difference_rows(index_t rows, index_t d, const T* a, index_t lda, const T* b, index_t ldb,
                                        const std::uint8_t* pad, T* diff, index_t ldd, double* sum) {
        constexpr index_t lanes = 8;
        double s = 0;
        index_t counted = 0;
        for (index_t r = 0; r < rows; ++r) {
            T* dr = diff + r * ldd;
            if (pad && pad[r]) {
                for (index_t i = 0; i < d; ++i) dr[i] = T(0);
                continue;
            }
            ++counted;
            const T *ar = a + r * lda, *br = b + r * ldb;
            // Eight partial sums, element i in partial i mod 8, added in a fixed order: the same
            // bits whether d is known at compile time or not (a compiler-chosen reduction splits
            // differently for the two).
            double part[lanes] = {};
            const auto element = [&](index_t j, index_t l) {
                const T v = ar[j] - br[j];
                dr[j] = v;
                part[l] += double(v) * double(v);
            };
            index_t i = 0;
            for (; i + lanes <= d; i += lanes)
                for (index_t l = 0; l < lanes; ++l) element(i + l, l);
            for (index_t l = 0; l < lanes && i + l < d; ++l) element(i + l, l);
            s += ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7]));
        }
        sum[0] = s;
        sum[1] = double(counted);
    }

    /// Key masks [B, n] (1 = visible) from the padding m_pad [m_len·B] of the memory's slots: keep_m
    /// masks a padded slot; keep_c a compressed slot all of whose `rate` slots are padding. any_m,
    /// any_c [B]: whether batch element b has a masked key.
    static void reconstruction_keep(index_t batch, index_t m_len, index_t c_len, const std::uint8_t* m_pad,
                                    std::uint8_t* keep_m, std::uint8_t* keep_c, std::uint8_t* any_m,
                                    std::uint8_t* any_c) {
        const index_t rate = c_len > 0 ? m_len / c_len : 1;
        for (index_t b = 0; b < batch; ++b) {
            any_m[b] = any_c[b] = 0;
            for (index_t s = 0; s < m_len; ++s) {
                const bool pad = m_pad[s * batch + b] != 0;
                keep_m[b * m_len + s] = pad ? 0 : 1;
                any_m[b] |= std::uint8_t(pad);
            }
            for (index_t s = 0; s < c_len; ++s) {
                bool all = true;
                for (index_t t = 0; t < rate; ++t) all = all && m_pad[(s * rate + t) * batch + b] != 0;
                keep_c[b * c_len + s] = all ? 0 : 1;
                any_c[b] |= std::uint8_t(all);
            }
        }
    }

    /// The keys and values of two key sets through one key and one value projection: km = mn·Wkᵀ,
    /// kc = cn·Wkᵀ, vm = mn·Wvᵀ + bv, vc = cn·Wvᵀ + bv (all [rows, d], row stride d). The keys on one
    /// thread and the values on the other at mid sizes (gemm::concurrent_pair): four products that two
    /// threads would each split poorly.
    template <class T>
    static void key_value_projections(index_t m_rows, index_t c_rows, index_t d, const T* mn, index_t ldmn,
                                      const T* cn, index_t ldcn, const T* wk, const T* wv, const T* bv, T* km, T* kc,
                                      T* vm, T* vc) {
        parallel_invoke(
            gemm::concurrent_pair(m_rows, d, d),
            [&] {
                gemm::gemm_nt(m_rows, d, d, mn, ldmn, wk, d, km, d);
                gemm::gemm_nt(c_rows, d, d, cn, ldcn, wk, d, kc, d);
            },
            [&] {
                gemm::gemm_nt_bias(m_rows, d, d, mn, ldmn, wv, d, bv, vm, d);
                gemm::gemm_nt_bias(c_rows, d, d, cn, ldcn, wv, d, bv, vc, d);
            });
    }

    /// out [Q·B, D] = per (b, head) softmax(scale·q·kᵀ)·v over all n keys (q, k, v, out rows
    /// position·B + b, row stride B·D); a [B, H, Q, n] saved. keep [B, n] (null: none; 1 = visible)
    /// masks keys of the batch elements with any[b] set. With a null `a` (ops<cpu>::
    /// plain_attention_scratch) the probabilities are not kept: each head's go through its thread's
    /// block (probability_block), which stays in L2 from the scores' product to the context's.
    /// Configuration B's target attention (the loss's a_m, 4 MB) written to its [B, H, Q, n] buffer
    /// took 28-37 µs a 128×128×32 score product inside the training step, 15-17.5 µs in the block
    /// (Granite Rapids VM, docs/performance.md).
    template <static_extents E, class T>
    static void plain_attention_forward(index_t batch, index_t heads, index_t d, index_t dk, index_t q_len, index_t n,
                                        T scale, const T* q, const T* k, const T* v, T* a, T* out,
                                        const std::uint8_t* keep, const std::uint8_t* any) {
        using H = heads_for<E>;
        const index_t ld = batch * d;
        parallel_range(batch * heads, true, [&](index_t begin, index_t end) {
            T* block = a ? nullptr : probability_block<T>(q_len * n);
            for (index_t bh = begin; bh < end; ++bh) {
                const index_t b = bh / heads, hh = bh % heads;
                const index_t off = b * d + hh * dk;
                T* ab = a ? a + (b * heads + hh) * q_len * n : block;
                H::gemm_nt(dk, q_len, n, q + off, ld, k + off, ld, ab, n);
                softmax_mask mask{};
                if (keep && any[b]) {
                    mask.keep = keep + b * n;
                    mask.ld_keep = 0;
                }
                if (!mask.keep) softmax::softmax_contiguous(q_len, n, ab, scale);
                else softmax::softmax_forward(q_len, n, ab, n, ab, n, scale, mask);
                H::gemm_nn(dk, q_len, n, ab, n, v + off, ld, out + off, ld);
            }
        });
    }

    /// The backward of plain_attention_forward to its keys and values, from d out: per (b, head)
    /// dA = d_out·vᵀ (into da [B, H, Q, n]), dv = Aᵀ·d_out, d scores through the softmax, dk = dSᵀ·q.
    template <static_extents E, class T>
    static void plain_attention_backward(index_t batch, index_t heads, index_t d, index_t dk, index_t q_len,
                                         index_t n, T scale, const T* q, const T* v, const T* a, const T* d_out, T* da,
                                         T* dk_out, T* dv_out) {
        using H = heads_for<E>;
        const index_t ld = batch * d;
        parallel_range(batch * heads, true, [&](index_t begin, index_t end) {
            for (index_t bh = begin; bh < end; ++bh) {
                const index_t b = bh / heads, hh = bh % heads;
                const index_t off = b * d + hh * dk, a_off = (b * heads + hh) * q_len * n;
                T* dab = da + a_off;
                H::gemm_nt(dk, q_len, n, d_out + off, ld, v + off, ld, dab, n);            // dA
                H::gemm_tn(dk, q_len, n, a + a_off, n, d_out + off, ld, dv_out + off, ld);  // dv
                softmax::softmax_backward(q_len, n, a + a_off, n, dab, n, dab, n, scale);
                H::gemm_tn(dk, q_len, n, dab, n, q + off, ld, dk_out + off, ld);  // dk
            }
        });
    }

private:
    /// This thread's block of at least n elements for plain_attention_forward's unsaved
    /// probabilities. Grown once, kept: a steady-state call allocates nothing.
    template <class T>
    static T* probability_block(index_t n) {
        thread_local std::vector<T, Eigen::aligned_allocator<T>> block;
        if (block.size() < std::size_t(n)) block.resize(std::size_t(n));
        return block.data();
    }
};

}  // namespace mnemo::cpu_kernels
