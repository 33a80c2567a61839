#pragma once
// The command lines of train and mnemo_eval, on CLI11: every flag either program takes is defined
// once, in the table below (its value's kind, range, help text and help group), and each program
// names the rows it takes. Parsing yields the flags as given (name → text; `--flag value`,
// `--flag=value`, or a line `flag = value` of a --config file, command-line flags winning); the
// programs then resolve each setting (a flag, else the checkpoint's value, else the default) and
// check what depends on other settings. A value of the wrong kind or out of its range fails here,
// one line naming the flag.
#include <CLI/CLI.hpp>

#include <charconv>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <mnemo/core/error.hpp>

namespace mnemo::examples {

enum class flag_kind { integer, real, text, toggle };

/// One flag. Integers and reals carry their range; texts and toggles none (their choices are checked
/// where they are resolved). metadata_key: the checkpoint metadata key a trainer setting is saved
/// under (nullptr: not saved).
struct flag_spec {
    const char* name;
    flag_kind kind;
    const char* group;
    const char* value;  // the value's name in --help
    const char* help;
    double min = 0, max = 0;
    const char* metadata_key = nullptr;
};

// Upper bounds of the size flags: far above any real run, low enough that products of them cannot
// overflow index_t; a run too large for the machine's memory ends with the out-of-memory message.
inline constexpr double max_extent = double(std::int64_t(1) << 24), max_batch = double(std::int64_t(1) << 20),
                        max_layers = 4096, max_threads = 4096, max_count = 9.0e18;
inline constexpr double no_max = std::numeric_limits<double>::infinity();

inline constexpr const char* g_what = "What to train";
inline constexpr const char* g_variants = "Variants of the compressive / XL model (all default to labml's reference model)";
inline constexpr const char* g_model = "Model";
inline constexpr const char* g_optim = "Optimisation";
inline constexpr const char* g_eval = "Evaluation and checkpoints";
inline constexpr const char* g_sample = "Sampling";
inline constexpr const char* g_files = "Files";

// clang-format off
inline const flag_spec flag_table[] = {
    {"--data", flag_kind::text, g_what, "FILE", "character-level LM on FILE (90% train / 10% validation)", 0, 0, "data"},
    {"--task", flag_kind::text, g_what, "recall", "the built-in recall task (the default without --data); without --model it trains the Compressive Transformer and then Transformer-XL and compares them", 0, 0, "task"},
    {"--model", flag_kind::text, g_what, "compressive|xl|feedback|feedback-kv", "default compressive; xl = no compressed memory; feedback = the Feedback Transformer (per-layer keys/values), feedback-kv = with shared keys/values: every segment from an empty memory, no --mem-len, --c-mem-len, --rate, --compression", 0, 0, "model"},
    {"--compression", flag_kind::text, g_what, "conv|max|mean|dilated|most-used", "compression function f_c (default conv); dilated: a stack of log2(rate) stride-2 convolutions; most-used: keeps the most-attended slot of each group", 0, 0, "compression"},
    {"--residual", flag_kind::text, g_variants, "add|gru", "residual connections, or GRU gates (lucidrains' gru_gated_residual) (add)", 0, 0, "residual"},
    {"--norm", flag_kind::text, g_variants, "pre|post", "LayerNorm before each sub-layer (labml) or after each residual (the paper) (pre)", 0, 0, "norm"},
    {"--memory-layers", flag_kind::text, g_variants, "L", "the layers that keep memory, e.g. 2,3,4 (lucidrains' memory_layers) (all)", 0, 0, "memory_layers"},
    {"--reconstruction", flag_kind::text, g_variants, "attention|autoencoding", "the compression function's loss: attention reconstruction (labml) or the paper's auto-encoding loss with a ConvTranspose1d decoder (attention)", 0, 0, "reconstruction"},
    {"--d-model", flag_kind::integer, g_model, "N", "model width (text 128, recall 64, feedback text 512); shapes not compiled in run the generic kernels", 1, max_extent, "d_model"},
    {"--heads", flag_kind::integer, g_model, "N", "attention heads (4; feedback text 8)", 1, max_extent, "heads"},
    {"--rate", flag_kind::integer, g_model, "N", "compression rate (2)", 1, max_extent, "compression_rate"},
    {"--d-ff", flag_kind::integer, g_model, "N", "feed-forward width (text 256, recall 128, feedback text 2048)", 1, max_extent, "d_ff"},
    {"--layers", flag_kind::integer, g_model, "N", "layers (text 6, recall 2)", 1, max_layers, "n_layers"},
    {"--n-pos", flag_kind::integer, g_model, "N", "relative positions P of the positional tables (text 4096, recall 64)", 1, max_extent, "n_pos"},
    {"--seq-len", flag_kind::integer, g_model, "N", "tokens per segment (8; feedback 128, recall 64)", 1, max_extent, "seq_len"},
    {"--mem-len", flag_kind::integer, g_model, "N", "memory slots (8; feedback: none)", 0, max_extent, "mem_len"},
    {"--c-mem-len", flag_kind::integer, g_model, "N", "compressed memory slots (text 128, recall 16; xl and feedback 0)", 0, max_extent, "c_mem_len"},
    {"--batch", flag_kind::integer, g_model, "N", "parallel streams (32; feedback text 64)", 1, max_batch, "batch"},
    {"--clamp-len", flag_kind::integer, g_model, "N", "distances above N use the positional embedding of N (Transformer-XL's clamp_len; 0: off, the default)", 0, max_extent, "clamp_len"},
    {"--optimizer", flag_kind::text, g_optim, "adamw|adam-warmup|noam", "adam-warmup: labml's AdamWarmup, the reference's \"AdamW\" (text default); adamw: torch.optim.AdamW (recall default); noam: labml's Noam (lr is a multiplier, default 1; feedback text default)", 0, 0, "optimizer"},
    {"--lr", flag_kind::real, g_optim, "X", "learning rate (text 2.5e-4, recall 1e-3, noam 1)", 0, no_max, "lr"},
    {"--warmup", flag_kind::integer, g_optim, "N", "adam-warmup/noam 2000; adamw: linear warm-up steps (text 0, recall 100 or steps/10)", 0, max_count, "warmup"},
    {"--schedule", flag_kind::text, g_optim, "constant|cosine", "adamw only (text constant, recall cosine: decays to lr/10)", 0, 0, "schedule"},
    {"--weight-decay", flag_kind::real, g_optim, "X", "adamw 0.01, adam-warmup/noam 0", 0, no_max, "weight_decay"},
    {"--clip", flag_kind::real, g_optim, "X", "global gradient-norm clip (1.0; 0 turns it off)", 0, no_max, "clip"},
    {"--steps", flag_kind::integer, g_optim, "N", "total optimizer steps (text 2000, recall 5000)", 0, max_count, "steps"},
    {"--stop-at", flag_kind::integer, g_optim, "N", "stop (validate, save) after step N of the --steps run; resume later to go on", 0, max_count},
    {"--seed", flag_kind::integer, g_optim, "N", "initialisation and recall data (1)", 0, max_count, "seed"},
    {"--threads", flag_kind::integer, g_optim, "N", "OpenMP threads (default: all cores)", 1, max_threads},
    {"--device", flag_kind::text, g_optim, "cpu|cuda", "where the model runs (cpu); cuda: the GPU, in a build with the CUDA backend"},
    {"--eval-every", flag_kind::integer, g_eval, "N", "validation every N steps (text 500, recall 1000; 0: only at the end)", 0, max_count},
    {"--eval-segments", flag_kind::integer, g_eval, "N", "segments per stream of each periodic validation (text 100, 0: all; recall 128); the final validation reads the whole validation text (recall: N segments)", 0, max_count},
    {"--eval-mem-len", flag_kind::integer, g_eval, "N", "memory slots of validation (default --mem-len); not a parameter, so any length with c_mem + mem + seq_len <= n_pos", 0, max_extent},
    {"--eval-c-mem-len", flag_kind::integer, g_eval, "N", "compressed memory slots of validation (default --c-mem-len)", 0, max_extent},
    {"--log-every", flag_kind::integer, g_eval, "N", "progress line every N steps (text 100, recall 500)", 1, max_count},
    {"--metrics", flag_kind::text, g_eval, "FILE", "also write one JSON line per progress line and per validation to FILE (appended on --resume; tools/plot.sh draws it)"},
    {"--checkpoint", flag_kind::text, g_eval, "PATH", "save PATH (model) and PATH.state.safetensors (trainer state) at the end"},
    {"--save-every", flag_kind::integer, g_eval, "N", "also save every N steps (0)", 0, max_count},
    {"--resume", flag_kind::text, g_eval, "PATH", "continue from PATH and PATH.state.safetensors; hyper-parameters come from the checkpoint (--steps, --lr, ... may override the recipe; model shapes may not)"},
    {"--export", flag_kind::text, g_eval, "PATH", "write the model alone (no trainer state) at the end"},
    {"--save-config", flag_kind::text, g_eval, "FILE", "write this run's resolved settings to FILE (TOML) and go on; --config FILE replays them"},
    {"--sample-len", flag_kind::integer, g_sample, "N", "characters sampled at the end (text 200, recall 40; 0: none)", 0, max_extent},
    {"--eval-sample", flag_kind::integer, g_sample, "N", "also sample N characters (greedy) at each validation (0)", 0, max_extent},
    {"--prompt", flag_kind::text, g_sample, "TEXT", "sampling prompt (default: the start of the validation text)"},
    {"--greedy", flag_kind::toggle, g_sample, "", "only the greedy sample (by default a greedy sample, then a drawn one)"},
    {"--temperature", flag_kind::real, g_sample, "X", "the drawn sample's temperature (0.8; 0: no drawn sample)", 0, no_max},
    {"--top-k", flag_kind::integer, g_sample, "N", "the drawn sample keeps the N most likely tokens (0: all)", 0, max_extent},
    {"--top-p", flag_kind::real, g_sample, "X", "the drawn sample keeps the smallest set of tokens whose probability reaches X (1: all)", 0, 1},
    // mnemo_eval's own.
    {"--tokens", flag_kind::text, g_files, "T.safetensors", "one I64 or I32 tensor 'tokens' [batch, n_tokens]"},
    {"--out", flag_kind::text, g_files, "O.safetensors", "output: logits, ce_loss, ar_loss (written atomically)"},
};
// clang-format on

inline const flag_spec& flag(std::string_view name) {
    for (const flag_spec& f : flag_table)
        if (name == f.name) return f;
    detail::fail("examples/cli.hpp: no flag ", name);
}

/// The flags as given: name → text ("true" for a toggle).
struct command_line {
    std::map<std::string, std::string> given;
    bool has(const std::string& f) const { return given.contains(f); }
    const std::string& at(const std::string& f) const { return given.at(f); }
};

/// A whole decimal integer (the whole of s: no spaces, no '+', in range), or nothing.
inline std::optional<long long> whole_integer(const std::string& s) {
    long long x = 0;
    const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), x);
    if (s.empty() || ec != std::errc() || end != s.data() + s.size()) return std::nullopt;
    return x;
}
/// A finite number (the whole of s), or nothing.
inline std::optional<double> finite_number(const std::string& s) {
    std::size_t used = 0;
    double x = 0;
    try {
        x = std::stod(s, &used);
    } catch (const std::exception&) {
        return std::nullopt;
    }
    if (s.empty() || used != s.size() || !std::isfinite(x)) return std::nullopt;
    return x;
}

