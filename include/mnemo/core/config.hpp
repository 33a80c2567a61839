#pragma once
// config<DModel, Heads, CompressionRate>: the compile-time shape of a model. d_head = d_model / heads.
// Everything else (batch, sequence, memory lengths, layers, vocabulary) is a runtime setting.
#include <cstddef>

#include "shape.hpp"

namespace mnemo {

template <std::size_t DModel, std::size_t Heads, std::size_t CompressionRate = 1>
struct config {
    static_assert(expect_divisible<DModel, Heads>::value);
    static_assert(expect_compression_rate<CompressionRate>::value);

    static constexpr std::size_t d_model = DModel;
    static constexpr std::size_t heads = Heads;
    static constexpr std::size_t d_head = DModel / Heads;
    static constexpr std::size_t compression_rate = CompressionRate;
};

}  // namespace mnemo
