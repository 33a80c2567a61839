#pragma once
// The causal band of an attention product (which keys each query row sees), shared by the per-head
// register tiles (head_products.hpp) and the packed GEMM (gemm_packed.hpp), which both skip what lies
// outside it.
#include <algorithm>

#include "../../core/shape.hpp"

namespace mnemo::cpu_kernels {

/// Which keys each query row of an attention product can see: row i sees keys j < offset + i + 1
/// (keys [memory, segment], offset = the memory's length less the product's first key). The
/// products skip what no row of a tile sees: nt leaves those scores unwritten (a softmax over the
/// visible prefix never reads them); nn and tn skip the zero weights there (the masked attention
/// weights and their gradients are exact zeros), adding nothing an FMA chain would change (but the
/// sign of a zero sum). none: every key.
struct causal_keys {
    static constexpr index_t none_offset = index_t(1) << 50;
    index_t offset = none_offset;
    constexpr bool none() const { return offset >= none_offset; }
    /// The keys any of the query rows before i_end sees: [0, end(i_end)).
    constexpr index_t end(index_t i_end) const { return offset + i_end; }
    /// The first query row that sees key j.
    constexpr index_t first_query(index_t j) const { return std::max<index_t>(0, j - offset); }
};

}  // namespace mnemo::cpu_kernels
