#pragma once
// The model configurations of the example programs (mnemo_eval, train).
//
// mnemo's fast path fixes d_model, heads and the compression rate at compile time, so a program that
// reads them from a checkpoint or the command line carries a table of configurations and picks one
// at run time: MNEMO_EXAMPLE_CONFIGS below, one line X(d_model, heads, rate) each. Transformer-XL and
// Feedback Transformer models (no compression) use the same table, matched on d_model and heads.
//
// Every other shape runs the runtime-shape model (config<dynamic, dynamic, dynamic>, mnemo::
// runtime_config): the same kernels with d_model, heads and the rate as runtime values, one
// instantiation per model kind and compression function, whatever the shape. with_model says so on
// stderr, once, naming the shapes compiled in; to make a shape fast, add its line to the table. The
// environment variable MNEMO_FORCE_DYNAMIC=1 sends every shape down the runtime-shape path (to compare
// the two, or to test it).
//
// The compression functions of nn/compression/dilated_conv.hpp and most_used.hpp are compiled
// only for the configurations of MNEMO_EXAMPLE_EXTRA_COMPRESSION_CONFIGS (the trainer's text and recall
// defaults, and the tests'), not for every line above: each one is a whole model instantiation more.
// The other lines run them through the runtime-shape model. The runtime variants (GRU residuals,
// post-LN, memory layers, the auto-encoding loss) are options of compressive_options and cost no
// instantiation.
#include <algorithm>
#include <charconv>
#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include <mnemo/models/compressive_transformer.hpp>
#include <mnemo/models/feedback_transformer.hpp>
#ifdef MNEMO_WITH_CUDA
#include <mnemo/cuda.hpp>
#endif

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
/// conv, max, mean: nn/compression/conv.hpp, pooling.hpp; dilated, most_used: nn/compression/dilated_conv.hpp, most_used.hpp (fewer configurations).
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

/// The shape with_model's runtime-shape fallback is building, for runtime_shape_model's constructor:
/// set while with_model's function runs, on this thread (null otherwise).
inline const model_shape*& requested_runtime_shape() {
    thread_local const model_shape* shape = nullptr;
    return shape;
}

/// The model type with_model hands its function for a shape that is not compiled in: Base, a model
/// over runtime_config, whose constructor takes the program's options as they are (vocab, layers, …)
/// and adds the shape with_model was asked for (d_model, heads, the compression rate). So a program
/// builds it exactly as it builds a compiled-in model: `Model model(options)` inside with_model's
/// function.
template <class Base>
class runtime_shape_model : public Base {
public:
    template <class Options>
    explicit runtime_shape_model(Options o) : Base(with_shape(std::move(o))) {}

private:
    template <class Options>
    static Options with_shape(Options o) {
        const model_shape* s = requested_runtime_shape();
        MNEMO_CHECK(s != nullptr, "runtime_shape_model: built outside the function with_model called (it takes "
                    "d_model, heads and the rate from there)");
        o.d_model = s->d_model;
        o.heads = s->heads;
        if constexpr (requires { o.compression_rate; }) o.compression_rate = s->compression_rate;
        return o;
    }
};

/// Whether Model is a Feedback Transformer (callers branch on it with `if constexpr`: its interface
/// has no memory object).
template <class Model>
inline constexpr bool is_feedback_model = false;
template <class T, class Config, class KV, class Backend>
inline constexpr bool is_feedback_model<feedback_transformer<T, Config, KV, Backend>> = true;
template <class Base>
inline constexpr bool is_feedback_model<runtime_shape_model<Base>> = is_feedback_model<Base>;

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

/// Why a shape runs the runtime-shape model (with_runtime_shape's note says it; on_gpu: every shape
/// does, see with_model_on, and no note is printed).
enum class runtime_shape_reason {
    not_compiled_in,    // no line of MNEMO_EXAMPLE_CONFIGS
    extra_compression,  // a line of it, but dilated / most-used are compiled for fewer
    forced,             // MNEMO_FORCE_DYNAMIC
    on_gpu              // --device cuda
};

template <class Backend = cpu, class F>
decltype(auto) with_runtime_shape(index_t d_model, index_t heads, index_t rate, model_kind kind, compression_kind comp,
                                  F&& f, runtime_shape_reason why);

