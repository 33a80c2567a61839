#pragma once
// config<DModel, Heads, CompressionRate>: the compile-time shape of a model. d_head = d_model / heads.
// Everything else (batch, sequence, memory lengths, layers, vocabulary) is a runtime setting.
//
// config<dynamic, dynamic, dynamic> (runtime_config) is the runtime-shape config, as Eigen's Dynamic
// beside fixed sizes: d_model, heads and the compression rate are then given when the model is built
// (compressive_options / feedback_options: d_model, heads, compression_rate) and every module keeps
// them as runtime values. The kernels are the same ones, taking the extents at run time; where the
// compiled-in shapes have kernels specialised for a compile-time width (the per-head products of
// d_head), the runtime shape takes their runtime-width twins, which compute the same sums in the same
// order. So a runtime-shape model performs the floating-point operations of the compiled-in model of
// the same shape, in the same order: built without FMA contraction (-ffp-contract=off) the two agree
// bitwise. With it (g++'s default), the compiler may fuse a·b + c differently in a loop whose trip
// count is a constant in one and a runtime value in the other: they then agree to float rounding
// (tests/test_dynamic_shape.cpp). The runtime shape is slower: the compiled-in one's loops over d_model
// and d_head are unrolled and vectorised for their sizes. The three are all static or all dynamic.
#include <cstddef>

#include "error.hpp"
#include "shape.hpp"

namespace mnemo {

namespace detail {
template <std::size_t DModel, std::size_t Heads, std::size_t CompressionRate>
struct expect_all_static_or_all_dynamic {
    static constexpr bool agree =
        (DModel == dynamic) == (Heads == dynamic) && (Heads == dynamic) == (CompressionRate == dynamic);
    static_assert(agree, "mnemo: config's d_model, heads and compression rate are all static or all dynamic "
                         "(config<dynamic, dynamic, dynamic> is the runtime-shape config)");
    static constexpr bool value = true;
};
}  // namespace detail

template <std::size_t DModel, std::size_t Heads, std::size_t CompressionRate = 1>
struct config {
    static_assert(detail::expect_all_static_or_all_dynamic<DModel, Heads, CompressionRate>::value);
    static_assert(expect_divisible<DModel, Heads>::value);
    static_assert(expect_compression_rate<CompressionRate>::value);

    /// True for config<dynamic, dynamic, dynamic>: the extents below are `dynamic`, given at run time.
    static constexpr bool is_dynamic = DModel == dynamic;
    static constexpr std::size_t d_model = DModel;
    static constexpr std::size_t heads = Heads;
    static constexpr std::size_t d_head = is_dynamic ? dynamic : DModel / Heads;
    static constexpr std::size_t compression_rate = CompressionRate;
};

/// The runtime-shape config: d_model, heads and the compression rate given when the model is built.
using runtime_config = config<dynamic, dynamic, dynamic>;

/// A model's extents as runtime values: the compile-time ones of a static config, or those a
/// runtime-shape model (runtime_config) is built with. Zero: not given.
struct model_shape {
    index_t d_model = 0;
    index_t heads = 0;
    index_t compression_rate = 0;
    index_t d_head() const { return heads > 0 ? d_model / heads : 0; }
};

/// Config's own extents: the static ones, or zeros (not given) for runtime_config.
template <class Config>
constexpr model_shape config_shape() {
    if constexpr (Config::is_dynamic) return {};
    else return {index_t(Config::d_model), index_t(Config::heads), index_t(Config::compression_rate)};
}

/// The shape a module or model of Config is built with, checked (one-line errors naming `who`, and the
/// fields as `field` + "d_model" etc., e.g. "compressive_options::"): for a static config `s` must be
/// its own (a zero field counts as its own), and the config's is returned; for runtime_config, d_model
/// >= 1, heads >= 1 dividing d_model, and a compression rate >= 1 (a zero rate means 1 unless
/// `rate_required`).
template <class Config>
model_shape check_shape(model_shape s, const char* who, const char* field = "", bool rate_required = false) {
    if constexpr (!Config::is_dynamic) {
        constexpr model_shape c = config_shape<Config>();
        MNEMO_CHECK(s.d_model == 0 || s.d_model == c.d_model, who, ": ", field, "d_model ", s.d_model,
                    " differs from the compiled-in d_model ", c.d_model, " of this model (leave it 0, or build the "
                    "runtime-shape model config<dynamic, dynamic, dynamic>)");
        MNEMO_CHECK(s.heads == 0 || s.heads == c.heads, who, ": ", field, "heads ", s.heads,
                    " differs from the compiled-in heads ", c.heads, " of this model (leave it 0, or build the "
                    "runtime-shape model config<dynamic, dynamic, dynamic>)");
        MNEMO_CHECK(s.compression_rate == 0 || s.compression_rate == c.compression_rate, who, ": ", field,
                    "compression_rate ", s.compression_rate, " differs from the compiled-in compression rate ",
                    c.compression_rate, " of this model (leave it 0, or build the runtime-shape model "
                    "config<dynamic, dynamic, dynamic>)");
        (void)rate_required;
        return c;
    } else {
        MNEMO_CHECK(s.d_model >= 1, who, ": ", field, "d_model must be at least 1 for a runtime-shape model "
                    "(config<dynamic, dynamic, dynamic>), got ", s.d_model);
        MNEMO_CHECK(s.heads >= 1, who, ": ", field, "heads must be at least 1 for a runtime-shape model "
                    "(config<dynamic, dynamic, dynamic>), got ", s.heads);
        MNEMO_CHECK(s.d_model % s.heads == 0, who, ": ", field, "d_model ", s.d_model, " is not divisible by ", field,
                    "heads ", s.heads);
        MNEMO_CHECK(s.compression_rate >= (rate_required ? 1 : 0), who, ": ", field,
                    "compression_rate must be at least 1, got ",
                    s.compression_rate);
        if (s.compression_rate == 0) s.compression_rate = 1;
        return s;
    }
}

/// A static extent must equal the value given for it (a runtime extent takes any positive value):
/// the check of a module built with runtime extents.
template <std::size_t Extent>
inline void check_extent(index_t given, const char* who, const char* what) {
    if constexpr (Extent != dynamic)
        MNEMO_CHECK(given == static_cast<index_t>(Extent), who, ": ", what, " ", given, " given for a module of static ",
                    what, " ", Extent);
    else
        MNEMO_CHECK(given >= 1, who, ": ", what, " must be at least 1, got ", given);
}

}  // namespace mnemo
