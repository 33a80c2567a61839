#pragma once
// Activation tags: chosen at compile time by feed-forward layers; kernels dispatch on them.
namespace mnemo {

struct relu {
    static constexpr const char* name = "relu";
};
struct gelu {
    static constexpr const char* name = "gelu";
};

}  // namespace mnemo