/// with_model's dilated / most-used branch for config (D, H, C): instantiated only for the lines of
/// MNEMO_EXAMPLE_EXTRA_COMPRESSION_CONFIGS; the others run the runtime-shape model.
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
        return with_runtime_shape(index_t(D), index_t(H), index_t(C), model_kind::compressive, comp, f,
                                  runtime_shape_reason::extra_compression);
    }
}

/// The compiled-in shapes in one line, "128/4/2, 256/8/4, …" (d_model/heads/rate).
inline std::string compiled_in_shapes(bool extra_compression) {
    std::ostringstream os;
    const char* sep = "";
#define MNEMO_LIST_SHAPE(D, H, C) \
    os << sep << D << "/" << H << "/" << C; \
    sep = ", ";
    if (extra_compression) {
        MNEMO_EXAMPLE_EXTRA_COMPRESSION_CONFIGS(MNEMO_LIST_SHAPE)
    } else {
        MNEMO_EXAMPLE_CONFIGS(MNEMO_LIST_SHAPE)
    }
#undef MNEMO_LIST_SHAPE
    return os.str();
}

/// MNEMO_FORCE_DYNAMIC set (and not "0"): every shape runs the runtime-shape model.
inline bool force_runtime_shape() {
    const char* v = std::getenv("MNEMO_FORCE_DYNAMIC");
    return v != nullptr && *v != '\0' && std::string(v) != "0";
}

/// Whether the runtime-shape note was printed (once per program, whatever with_model is called with).
inline bool& runtime_shape_noted() {
    static bool said = false;
    return said;
}

/// with_model's fallback: f.template operator()<Model>() with the runtime-shape model of `kind` and
/// `comp` over Backend (one instantiation each, whatever the shape), after checking the shape; on the
/// CPU, says once per program, on stderr, that this shape runs the generic kernels, and why (which
/// shapes are compiled in).
template <class Backend, class F>
decltype(auto) with_runtime_shape(index_t d_model, index_t heads, index_t rate, model_kind kind, compression_kind comp,
                                  F&& f, runtime_shape_reason why) {
    const bool compresses = kind == model_kind::compressive;
    if (heads < 1) detail::fail("heads must be at least 1, got ", heads);
    if (d_model < 1 || d_model % heads != 0)
        detail::fail("d_model ", d_model, " does not split into ", heads,
                     " heads (d_model must be a multiple of heads)");
    if (compresses && rate < 1) detail::fail("the compression rate must be at least 1, got ", rate);
    if (compresses && comp == compression_kind::dilated && (rate < 2 || (rate & (rate - 1)) != 0))
        detail::fail("--compression dilated needs a compression rate that is a power of two >= 2, got ", rate);
    const model_shape shape{d_model, heads, compresses ? rate : 1};
    if (why != runtime_shape_reason::on_gpu && !runtime_shape_noted()) {
        runtime_shape_noted() = true;
        std::string what = "d_model " + std::to_string(d_model) + ", heads " + std::to_string(heads);
        if (compresses) what += ", compression rate " + std::to_string(rate);
        what += std::string(" (") + name(kind) + (compresses ? std::string(", ") + name(comp) : std::string()) + ")";
        const std::string reason =
            why == runtime_shape_reason::forced ? std::string("MNEMO_FORCE_DYNAMIC is set")
            : why == runtime_shape_reason::extra_compression
                ? std::string("--compression ") + name(comp) + " is compiled in for " + compiled_in_shapes(true) +
                      " only"
                : "compiled in: " + compiled_in_shapes(false);
        std::fprintf(stderr,
                     "mnemo: note: %s runs the generic kernels (runtime shape, slower than a compiled-in one; %s; "
                     "d_model/heads/rate, see examples/model_zoo.hpp)\n",
                     what.c_str(), reason.c_str());
    }
    // The shape runtime_shape_model's constructor reads, while f runs.
    struct scope {
        const model_shape* saved = requested_runtime_shape();
        explicit scope(const model_shape* s) { requested_runtime_shape() = s; }
        ~scope() { requested_runtime_shape() = saved; }
        scope(const scope&) = delete;
        scope& operator=(const scope&) = delete;
    } in_scope(&shape);
    // One instantiation per model kind and compression function.
    using dyn = runtime_config;
    auto run = [&]<class Base>() { return f.template operator()<runtime_shape_model<Base>>(); };
    switch (kind) {
        case model_kind::xl: return run.template operator()<compressive_transformer<float, dyn, no_compression, Backend>>();
        case model_kind::feedback: return run.template operator()<feedback_transformer<float, dyn, per_layer_kv, Backend>>();
        case model_kind::feedback_kv: return run.template operator()<feedback_transformer<float, dyn, shared_kv, Backend>>();
        case model_kind::compressive: break;
    }
    switch (comp) {
        case compression_kind::conv:
            return run.template operator()<compressive_transformer<float, dyn, conv_compression, Backend>>();
        case compression_kind::max:
            return run.template operator()<compressive_transformer<float, dyn, max_pool_compression, Backend>>();
        case compression_kind::mean:
            return run.template operator()<compressive_transformer<float, dyn, mean_pool_compression, Backend>>();
        case compression_kind::dilated:
            return run.template operator()<compressive_transformer<float, dyn, dilated_conv_compression, Backend>>();
        case compression_kind::most_used: break;
    }
    return run.template operator()<compressive_transformer<float, dyn, most_used_compression, Backend>>();
}

