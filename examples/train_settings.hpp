#pragma once
// train's settings (examples/train.cpp): its flags, the settings of a run resolved from them (a flag,
// else the checkpoint's metadata when resuming, else the default of the task and model), the
// checkpoint metadata they are saved as, and the --save-config file that replays them.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <mnemo/io/safetensors.hpp>

#include "cli.hpp"
#include "model_zoo.hpp"

namespace mnemo::examples::train_program {

using mnemo::index_t;
namespace ex = mnemo::examples;

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

// ---------------------------------------------------------------------------------------------
// Command line and settings: flags over checkpoint metadata over defaults
// ---------------------------------------------------------------------------------------------

constexpr const char* train_flags[] = {
    "--data", "--task", "--model", "--compression", "--residual", "--norm", "--memory-layers", "--reconstruction",
    "--d-model", "--heads", "--rate", "--d-ff", "--layers", "--n-pos", "--seq-len", "--mem-len", "--c-mem-len",
    "--batch", "--clamp-len", "--optimizer", "--lr", "--warmup", "--schedule", "--weight-decay", "--clip", "--steps",
    "--stop-at", "--seed", "--threads", "--device", "--eval-every", "--eval-segments", "--eval-mem-len", "--eval-c-mem-len",
    "--log-every", "--metrics", "--checkpoint", "--save-every", "--resume", "--export", "--save-config",
    "--sample-len", "--eval-sample", "--prompt", "--greedy", "--temperature", "--top-k", "--top-p"};

// A value read from checkpoint metadata or a flag (examples/cli.hpp's parsers; flags have passed its
// range checks already, checkpoint values are checked here).
std::int64_t parse_integer(const std::string& flag, const std::string& s) {
    const auto v = ex::whole_integer(s);
    if (!v) fail(flag, " expects an integer, got '", s, "'");
    return *v;
}

double parse_real(const std::string& flag, const std::string& s) {
    const auto v = ex::finite_number(s);
    if (!v) fail(flag, " expects a number, got '", s, "'");
    return *v;
}

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
    double temperature = 0.8, top_p = 1.0;
    index_t top_k = 0;
    bool greedy = false;
    std::optional<std::string> prompt;
    std::string checkpoint, resume, export_path, metrics, save_config;
    int threads = 1;
    ex::device_kind device = ex::device_kind::cpu;
};

const char* task_name(task_kind t) { return t == task_kind::text ? "text" : "recall"; }

/// Resolves each setting: an explicit flag, else the checkpoint's value (when resuming), else the
/// default. Model and data settings must agree with the checkpoint ("strict"); recipe settings (steps,
/// lr, ...) may be changed on resume, with a note.
class setting_resolver {
public:
    enum class kind { strict, recipe };

    setting_resolver(const ex::command_line& cl, const mnemo::safetensors_metadata* checkpoint)
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
    static const char* key_of(const char* flag) { return ex::flag(flag).metadata_key; }

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

    const ex::command_line& cl_;
    const mnemo::safetensors_metadata* ckpt_;
};

// Upper bounds of the size flags (examples/cli.hpp checks flags against the same).
constexpr std::int64_t max_extent = std::int64_t(1) << 24, max_batch = std::int64_t(1) << 20, max_layers = 4096,
                       max_threads = 4096;

settings resolve_settings(const ex::command_line& cl, const mnemo::safetensors_metadata* ckpt) {
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
    if (cl.has("--device")) s.device = ex::parse_device_kind(cl.at("--device"));
    ex::check_device(s.device);  // before any data is read
    if (cl.has("--temperature")) s.temperature = parse_real("--temperature", cl.at("--temperature"));
    if (s.temperature < 0) fail("--temperature must be >= 0, got ", s.temperature);
    s.greedy = cl.has("--greedy");
    s.top_k = run_int("--top-k", 0, 0, max_extent);
    if (cl.has("--top-p")) s.top_p = parse_real("--top-p", cl.at("--top-p"));
    if (!(s.top_p > 0 && s.top_p <= 1)) fail("--top-p must be in (0, 1], got ", s.top_p);
    if (s.greedy)
        for (const char* flag : {"--temperature", "--top-k", "--top-p"})
            if (cl.has(flag)) fail("--greedy samples by argmax: ", flag, " does not apply");
    if (cl.has("--metrics")) s.metrics = cl.at("--metrics");
    if (cl.has("--save-config")) s.save_config = cl.at("--save-config");
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

/// The resolved settings as a --config file: every flag that has a value, so that `train --config
/// FILE` replays the run (the main job's comparison keeps --model out, as it was given).
std::vector<std::pair<std::string, std::string>> settings_as_flags(const settings& s) {
    std::vector<std::pair<std::string, std::string>> f;
    const auto add = [&](const char* flag, std::string v) { f.emplace_back(flag, std::move(v)); };
    const auto num = [](auto v) { return std::to_string(v); };
    if (s.task == task_kind::text) add("--data", s.data);
    else add("--task", "recall");
    if (!s.compare) add("--model", ex::name(s.model));
    const bool feedback = ex::is_feedback(s.model), xl = s.model == ex::model_kind::xl;
    if (!feedback) {
        if (!xl) add("--compression", ex::name(s.compression));
        add("--residual", ex::name(s.residual));
        add("--norm", ex::name(s.norm));
        add("--memory-layers", ex::format_memory_layers(s.memory_layers));
        if (!xl) add("--reconstruction", ex::name(s.reconstruction));
        add("--rate", num(s.rate));
    }
    add("--d-model", num(s.d_model));
    add("--heads", num(s.heads));
    add("--d-ff", num(s.d_ff));
    add("--layers", num(s.n_layers));
    add("--n-pos", num(s.n_pos));
    add("--seq-len", num(s.seq_len));
    if (!feedback) {
        add("--mem-len", num(s.mem_len));
        add("--c-mem-len", num(s.c_mem_len));
        add("--clamp-len", num(s.clamp_len));
        add("--eval-mem-len", num(s.eval_mem_len));
        add("--eval-c-mem-len", num(s.eval_c_mem_len));
    }
    add("--batch", num(s.batch));
    add("--optimizer", s.optimizer);
    if (s.optimizer == "adamw") add("--schedule", s.schedule);
    add("--lr", format_double(s.lr));
    add("--warmup", num(s.warmup));
    add("--weight-decay", format_double(s.weight_decay));
    add("--clip", format_double(s.clip));
    add("--steps", num(s.steps));
    if (s.stop_at > 0) add("--stop-at", num(s.stop_at));
    add("--seed", num(s.seed));
    add("--eval-every", num(s.eval_every));
    add("--eval-segments", num(s.eval_segments));
    add("--log-every", num(s.log_every));
    add("--sample-len", num(s.sample_len));
    add("--eval-sample", num(s.eval_sample));
    if (s.prompt) add("--prompt", *s.prompt);
    if (s.greedy) add("--greedy", "true");
    else {
        add("--temperature", format_double(s.temperature));
        add("--top-k", num(s.top_k));
        add("--top-p", format_double(s.top_p));
    }
    if (!s.checkpoint.empty()) add("--checkpoint", s.checkpoint);
    if (s.save_every > 0) add("--save-every", num(s.save_every));
    if (!s.export_path.empty()) add("--export", s.export_path);
    if (!s.metrics.empty()) add("--metrics", s.metrics);
    return f;
}


}  // namespace mnemo::examples::train_program
