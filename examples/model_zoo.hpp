#pragma once
// The compiled-in model configurations of the example programs (mnemo_eval, train).
//
// mnemo fixes d_model, heads and the compression rate at compile time, so a program that reads them
// from a checkpoint or the command line carries a table of configurations and picks one at run time.
// To support another one, add ONE line to MNEMO_EXAMPLE_CONFIGS below: X(d_model, heads, rate).
// Transformer-XL and Feedback Transformer models (no compression) use the same table, matched on
// d_model and heads.
//
// The compression functions of nn/compression_extra.hpp (dilated convolutions, most-used) are compiled
// only for the configurations of MNEMO_EXAMPLE_EXTRA_COMPRESSION_CONFIGS (the trainer's text and recall
// defaults, and the tests'), not for every line above: each one is a whole model instantiation more.
// The runtime variants (GRU residuals, post-LN, memory layers, the auto-encoding loss) are options of
// compressive_options and cost no instantiation.
#include <algorithm>
#include <charconv>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

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

// X(d_model, heads, compression rate): also with dilated_conv_compression and most_used_compression.
// Each must be a line of MNEMO_EXAMPLE_CONFIGS; dilated needs a rate that is a power of two >= 2.
#define MNEMO_EXAMPLE_EXTRA_COMPRESSION_CONFIGS(X) \
    X(128, 4, 2) /* the reference experiment */    \
    X(64, 4, 2)  /* the recall task */             \
    X(16, 2, 2)  /* the trainer's ctests */

namespace mnemo::examples {

/// feedback: the original Feedback Transformer (per-layer keys/values); feedback_kv: shared keys/values.
enum class model_kind { compressive, xl, feedback, feedback_kv };
/// conv, max, mean: nn/compression.hpp; dilated, most_used: nn/compression_extra.hpp (fewer configurations).
enum class compression_kind { conv, max, mean, dilated, most_used };

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
    if (s == "dilated") return compression_kind::dilated;
    if (s == "most-used") return compression_kind::most_used;
    detail::fail("unknown --compression '", s, "' (expected conv, max, mean, dilated or most-used)");
}
/// The --compression spelling.
inline const char* name(compression_kind c) {
    switch (c) {
        case compression_kind::conv: return "conv";
        case compression_kind::max: return "max";
        case compression_kind::mean: return "mean";
        case compression_kind::dilated: return "dilated";
        case compression_kind::most_used: return "most-used";
    }
    return "?";
}

inline residual_kind parse_residual_kind(const std::string& s) {
    if (s == "add") return residual_kind::add;
    if (s == "gru") return residual_kind::gru;
    detail::fail("unknown --residual '", s, "' (expected add or gru)");
}
inline const char* name(residual_kind r) { return r == residual_kind::add ? "add" : "gru"; }
inline norm_kind parse_norm_kind(const std::string& s) {
    if (s == "pre") return norm_kind::pre;
    if (s == "post") return norm_kind::post;
    detail::fail("unknown --norm '", s, "' (expected pre or post)");
}
inline const char* name(norm_kind n) { return n == norm_kind::pre ? "pre" : "post"; }
inline reconstruction_kind parse_reconstruction_kind(const std::string& s) {
    if (s == "attention") return reconstruction_kind::attention;
    if (s == "autoencoding") return reconstruction_kind::autoencoding;
    detail::fail("unknown --reconstruction '", s, "' (expected attention or autoencoding)");
}
inline const char* name(reconstruction_kind r) {
    return r == reconstruction_kind::attention ? "attention" : "autoencoding";
}

