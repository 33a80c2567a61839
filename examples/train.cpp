// train: character-level language modelling with the Compressive Transformer (Rae et al., 2019) or
// Transformer-XL (Dai et al., 2019), trained as labml's compressive experiment does, or with the
// Feedback Transformer (Fan et al., 2020), trained as labml's feedback experiment does.
//
//   train                                  the main job: the built-in recall task (below), trains the
//                                          Compressive Transformer and then Transformer-XL with the same
//                                          settings and prints both recall accuracies
//   train --task recall --model xl         the recall task with one model
//   train --data FILE [--model compressive|xl|feedback|feedback-kv]
//                                          any text file; defaults are the reference experiment's
//   train --resume CKPT [--steps N]        continues a saved run bit for bit
//   train --help                           every flag
//
// Data (the reference's sequential batching). The text is split 90/10 into training and validation;
// each part is cut into `batch` contiguous streams, read segment after segment: segment s of stream b is
// tokens [s·Q, s·Q + Q) of that stream and its targets are the next tokens. Batched tokens are
// sequence-major, row = position·batch + b, as the model expects. The memory is carried from segment to
// segment, so it always holds the text just before the segment; when the streams run out they start
// again from the beginning with an empty memory. Validation reads its own streams from their beginning
// with its own memory. The vocabulary is the file's distinct bytes, sorted; token = index.
//
// The recall task (no download, and a task that needs the compressed memory). Each stream is a sequence
// of episodes of `episode_len` tokens:
//     K f f f ... f ? K          K: a key, one of 8 symbols A–H; f: random fillers a–p; ?: the query
// The target of the `?` position is the episode's key, seen episode_len − 2 = 30 tokens before. A model
// with segments of Q = 8 tokens, memory of 8 slots and L layers reaches at most Q − 1 + 8·L tokens back
// (each layer's memory holds the previous layer's outputs for the 8 tokens before the segment): 23 for
// 2 layers, so Transformer-XL cannot see the key and answers at chance (1/8). The compressed memory of
// c_mem_len slots at rate 2 covers 2·c_mem_len more tokens, so the Compressive Transformer can. The loss
// is on every position (fillers are random, so their loss cannot fall below 4 bits); the accuracy is
// measured on the answer positions only (argmax = key), over validation episodes whose key lies inside
// the validation stream. Streams are pure functions of (seed, stream, position): the data "RNG state"
// is the stream position. Each stream starts at a random phase, so keys fall anywhere in a segment.
// Defaults chosen by measurement (2 cores, about 2–4 ms a step when the cores are idle): d_model 64,
// 4 heads, rate 2, 2 layers, d_ff 128, c_mem_len 16 (32 tokens), n_pos 64, AdamW lr 1e-3 with a
// cosine decay, 5000 steps. Compressive accuracy 0.999 / 0.997 / 0.996 for seeds 1–3 (0.98 with mean,
// 0.99 with max pooling); Transformer-XL 0.11–0.15, chance. A constant lr 1e-3 reached 0.85–0.99.
//
// The Feedback Transformer (--model feedback: per-layer keys/values; feedback-kv: shared ones). On text
// the defaults are labml's feedback experiment: d_model 512, 8 heads, d_ff 2048, 6 layers, n_pos 4096,
// seq_len 128, batch 64, Noam with lr 1 and 2000 warm-up steps (the reference shuffles its sequences;
// here they are read from the streams as above). Every segment starts from an empty memory, in training
// and validation alike (docs/reference.md §16): no state is carried, so --mem-len and --c-mem-len must be 0
// and a checkpoint holds no memory. Sampling feeds the prompt and the continuation to the model's
// generator as one sequence, each step reusing the cached keys and values of the earlier ones (the same
// logits as the reference's re-evaluation of the whole growing sequence); a sequence spans at most
// n_pos + 1 tokens (the positional tables), so a longer one starts again from its last seq_len tokens.
// On the recall task the recall recipe applies (sizes, optimiser), with seq_len 64 so that a sequence
// can hold a key and its answer; answers whose key lies in the previous segment are out of reach.
//
// Variants of the compressive / XL model (compressive_options; README "Model variants"): --residual gru,
// --norm post, --memory-layers L (compressive and xl) and --reconstruction autoencoding, --compression
// dilated|most-used (compressive). They are model settings: saved in the metadata (residual, norm,
// memory_layers, reconstruction, compression), taken from it on resume, and an error if a flag
// disagrees with it.
//
// Checkpoints (--checkpoint PATH, atomic safetensors writes):
//   PATH                     the model alone, parameters under their PyTorch state_dict names (F32),
//                            directly usable by mnemo_eval and tools/reference_eval.py; "__metadata__"
//                            holds every hyper-parameter, the step, and the vocabulary as hex bytes.
//   PATH.state.safetensors   what resuming needs besides the model: optimizer.exp_avg.<name> and
//                            optimizer.exp_avg_sq.<name> (F32, the parameters' layout), trainer.step,
//                            trainer.data_position [batch] (each stream's next segment), trainer.sample_rng
//                            (the sampling RNG's offset), trainer.vocab (U8), memory.<l>.mem and
//                            memory.<l>.c_mem (F32 [slots, batch, d_model], oldest slot first, for each
//                            memory layer l; none for the Feedback Transformer, which carries no memory;
//                            most-used compression adds memory.<l>.usage [slots, batch], the attention
//                            each memory row has received), and the same metadata.
//                            A resumed run continues bit for bit: k steps, save, resume, k steps equals
//                            2k steps (tests/train_resume.cmake checks the files bytewise), with any
//                            --threads (mnemo's results do not depend on the thread count).
//   --export PATH            the model file alone, at the end.
#include <omp.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cinttypes>
#include <cmath>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <new>
#include <stdexcept>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <mnemo/mnemo.hpp>
#include <mnemo/models/compressive_transformer.hpp>
#include <mnemo/train/clip.hpp>
#include <mnemo/train/optimizer.hpp>
#include <mnemo/train/safetensors.hpp>
#include <mnemo/train/schedule.hpp>
#include <mnemo/train/text_data.hpp>

#include "model_zoo.hpp"

