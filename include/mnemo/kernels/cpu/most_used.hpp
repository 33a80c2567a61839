#pragma once
// Most-used compression's kernels (nn/compression/most_used.hpp): the attention mass each memory slot
// receives, summed over heads and queries, and the selection of each group's most used slot with
// its backward.
#include <cmath>
#include <cstddef>

#include "../../core/error.hpp"
#include "../../core/shape.hpp"
#include "parallel.hpp"

namespace mnemo::cpu_kernels::detail {
/// f(i) for i in [0, n): split over the threads when `parallel` (parallel_range), else a plain loop.
template <class F>
inline void for_each_item(index_t n, bool parallel, F&& f) {
    parallel_range(n, parallel, [&](index_t begin, index_t end) {
        for (index_t i = begin; i < end; ++i) f(i);
    });
}
}  // namespace mnemo::cpu_kernels::detail

namespace mnemo::cpu_kernels {

/// The per-key attention mass the memory slots receive, for most-used compression.
struct attention_usage {
    /// usage[j·batch + b] += Σ_h Σ_i probs[((b·heads + h)·q + i)·k + j]: the attention weights of
    /// every head and every query on key j of batch element b, summed (heads outer, queries inner) and
    /// added to usage. probs is [batch][heads][q][k] contiguous, as relative_attention keeps its
    /// softmax output; usage is indexed as the key rows (key position·batch + b). Batch elements
    /// write disjoint entries, so threads split them.
    template <class T>
    static void accumulate_key_usage(index_t batch, index_t heads, index_t q, index_t k, const T* probs, T* usage) {
        detail::for_each_item(batch, batch * heads * q * k >= 65536, [&](index_t b) {
            for (index_t h = 0; h < heads; ++h) {
                const T* p = probs + (b * heads + h) * q * k;
                for (index_t i = 0; i < q; ++i) {
                    const T* pi = p + i * k;
                    for (index_t j = 0; j < k; ++j) usage[j * batch + b] += pi[j];
                }
            }
        });
    }
};

/// Most-used selection. Arguments as cpu_kernels::compression: `out_rows` = n·batch compressed rows,
/// memory row (s·Rate + t)·batch + b for output row r = s·batch + b, `d` features, `ld*` row strides;
/// Rate may be `dynamic`, the rate then given as the last argument.
struct most_used_selection {
    /// arg[r] = the first t maximising usage[(s·Rate + t)·batch + b] (a NaN never wins);
    /// out[r, :] = mem[(s·Rate + arg[r])·batch + b, :].
    template <std::size_t Rate, class T, class I>
    static void most_used_forward(index_t out_rows, index_t batch, index_t d, const T* usage, const T* mem, index_t ldm, T* out,
                        index_t ldo, I* arg, index_t rate = index_t(Rate)) {
        const index_t c = Rate != dynamic ? static_cast<index_t>(Rate) : rate;
        detail::for_each_item(out_rows, out_rows * d >= 65536, [&](index_t r) {
            const index_t s = r / batch, b = r % batch;
            index_t best = 0;
            T best_u = usage[s * c * batch + b];
            for (index_t t = 1; t < c; ++t) {
                const T u = usage[(s * c + t) * batch + b];
                if (u > best_u || (std::isnan(best_u) && !std::isnan(u))) {  // ties keep the first
                    best = t;
                    best_u = u;
                }
            }
            arg[r] = static_cast<I>(best);
            const T* m = mem + ((s * c + best) * batch + b) * ldm;
            T* o = out + r * ldo;
            for (index_t i = 0; i < d; ++i) o[i] = m[i];
        });
    }

    /// d_mem[(s·Rate + t)·batch + b, :] = d_out[r, :] where t = arg[r], else 0 (assigned).
    template <std::size_t Rate, class T, class I>
    static void most_used_backward(index_t out_rows, index_t batch, index_t d, const T* d_out, index_t ldo, const I* arg,
                         T* d_mem, index_t ldm, index_t rate = index_t(Rate)) {
        const index_t c = Rate != dynamic ? static_cast<index_t>(Rate) : rate;
        detail::for_each_item(out_rows, out_rows * d * c >= 65536, [&](index_t r) {
            const index_t s = r / batch, b = r % batch;
            const T* g = d_out + r * ldo;
            for (index_t t = 0; t < c; ++t) {
                T* m = d_mem + ((s * c + t) * batch + b) * ldm;
                if (static_cast<index_t>(arg[r]) == t)
                    for (index_t i = 0; i < d; ++i) m[i] = g[i];
                else
                    for (index_t i = 0; i < d; ++i) m[i] = T(0);
            }
        });
    }
};

}  // namespace mnemo::cpu_kernels

namespace mnemo {

/// usage[j·batch + b] += Σ_{h, i} probs[b][h][i][j] (CPU): the attention mass that key row j·batch + b
/// received from every head and query. probs [batch][heads][q][k] contiguous (relative_attention's
/// softmax output layout); usage has k·batch entries, indexed as the key rows.
template <class T>
void accumulate_key_usage(index_t batch, index_t heads, index_t q, index_t k, const T* probs, T* usage) {
    MNEMO_CHECK(batch >= 0 && heads >= 0 && q >= 0 && k >= 0, "accumulate_key_usage: negative extent (batch ", batch,
                ", heads ", heads, ", q ", q, ", k ", k, ")");
    cpu_kernels::attention_usage::accumulate_key_usage(batch, heads, q, k, probs, usage);
}

}  // namespace mnemo
