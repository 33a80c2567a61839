#pragma once
// The CPU model benchmarks' shared set-up (bench_models, region_profile): a segment's tokens and a
// memory brought to its steady state.
#include <cstdint>
#include <vector>

#include <mnemo/mnemo.hpp>

#include "model_shapes.hpp"

namespace mnemo_bench {

/// seq·batch tokens of configuration s, drawn from seed.
inline std::vector<mnemo::token_t> tokens_for(const shape& s, std::uint64_t seed) {
    mnemo::rng r(seed);
    std::vector<mnemo::token_t> t(std::size_t(s.seq * s.batch));
    for (auto& x : t) x = mnemo::token_t(r.next_u32() % std::uint32_t(s.vocab));
    return t;
}

/// Brings the memory to its steady state (full memory and compressed memory).
template <class Model>
void fill_memory(Model& m, typename Model::memory_type& mem, const shape& s) {
    const index_t steps = (s.mem + s.c_mem * index_t(Model::config::compression_rate)) / s.seq + 2;
    for (index_t i = 0; i < steps; ++i) {
        auto t = tokens_for(s, 1000 + std::uint64_t(i));
        m.forward(t, s.batch, mem);
        m.update_memory(mem);
    }
}

}  // namespace mnemo_bench
