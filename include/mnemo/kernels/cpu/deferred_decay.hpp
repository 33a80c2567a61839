#pragma once
// The CPU kernel that pays the deferred weight decay (kernels/optimizer_state.hpp, deferred_decay):
// the optimizer kernels pay a block before they update it, the attention modules the window of the
// positional tables they read, and parameter_set's host path everything it copies. Kept apart from
// kernels/cpu/optimizer.hpp so that core/parameters.hpp can include it alone.
#include <algorithm>
#include <cstdint>

#include "../../core/shape.hpp"
#include "../optimizer_state.hpp"
#include "parallel.hpp"

namespace mnemo::cpu_kernels {

struct deferred_decay_payment {
    /// Block b's elements times the factors it owes, log[owed_from[b] … upto), one multiplication per
    /// factor in the logged order (round(p·f) each, as the eager steps' decay); then it owes from upto.
    /// A block that is not deferrable owes nothing.
    template <class T>
    static void pay_block(const deferred_decay<T>& d, index_t b, std::uint32_t upto) {
        if (!d.deferrable || !d.deferrable[b]) return;
        std::uint32_t& from = d.owed_from[b];
        if (from >= upto) return;
        T* v = d.values;
        const index_t i0 = b * adam_cold_block, i1 = std::min(d.total, i0 + adam_cold_block);
        for (std::uint32_t k = from; k < upto; ++k) {
            const T f = d.log[k];
            for (index_t i = i0; i < i1; ++i) v[i] = v[i] * f;
        }
        from = upto;
    }

    /// Pays every deferrable block that meets the elements [begin, end) of d.values what it owes:
    /// before anything reads those elements. Blocks are independent, so threads split them.
    template <class T>
    static void pay_deferred_decay(const deferred_decay<T>& d, index_t begin, index_t end) {
        if (!d.deferrable || begin >= end || d.logged == 0) return;
        const index_t b0 = begin / adam_cold_block, b1 = (end - 1) / adam_cold_block + 1;
        parallel_range(b1 - b0, end - begin >= (index_t{1} << 15), [&](index_t lo, index_t hi) {
            for (index_t b = b0 + lo; b < b0 + hi; ++b) pay_block(d, b, d.logged);
        });
    }
};

}  // namespace mnemo::cpu_kernels