/// "N" ranges: a whole decimal integer in [min, max]; "X": a finite number in [min, max].
inline CLI::Validator range_validator(const flag_spec& f) {
    return CLI::Validator(
        [f](std::string& s) -> std::string {
            const auto bound = [&](double b) {
                char t[32];
                if (f.kind == flag_kind::integer) std::snprintf(t, sizeof t, "%lld", (long long)b);
                else std::snprintf(t, sizeof t, "%g", b);
                return std::string(t);
            };
            double x = 0;
            if (f.kind == flag_kind::integer) {
                const auto v = whole_integer(s);
                if (!v) return "expects an integer, got '" + s + "'";
                x = double(*v);
            } else {
                const auto v = finite_number(s);
                if (!v) return "expects a number, got '" + s + "'";
                x = *v;
            }
            if (x < f.min) return "must be at least " + bound(f.min) + ", got " + s;
            if (x > f.max) return "must be at most " + bound(f.max) + ", got " + s;
            return {};
        },
        "", "range");
}

/// Parses argv with the given flags (and --config FILE, --help); help_overrides replaces the table's
/// help text of a flag where the program means something else by it. Returns false when --help was
/// printed. Errors are mnemo::error, one line naming the program and the flag.
inline bool parse_command_line(const char* program, const std::string& description, std::span<const char* const> flags,
                               int argc, char** argv, command_line& out, const std::string& footer = {},
                               const std::map<std::string, std::string>& help_overrides = {}) {
    CLI::App app(description, program);
    app.allow_extras(true);
    app.set_config("--config", "", "read flags from a TOML or INI file (as --save-config writes); flags on the command line win");
    app.get_config_ptr()->group(g_files);
    app.footer(footer);
    app.get_formatter()->column_width(34);
    std::map<std::string, std::string> texts;
    std::map<std::string, CLI::Option*> options;
    for (const char* name : flags) {
        const flag_spec& f = flag(name);
        const auto over = help_overrides.find(name);
        const std::string help = over != help_overrides.end() ? over->second : f.help;
        CLI::Option* o = nullptr;
        if (f.kind == flag_kind::toggle) {
            o = app.add_flag(f.name, help);
        } else {
            o = app.add_option(f.name, texts[f.name], help)->type_name(f.value);
            o->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);
            o->allow_extra_args(false);
            if (f.kind == flag_kind::integer || f.kind == flag_kind::real) o->check(range_validator(f));
        }
        o->group(f.group);
        options[f.name] = o;
    }
    try {
        app.parse(argc, argv);
    } catch (const CLI::CallForHelp&) {
        std::fputs(app.help().c_str(), stdout);
        return false;
    } catch (const CLI::ValidationError& e) {
        // "--batch: expects an integer, got 'x'" → "--batch expects an integer, got 'x'"
        std::string m = e.what();
        if (const auto colon = m.find(": "); colon != std::string::npos) m.erase(colon, 1);
        detail::fail(program, ": ", m);
    } catch (const CLI::FileError& e) {
        detail::fail(program, ": --config: ", e.what());
    } catch (const CLI::ParseError& e) {
        std::string m = e.what();
        if (const auto nl = m.find('\n'); nl != std::string::npos) m.resize(nl);
        if (m.find("required") != std::string::npos && m.find("missing") != std::string::npos) {
            // "--steps: 1 required TEXT missing"
            detail::fail(program, ": option ", m.substr(0, m.find(':')), " needs a value");
        }
        detail::fail(program, ": ", m, " (try --help)");
    }
    for (const std::string& r : app.remaining()) {
        if (r.starts_with("-")) detail::fail(program, ": unknown option '", r.substr(0, r.find('=')), "' (try --help)");
        detail::fail(program, ": unexpected argument '", r, "' (flags take the form --name value; try --help)");
    }
    for (const auto& [name, o] : options) {
        if (o->count() == 0) continue;
        if (o->count() > 1) detail::fail(program, ": option ", name, " given twice");
        out.given[name] = flag(name).kind == flag_kind::toggle ? "true" : texts[name];
    }
    return true;
}

/// A TOML file that --config reads back: `name = value` per setting (names without the dashes),
/// texts quoted. Written atomically.
inline void write_config(const std::string& path, const std::vector<std::pair<std::string, std::string>>& settings,
                         const std::string& comment) {
    std::string s = "# " + comment + "\n";
    for (const auto& [name, value] : settings) {
        const flag_spec& f = flag(name);
        s += std::string(name).substr(2) + " = ";
        if (f.kind == flag_kind::text) {
            s += '"';
            for (char c : value) {
                if (c == '"' || c == '\\') s += '\\';
                s += c;
            }
            s += '"';
        } else {
            s += value;
        }
        s += '\n';
    }
    const std::string tmp = path + ".tmp";
    std::FILE* f = std::fopen(tmp.c_str(), "wb");
    MNEMO_CHECK(f, "--save-config: cannot write '", path, "'");
    const bool ok = std::fwrite(s.data(), 1, s.size(), f) == s.size();
    MNEMO_CHECK(std::fclose(f) == 0 && ok && std::rename(tmp.c_str(), path.c_str()) == 0, "--save-config: cannot write '",
                path, "'");
}

}  // namespace mnemo::examples
