#pragma once
// The compiled-in model configurations of the example programs (mnemo_eval, train).
//
// mnemo fixes d_model, heads and the compression rate at compile time, so a program that reads them
// from a checkpoint or the command line carries a table of configurations and picks one at run time.
// To support another one, add ONE line to MNEMO_EXAMPLE_CONFIGS below: X(d_model, heads, rate).
// Transformer-XL and Feedback Transformer models (no compression) use the same table, matched on
// d_model and heads.
#include <sstream>
#include <string>
#include <utility>

#include <mnemo/models/compressive_transformer.hpp>
#include <mnemo/models/feedback_transformer.hpp>

// X(d_model, heads, compression rate)
#define MNEMO_EXAMPLE_CONFIGS(X) \
    X(128, 4, 2) /* the reference experiment (labml, Tiny Shakespeare) */ \
    X(256, 8, 4)                                                          \
    X(512, 8, 4) /* and the reference feedback experiment (512, 8) */     \
    X(64, 4, 2) /* the main job's synthetic task */                       \
    X(16, 2, 2) /* tests/golden compressive_tiny, xl_tiny */              \
    X(12, 3, 3) /* tests/golden compressive_odd */

namespace mnemo::examples {

/// feedback: the original Feedback Transformer (per-layer keys/values); feedback_kv: shared keys/values.
enum class model_kind { compressive, xl, feedback, feedback_kv };
enum class compression_kind { conv, max, mean };

inline model_kind parse_model_kind(const std::string& s) {
    if (s == "compressive") return model_kind::compressive;
    if (s == "xl") return model_kind::xl;
    if (s == "feedback") return model_kind::feedback;
    if (s == "feedback-kv") return model_kind::feedback_kv;
    detail::fail("unknown --model '", s, "' (expected compressive, xl, feedback or feedback-kv)");
}
/// The --model spelling.
inline const char* name(model_kind k) {
    switch (k) {
        case model_kind::compressive: return "compressive";
        case model_kind::xl: return "xl";
        case model_kind::feedback: return "feedback";
        case model_kind::feedback_kv: return "feedback-kv";
    }
    return "?";
}
/// Feedback Transformers carry no memory from one sequence to the next and have no compression.
inline bool is_feedback(model_kind k) { return k == model_kind::feedback || k == model_kind::feedback_kv; }
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

/// Whether Model is a Feedback Transformer (callers branch on it with `if constexpr`: its interface
/// has no memory object).
template <class Model>
inline constexpr bool is_feedback_model = false;
template <class T, class Config, class KV, class Backend>
inline constexpr bool is_feedback_model<feedback_transformer<T, Config, KV, Backend>> = true;

/// Calls f.template operator()<Model>() with the model type for (d_model, heads, rate, kind,
/// compression), T = float; Transformer-XL and the Feedback Transformers ignore rate and compression.
/// Throws a mnemo::error listing the supported configurations otherwise.
template <class F>
decltype(auto) with_model(index_t d_model, index_t heads, index_t rate, model_kind kind, compression_kind comp, F&& f) {
#define MNEMO_DISPATCH_CONFIG(D, H, C)                                                                          \
    if (d_model == D && heads == H && kind == model_kind::xl)                                                 \
        return f.template operator()<compressive_transformer<float, config<D, H, 1>, no_compression>>();     \
    if (d_model == D && heads == H && kind == model_kind::feedback)                                           \
        return f.template operator()<feedback_transformer<float, config<D, H>, per_layer_kv>>();             \
    if (d_model == D && heads == H && kind == model_kind::feedback_kv)                                        \
        return f.template operator()<feedback_transformer<float, config<D, H>, shared_kv>>();                \
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
    const bool compresses = kind == model_kind::compressive;
    detail::fail("no compiled-in configuration for d_model ", d_model, ", heads ", heads,
                 compresses ? ", compression rate " + std::to_string(rate) : std::string(), ". Supported",
                 compresses ? "" : " (the compression rate does not matter for this model)", ":\n",
                 supported_configs(), "To add one, add the line X(", d_model, ", ", heads, ", ", compresses ? rate : 1,
                 ") to MNEMO_EXAMPLE_CONFIGS in examples/model_zoo.hpp and rebuild.");
}

}  // namespace mnemo::examples