namespace {

using mnemo::index_t;
using mnemo::token_t;
namespace ex = mnemo::examples;

constexpr double ln2 = 0.69314718055994530942;
constexpr const char* state_suffix = mnemo::checkpoint_state_suffix;

template <class... Args>
[[noreturn]] void fail(Args&&... args) {
    mnemo::detail::fail("train: ", std::forward<Args>(args)...);
}

// The shortest of %.15g, %.16g, %.17g that reads back as x (so the metadata round-trips exactly).
std::string format_double(double x) {
    char b[40];
    for (int digits = 15; digits <= 17; ++digits) {
        std::snprintf(b, sizeof b, "%.*g", digits, x);
        if (std::strtod(b, nullptr) == x) break;
    }
    return b;
}

std::string format_duration(double seconds) {
    char b[32];
    const long s = std::lround(std::max(0.0, seconds));
    if (s >= 3600) std::snprintf(b, sizeof b, "%ldh%02ldm", s / 3600, s / 60 % 60);
    else if (s >= 60) std::snprintf(b, sizeof b, "%ldm%02lds", s / 60, s % 60);
    else std::snprintf(b, sizeof b, "%lds", s);
    return b;
}

// Printable form of a sample (control characters other than newline shown as '.').
std::string printable(std::string_view s) {
    std::string out(s);
    for (char& c : out)
        if ((static_cast<unsigned char>(c) < 32 && c != '\n') || c == 127) c = '.';
    return out;
}

std::uint64_t splitmix64(std::uint64_t x) {
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

// ---------------------------------------------------------------------------------------------
// Command line
// ---------------------------------------------------------------------------------------------

constexpr const char* usage_text = R"(usage: train [--data FILE | --task recall] [--model MODEL] [flags]

what to train
  --data FILE          character-level LM on FILE (90% train / 10% validation)
  --task recall        the built-in recall task (the default without --data); without --model it trains
                       the Compressive Transformer and then Transformer-XL and compares them
  --model compressive|xl|feedback|feedback-kv
                       default compressive; xl = no compressed memory; feedback = the Feedback
                       Transformer (per-layer keys/values), feedback-kv = with shared keys/values:
                       every segment from an empty memory, no --mem-len, --c-mem-len, --rate, --compression
  --compression conv|max|mean|dilated|most-used
                       compression function f_c (default conv); dilated (a stack of log2(rate)
                       stride-2 convolutions) and most-used (keeps the most-attended slot of each
                       group) are compiled for fewer configurations (see examples/model_zoo.hpp)
variants of the compressive / XL model (all default to labml's reference model)
  --residual add|gru   residual connections, or GRU gates (lucidrains' gru_gated_residual) (add)
  --norm pre|post      LayerNorm before each sub-layer (labml) or after each residual (the paper) (pre)
  --memory-layers L    the layers that keep memory, e.g. 2,3,4 (lucidrains' memory_layers) (all)
  --reconstruction attention|autoencoding
                       the compression function's loss: attention reconstruction (labml) or the
                       paper's auto-encoding loss with a ConvTranspose1d decoder (attention)
model (must be compiled in: see examples/model_zoo.hpp)
  --d-model N --heads N --rate N             text: 128 4 2; recall: 64 4 2; feedback text: 512 8
  --d-ff N --layers N --n-pos N              text: 256 6 4096; recall: 128 2 64; feedback text: 2048 6 4096
  --seq-len N --mem-len N --c-mem-len N      text: 8 8 128; recall: 8 8 16 (xl: c-mem-len 0);
                                             feedback: 128 (recall 64), no memory
  --batch N                                  32 (feedback text: 64)
  --clamp-len N        distances above N use the positional embedding of N (Transformer-XL's
                       clamp_len; 0: off, the default; saved in the checkpoint when set)
optimisation
  --optimizer adamw|adam-warmup|noam   adam-warmup: labml's AdamWarmup, the reference's "AdamW"
                                       (text default); adamw: torch.optim.AdamW (recall default);
                                       noam: labml's Noam (lr is a multiplier, default 1; feedback
                                       text default, as the reference's feedback experiment)
  --lr X               text 2.5e-4, recall 1e-3, noam 1
  --warmup N           adam-warmup/noam 2000; adamw: linear warm-up steps (text 0, recall 100 or steps/10)
  --schedule constant|cosine           adamw only (text constant, recall cosine: decays to lr/10)
  --weight-decay X     adamw 0.01, adam-warmup/noam 0
  --clip X             global gradient-norm clip (1.0; 0 turns it off)
  --steps N            total optimizer steps (text 2000, recall 5000)
  --stop-at N          stop (validate, save) after step N of the --steps run; resume later to go on
  --seed N             initialisation and recall data (1)
evaluation, sampling, checkpoints
  --eval-every N       validation every N steps (text 500, recall 1000; 0: only at the end)
  --eval-segments N    segments per stream of each periodic validation (text 100, 0: all; recall 128);
                       the final validation reads the whole validation text (recall: N segments)
  --eval-mem-len N --eval-c-mem-len N
                       memory lengths of validation (default: --mem-len, --c-mem-len); not parameters,
                       so any lengths with c_mem + mem + seq_len <= n_pos (e.g. on --resume --steps 0)
  --log-every N        progress line every N steps (text 100, recall 500)
  --sample-len N       characters sampled at the end (text 200, recall 40; 0: none)
  --eval-sample N      also sample N characters at each validation (0)
  --prompt TEXT        sampling prompt (default: the start of the validation text)
  --temperature X      the second sample's temperature (0.8; the first is greedy)
  --checkpoint PATH    save PATH (model) and PATH.state.safetensors (trainer state) at the end
  --save-every N       also save every N steps (0)
  --resume PATH        continue from PATH and PATH.state.safetensors; hyper-parameters come from the
                       checkpoint (--steps, --lr, ... may override the recipe; model shapes may not)
  --export PATH        write the model alone (no trainer state) at the end
  --threads N          OpenMP threads (default: all cores)
)";

struct flag_info {
    const char* name;
    const char* metadata_key;  // nullptr: not a saved hyper-parameter
};

constexpr flag_info known_flags[] = {
    {"--data", "data"},         {"--task", "task"},           {"--model", "model"},
    {"--compression", "compression"}, {"--d-model", "d_model"}, {"--heads", "heads"},
    {"--residual", "residual"}, {"--norm", "norm"}, {"--memory-layers", "memory_layers"},
    {"--reconstruction", "reconstruction"},
    {"--rate", "compression_rate"},   {"--d-ff", "d_ff"},       {"--layers", "n_layers"},
    {"--n-pos", "n_pos"},       {"--seq-len", "seq_len"},     {"--mem-len", "mem_len"},
    {"--c-mem-len", "c_mem_len"}, {"--batch", "batch"},       {"--optimizer", "optimizer"},
    {"--lr", "lr"},             {"--warmup", "warmup"},       {"--schedule", "schedule"},
    {"--weight-decay", "weight_decay"}, {"--clip", "clip"},   {"--steps", "steps"},
    {"--seed", "seed"},         {"--eval-every", nullptr},    {"--eval-segments", nullptr},
    {"--log-every", nullptr},   {"--sample-len", nullptr},    {"--eval-sample", nullptr},
    {"--prompt", nullptr},      {"--temperature", nullptr},   {"--checkpoint", nullptr},
    {"--save-every", nullptr},  {"--resume", nullptr},        {"--export", nullptr},
    {"--threads", nullptr},     {"--stop-at", nullptr},
    {"--clamp-len", "clamp_len"}, {"--eval-mem-len", nullptr}, {"--eval-c-mem-len", nullptr},
};

/// The flags as given: name → value. Each flag takes one value; "--flag=value" works too.
struct command_line {
    std::map<std::string, std::string> given;
    bool help = false;
    bool has(const std::string& f) const { return given.contains(f); }
};

command_line parse_command_line(int argc, char** argv) {
    command_line c;
    for (int i = 1; i < argc; ++i) {
        std::string a = argv[i], v;
        if (a == "--help" || a == "-h") {
            c.help = true;
            continue;
        }
        bool inline_value = false;
        if (const auto eq = a.find('='); a.starts_with("--") && eq != std::string::npos) {
            v = a.substr(eq + 1);
            a = a.substr(0, eq);
            inline_value = true;
        }
        const bool known = std::any_of(std::begin(known_flags), std::end(known_flags),
                                       [&](const flag_info& f) { return a == f.name; });
        if (!known) fail("unknown option '", a, "' (try --help)");
        if (!inline_value) {
            if (i + 1 >= argc) fail("option ", a, " needs a value");
            v = argv[++i];
        }
        if (c.given.contains(a)) fail("option ", a, " given twice");
        c.given[a] = v;
    }
    return c;
}

std::int64_t parse_integer(const std::string& flag, const std::string& s) {
    std::size_t used = 0;
    long long x = 0;
    try {
        x = std::stoll(s, &used);
    } catch (const std::exception&) {
        used = 0;
    }
    if (s.empty() || used != s.size()) fail(flag, " expects an integer, got '", s, "'");
    return x;
}

double parse_real(const std::string& flag, const std::string& s) {
    std::size_t used = 0;
    double x = 0;
    try {
        x = std::stod(s, &used);
    } catch (const std::exception&) {
        used = 0;
    }
    if (s.empty() || used != s.size() || !std::isfinite(x)) fail(flag, " expects a number, got '", s, "'");
    return x;
}

// ---------------------------------------------------------------------------------------------
// Settings: flags over checkpoint metadata over defaults
// ---------------------------------------------------------------------------------------------

enum class task_kind { text, recall };

/// Everything one training run needs, resolved.
struct settings {
    task_kind task = task_kind::text;
    bool compare = false;  // the main job: compressive then Transformer-XL
    std::string data;      // the text file (task text)
    ex::model_kind model = ex::model_kind::compressive;
    ex::compression_kind compression = ex::compression_kind::conv;
    mnemo::residual_kind residual = mnemo::residual_kind::add;
    mnemo::norm_kind norm = mnemo::norm_kind::pre;
    std::vector<index_t> memory_layers;  // empty: every layer
    mnemo::reconstruction_kind reconstruction = mnemo::reconstruction_kind::attention;
    index_t d_model = 0, heads = 0, rate = 0, d_ff = 0, n_layers = 0, n_pos = 0;
    index_t seq_len = 0, mem_len = 0, c_mem_len = 0, batch = 0;
    index_t clamp_len = 0, eval_mem_len = 0, eval_c_mem_len = 0;  // clamp_len 0: off
    std::string optimizer, schedule;
    double lr = 0, weight_decay = 0, clip = 0;
    std::int64_t warmup = 0, steps = 0;
    std::uint64_t seed = 1;
    std::int64_t eval_every = 0, eval_segments = 0, log_every = 0, sample_len = 0, eval_sample = 0, save_every = 0;
    std::int64_t stop_at = 0;  // 0: run to `steps`
    double temperature = 0.8;
    std::optional<std::string> prompt;
    std::string checkpoint, resume, export_path;
    int threads = 1;
};

const char* task_name(task_kind t) { return t == task_kind::text ? "text" : "recall"; }

/// Resolves each setting: an explicit flag, else the checkpoint's value (when resuming), else the
/// default. Model and data settings must agree with the checkpoint ("strict"); recipe settings (steps,
/// lr, ...) may be changed on resume, with a note.
class setting_resolver {
public:
    enum class kind { strict, recipe };

    setting_resolver(const command_line& cl, const mnemo::safetensors_metadata* checkpoint)
        : cl_(cl), ckpt_(checkpoint) {}

    std::string text(const char* flag, std::string fallback, kind k = kind::strict) const {
        const auto as_is = [](const std::string&, const std::string& v) { return v; };
        return resolve<std::string>(flag, std::move(fallback), k, as_is);
    }
    std::int64_t integer(const char* flag, std::int64_t fallback, std::int64_t min, kind k = kind::strict,
                         std::int64_t max = std::numeric_limits<std::int64_t>::max()) const {
        const std::int64_t v = resolve<std::int64_t>(flag, fallback, k, parse_integer);
        if (v < min) fail(flag, " must be at least ", min, ", got ", v);
        if (v > max) fail(flag, " must be at most ", max, ", got ", v);
        return v;
    }
    template <class V, class Parse>
    V custom(const char* flag, V fallback, kind k, Parse parse) const {
        return resolve<V>(flag, std::move(fallback), k, parse);
    }
    double real(const char* flag, double fallback, double min, kind k = kind::recipe) const {
        const double v = resolve<double>(flag, fallback, k, parse_real);
        if (v < min) fail(flag, " must be at least ", min, ", got ", v);
        return v;
    }

private:
    static const char* key_of(const char* flag) {
        for (const flag_info& f : known_flags)
            if (std::string_view(f.name) == flag) return f.metadata_key;
        return nullptr;
    }

    template <class V, class Parse>
    V resolve(const char* flag, V fallback, kind k, Parse parse) const {
        const char* key = key_of(flag);
        std::optional<V> saved;
        if (ckpt_ && key) {
            const auto it = ckpt_->find(key);
            if (it != ckpt_->end()) saved = parse(std::string("checkpoint metadata '") + key + "'", it->second);
        }
        const auto g = cl_.given.find(flag);
        if (g == cl_.given.end()) return saved ? *saved : fallback;
        const V v = parse(flag, g->second);
        if (saved && !(*saved == v)) {
            if (k == kind::strict)
                fail("checkpoint has ", key, " ", cl_value(*saved), " but ", flag, " is ", cl_value(v),
                     " (leave the flag out to use the checkpoint's value)");
            std::printf("note: %s %s overrides the checkpoint's %s\n", flag, cl_value(v).c_str(),
                        cl_value(*saved).c_str());
        }
        return v;
    }
    template <class V>
    static std::string cl_value(const V& v) {
        if constexpr (std::is_same_v<V, std::string>) return v;
        else if constexpr (std::is_same_v<V, double>) {
            char b[32];
            std::snprintf(b, sizeof b, "%g", v);
            return b;
        } else return std::to_string(v);
    }

    const command_line& cl_;
    const mnemo::safetensors_metadata* ckpt_;
};

// Upper bounds of the size flags: far above any real run, low enough that products of them cannot
// overflow index_t; a run too large for the machine's memory ends with the out-of-memory message.
constexpr std::int64_t max_extent = std::int64_t(1) << 24, max_batch = std::int64_t(1) << 20, max_layers = 4096,
                       max_threads = 4096;

settings resolve_settings(const command_line& cl, const mnemo::safetensors_metadata* ckpt) {
    using k = setting_resolver::kind;
    const setting_resolver r(cl, ckpt);
    settings s;
    if (cl.has("--resume")) s.resume = cl.given.at("--resume");

    // What to train on.
    std::string task = r.text("--task", cl.has("--data") ? "text" : "recall");
    if (task != "text" && task != "recall") fail("unknown --task '", task, "' (expected recall, or --data FILE)");
    s.task = task == "text" ? task_kind::text : task_kind::recall;
    if (s.task == task_kind::recall && cl.has("--data")) fail("--task recall is the built-in task; it takes no --data");
    if (s.task == task_kind::text) {
        // On resume the data path is only a default: the data's fingerprint decides (check_data_matches).
        s.data = cl.has("--data") ? cl.given.at("--data") : (ckpt && ckpt->contains("data") ? ckpt->at("data") : "");
        if (s.data.empty()) fail("--task text needs --data FILE");
    }
    const bool recall = s.task == task_kind::recall;
    s.compare = recall && !ckpt && !cl.has("--model");
    s.model = ex::parse_model_kind(r.text("--model", "compressive"));
    const bool xl = s.model == ex::model_kind::xl, feedback = ex::is_feedback(s.model);
    if (feedback)
        for (const char* flag : {"--compression", "--rate", "--residual", "--norm", "--memory-layers", "--reconstruction"})
            if (cl.has(flag))
                fail("--model ", ex::name(s.model), " has no compression and none of the compressive model's variants: ",
                     flag, " does not apply");
    if (xl && cl.has("--reconstruction")) fail("--model xl compresses nothing: --reconstruction does not apply");
    s.compression = ex::parse_compression_kind(r.text("--compression", "conv"));
    s.residual = ex::parse_residual_kind(r.text("--residual", "add"));
    s.norm = ex::parse_norm_kind(r.text("--norm", "pre"));
    s.reconstruction = ex::parse_reconstruction_kind(r.text("--reconstruction", "attention"));
    // Compared with the checkpoint's in canonical form ("all", or sorted indices).
    const auto memory_layers_value = [](const std::string& what, const std::string& v) {
        return ex::format_memory_layers(ex::parse_memory_layers(v, what));
    };
    s.memory_layers = ex::parse_memory_layers(
        r.custom("--memory-layers", std::string("all"), setting_resolver::kind::strict, memory_layers_value),
        "--memory-layers");

    // The model (recall: a smaller one that learns the task in about a minute on two cores; feedback on
    // text: labml's feedback experiment).
    const bool feedback_text = feedback && !recall;
    s.d_model = r.integer("--d-model", recall ? 64 : feedback ? 512 : 128, 1);
    s.heads = r.integer("--heads", feedback_text ? 8 : 4, 1);
    s.rate = feedback ? 1 : r.integer("--rate", 2, 1);
    s.d_ff = r.integer("--d-ff", recall ? 128 : feedback ? 2048 : 256, 1, k::strict, max_extent);
    s.n_layers = r.integer("--layers", recall ? 2 : 6, 1, k::strict, max_layers);
    for (index_t l : s.memory_layers)
        if (l >= s.n_layers)
            fail("--memory-layers ", ex::format_memory_layers(s.memory_layers), ": layer ", l, " is not one of the ",
                 s.n_layers, " layers (0 … ", s.n_layers - 1, ")");
    s.n_pos = r.integer("--n-pos", recall ? 64 : 4096, 1, k::strict, max_extent);
    s.seq_len = r.integer("--seq-len", feedback ? (recall ? 64 : 128) : 8, 1, k::strict, max_extent);
    s.mem_len = r.integer("--mem-len", feedback ? 0 : 8, 0, k::strict, max_extent);
    s.c_mem_len = r.integer("--c-mem-len", xl || feedback ? 0 : recall ? 16 : 128, 0, k::strict, max_extent);
    if (xl && s.c_mem_len != 0)
        fail("--model xl is Transformer-XL: it has no compressed memory, so --c-mem-len must be 0");
    if (feedback)
        for (const auto& [flag, v] : {std::pair{"--mem-len", s.mem_len}, std::pair{"--c-mem-len", s.c_mem_len}})
            if (v != 0)
                fail("--model ", ex::name(s.model), " carries no memory between segments (each starts from an ",
                     "empty memory): ", flag, " must be 0 or left out, got ", v);
    s.batch = r.integer("--batch", feedback_text ? 64 : 32, 1, k::strict, max_batch);
    s.clamp_len = r.integer("--clamp-len", 0, 0, k::recipe, max_extent);
    if (feedback && s.clamp_len != 0) fail("--clamp-len is for the compressive and xl models");
    // Fail now, before any data is read, if (d_model, heads, rate) is not compiled in.
    ex::with_model(s.d_model, s.heads, s.rate, s.model, s.compression, []<class Model>() { return 0; });
    s.seed = std::uint64_t(r.integer("--seed", 1, 0));

    // The optimiser. Its kind is strict: the saved moments mean different things for each.
    s.optimizer = r.text("--optimizer", recall ? "adamw" : feedback ? "noam" : "adam-warmup");
    if (s.optimizer != "adamw" && s.optimizer != "adam-warmup" && s.optimizer != "noam")
        fail("unknown --optimizer '", s.optimizer, "' (expected adamw, adam-warmup or noam)");
    const bool is_adamw = s.optimizer == "adamw";
    // Recall: a cosine decay steadies the end of the short run (constant 1e-3 wobbled between 0.85 and 0.99).
    s.schedule = r.text("--schedule", recall && is_adamw ? "cosine" : "constant", k::recipe);
    if (s.schedule != "constant" && s.schedule != "cosine")
        fail("unknown --schedule '", s.schedule, "' (expected constant or cosine)");
    if (!is_adamw && s.schedule != "constant")
        fail("--schedule ", s.schedule, " is for --optimizer adamw; ", s.optimizer, " has its own schedule");
    s.lr = r.real("--lr", s.optimizer == "noam" ? 1.0 : recall ? 1e-3 : 2.5e-4, 0.0);
    s.steps = r.integer("--steps", recall ? 5000 : 2000, 0, k::recipe);
    // Recall's warm-up: 100 steps, fewer for a short run (a cosine schedule needs steps > warm-up).
    s.warmup = r.integer("--warmup", is_adamw ? (recall ? std::min<std::int64_t>(100, s.steps / 10) : 0) : 2000,
                         is_adamw ? 0 : 1, k::recipe);
    s.weight_decay = r.real("--weight-decay", is_adamw ? 0.01 : 0.0, 0.0);
    s.clip = r.real("--clip", 1.0, 0.0);
    if (is_adamw && s.schedule == "cosine" && s.steps > 0 && s.steps <= s.warmup)
        fail("--schedule cosine needs --steps (", s.steps, ") greater than --warmup (", s.warmup,
             "); use --schedule constant for such a short run");

    // This run only (never saved).
    const auto run_int = [&](const char* flag, std::int64_t fallback, std::int64_t min,
                             std::int64_t max = std::numeric_limits<std::int64_t>::max()) {
        const std::int64_t v = cl.has(flag) ? parse_integer(flag, cl.given.at(flag)) : fallback;
        if (v < min) fail(flag, " must be at least ", min, ", got ", v);
        if (v > max) fail(flag, " must be at most ", max, ", got ", v);
        return v;
    };
    s.eval_every = run_int("--eval-every", recall ? 1000 : 500, 0);
    // 0 means one pass over the validation text; the recall streams never end, so they need a count.
    s.eval_segments = run_int("--eval-segments", recall ? 128 : 100, recall ? 1 : 0);
    s.log_every = run_int("--log-every", recall ? 500 : 100, 1);
    s.sample_len = run_int("--sample-len", recall ? 40 : 200, 0, max_extent);
    s.eval_sample = run_int("--eval-sample", 0, 0, max_extent);
    s.save_every = run_int("--save-every", 0, 0);
    s.stop_at = run_int("--stop-at", 0, 0);
    s.eval_mem_len = run_int("--eval-mem-len", s.mem_len, 0, max_extent);
    s.eval_c_mem_len = run_int("--eval-c-mem-len", s.c_mem_len, 0, max_extent);
    if ((feedback || xl) && s.eval_c_mem_len != 0)
        fail("--eval-c-mem-len must be 0 for --model ", ex::name(s.model), ", got ", s.eval_c_mem_len);
    if (feedback && s.eval_mem_len != 0)
        fail("--eval-mem-len must be 0 for --model ", ex::name(s.model), ": it carries no memory");
    if (!feedback && s.eval_c_mem_len + s.eval_mem_len + s.seq_len > s.n_pos)
        fail("--eval-c-mem-len ", s.eval_c_mem_len, " + --eval-mem-len ", s.eval_mem_len, " + --seq-len ", s.seq_len,
             " exceeds n_pos = ", s.n_pos, " (the positional tables); shorten the validation memory");
    if (!feedback && s.eval_c_mem_len > 0 && s.eval_mem_len < s.rate - 1)
        fail("--eval-mem-len ", s.eval_mem_len, " is too short for --rate ", s.rate, ": it must be at least rate − 1");
    s.threads = int(run_int("--threads", omp_get_num_procs(), 1, max_threads));
    if (cl.has("--temperature")) s.temperature = parse_real("--temperature", cl.given.at("--temperature"));
    if (s.temperature < 0) fail("--temperature must be >= 0, got ", s.temperature);
    if (cl.has("--prompt")) s.prompt = cl.given.at("--prompt");
    if (cl.has("--checkpoint")) s.checkpoint = cl.given.at("--checkpoint");
    if (cl.has("--export")) s.export_path = cl.given.at("--export");
    if (s.compare && (!s.checkpoint.empty() || !s.export_path.empty()))
        fail("the comparison trains two models; --checkpoint and --export need one: add --model compressive or "
             "--model xl");

    // Shapes the model and memory need.
    if (feedback && s.seq_len - 1 > s.n_pos)
        fail("--n-pos ", s.n_pos, " is too small: the last token of a sequence of --seq-len ", s.seq_len,
             " attends over ", s.seq_len - 1, " earlier positions");
    const index_t keys = s.c_mem_len + s.mem_len + s.seq_len;
    if (!feedback && keys > s.n_pos)
        fail("--n-pos ", s.n_pos, " is too small: attention reaches c_mem_len + mem_len + seq_len = ", keys,
             " positions back");
    if (!xl && s.c_mem_len > 0 && s.mem_len < s.rate - 1)
        fail("--mem-len ", s.mem_len, " is too short for --rate ", s.rate, ": it must be at least rate − 1");
    return s;
}

/// The hyper-parameters of a run as checkpoint metadata (the keys of known_flags).
mnemo::safetensors_metadata settings_metadata(const settings& s) {
    mnemo::safetensors_metadata m;
    m["format"] = "mnemo-train-1";
    m["task"] = task_name(s.task);
    if (s.task == task_kind::text) m["data"] = s.data;
    m["model"] = ex::name(s.model);
    if (s.model == ex::model_kind::compressive) {  // Transformer-XL has neither
        m["compression"] = ex::name(s.compression);
        m["compression_rate"] = std::to_string(s.rate);
        m["reconstruction"] = ex::name(s.reconstruction);
    }
    if (!ex::is_feedback(s.model)) {  // the variants of the compressive / XL model
        m["residual"] = ex::name(s.residual);
        m["norm"] = ex::name(s.norm);
        m["memory_layers"] = ex::format_memory_layers(s.memory_layers);
    }
    m["d_model"] = std::to_string(s.d_model);
    m["heads"] = std::to_string(s.heads);
    m["d_ff"] = std::to_string(s.d_ff);
    m["n_layers"] = std::to_string(s.n_layers);
    m["n_pos"] = std::to_string(s.n_pos);
    m["seq_len"] = std::to_string(s.seq_len);
    if (!ex::is_feedback(s.model)) {  // the Feedback Transformer carries no memory
        m["mem_len"] = std::to_string(s.mem_len);
        m["c_mem_len"] = std::to_string(s.c_mem_len);
        if (s.clamp_len > 0) m["clamp_len"] = std::to_string(s.clamp_len);
    }
    m["batch"] = std::to_string(s.batch);
    m["optimizer"] = s.optimizer;
    m["schedule"] = s.schedule;
    m["lr"] = format_double(s.lr);
    m["warmup"] = std::to_string(s.warmup);
    m["weight_decay"] = format_double(s.weight_decay);
    m["clip"] = format_double(s.clip);
    m["steps"] = std::to_string(s.steps);
    m["seed"] = std::to_string(s.seed);
    return m;
}

// ---------------------------------------------------------------------------------------------
// Vocabulary and data
// ---------------------------------------------------------------------------------------------

using vocabulary = mnemo::byte_vocabulary;  // sorted distinct bytes; token id = index

/// The built-in recall task (see the top of the file). Tokens are pure functions of (stream key,
/// position), so a stream needs no state beyond its position.
struct recall_task {
    static constexpr std::string_view keys = "ABCDEFGH";
    static constexpr std::string_view fillers = "abcdefghijklmnop";
    static constexpr char query = '?';
    static constexpr std::int64_t episode_len = 32;  // key to query: 30 tokens

    vocabulary vocab = vocabulary::of_bytes(alphabet());

    static std::vector<std::uint8_t> alphabet() {
        const std::string a = std::string(keys) + std::string(fillers) + query;
        return {a.begin(), a.end()};
    }

    /// A stream's phase: where in an episode its position 0 falls.
    static std::int64_t phase(std::uint64_t key) { return std::int64_t(splitmix64(key ^ 0x5EEDull) % episode_len); }
    static std::uint32_t word(std::uint64_t key, std::int64_t index) {
        return mnemo::random_u32(key, std::uint64_t(index));
    }

    token_t token(std::uint64_t key, std::int64_t p) const {
        const std::int64_t q = p + phase(key), e = q / episode_len, i = q % episode_len;
        if (i == 0 || i == episode_len - 1) return vocab.id(keys[word(key, e * episode_len) % keys.size()]);
        if (i == episode_len - 2) return vocab.id(query);
        return vocab.id(fillers[word(key, e * episode_len + i) % fillers.size()]);
    }
    /// Whether position p holds an answer whose key is inside the stream (p − episode_len + 1 >= 0).
    bool is_scored_answer(std::uint64_t key, std::int64_t p) const {
        return (p + phase(key)) % episode_len == episode_len - 1 && p >= episode_len - 1;
    }
};

/// The data: a text split 90/10, or the recall task (train and validation streams from separate keys).
struct corpus {
    task_kind task = task_kind::text;
    vocabulary vocab;
    std::vector<token_t> train, valid;  // text
    recall_task recall;
    std::uint64_t seed = 0;             // recall
    std::string description;
    std::string fingerprint;            // identifies the data for resume
    std::string valid_text;             // the validation text's start, the default prompt
};

corpus load_text_corpus(const std::string& path) {
    mnemo::text_corpus t = mnemo::read_text_corpus(path);
    corpus c;
    c.task = task_kind::text;
    c.vocab = std::move(t.vocab);
    c.train = std::move(t.train);
    c.valid = std::move(t.valid);
    c.valid_text = std::move(t.valid_start);
    c.fingerprint = std::move(t.fingerprint);
    char b[160];
    std::snprintf(b, sizeof b, "%s: %zu bytes (%zu training, %zu validation), vocabulary %zu", path.c_str(), t.bytes,
                  t.split, t.bytes - t.split, c.vocab.bytes.size());
    c.description = b;
    return c;
}

corpus make_recall_corpus(std::uint64_t seed) {
    corpus c;
    c.task = task_kind::recall;
    c.vocab = c.recall.vocab;
    c.seed = seed;
    char b[200];
    std::snprintf(b, sizeof b,
                  "recall task: episodes of %" PRId64 " tokens 'K fillers ? K', %zu keys, %zu fillers; the answer is "
                  "%" PRId64 " tokens after its key",
                  recall_task::episode_len, recall_task::keys.size(), recall_task::fillers.size(),
                  recall_task::episode_len - 2);
    c.description = b;
    c.fingerprint = "recall-v1";
    return c;
}

/// `batch` parallel streams read segment after segment (the reference's sequential batching).
class segment_streams {
public:
    /// Streams over a text: stream b is text[b·n, (b + 1)·n), n = |text| / batch.
    segment_streams(std::span<const token_t> text, index_t batch, index_t seq_len, const char* what)
        : text_(text), batch_(batch), seq_len_(seq_len), length_(std::int64_t(text.size()) / batch) {
        const std::int64_t need = std::int64_t(batch) * (seq_len + 1);
        if (std::int64_t(text.size()) < need)
            fail("the text is too short: its ", what, " part has ", text.size(), " characters, but one batch of ",
                 "segments needs batch·(seq_len + 1) = ", batch, "·", seq_len + 1, " = ", need);
    }
    /// Streams of the recall task, keyed by (seed, stream).
    segment_streams(const recall_task& task, std::uint64_t seed, index_t batch, index_t seq_len)
        : task_(&task), batch_(batch), seq_len_(seq_len), length_(INT64_MAX / 2) {
        for (index_t b = 0; b < batch; ++b) keys_.push_back(splitmix64(seed * 0x100000001B3ull + std::uint64_t(b)));
    }

    index_t batch() const { return batch_; }
    /// Whole segments in one pass over the streams.
    std::int64_t segments_per_pass() const { return (length_ - 1) / seq_len_; }
    /// The next segment's offset within each stream.
    std::int64_t position() const { return position_; }
    void set_position(std::int64_t p) {
        // p may sit at the end of a pass (the next segment then starts the next pass).
        if (p < 0 || p % seq_len_ != 0 || p / seq_len_ > segments_per_pass())
            fail("the saved data position ", p, " does not fit these streams (", segments_per_pass(),
                 " segments of ", seq_len_, ")");
        position_ = p;
    }
    /// Each stream's absolute offset of the next segment (what a checkpoint saves).
    std::vector<std::int64_t> offsets() const {
        std::vector<std::int64_t> o(static_cast<std::size_t>(batch_));
        for (index_t b = 0; b < batch_; ++b) o[std::size_t(b)] = (task_ ? 0 : b * length_) + position_;
        return o;
    }
    void set_offsets(std::span<const std::int64_t> o) {
        if (index_t(o.size()) != batch_) fail("the saved data position has ", o.size(), " streams, batch is ", batch_);
        set_position(o[0]);
        if (!std::ranges::equal(o, offsets())) fail("the saved stream offsets do not match these streams");
    }

    /// The next segment: inputs and targets [seq_len·batch], sequence-major (position·batch + b).
    /// Returns true when the streams ran out and started again from the beginning (the caller then
    /// empties the memory: it would hold the end of the text).
    bool next(std::vector<token_t>& inputs, std::vector<token_t>& targets) {
        bool wrapped = false;
        if (position_ + seq_len_ + 1 > length_) {
            position_ = 0;
            wrapped = true;
        }
        inputs.resize(std::size_t(seq_len_ * batch_));
        targets.resize(inputs.size());
        for (index_t t = 0; t < seq_len_; ++t)
            for (index_t b = 0; b < batch_; ++b) {
                inputs[std::size_t(t * batch_ + b)] = at(b, position_ + t);
                targets[std::size_t(t * batch_ + b)] = at(b, position_ + t + 1);
            }
        position_ += seq_len_;
        return wrapped;
    }

    /// Recall task: whether target row r of the segment just read is a scored answer.
    bool scored_answer(index_t r) const {
        if (!task_) return false;
        const index_t t = r / batch_, b = r % batch_;
        return task_->is_scored_answer(keys_[std::size_t(b)], position_ - seq_len_ + t + 1);
    }
    /// The first n tokens of stream 0 (a prompt).
    std::vector<token_t> head(std::int64_t n) const {
        std::vector<token_t> out;
        for (std::int64_t p = 0; p < std::min(n, length_); ++p) out.push_back(at(0, p));
        return out;
    }

private:
    token_t at(index_t b, std::int64_t p) const {
        return task_ ? task_->token(keys_[std::size_t(b)], p) : text_[std::size_t(b * length_ + p)];
    }

    std::span<const token_t> text_;
    const recall_task* task_ = nullptr;
    std::vector<std::uint64_t> keys_;
    index_t batch_, seq_len_;
    std::int64_t length_;
    std::int64_t position_ = 0;
};

segment_streams training_streams(const corpus& c, const settings& s) {
    if (c.task == task_kind::recall) return segment_streams(c.recall, c.seed * 2 + 0, s.batch, s.seq_len);
    return segment_streams(c.train, s.batch, s.seq_len, "training (90%)");
}
segment_streams validation_streams(const corpus& c, const settings& s) {
    if (c.task == task_kind::recall) return segment_streams(c.recall, c.seed * 2 + 1, s.batch, s.seq_len);
    return segment_streams(c.valid, s.batch, s.seq_len, "validation (10%)");
}

// ---------------------------------------------------------------------------------------------
// Optimiser: AdamW, AdamWarmup or Noam over the flat parameter buffer
// ---------------------------------------------------------------------------------------------

class trainer_optimizer {
public:
    trainer_optimizer(const settings& s, index_t n) : s_(s) {
        if (s.optimizer == "adamw") adamw_.emplace(n, mnemo::adamw_options{.lr = s.lr, .weight_decay = s.weight_decay});
        else labml_.emplace(n, mnemo::labml_adam_options{.lr = s.lr, .weight_decay = s.weight_decay});
    }

    mnemo::adam_state<float>& state() {
        if (adamw_) return *adamw_;
        return *labml_;
    }
    std::int64_t step_count() { return state().step_count(); }

    /// The rate of the next step (schedules count the steps already taken).
    double lr() {
        const std::int64_t t = step_count();
        if (s_.optimizer == "adam-warmup") return mnemo::adam_warmup_schedule(s_.lr, s_.warmup).lr(t);
        if (s_.optimizer == "noam") return mnemo::noam_schedule(s_.lr, s_.d_model, s_.warmup).lr(t);
        if (s_.schedule == "cosine") return mnemo::cosine_schedule(s_.lr, s_.steps, s_.lr / 10, s_.warmup).lr(t);
        return mnemo::linear_warmup_schedule(s_.lr, s_.warmup).lr(t);
    }
    void step(mnemo::parameter_set<float>& ps, double lr) {
        if (adamw_) adamw_->step(ps, lr);
        else labml_->step(ps, lr);
    }

private:
    const settings& s_;
    std::optional<mnemo::adamw<float>> adamw_;
    std::optional<mnemo::labml_adam<float>> labml_;
};

// ---------------------------------------------------------------------------------------------
// The model and what it carries across segments: the compressive / XL memory, or nothing (feedback)
// ---------------------------------------------------------------------------------------------

/// The model's construction options.
template <class Model>
auto model_options(const settings& s, index_t vocab) {
    if constexpr (ex::is_feedback_model<Model>)
        return mnemo::feedback_options{.vocab = vocab, .n_layers = s.n_layers, .d_ff = s.d_ff, .n_pos = s.n_pos};
    else
        return mnemo::compressive_options{.vocab = vocab,
                                          .n_layers = s.n_layers,
                                          .d_ff = s.d_ff,
                                          .n_pos = s.n_pos,
                                          .residual = s.residual,
                                          .norm = s.norm,
                                          .memory_layers = s.memory_layers,
                                          .reconstruction = s.reconstruction};
}

/// What the Feedback Transformer carries from one segment to the next: nothing (every sequence starts
/// from an empty memory, as the reference trains). Stands in for the other models' memory.
struct no_memory {
    void reset(index_t, index_t) {}
};

/// An empty memory for `batch` streams.
template <class Model>
auto make_memory(Model& model, const settings& s, index_t batch) {
    if constexpr (ex::is_feedback_model<Model>) {
        return no_memory{};
    } else {
        auto memory = model.make_memory(s.mem_len, s.c_mem_len);
        memory.reset(batch, s.seq_len);
        return memory;
    }
}
template <class Model>
using memory_of = decltype(make_memory(std::declval<Model&>(), std::declval<const settings&>(), index_t()));

/// One segment: forward and losses, and with `train` backward (parameter gradients +=); the memory is
/// read and then updated (compressive / XL).
template <class Model>
mnemo::segment_losses run_segment(Model& model, std::span<const token_t> inputs, std::span<const token_t> targets,
                                  index_t batch, memory_of<Model>& memory, bool train) {
    if constexpr (ex::is_feedback_model<Model>)
        return {.ce = train ? model.train_segment(inputs, targets, batch) : model.eval_segment(inputs, targets, batch)};
    else
        return train ? model.train_segment(inputs, targets, batch, memory)
                     : model.eval_segment(inputs, targets, batch, memory);
}

/// ", GRU residuals, post-LN, memory in layers 2,3" for the variants in use ("" for none).
std::string variant_description(const settings& s) {
    std::string d;
    if (s.residual == mnemo::residual_kind::gru) d += ", GRU-gated residuals";
    if (s.norm == mnemo::norm_kind::post) d += ", post-LN";
    if (!s.memory_layers.empty())
        d += std::string(", memory only in layer") + (s.memory_layers.size() > 1 ? "s " : " ") +
             ex::format_memory_layers(s.memory_layers);
    if (s.model == ex::model_kind::compressive && s.reconstruction == mnemo::reconstruction_kind::autoencoding)
        d += ", auto-encoding loss";
    return d;
}

/// "Compressive Transformer (conv compression, rate 2)" and the like.
std::string model_description(const settings& s) {
    switch (s.model) {
        case ex::model_kind::compressive:
            return std::string("Compressive Transformer (") + ex::name(s.compression) + " compression, rate " +
                   std::to_string(s.rate) + variant_description(s) + ")";
        case ex::model_kind::xl: {
            const std::string v = variant_description(s);
            return v.empty() ? "Transformer-XL" : "Transformer-XL (" + v.substr(2) + ")";
        }
        case ex::model_kind::feedback: return "Feedback Transformer (per-layer keys/values)";
        case ex::model_kind::feedback_kv: return "Feedback Transformer (shared keys/values)";
    }
    return "?";
}

// ---------------------------------------------------------------------------------------------
// Evaluation and sampling
// ---------------------------------------------------------------------------------------------

struct validation_result {
    double ce = 0, ar = 0;        // means over segments (CE in nats)
    std::int64_t segments = 0;
    std::int64_t answers = 0, correct = 0;  // recall task
    double accuracy() const { return answers ? double(correct) / double(answers) : 0.0; }
};

/// Validation from the start of the validation streams with a fresh memory; max_segments 0 = one pass.
template <class Model>
validation_result validate(Model& model, segment_streams streams, const settings& s, std::int64_t max_segments) {
    settings es = s;  // validation's memory lengths (--eval-mem-len, --eval-c-mem-len)
    es.mem_len = s.eval_mem_len;
    es.c_mem_len = s.eval_c_mem_len;
    auto memory = make_memory(model, es, s.batch);
    const std::int64_t n =
        max_segments > 0 ? std::min(max_segments, streams.segments_per_pass()) : streams.segments_per_pass();
    std::vector<token_t> inputs, targets;
    validation_result v;
    for (std::int64_t i = 0; i < n; ++i) {
        streams.next(inputs, targets);
        const mnemo::segment_losses l = run_segment(model, inputs, targets, s.batch, memory, /*train=*/false);
        v.ce += l.ce;
        v.ar += l.ar;
        const auto logits = model.logits();  // [Q·B, vocab]
        for (index_t r = 0; r < logits.rows(); ++r) {
            if (!streams.scored_answer(r)) continue;
            const float* row = logits.row(r);
            const token_t best = token_t(std::max_element(row, row + logits.cols()) - row);
            ++v.answers;
            v.correct += best == targets[std::size_t(r)];
        }
    }
    v.segments = n;
    v.ce /= double(std::max<std::int64_t>(n, 1));
    v.ar /= double(std::max<std::int64_t>(n, 1));
    return v;
}

/// The next token from a row of logits: argmax when temperature is 0, else a draw from softmax(l/T).
token_t pick_token(const float* logits, index_t vocab, double temperature, mnemo::rng& r) {
    if (temperature <= 0) return token_t(std::max_element(logits, logits + vocab) - logits);
    const double top = *std::max_element(logits, logits + vocab);
    std::vector<double> p(static_cast<std::size_t>(vocab));
    double sum = 0;
    for (index_t i = 0; i < vocab; ++i) sum += p[std::size_t(i)] = std::exp((double(logits[i]) - top) / temperature);
    double u = r.uniform() * sum;
    for (index_t i = 0; i < vocab; ++i)
        if ((u -= p[std::size_t(i)]) < 0) return token_t(i);
    return token_t(vocab - 1);
}

/// Feedback Transformer: continues `prompt` by `count` tokens with the generator, one step per token
/// over the cached keys and values of the earlier ones: the prompt and the continuation are one
/// sequence from an empty memory, as the reference samples. A sequence spans at most n_pos + 1 tokens;
/// at that length the generator starts again from the last seq_len tokens (re-fed from empty).
template <class Model>
std::string sample_feedback(Model& model, const vocabulary& vocab, std::span<const token_t> prompt,
                            const settings& s, std::int64_t count, double temperature, mnemo::rng& r) {
    auto generator = model.generator(1);
    const index_t window = s.n_pos + 1;
    generator.reserve(std::min<index_t>(window, index_t(prompt.size()) + index_t(count)));
    std::vector<token_t> text;  // every token fed
    const auto feed = [&](token_t t) {
        text.push_back(t);
        if (generator.length() == window) {
            generator.reset();
            for (std::size_t i = text.size() - std::size_t(s.seq_len); i + 1 < text.size(); ++i)
                generator.step(std::span<const token_t>(&text[i], 1));
        }
        return generator.step(std::span<const token_t>(&text.back(), 1));  // [1, vocab]
    };
    if (prompt.empty()) fail("--prompt is empty");
    for (std::size_t i = 0; i + 1 < prompt.size(); ++i) feed(prompt[i]);
    auto logits = feed(prompt.back());
    std::string out;
    for (std::int64_t k = 0; k < count; ++k) {
        const token_t next = pick_token(logits.row(0), logits.cols(), temperature, r);
        out += vocab.byte(next);
        if (k + 1 == count) break;
        logits = feed(next);
    }
    return out;
}

/// Continues `prompt` by `count` tokens, carrying a memory of batch 1 as the reference streams: the
/// prompt in segments of up to seq_len, then one token per segment (the memory then oscillates
/// between mem_len + 1 − c and mem_len slots, one compression every c tokens).
template <class Model>
std::string sample_with_memory(Model& model, const vocabulary& vocab, std::span<const token_t> prompt,
                               const settings& s, std::int64_t count, double temperature, mnemo::rng& r) {
    auto memory = make_memory(model, s, 1);
    // The generation cache: memory keys and values are projected once per slot, not once per token.
    struct cache_scope {
        Model& m;
        ~cache_scope() { m.cache_memory_projections(false); }
    } scope{model};
    model.cache_memory_projections(true);
    for (std::size_t i = 0; i < prompt.size(); i += std::size_t(s.seq_len)) {
        model.forward(prompt.subspan(i, std::min(prompt.size() - i, std::size_t(s.seq_len))), 1, memory);
        model.update_memory(memory);
    }
    std::string out;
    for (std::int64_t k = 0; k < count; ++k) {
        const auto logits = model.logits();  // the last forward's [rows, vocab]; its last row predicts next
        const token_t next = pick_token(logits.row(logits.rows() - 1), logits.cols(), temperature, r);
        out += vocab.byte(next);
        if (k + 1 == count) break;
        model.forward(std::span<const token_t>(&next, 1), 1, memory);
        model.update_memory(memory);
    }
    return out;
}

/// Continues `prompt` by `count` tokens (greedy at temperature 0), the way the model runs.
template <class Model>
std::string sample(Model& model, const vocabulary& vocab, std::span<const token_t> prompt, const settings& s,
                   std::int64_t count, double temperature, mnemo::rng& r) {
    if constexpr (ex::is_feedback_model<Model>) return sample_feedback(model, vocab, prompt, s, count, temperature, r);
    else return sample_with_memory(model, vocab, prompt, s, count, temperature, r);
}

// ---------------------------------------------------------------------------------------------
// Checkpoints: PATH (model) + PATH.state.safetensors (trainer state)
// ---------------------------------------------------------------------------------------------

/// The trainer's state besides the parameters.
template <class Model>
struct run_state {
    trainer_optimizer& optimizer;
    memory_of<Model>& memory;
    segment_streams& train;
    mnemo::rng& sample_rng;
};

template <class Model>
void save_checkpoint(const std::string& path, Model& model, const settings& s, const corpus& c,
                     run_state<Model>& st) {
    auto meta = settings_metadata(s);
    meta["step"] = std::to_string(st.optimizer.step_count());
    meta["vocab_hex"] = c.vocab.hex();
    meta["data_fingerprint"] = c.fingerprint;
    const auto& ps = model.parameters();

    // The model file (what mnemo_eval and tools/reference_eval.py read) and the state file, written as
    // one: a crash at any instant leaves the previous pair or this one (mnemo/train/checkpoint.hpp).
    mnemo::checkpoint_writer cw(path);
    mnemo::add_parameter_buffer(cw.model(), ps, ps.values(), "");
    cw.model().set_metadata(meta);
    mnemo::safetensors_writer& w = cw.state();
    auto& opt = st.optimizer.state();
    mnemo::add_parameter_buffer(w, ps, opt.exp_avg().data(), "optimizer.exp_avg.");
    mnemo::add_parameter_buffer(w, ps, opt.exp_avg_sq().data(), "optimizer.exp_avg_sq.");
    const std::int64_t step = opt.step_count(), sample_offset = std::int64_t(st.sample_rng.offset());
    const std::vector<std::int64_t> offsets = st.train.offsets();
    w.add("trainer.step", {1}, &step);
    w.add("trainer.data_position", {std::int64_t(offsets.size())}, offsets.data());
    w.add("trainer.sample_rng", {1}, &sample_offset);
    w.add("trainer.vocab", {c.vocab.size()}, c.vocab.bytes.data());
    if constexpr (!ex::is_feedback_model<Model>) {  // the Feedback Transformer carries no memory
        const std::int64_t b = s.batch, d = s.d_model;
        for (index_t slot = 0; slot < model.n_memory_layers(); ++slot) {  // named by layer
            const std::string p = "memory." + std::to_string(model.memory_layer(slot));
            w.add(p + ".mem", {st.memory.mem_slots(), b, d}, st.memory.mem(slot).data());
            w.add(p + ".c_mem", {st.memory.c_mem_slots(), b, d}, st.memory.c_mem(slot).data());
            if constexpr (Model::needs_usage)  // most-used compression: the attention each row received
                w.add(p + ".usage", {st.memory.mem_slots(), b}, st.memory.usage(slot));
        }
    }
    w.set_metadata(meta);
    cw.commit();
}

/// A checkpoint read for resuming: the model file and the state file.
struct checkpoint_files {
    mnemo::safetensors_file model, state;
};

checkpoint_files read_checkpoint(const std::string& path) {
    std::error_code ec;
    if (!std::filesystem::exists(path, ec)) fail("--resume: checkpoint '", path, "' does not exist");
    const std::string state_path = path + state_suffix;
    switch (mnemo::recover_checkpoint(path)) {  // a save that a crash interrupted
        case mnemo::checkpoint_recovery::rolled_forward:
            std::printf("--resume: completed the save of '%s' that was interrupted\n", path.c_str());
            break;
        case mnemo::checkpoint_recovery::discarded:
            std::printf("--resume: removed the unfinished save of '%s'; the previous checkpoint is intact\n",
                        path.c_str());
            break;
        case mnemo::checkpoint_recovery::none: break;
    }
    if (!std::filesystem::exists(state_path, ec))
        fail("--resume: '", state_path, "' (the trainer state saved with '", path,
             "') does not exist; a model-only file (from --export) cannot be resumed");
    checkpoint_files f{mnemo::read_safetensors(path), mnemo::read_safetensors(state_path)};
    const auto& st = f.state.metadata();
    if (!st.contains("format") || st.at("format") != "mnemo-train-1")
        fail("--resume: '", state_path, "' is not a train state file (no format mnemo-train-1 in its metadata)");
    mnemo::check_checkpoint_pair(f.model, f.state);
    return f;
}

template <class Model>
void restore_checkpoint(const checkpoint_files& f, Model& model, const settings& s, run_state<Model>& st) {
    auto& ps = model.parameters();
    mnemo::load_parameters(f.model, ps);  // strict: every tensor, the model's shapes

    const std::int64_t step = mnemo::read_state_count(f.state, "trainer.step");
    std::vector<float> m(std::size_t(ps.size()), 0.0f), v(std::size_t(ps.size()), 0.0f);
    mnemo::read_parameter_buffer(f.state, ps, m.data(), "optimizer.exp_avg.");
    mnemo::read_parameter_buffer(f.state, ps, v.data(), "optimizer.exp_avg_sq.");
    st.optimizer.state().set_state(step, m, v);

    st.train.set_offsets(f.state.to_vector<std::int64_t>("trainer.data_position"));
    const std::int64_t sample_offset = mnemo::read_state_count(f.state, "trainer.sample_rng");
    st.sample_rng.set_state(st.sample_rng.seed(), std::uint64_t(sample_offset));

    st.memory.reset(s.batch, s.seq_len);
    if constexpr (!ex::is_feedback_model<Model>) {  // the memory layers, in the memory's slot order
        std::vector<index_t> layers;
        for (index_t slot = 0; slot < model.n_memory_layers(); ++slot) layers.push_back(model.memory_layer(slot));
        mnemo::read_state_memory(f.state, layers, s.batch, s.d_model, st.memory);
    }
}

/// The checkpoint's vocabulary (trainer.vocab), and a check that the data is the one it was trained on.
vocabulary checkpoint_vocabulary(const checkpoint_files& f) {
    return vocabulary::of_bytes(mnemo::read_state_bytes(f.state, "trainer.vocab"));
}

void check_data_matches(const corpus& c, const checkpoint_files& f) {
    const auto& m = f.state.metadata();
    const auto it = m.find("data_fingerprint");
    if (it != m.end() && it->second != c.fingerprint)
        fail("--resume: the data differs from the data the checkpoint was trained on (fingerprint ", c.fingerprint,
             ", checkpoint ", it->second, "); resume with the same --data file");
    if (checkpoint_vocabulary(f).bytes != c.vocab.bytes)
        fail("--resume: the checkpoint's vocabulary differs from the data's");
}

// ---------------------------------------------------------------------------------------------
// Training
// ---------------------------------------------------------------------------------------------

struct run_result {
    validation_result final;
    double seconds = 0;
    std::int64_t steps = 0;
};

/// The reconstruction loss's label in progress lines: ar (attention reconstruction) or ae (auto-encoding).
const char* aux_loss_name(const settings& s) {
    return s.reconstruction == mnemo::reconstruction_kind::autoencoding ? "ae" : "ar";
}

void print_validation(std::int64_t step, const validation_result& v, const settings& s, double seconds) {
    std::printf("valid  step %6" PRId64 ": loss %.4f bits/char", step, v.ce / ln2);
    if (s.c_mem_len > 0) std::printf("  %s %.5f", aux_loss_name(s), v.ar);
    if (v.answers) std::printf("  recall accuracy %.3f (%" PRId64 " answers)", v.accuracy(), v.answers);
    std::printf("  [%" PRId64 " segments × %td streams, %.1fs]\n", v.segments, s.batch, seconds);
    std::fflush(stdout);
}

template <class Model>
run_result train_model(const settings& s, const corpus& c, const checkpoint_files* resume) {
    const auto t_start = std::chrono::steady_clock::now();
    const auto seconds_since = [](auto t0) {
        return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    };
    constexpr bool feedback = ex::is_feedback_model<Model>;
    Model model(model_options<Model>(s, c.vocab.size()));
    model.reset_parameters(s.seed);
    if constexpr (!ex::is_feedback_model<Model>) model.set_clamp_len(s.clamp_len);
    auto& ps = model.parameters();
    trainer_optimizer optimizer(s, ps.size());
    auto memory = make_memory(model, s, s.batch);
    segment_streams train = training_streams(c, s);
    const segment_streams valid = validation_streams(c, s);
    mnemo::rng sample_rng(splitmix64(s.seed ^ 0x53414D504C45ull));
    run_state<Model> st{optimizer, memory, train, sample_rng};
    if (resume) {
        restore_checkpoint(*resume, model, s, st);
        std::printf("resumed from %s at step %" PRId64, s.resume.c_str(), optimizer.step_count());
        if constexpr (!feedback)
            std::printf(" (memory %td + %td compressed slots)", memory.mem_slots(), memory.c_mem_slots());
        std::printf("\n");
    }

    std::printf("model: %s, d_model %td, heads %td, d_ff %td, %td layer%s, n_pos %td, %td parameters\n",
                model_description(s).c_str(), s.d_model, s.heads, s.d_ff, s.n_layers, s.n_layers == 1 ? "" : "s",
                s.n_pos, ps.count());
    if constexpr (feedback) std::printf("       seq_len %td (each from an empty memory)", s.seq_len);
    else std::printf("       seq_len %td, mem_len %td, c_mem_len %td", s.seq_len, s.mem_len, s.c_mem_len);
    std::printf(", batch %td; %s lr %g", s.batch, s.optimizer.c_str(), s.lr);
    if (s.optimizer == "adamw") std::printf(" (%s, warm-up %" PRId64, s.schedule.c_str(), s.warmup);
    else std::printf(" (warm-up %" PRId64, s.warmup);
    std::printf(", weight decay %g)", s.weight_decay);
    std::printf(", clip %g, %" PRId64 " steps, seed %" PRIu64 "\n", s.clip, s.steps, s.seed);

    std::vector<token_t> prompt;
    if (s.prompt) prompt = c.vocab.encode(*s.prompt, "--prompt");
    else if (c.task == task_kind::text) prompt = c.vocab.encode(c.valid_text, "the validation text");
    else {
        // Recall: a validation stream up to just after a query whose key is in the prompt.
        prompt = valid.head(3 * recall_task::episode_len);
        while (prompt.size() > recall_task::episode_len && c.vocab.byte(prompt.back()) != recall_task::query)
            prompt.pop_back();
    }
    if (prompt.empty() && (s.sample_len > 0 || s.eval_sample > 0)) fail("--prompt is empty");
    const auto print_sample = [&](const char* label, std::int64_t count, double temperature) {
        const std::string out = sample(model, c.vocab, prompt, s, count, temperature, sample_rng);
        std::string p;
        for (token_t t : prompt) p += c.vocab.byte(t);
        std::printf("%s:\n%s|%s\n", label, printable(p).c_str(), printable(out).c_str());
        std::fflush(stdout);
    };
    // Periodic validations read --eval-segments; the final one the whole validation text (recall: the
    // streams never end, so --eval-segments again).
    const auto run_validation = [&](std::int64_t step, bool final) {
        const auto t0 = std::chrono::steady_clock::now();
        const validation_result v =
            validate(model, valid, s, final && c.task == task_kind::text ? 0 : s.eval_segments);
        print_validation(step, v, s, seconds_since(t0));
        if (s.eval_sample > 0) print_sample("sample (greedy)", s.eval_sample, 0.0);
        return v;
    };
    std::int64_t last_saved = resume ? optimizer.step_count() : -1;  // the step of the checkpoint on disk
    const auto save = [&](const std::string& why) {
        save_checkpoint(s.checkpoint, model, s, c, st);
        last_saved = optimizer.step_count();
        std::printf("saved %s and %s%s (%s, step %" PRId64 ")\n", s.checkpoint.c_str(), s.checkpoint.c_str(),
                    state_suffix, why.c_str(), optimizer.step_count());
        std::fflush(stdout);
    };

    // The loop: one segment per step, the memory carried (feedback: none); the optimiser's counter is the step.
    std::vector<token_t> inputs, targets;
    const std::int64_t first = optimizer.step_count();
    double train_seconds = 0, log_seconds = 0, log_ce = 0, log_ar = 0, log_norm = 0;  // timing excludes validation
    std::int64_t log_n = 0;
    // --stop-at ends this session early; the schedules still span --steps.
    const std::int64_t end = s.stop_at > 0 ? std::min(s.stop_at, s.steps) : s.steps;
    for (std::int64_t step = first; step < end; ++step) {
        const auto t_step = std::chrono::steady_clock::now();
        if (train.next(inputs, targets)) memory.reset(s.batch, s.seq_len);  // a new pass over the text
        ps.zero_grad();
        const mnemo::segment_losses l = run_segment(model, inputs, targets, s.batch, memory, /*train=*/true);
        const double norm = s.clip > 0 ? mnemo::clip_grad_norm(ps, s.clip) : mnemo::grad_norm(ps);
        // A NaN or infinity stops the run before the optimizer step would spread it into the parameters;
        // the last checkpoint on disk is the last good one.
        if (!std::isfinite(l.ce) || !std::isfinite(l.ar) || !std::isfinite(norm)) {
            const bool ce_bad = !std::isfinite(l.ce), ar_bad = !ce_bad && !std::isfinite(l.ar);
            fail("step ", step + 1, ": ",
                 ce_bad ? "the loss" : ar_bad ? "the reconstruction loss" : "the gradient norm", " is ",
                 format_double(ce_bad ? l.ce : ar_bad ? l.ar : norm), "; stopped before the optimizer step (",
                 last_saved < 0 ? std::string("nothing was saved") :
                                  "the last checkpoint, '" + s.checkpoint + "' at step " + std::to_string(last_saved) +
                                      ", is kept",
                 "; a lower --lr or a --clip may help)");
        }
        const double lr = optimizer.lr();
        optimizer.step(ps, lr);
        const double step_seconds = seconds_since(t_step);
        train_seconds += step_seconds;
        log_seconds += step_seconds;
        log_ce += l.ce;
        log_ar += l.ar;
        log_norm += norm;
        ++log_n;
        const std::int64_t done = step + 1;
        if (done % s.log_every == 0 || done == end) {
            const double per_step = log_seconds / double(log_n);  // since the last progress line
            const double eta = train_seconds / double(done - first) * double(s.steps - done);
            std::printf("step %6" PRId64 "/%" PRId64 "  loss %.4f bits/char", done, s.steps,
                        log_ce / double(log_n) / ln2);
            if (s.c_mem_len > 0) std::printf("  %s %.5f", aux_loss_name(s), log_ar / double(log_n));
            std::printf("  |grad| %.3f  lr %.3g  %.0f tok/s  %.1f ms/step  ETA %s\n", log_norm / double(log_n), lr,
                        double(s.seq_len * s.batch) / per_step, 1e3 * per_step,
                        format_duration(eta).c_str());
            std::fflush(stdout);
            log_seconds = log_ce = log_ar = log_norm = 0;
            log_n = 0;
        }
        if (s.eval_every > 0 && done % s.eval_every == 0 && done != end) run_validation(done, false);
        if (!s.checkpoint.empty() && s.save_every > 0 && done % s.save_every == 0 && done != end)
            save("every " + std::to_string(s.save_every) + " steps");
    }
    run_result result;
    result.steps = optimizer.step_count() - first;
    result.seconds = seconds_since(t_start);
    result.final = run_validation(optimizer.step_count(), true);
    // Saved before the closing samples draw from the sampling RNG, so that a run resumed from here
    // samples exactly as an uninterrupted run would.
    if (!s.checkpoint.empty()) save("end of training");

    if (s.sample_len > 0) {
        print_sample("sample (greedy)", s.sample_len, 0.0);
        if (s.temperature > 0) {
            char label[48];
            std::snprintf(label, sizeof label, "sample (temperature %g)", s.temperature);
            print_sample(label, s.sample_len, s.temperature);
        }
    }
    if (!s.export_path.empty()) {
        auto meta = settings_metadata(s);
        meta["step"] = std::to_string(optimizer.step_count());
        meta["vocab_hex"] = c.vocab.hex();
        mnemo::save_parameters(s.export_path, ps, mnemo::dtype::f32, meta);
        std::printf("exported the model to %s\n", s.export_path.c_str());
    }
    return result;
}

run_result run(const settings& s, const corpus& c, const checkpoint_files* resume) {
    return ex::with_model(s.d_model, s.heads, s.rate, s.model, s.compression,
                          [&]<class Model>() { return train_model<Model>(s, c, resume); });
}

}  // namespace

/// Fails now, not after hours of training, where `flag`'s output file cannot be written: its directory
/// must exist and be writable, and the path must not be a directory.
void check_writable(const char* flag, const std::string& path) {
    if (path.empty()) return;
    namespace fs = std::filesystem;
    std::error_code ec;
    if (fs::is_directory(path, ec)) fail(flag, ": '", path, "' is a directory; give a file name");
    fs::path dir = fs::path(path).parent_path();
    if (dir.empty()) dir = ".";
    if (!fs::is_directory(dir, ec)) fail(flag, ": cannot write '", path, "': the directory '", dir.string(), "' does not exist");
    if (::access(dir.c_str(), W_OK | X_OK) != 0)
        fail(flag, ": cannot write '", path, "': the directory '", dir.string(), "' is not writable");
}

int main(int argc, char** argv) try {
    // A file-size limit (ulimit -f) then fails a save with EFBIG, reported by name, instead of killing us.
    std::signal(SIGXFSZ, SIG_IGN);
    const command_line cl = parse_command_line(argc, argv);
    if (cl.help) {
        std::fputs(usage_text, stdout);
        return 0;
    }
    std::optional<checkpoint_files> resume;
    if (cl.has("--resume")) resume = read_checkpoint(cl.given.at("--resume"));
    const settings s = resolve_settings(cl, resume ? &resume->state.metadata() : nullptr);
    check_writable("--checkpoint", s.checkpoint);
    check_writable("--export", s.export_path);
    omp_set_num_threads(s.threads);

    corpus c = s.task == task_kind::text ? load_text_corpus(s.data) : make_recall_corpus(s.seed);
    if (resume) check_data_matches(c, *resume);

    const char* mode = s.compare ? "main job: recall task, Compressive Transformer vs Transformer-XL"
                       : resume  ? "resuming a checkpoint"
                                 : "training one model";
    std::printf("train: %s\n", mode);
    std::printf("data: %s\n", c.description.c_str());
    std::printf("threads: %d\n", s.threads);
    std::fflush(stdout);

    if (!s.compare) {
        run(s, c, resume ? &*resume : nullptr);
        return 0;
    }
    // The main job: the same settings with and without the compressed memory.
    const run_result comp = run(s, c, nullptr);
    settings xl = s;
    xl.model = ex::model_kind::xl;
    xl.c_mem_len = 0;
    xl.eval_c_mem_len = 0;
    std::printf("\n");
    const run_result plain = run(xl, c, nullptr);
    std::printf("\nrecall accuracy: compressive %.3f, transformer-xl %.3f (chance %.3f; %" PRId64
                " validation answers each; %.0fs + %.0fs)\n",
                comp.final.accuracy(), plain.final.accuracy(), 1.0 / double(recall_task::keys.size()),
                comp.final.answers, comp.seconds, plain.seconds);
    std::printf("validation loss: compressive %.4f, transformer-xl %.4f bits/char\n", comp.final.ce / ln2,
                plain.final.ce / ln2);
    return 0;
} catch (const std::exception& e) {
    // std::bad_alloc and std::length_error (a vector past max_size) both mean: too big for this machine.
    const bool out_of_memory = dynamic_cast<const std::bad_alloc*>(&e) || dynamic_cast<const std::length_error*>(&e);
    std::fprintf(stderr, "%s\n",
                 out_of_memory ? "mnemo: train: out of memory: the model, --batch or the memory lengths are too large "
                                 "for this machine"
                               : e.what());
    return 1;
}
