#pragma once
// The compiled-in model configurations of the example programs (mnemo_eval, train).
//
// mnemo fixes d_model, heads and the compression rate at compile time, so a program that reads them
// from a checkpoint or the command line carries a table of configurations and picks one at run time.
// To support another one, add ONE line to MNEMO_EXAMPLE_CONFIGS below: X(d_model, heads, rate).
// Transformer-XL models (no compression) use the same table, matched on d_model and heads.
#include <sstream>
#include <string>
#include <utility>

#include <mnemo/models/compressive_transformer.hpp>

// X(d_model, heads, compression rate)
#define MNEMO_EXAMPLE_CONFIGS(X) \
    X(128, 4, 2) /* the reference experiment (labml, Tiny Shakespeare) */ \
    X(256, 8, 4)                                                          \
    X(512, 8, 4)                                                          \
    X(64, 4, 2) /* the main job's synthetic task */                       \
    X(16, 2, 2) /* tests/golden compressive_tiny, xl_tiny */              \
    X(12, 3, 3) /* tests/golden compressive_odd */

namespace mnemo::examples {

enum class model_kind { compressive, xl };
enum class compression_kind { conv, max, mean };

inline model_kind parse_model_kind(const std::string& s) {
    if (s == "compressive") return model_kind::compressive;
    if (s == "xl") return model_kind::xl;
    detail::fail("unknown --model '", s, "' (expected compressive or xl)");
}
inline compression_kind parse_compression_kind(const std::string& s) {
    if (s == "conv") return compression_kind::conv;
    if (s == "max") return compression_kind::max;
    if (s == "mean") return compression_kind::mean;
    detail::fail("unknown --compression '", s, "' (expected conv, max or mean)");
}
inline const char* name(compression_kind c) {
    return c == compression_kind::conv ? "conv" : c == compression_kind::max ? "max" : "mean";
}

/// The supported configurations, one per line, for error messages.
inline std::string supported_configs() {
    std::ostringstream os;
#define MNEMO_LIST_CONFIG(D, H, C) os << "  d_model " << D << ", heads " << H << ", compression rate " << C << "\n";
    MNEMO_EXAMPLE_CONFIGS(MNEMO_LIST_CONFIG)
#undef MNEMO_LIST_CONFIG
    return os.str();
}

/// Calls f.template operator()<Model>() with the model type for (d_model, heads, rate, kind,
/// compression), T = float. Throws a mnemo::error listing the supported configurations otherwise.
template <class F>
decltype(auto) with_model(index_t d_model, index_t heads, index_t rate, model_kind kind, compression_kind comp, F&& f) {
#define MNEMO_DISPATCH_CONFIG(D, H, C)                                                                          \
    if (d_model == D && heads == H && kind == model_kind::xl)                                                 \
        return f.template operator()<compressive_transformer<float, config<D, H, 1>, no_compression>>();     \
    if (d_model == D && heads == H && rate == C && kind == model_kind::compressive) {                         \
        switch (comp) {                                                                                       \
            case compression_kind::conv:                                                                      \
                return f.template operator()<compressive_transformer<float, config<D, H, C>, conv_compression>>(); \
            case compression_kind::max:                                                                       \
                return f.template operator()<compressive_transformer<float, config<D, H, C>, max_pool_compression>>(); \
            case compression_kind::mean:                                                                      \
                return f.template operator()<compressive_transformer<float, config<D, H, C>, mean_pool_compression>>(); \
        }                                                                                                     \
    }
    MNEMO_EXAMPLE_CONFIGS(MNEMO_DISPATCH_CONFIG)
#undef MNEMO_DISPATCH_CONFIG
    detail::fail("no compiled-in configuration for d_model ", d_model, ", heads ", heads,
                 kind == model_kind::xl ? std::string() : ", compression rate " + std::to_string(rate),
                 ". Supported:\n", supported_configs(),
                 "To add one, add the line X(", d_model, ", ", heads, ", ", kind == model_kind::xl ? 1 : rate,
                 ") to MNEMO_EXAMPLE_CONFIGS in examples/model_zoo.hpp and rebuild.");
}

}  // namespace mnemo::examples
