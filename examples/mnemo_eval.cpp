// mnemo_eval: evaluates a Compressive Transformer / Transformer-XL / Feedback Transformer checkpoint
// over a token file and writes the logits and losses, so that mnemo can be checked against a PyTorch
// model holding the same weights. Its Python twins are tools/reference_eval.py (compressive, xl) and
// tools/reference/feedback.py (feedback, feedback-kv), with the same flags and the same output file;
// tools/check_eval_parity.sh runs both on random checkpoints and compares.
//
//   mnemo_eval --model compressive|xl --checkpoint W.safetensors --tokens T.safetensors --out O.safetensors
//              --seq-len N --mem-len M --c-mem-len K [--compression conv|max|mean|dilated|most-used]
//              [--rate C] [--n-pos P] [--clamp-len L] [--residual add|gru] [--norm pre|post]
//              [--memory-layers L] [--reconstruction attention|autoencoding]
//   mnemo_eval --model feedback|feedback-kv --checkpoint W.safetensors --tokens T.safetensors
//              --out O.safetensors --seq-len N [--n-pos P]
//   either form: [--device cpu|cuda] (cuda: the GPU, in a build with the CUDA backend; every shape
//              then runs the runtime-shape model, see examples/model_zoo.hpp's with_model_on)
//
// The sizes come from the checkpoint's shapes (labml's state_dict names):
//   vocab, d_model   src_embed.weight [vocab, D]
//   n_layers         the number of transformer.layers.<l> prefixes
//   d_ff             transformer.layers.0.feed_forward.layer1.weight [d_ff, D]
//   heads, P         transformer.layers.0.self_attn.key_pos_bias [2P, heads]
//                    (feedback: transformer.layers.0.attn.key_pos_bias [P, heads])
//   rate             transformer.layers.<l>.compress.conv.weight [D, D, rate] (the first layer that has
//                    one), or 2^k for k dilated convolutions compress.convs.<k>; without conv weights
//                    (max/mean pooling, most-used) --rate or "__metadata__" compression_rate
// The model's variants (README "Model variants"; the train program saves them in "__metadata__"):
// each comes from its flag, else the metadata (a flag that disagrees with it is an error), else the
// tensors where they tell (gate_attn tensors: --residual gru; decoder tensors: --reconstruction
// autoencoding; compress.convs.*: --compression dilated; the layers with compress.* conv tensors:
// --memory-layers), else the reference's choice (add, pre, every layer, attention, conv). --norm cannot
// be told from the tensors (pre- and post-LN have the same ones): a post-LN checkpoint without metadata
// needs --norm post. With --reconstruction autoencoding, ar_loss holds the auto-encoding loss.
// d_model, heads and the rate are compile-time in mnemo, so the program picks one of the
// configurations compiled in from examples/model_zoo.hpp (feedback models match on d_model and heads).
// The feedback variant must match the checkpoint: feedback has per-layer key/value projections
// (transformer.layers.<l>.attn.key.linear.weight), feedback-kv shared ones (transformer.key.linear.weight).
//
// Segment s (of n_segments = (n_tokens − 1) / N) reads tokens[:, s·N, s·N + N) and predicts
// tokens[:, s·N + 1, s·N + N + 1). Compressive / XL: the memory is carried across segments and merged
// (compressing the overflow) after each, exactly as in training; "--c-mem-len 0" is Transformer-XL for
// either model. Feedback: every segment starts from an empty memory, as the reference trains (no state
// is carried); --mem-len and --c-mem-len may be left out or given as 0. The memory lengths (and
// --clamp-len) are evaluation settings, independent of the ones the checkpoint was trained with: no
// parameter depends on them, only the positional tables bound them (c_mem + mem + seq <= P).
//
// O.safetensors: logits F32 [n_segments, batch, N, vocab], ce_loss F32 [n_segments] (mean over the
// batch·N positions), ar_loss F32 [n_segments] (attention reconstruction; 0 where nothing was compressed,
// and always 0 for the feedback models, which have none: written so that every model's file has the
// same tensors).
#include <algorithm>
#include <charconv>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <iterator>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include <mnemo/models/compressive_transformer.hpp>
#include <mnemo/io/safetensors.hpp>

#include "cli.hpp"
#include "model_zoo.hpp"