/// "2,3,4" → {2, 3, 4}; "all" (or "") → {} (every layer). Sorted; repeats and negatives are errors.
inline std::vector<index_t> parse_memory_layers(const std::string& s, const std::string& what) {
    std::vector<index_t> out;
    if (s.empty() || s == "all") return out;
    std::size_t pos = 0;
    while (pos <= s.size()) {
        const std::size_t comma = std::min(s.find(',', pos), s.size());
        const std::string item = s.substr(pos, comma - pos);
        index_t l = -1;
        const auto [end, ec] = std::from_chars(item.data(), item.data() + item.size(), l);
        if (item.empty() || ec != std::errc() || end != item.data() + item.size() || l < 0)
            detail::fail(what, " expects layer indices separated by commas (e.g. 2,3,4) or 'all', got '", s, "'");
        out.push_back(l);
        pos = comma + 1;
    }
    std::sort(out.begin(), out.end());
    for (std::size_t i = 1; i < out.size(); ++i)
        if (out[i] == out[i - 1]) detail::fail(what, " lists layer ", out[i], " twice ('", s, "')");
    return out;
}
/// The canonical spelling: "all" for every layer, else the sorted indices joined by commas.
inline std::string format_memory_layers(const std::vector<index_t>& layers) {
    if (layers.empty()) return "all";
    std::string out;
    for (index_t l : layers) {
        if (!out.empty()) out += ',';
        out += std::to_string(l);
    }
    return out;
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

template <class A>
concept has_attention_weights = requires(const A& a) { a.attention_weights(); };

/// Whether (D, H, C) is a line of MNEMO_EXAMPLE_EXTRA_COMPRESSION_CONFIGS.
template <std::size_t D, std::size_t H, std::size_t C>
constexpr bool has_extra_compression() {
#define MNEMO_IS_EXTRA_CONFIG(D2, H2, C2) \
    if (D == D2 && H == H2 && C == C2) return true;
    MNEMO_EXAMPLE_EXTRA_COMPRESSION_CONFIGS(MNEMO_IS_EXTRA_CONFIG)
#undef MNEMO_IS_EXTRA_CONFIG
    return false;
}

/// The configurations compiled with dilated and most-used compression, for error messages.
inline std::string extra_compression_configs() {
    std::ostringstream os;
#define MNEMO_LIST_EXTRA_CONFIG(D, H, C) os << "  d_model " << D << ", heads " << H << ", compression rate " << C << "\n";
    MNEMO_EXAMPLE_EXTRA_COMPRESSION_CONFIGS(MNEMO_LIST_EXTRA_CONFIG)
#undef MNEMO_LIST_EXTRA_CONFIG
    return os.str();
}

/// with_model's dilated / most-used branch for config (D, H, C): instantiated only for the lines of
/// MNEMO_EXAMPLE_EXTRA_COMPRESSION_CONFIGS, an error for the others.
template <std::size_t D, std::size_t H, std::size_t C, class F>
auto with_extra_compression(compression_kind comp, F&& f)
    -> decltype(f.template operator()<compressive_transformer<float, config<D, H, C>, conv_compression>>()) {
    if constexpr (has_extra_compression<D, H, C>()) {
        if (comp == compression_kind::dilated) {
            if constexpr (C >= 2 && (C & (C - 1)) == 0)
                return f.template operator()<compressive_transformer<float, config<D, H, C>, dilated_conv_compression>>();
            else
                detail::fail("--compression dilated needs a compression rate that is a power of two >= 2, got ", C);
        }
        if constexpr (has_attention_weights<relative_attention<float, config<D, H, C>>>)
            return f.template operator()<compressive_transformer<float, config<D, H, C>, most_used_compression>>();
        else
            detail::fail("--compression most-used needs the attention weights of relative_attention "
                         "(attention_weights()), which this build of mnemo does not have");
    } else {
        detail::fail("--compression ", name(comp), " is compiled only for these configurations:\n",
                     extra_compression_configs(), "not for d_model ", D, ", heads ", H, ", compression rate ", C,
                     ". To add one, add the line X(", D, ", ", H, ", ", C,
                     ") to MNEMO_EXAMPLE_EXTRA_COMPRESSION_CONFIGS in examples/model_zoo.hpp and rebuild.");
    }
}

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
            case compression_kind::dilated:                                                                   \
            case compression_kind::most_used: return with_extra_compression<D, H, C>(comp, f);                \
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