/// Calls f.template operator()<Model>() with the model type for (d_model, heads, rate, kind,
/// compression), T = float; Transformer-XL and the Feedback Transformers ignore rate and compression.
/// A compiled-in shape gets its own instantiation (the fast path); any other, or every one with
/// MNEMO_FORCE_DYNAMIC=1, the runtime-shape model (with_runtime_shape), which f builds from its
/// options as any other. Throws a mnemo::error for a shape no model can have (heads not dividing
/// d_model, a rate below 1, dilated compression at a rate that is not a power of two).
template <class F>
decltype(auto) with_model(index_t d_model, index_t heads, index_t rate, model_kind kind, compression_kind comp, F&& f) {
    if (force_runtime_shape())
        return with_runtime_shape(d_model, heads, rate, kind, comp, f, runtime_shape_reason::forced);
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
    return with_runtime_shape(d_model, heads, rate, kind, comp, f, runtime_shape_reason::not_compiled_in);
}

/// Where a program runs its model: --device cpu|cuda.
enum class device_kind { cpu, cuda };

inline device_kind parse_device_kind(const std::string& s) {
    if (s == "cpu") return device_kind::cpu;
    if (s == "cuda") return device_kind::cuda;
    detail::fail("unknown --device '", s, "' (expected cpu or cuda)");
}
inline const char* name(device_kind d) { return d == device_kind::cpu ? "cpu" : "cuda"; }

/// Whether this program was built with the CUDA backend (examples/CMakeLists.txt defines
/// MNEMO_WITH_CUDA and links mnemo::cuda when it is built).
inline constexpr bool built_with_cuda =
#ifdef MNEMO_WITH_CUDA
    true;
#else
    false;
#endif

/// Throws the one-line reason --device cuda cannot run here: a build without the CUDA backend, or
/// no usable GPU (CUDA's own message).
inline void check_device(device_kind d) {
    if (d == device_kind::cpu) return;
#ifdef MNEMO_WITH_CUDA
    if (!cuda_runtime::available())
        detail::fail("--device cuda: ", cuda_runtime::describe(), " (use --device cpu)");
#else
    detail::fail("--device cuda: this program was built without the CUDA backend (configure mnemo where nvcc is "
                 "found, e.g. /usr/local/cuda/bin/nvcc, or with -DMNEMO_CUDA=ON)");
#endif
}

/// with_model on `device`. On the GPU every shape runs the runtime-shape model over mnemo::cuda: the
/// CUDA kernels take every extent at run time, so a compiled-in shape would gain nothing there.
template <class F>
decltype(auto) with_model_on(device_kind device, index_t d_model, index_t heads, index_t rate, model_kind kind,
                             compression_kind comp, F&& f) {
    check_device(device);
#ifdef MNEMO_WITH_CUDA
    if (device == device_kind::cuda)
        return with_runtime_shape<mnemo::cuda>(d_model, heads, rate, kind, comp, f, runtime_shape_reason::on_gpu);
#endif
    return with_model(d_model, heads, rate, kind, comp, f);
}

}  // namespace mnemo::examples