namespace {

using mnemo::index_t;
using mnemo::token_t;
using mnemo::detail::fail;
namespace ex = mnemo::examples;

constexpr const char* usage =
    "mnemo_eval: evaluates a Compressive Transformer (or Transformer-XL: --model xl, or --c-mem-len 0) checkpoint "
    "with labml's parameter names over consecutive segments of N tokens, carrying the memory, or a Feedback "
    "Transformer checkpoint with every segment from an empty memory, and writes logits [n_segments, batch, N, vocab], "
    "ce_loss [n_segments] and ar_loss [n_segments] (F32; ar_loss is 0 for the feedback models).\n"
    "Required: --model, --checkpoint, --tokens, --out, --seq-len, and for compressive / xl --mem-len and --c-mem-len.";

struct options {
    ex::model_kind model = ex::model_kind::compressive;
    std::string checkpoint, tokens, out;
    index_t seq_len = 0, mem_len = 0, c_mem_len = 0;
    std::optional<ex::compression_kind> compression;  // resolved against the checkpoint (resolve_variants)
    std::optional<index_t> rate, n_pos;
    // The variants as given on the command line (resolved against the checkpoint in resolve_variants).
    std::optional<std::string> residual, norm, memory_layers, reconstruction;
    index_t clamp_len = 0;  // 0: off
    ex::device_kind device = ex::device_kind::cpu;
};

// The compressive / XL model's variants, resolved.
struct variants {
    ex::compression_kind compression = ex::compression_kind::conv;
    mnemo::residual_kind residual = mnemo::residual_kind::add;
    mnemo::norm_kind norm = mnemo::norm_kind::pre;
    std::vector<index_t> memory_layers;  // empty: every layer
    mnemo::reconstruction_kind reconstruction = mnemo::reconstruction_kind::attention;
};

// A whole decimal integer (no sign other than '-', no trailing characters), else an error naming
// where it came from.
index_t parse_integer(const std::string& s, const std::string& what) {
    const auto x = ex::whole_integer(s);
    if (!x) fail("mnemo_eval: ", what, " expects an integer, got '", s, "'");
    return index_t(*x);
}

options parse(int argc, char** argv) {
    static constexpr const char* flags[] = {"--model", "--checkpoint", "--tokens", "--out", "--seq-len", "--mem-len",
                                            "--c-mem-len", "--compression", "--rate", "--n-pos", "--clamp-len",
                                            "--residual", "--norm", "--memory-layers", "--reconstruction", "--device"};
    ex::command_line cl;
    const std::map<std::string, std::string> help = {
        {"--checkpoint", "weights (safetensors); the sizes are read from the tensor shapes"},
        {"--seq-len", "N, tokens per segment"},
        {"--mem-len", "M, memory slots kept (feedback: none are kept, 0 or left out)"},
        {"--c-mem-len", "K, compressed memory slots kept (0 is Transformer-XL; feedback: 0 or left out); M and K need "
                        "not be the training run's: any lengths with K + M + N <= P work"},
        {"--rate", "compression rate for max/mean pooling when the checkpoint's __metadata__ has no compression_rate "
                   "(must agree with it, and with the conv kernel, where present)"},
        {"--n-pos", "relative positions P; read from the checkpoint, and an error if given and different"},
        {"--compression", "conv, max, mean, dilated, most-used; default: the checkpoint's __metadata__ compression, "
                          "else dilated for a checkpoint with compress.convs.* tensors, else conv"},
    };
    if (!ex::parse_command_line("mnemo_eval", usage, flags, argc, argv, cl,
                                "Model shapes compiled in (others run the generic kernels):\n" + ex::supported_configs(),
                                help))
        std::exit(0);
    std::map<std::string, std::string> given = cl.given;
    for (const char* required : {"--model", "--checkpoint", "--tokens", "--out", "--seq-len"})
        if (!given.count(required)) fail("mnemo_eval: missing required option ", required, " (try --help)");

    options o;
    o.model = ex::parse_model_kind(given["--model"]);
    const bool feedback = ex::is_feedback(o.model);
    if (feedback) {
        // No memory is carried and nothing is compressed: 0 (as a uniform command line may pass) or nothing.
        for (const char* flag : {"--mem-len", "--c-mem-len"})
            if (given.count(flag) && parse_integer(given[flag], flag) != 0)
                fail("mnemo_eval: --model ", ex::name(o.model), " carries no memory between segments (each starts ",
                     "from an empty memory): ", flag, " must be 0 or left out, got ", given[flag]);
        for (const char* flag : {"--compression", "--rate"})
            if (given.count(flag))
                fail("mnemo_eval: --model ", ex::name(o.model), " has no compression: ", flag, " does not apply");
        for (const char* flag : {"--residual", "--norm", "--memory-layers", "--reconstruction"})
            if (given.count(flag))
                fail("mnemo_eval: --model ", ex::name(o.model), " has none of the compressive model's variants: ",
                     flag, " does not apply");
        if (given.count("--clamp-len"))
            fail("mnemo_eval: --clamp-len applies to the compressive and xl models only, not --model ", ex::name(o.model));
        given.try_emplace("--mem-len", "0");
        given.try_emplace("--c-mem-len", "0");
    }
    for (const char* required : {"--mem-len", "--c-mem-len"})
        if (!given.count(required)) fail("mnemo_eval: missing required option ", required, " (try --help)");
    o.checkpoint = given["--checkpoint"];
    o.tokens = given["--tokens"];
    o.out = given["--out"];
    o.seq_len = parse_integer(given["--seq-len"], "--seq-len");
    o.mem_len = parse_integer(given["--mem-len"], "--mem-len");
    o.c_mem_len = parse_integer(given["--c-mem-len"], "--c-mem-len");
    if (given.count("--compression")) o.compression = ex::parse_compression_kind(given["--compression"]);
    if (given.count("--residual")) o.residual = ex::name(ex::parse_residual_kind(given["--residual"]));
    if (given.count("--norm")) o.norm = ex::name(ex::parse_norm_kind(given["--norm"]));
    if (given.count("--memory-layers"))
        o.memory_layers = ex::format_memory_layers(ex::parse_memory_layers(given["--memory-layers"], "--memory-layers"));
    if (given.count("--reconstruction"))
        o.reconstruction = ex::name(ex::parse_reconstruction_kind(given["--reconstruction"]));
    if (given.count("--rate")) o.rate = parse_integer(given["--rate"], "--rate");
    if (given.count("--n-pos")) o.n_pos = parse_integer(given["--n-pos"], "--n-pos");
    if (given.count("--clamp-len")) o.clamp_len = parse_integer(given["--clamp-len"], "--clamp-len");
    if (given.count("--device")) o.device = ex::parse_device_kind(given["--device"]);
    ex::check_device(o.device);  // before the checkpoint is read
    if (o.clamp_len < 0) fail("mnemo_eval: --clamp-len must be >= 0 (0: off), got ", o.clamp_len);
    if (o.seq_len < 1) fail("mnemo_eval: --seq-len must be at least 1, got ", o.seq_len);
    if (o.mem_len < 0) fail("mnemo_eval: --mem-len must be >= 0, got ", o.mem_len);
    if (o.c_mem_len < 0) fail("mnemo_eval: --c-mem-len must be >= 0, got ", o.c_mem_len);
    if (o.rate && *o.rate < 1) fail("mnemo_eval: --rate must be at least 1, got ", *o.rate);
    if (o.n_pos && *o.n_pos < 1) fail("mnemo_eval: --n-pos must be at least 1, got ", *o.n_pos);
    if (o.model == ex::model_kind::xl && o.c_mem_len != 0)
        fail("mnemo_eval: --model xl is Transformer-XL: --c-mem-len must be 0, got ", o.c_mem_len);
    return o;
}

// The sizes a checkpoint implies, read from its tensor shapes.
struct model_sizes {
    index_t vocab = 0, d_model = 0, n_layers = 0, d_ff = 0, heads = 0, n_pos = 0;
    std::optional<index_t> conv_rate;     // kernel of the first transformer.layers.<l>.compress.conv.weight
    std::optional<index_t> dilated_rate;  // 2^k for compress.convs.0 … k−1 (dilated convolutions)
};

// The model family, as the error messages name it.
const char* family(ex::model_kind k) {
    return ex::is_feedback(k) ? "Feedback Transformer" : "Compressive Transformer / Transformer-XL";
}

const mnemo::safetensors_tensor& shaped(const mnemo::safetensors_file& f, const std::string& name, std::size_t rank,
                                        ex::model_kind kind) {
    const mnemo::safetensors_tensor* t = f.find(name);
    if (!t)
        fail("mnemo_eval: checkpoint '", f.path(), "' has no tensor '", name, "' (is it a ", family(kind),
             " checkpoint with labml's parameter names?)");
    if (t->shape.size() != rank)
        fail("mnemo_eval: tensor '", name, "' in '", f.path(), "' has shape ", mnemo::shape_string(t->shape),
             ", expected rank ", rank);
    return *t;
}

// The layer index of a name "transformer.layers.<l>.<rest>", or nothing.
std::optional<index_t> layer_index(const std::string& name) {
    static const std::string prefix = "transformer.layers.";
    if (name.rfind(prefix, 0) != 0) return std::nullopt;
    const char* first = name.data() + prefix.size();
    const char* last = name.data() + name.size();
    index_t l = 0;
    const auto [end, ec] = std::from_chars(first, last, l);
    if (ec != std::errc() || end == last || *end != '.') return std::nullopt;
    return l;
}

model_sizes read_sizes(const mnemo::safetensors_file& f, ex::model_kind kind) {
    model_sizes s;
    const auto& embed = shaped(f, "src_embed.weight", 2, kind);
    s.vocab = index_t(embed.shape[0]);
    s.d_model = index_t(embed.shape[1]);
    for (const auto& t : f.tensors())
        if (const auto l = layer_index(t.name)) s.n_layers = std::max(s.n_layers, *l + 1);
    if (s.n_layers == 0) fail("mnemo_eval: checkpoint '", f.path(), "' has no transformer.layers.<l>.* tensors");
    s.d_ff = index_t(shaped(f, "transformer.layers.0.feed_forward.layer1.weight", 2, kind).shape[0]);
    if (ex::is_feedback(kind)) {  // the feedback tables have P rows (distances 1 … P), not 2P
        const auto& bias = shaped(f, "transformer.layers.0.attn.key_pos_bias", 2, kind);
        s.n_pos = index_t(bias.shape[0]);
        s.heads = index_t(bias.shape[1]);
        return s;
    }
    const auto& bias = shaped(f, "transformer.layers.0.self_attn.key_pos_bias", 2, kind);
    if (bias.shape[0] % 2 != 0)
        fail("mnemo_eval: tensor 'transformer.layers.0.self_attn.key_pos_bias' in '", f.path(), "' has shape ",
             mnemo::shape_string(bias.shape), ": its first dimension must be 2·n_pos (even)");
    s.n_pos = index_t(bias.shape[0] / 2);
    s.heads = index_t(bias.shape[1]);
    // The first layer with compression weights (with --memory-layers, layer 0 may have none).
    for (index_t l = 0; l < s.n_layers && !s.conv_rate && !s.dilated_rate; ++l) {
        const std::string p = "transformer.layers." + std::to_string(l) + ".compress.";
        if (f.contains(p + "conv.weight")) s.conv_rate = index_t(shaped(f, p + "conv.weight", 3, kind).shape[2]);
        index_t k = 0;
        while (f.contains(p + "convs." + std::to_string(k) + ".weight")) ++k;
        if (k > 0) s.dilated_rate = index_t(1) << k;
    }
    return s;
}

// The feedback variant must be the checkpoint's: each has key projections the other lacks.
void check_feedback_variant(const options& o, const mnemo::safetensors_file& f) {
    static const std::string shared = "transformer.key.linear.weight",
                             per_layer = "transformer.layers.0.attn.key.linear.weight";
    const bool want_shared = o.model == ex::model_kind::feedback_kv;
    const std::string& need = want_shared ? shared : per_layer;
    if (f.contains(need)) return;
    const std::string& other = want_shared ? per_layer : shared;
    fail("mnemo_eval: --model ", ex::name(o.model), " needs the ", want_shared ? "shared" : "per-layer",
         " key projection '", need, "', which checkpoint '", f.path(), "' does not have",
         f.contains(other) ? std::string(" (it has '") + other + "': a " +
                                 (want_shared ? "per-layer (--model feedback)" : "shared-KV (--model feedback-kv)") +
                                 " checkpoint)"
                           : std::string());
}

// The compression rate: the conv kernel, --rate and the metadata must agree where present. A model
// that never compresses (c_mem_len 0) needs none, so std::nullopt is allowed then.
std::optional<index_t> resolve_rate(const options& o, const model_sizes& s, const mnemo::safetensors_file& f,
                                    bool compresses, ex::compression_kind comp) {
    std::optional<index_t> meta;
    if (const auto it = f.metadata().find("compression_rate"); it != f.metadata().end())
        meta = parse_integer(it->second, "the checkpoint's __metadata__ compression_rate");
    if (s.conv_rate && meta && *s.conv_rate != *meta)
        fail("mnemo_eval: checkpoint '", f.path(), "': __metadata__ compression_rate ", *meta,
             " disagrees with the conv kernel size ", *s.conv_rate);
    if (o.rate && s.conv_rate && *o.rate != *s.conv_rate)
        fail("mnemo_eval: --rate ", *o.rate, " disagrees with the checkpoint's conv kernel size ", *s.conv_rate);
    if (o.rate && meta && *o.rate != *meta)
        fail("mnemo_eval: --rate ", *o.rate, " disagrees with the checkpoint's __metadata__ compression_rate ", *meta);
    if (s.dilated_rate && o.rate && *o.rate != *s.dilated_rate)
        fail("mnemo_eval: --rate ", *o.rate, " disagrees with the checkpoint's ", *s.dilated_rate,
             " (its dilated convolutions compress.convs.*)");
    const std::optional<index_t> rate = s.conv_rate      ? s.conv_rate
                                        : s.dilated_rate ? s.dilated_rate
                                        : o.rate         ? o.rate
                                                         : meta;
    if (compresses && comp == ex::compression_kind::conv && !s.conv_rate)
        fail("mnemo_eval: --compression conv needs transformer.layers.<l>.compress.conv.weight / .bias in '",
             f.path(), "' (for a checkpoint without them pass --compression max or mean)");
    if (compresses && comp == ex::compression_kind::dilated && !s.dilated_rate)
        fail("mnemo_eval: --compression dilated needs transformer.layers.<l>.compress.convs.<k>.weight / .bias in '",
             f.path(), "'");
    if (compresses && !rate)
        fail("mnemo_eval: --compression ", ex::name(comp), ": the compression rate is not in '", f.path(),
             "' (no conv weights, no __metadata__ compression_rate); pass it with --rate C");
    return rate;
}

// Compression weights the chosen model does not read (pooling, or Transformer-XL), as the reference
// skips them: transformer.layers.<l>.compress.conv.weight / .bias, .compress.convs.<k>.weight / .bias
// (dilated), and the auto-encoding decoder's .decoder.weight / .bias (a loss, not part of the forward).
bool unused_conv_weight(const std::string& name) {
    if (!layer_index(name)) return false;
    const auto tail = name.substr(name.find('.', std::string("transformer.layers.").size()));
    if (tail == ".compress.conv.weight" || tail == ".compress.conv.bias") return true;
    if (tail == ".decoder.weight" || tail == ".decoder.bias") return true;
    static const std::string convs = ".compress.convs.";
    if (tail.rfind(convs, 0) != 0) return false;
    const std::string rest = tail.substr(convs.size());  // "<k>.weight" or "<k>.bias"
    const auto dot = rest.find('.');
    return dot != std::string::npos && dot > 0 && rest.find_first_not_of("0123456789") == dot &&
           (rest.substr(dot) == ".weight" || rest.substr(dot) == ".bias");
}

// One variant: its flag, else the checkpoint's metadata (a disagreement is an error), else `inferred`
// (what the tensors show), else the reference's choice. Values are compared in canonical spelling.
template <class Canonical>
std::string resolve_variant(const std::optional<std::string>& flag, const char* flag_name,
                            const mnemo::safetensors_file& f, const char* key, Canonical canonical,
                            const std::optional<std::string>& inferred, const std::string& fallback) {
    std::optional<std::string> meta;
    if (const auto it = f.metadata().find(key); it != f.metadata().end())
        meta = canonical(it->second, std::string("the checkpoint's __metadata__ ") + key);
    if (flag && meta && *flag != *meta)
        fail("mnemo_eval: ", flag_name, " ", *flag, " disagrees with the checkpoint's __metadata__ ", key, " ", *meta);
    return flag ? *flag : meta ? *meta : inferred ? *inferred : fallback;
}

variants resolve_variants(const options& o, const model_sizes& sz, const mnemo::safetensors_file& f) {
    variants v;
    const auto layer_has = [&](index_t l, const std::string& tail) {
        return f.contains("transformer.layers." + std::to_string(l) + "." + tail);
    };
    const auto some = [](bool b, const char* value) { return b ? std::optional<std::string>(value) : std::nullopt; };
    v.compression = ex::parse_compression_kind(resolve_variant(
        o.compression ? std::optional<std::string>(ex::name(*o.compression)) : std::nullopt, "--compression", f,
        "compression",
        [](const std::string& s, const std::string&) { return std::string(ex::name(ex::parse_compression_kind(s))); },
        some(sz.dilated_rate.has_value(), "dilated"), "conv"));
    v.residual = ex::parse_residual_kind(resolve_variant(
        o.residual, "--residual", f, "residual",
        [](const std::string& s, const std::string&) { return std::string(ex::name(ex::parse_residual_kind(s))); },
        some(layer_has(0, "gate_attn.weight_ih"), "gru"), "add"));
    v.norm = ex::parse_norm_kind(resolve_variant(
        o.norm, "--norm", f, "norm",
        [](const std::string& s, const std::string&) { return std::string(ex::name(ex::parse_norm_kind(s))); },
        std::nullopt, "pre"));
    // The memory layers show as the layers with compression weights (conv or dilated), when some have none.
    std::vector<index_t> with;
    for (index_t l = 0; l < sz.n_layers; ++l)
        if (layer_has(l, "compress.conv.weight") || layer_has(l, "compress.convs.0.weight")) with.push_back(l);
    v.memory_layers = ex::parse_memory_layers(
        resolve_variant(o.memory_layers, "--memory-layers", f, "memory_layers",
                        [](const std::string& s, const std::string& what) {
                            return ex::format_memory_layers(ex::parse_memory_layers(s, what));
                        },
                        !with.empty() && index_t(with.size()) < sz.n_layers
                            ? std::optional<std::string>(ex::format_memory_layers(with))
                            : std::nullopt,
                        "all"),
        "--memory-layers");
    for (index_t l : v.memory_layers)
        if (l >= sz.n_layers) fail("mnemo_eval: memory layer ", l, " is not one of the checkpoint's ", sz.n_layers, " layers");
    bool decoder = false;
    for (index_t l = 0; l < sz.n_layers; ++l) decoder = decoder || layer_has(l, "decoder.weight");
    v.reconstruction = ex::parse_reconstruction_kind(resolve_variant(
        o.reconstruction, "--reconstruction", f, "reconstruction",
        [](const std::string& s, const std::string&) { return std::string(ex::name(ex::parse_reconstruction_kind(s))); },
        some(decoder, "autoencoding"), "attention"));
    return v;
}


// Tokens [batch, n_tokens] from the tokens file, checked against the vocabulary.
struct token_matrix {
    index_t batch = 0, length = 0;
    std::vector<std::int64_t> ids;  // [batch, length] row-major
};

token_matrix read_tokens(const std::string& path, index_t vocab) {
    const mnemo::safetensors_file f = mnemo::read_safetensors(path);
    const mnemo::safetensors_tensor* t = f.find("tokens");
    if (!t) fail("mnemo_eval: '", path, "' has no tensor named 'tokens' (expected I64 or I32 [batch, n_tokens])");
    if (t->type != mnemo::dtype::i64 && t->type != mnemo::dtype::i32)
        fail("mnemo_eval: tensor 'tokens' in '", path, "' has dtype ", mnemo::dtype_name(t->type),
             "; expected I64 or I32");
    if (t->shape.size() != 2)
        fail("mnemo_eval: tensor 'tokens' in '", path, "' has shape ", mnemo::shape_string(t->shape),
             "; expected [batch, n_tokens]");
    token_matrix m;
    m.batch = index_t(t->shape[0]);
    m.length = index_t(t->shape[1]);
    if (m.batch < 1) fail("mnemo_eval: tensor 'tokens' in '", path, "' has batch 0");
    m.ids = f.to_vector<std::int64_t>("tokens");
    for (std::size_t i = 0; i < m.ids.size(); ++i)
        if (m.ids[i] < 0 || m.ids[i] >= vocab)
            fail("mnemo_eval: token ", m.ids[i], " at [", index_t(i) / m.length, ", ", index_t(i) % m.length,
                 "] of '", path, "' is outside the checkpoint's vocabulary [0, ", vocab, ")");
    return m;
}

// Key positions each segment attends over, from the memory lengths the merges leave (mirrors
// compressive_memory::merge with integers only), so that a run too long for the checkpoint's
// positional tables fails before any work, naming the segment — exactly when the reference fails.
void check_positions(const options& o, index_t rate, index_t n_pos, index_t n_segments) {
    index_t mem = 0, c_mem = 0;
    for (index_t s = 0; s < n_segments; ++s) {
        const index_t keys = c_mem + mem + o.seq_len;
        if (keys > n_pos)
            fail("mnemo_eval: segment ", s, " attends over ", keys, " positions (compressed memory ", c_mem,
                 " + memory ", mem, " + segment ", o.seq_len, ") but the checkpoint's positional tables cover n_pos = ",
                 n_pos, "; shorten --seq-len, --mem-len or --c-mem-len");
        const index_t m = mem + o.seq_len;
        if (o.c_mem_len == 0) {
            mem = std::min(m, o.mem_len);
        } else if (m <= o.mem_len) {
            mem = m;
        } else {
            const index_t old = (m - o.mem_len + rate - 1) / rate * rate;
            mem = m - old;
            c_mem = std::min(c_mem + old / rate, o.c_mem_len);
        }
    }
}

// A feedback segment of N tokens attends over N − 1 memory slots at its last step (distances 1 … N − 1).
void check_feedback_positions(const options& o, index_t n_pos) {
    if (o.seq_len - 1 > n_pos)
        fail("mnemo_eval: a segment of ", o.seq_len, " tokens attends over ", o.seq_len - 1,
             " memory slots at its last step, but the checkpoint's positional tables cover n_pos = ", n_pos,
             "; shorten --seq-len to at most ", n_pos + 1);
}

struct eval_result {
    std::vector<float> logits;  // [n_segments, batch, N, vocab]
    std::vector<float> ce, ar;  // [n_segments]
};

// The model's construction options from the checkpoint's sizes and the variants.
template <class Model>
auto model_options(const model_sizes& sz, const variants& v) {
    if constexpr (ex::is_feedback_model<Model>)
        return mnemo::feedback_options{.vocab = sz.vocab, .n_layers = sz.n_layers, .d_ff = sz.d_ff, .n_pos = sz.n_pos};
    else
        return mnemo::compressive_options{.vocab = sz.vocab,
                                          .n_layers = sz.n_layers,
                                          .d_ff = sz.d_ff,
                                          .n_pos = sz.n_pos,
                                          .residual = v.residual,
                                          .norm = v.norm,
                                          .memory_layers = v.memory_layers,
                                          .reconstruction = v.reconstruction};
}

// What the feedback models carry from segment to segment: nothing.
struct no_memory {};

template <class Model>
eval_result evaluate(const options& o, const model_sizes& sz, const variants& var, const mnemo::safetensors_file& ckpt,
                     const token_matrix& tok, index_t n_segments) {
    constexpr bool feedback = ex::is_feedback_model<Model>;
    Model model(model_options<Model>(sz, var));
    auto& ps = model.parameters();
    // Strict loading: every parameter present with its shape (load_parameters checks), and no tensor
    // the model does not declare, except conv weights of a model built without them.
    const std::string model_name = feedback                ? std::string(ex::name(o.model))
                                   : o.c_mem_len == 0      ? std::string("Transformer-XL")
                                                           : std::string(ex::name(var.compression)) + "-compression";
    for (const auto& t : ckpt.tensors())
        if (!ps.find(t.name) && (feedback || !unused_conv_weight(t.name)))
            fail("mnemo_eval: unexpected tensor '", t.name, "' in '", ckpt.path(), "': the ", model_name,
                 " model with ", sz.n_layers, " layers has no parameter of that name");
    mnemo::load_parameters(ckpt, ps, {.ignore_unexpected = true});
    if constexpr (!feedback) model.set_clamp_len(o.clamp_len);

    const index_t B = tok.batch, N = o.seq_len, V = sz.vocab;
    [[maybe_unused]] auto memory = [&] {
        if constexpr (feedback) {
            return no_memory{};
        } else {
            auto m = model.make_memory(o.mem_len, o.c_mem_len);
            m.reset(B, N);
            return m;
        }
    }();
    eval_result r;
    r.logits.resize(std::size_t(n_segments * B * N * V));
    r.ce.resize(std::size_t(n_segments));
    r.ar.resize(std::size_t(n_segments));
    std::vector<token_t> inputs(std::size_t(N * B)), targets(std::size_t(N * B));  // [N·B] sequence-major
    std::vector<float> logits_host;  // a segment's logits, copied from the model's backend
    const index_t report_every = std::max<index_t>(1, n_segments / 10);
    const auto t0 = std::chrono::steady_clock::now();
    for (index_t s = 0; s < n_segments; ++s) {
        // tokens is [batch, n_tokens] (batch-major); mnemo's rows are position·B + b.
        for (index_t q = 0; q < N; ++q)
            for (index_t b = 0; b < B; ++b) {
                const std::int64_t* row = tok.ids.data() + b * tok.length + s * N;
                inputs[std::size_t(q * B + b)] = token_t(row[q]);
                targets[std::size_t(q * B + b)] = token_t(row[q + 1]);
            }
        mnemo::segment_losses losses;
        if constexpr (feedback) losses.ce = model.eval_segment(inputs, targets, B);  // from an empty memory
        else losses = model.eval_segment(inputs, targets, B, memory);
        const auto logits = model.logits();  // [N·B, V], rows ld() apart, in the model's backend memory
        logits_host.resize(std::size_t(logits.rows() * logits.ld()));
        mnemo::device_memory<typename Model::backend_type>::download(
            logits_host.data(), logits.data(), sizeof(float) * std::size_t((logits.rows() - 1) * logits.ld() + V));
        for (index_t q = 0; q < N; ++q)
            for (index_t b = 0; b < B; ++b) {
                const float* src = logits_host.data() + (q * B + b) * logits.ld();
                std::copy(src, src + V, r.logits.begin() + ((s * B + b) * N + q) * V);
            }
        r.ce[std::size_t(s)] = float(losses.ce);
        r.ar[std::size_t(s)] = float(losses.ar);
        if (n_segments >= 20 && ((s + 1) % report_every == 0 || s + 1 == n_segments)) {
            const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
            std::fprintf(stderr, "mnemo_eval: segment %lld/%lld (%.1f s)\n", static_cast<long long>(s + 1),
                         static_cast<long long>(n_segments), secs);
        }
    }
    return r;
}

}  // namespace

int main(int argc, char** argv) try {
    const options o = parse(argc, argv);
    const mnemo::safetensors_file ckpt = mnemo::read_safetensors(o.checkpoint);
    const bool feedback = ex::is_feedback(o.model);
    const model_sizes sz = read_sizes(ckpt, o.model);
    if (o.n_pos && *o.n_pos != sz.n_pos)
        fail("mnemo_eval: --n-pos ", *o.n_pos, " disagrees with the checkpoint '", o.checkpoint,
             "', whose positional tables have ", feedback ? "" : "2·", sz.n_pos, " rows");
    if (feedback) check_feedback_variant(o, ckpt);
    if (o.model == ex::model_kind::xl && sz.conv_rate)
        // The reference accepts this too: Transformer-XL never compresses, so the conv weights go unread.
        std::fprintf(stderr, "mnemo_eval: note: --model xl ignores the checkpoint's compress.conv.* tensors\n");
    const bool compresses = o.c_mem_len > 0;
    const variants var = feedback ? variants{} : resolve_variants(o, sz, ckpt);
    const std::optional<index_t> rate = feedback ? std::nullopt : resolve_rate(o, sz, ckpt, compresses, var.compression);
    // A run that never compresses is Transformer-XL whatever the checkpoint holds: build the model
    // without a compression function, so it only needs d_model and heads to be compiled in.
    const ex::model_kind kind = feedback ? o.model : compresses ? ex::model_kind::compressive : ex::model_kind::xl;
    // An unsupported configuration fails here, before the tokens are read, listing what is compiled in.
    ex::with_model_on(o.device, sz.d_model, sz.heads, rate.value_or(1), kind, var.compression, []<class>() {});

    const token_matrix tok = read_tokens(o.tokens, sz.vocab);
    const index_t n_segments = (tok.length - 1) / o.seq_len;
    if (n_segments < 1)
        fail("mnemo_eval: '", o.tokens, "' has ", tok.length, " tokens per stream, which do not make one segment of ",
             o.seq_len, " plus its target (need at least ", o.seq_len + 1, ")");
    if (compresses && o.mem_len < *rate - 1)
        fail("mnemo_eval: --mem-len ", o.mem_len, " is below compression rate − 1 = ", *rate - 1,
             ": the memory must hold whole groups of ", *rate, " to compress");
    if (feedback) check_feedback_positions(o, sz.n_pos);
    else check_positions(o, rate.value_or(1), sz.n_pos, n_segments);

    const eval_result r =
        ex::with_model_on(o.device, sz.d_model, sz.heads, rate.value_or(1), kind, var.compression,
                          [&]<class Model>() { return evaluate<Model>(o, sz, var, ckpt, tok, n_segments); });

    const index_t S = n_segments, B = tok.batch, N = o.seq_len, V = sz.vocab;
    mnemo::safetensors_writer(o.out)
        .add("logits", {S, B, N, V}, r.logits.data(), mnemo::dtype::f32)
        .add("ce_loss", {S}, r.ce.data(), mnemo::dtype::f32)
        .add("ar_loss", {S}, r.ar.data(), mnemo::dtype::f32)
        .commit();
    // The same lines as tools/reference_eval.py, so the two can be diffed.
    for (index_t s = 0; s < S; ++s)
        std::printf("segment %lld: ce %.6f ar %.6g\n", static_cast<long long>(s), double(r.ce[std::size_t(s)]),
                    double(r.ar[std::size_t(s)]));
    return 0;
} catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
}
