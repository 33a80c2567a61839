// train: character-level language modelling with the Compressive Transformer (Rae et al., 2019) or
// Transformer-XL (Dai et al., 2019), trained as labml's compressive experiment does, or with the
// Feedback Transformer (Fan et al., 2020), trained as labml's feedback experiment does. The training
// itself is the library's (mnemo/trainer/: the streams, the loop, checkpoints, metrics); this program
// is its command line: flags (examples/cli.hpp), settings, and what it prints.
//
//   train                                  the main job: the built-in recall task, trains the
//                                          Compressive Transformer and then Transformer-XL with the same
//                                          settings and prints both recall accuracies
//   train --task recall --model xl         the recall task with one model
//   train --data FILE [--model compressive|xl|feedback|feedback-kv]
//                                          any text file; defaults are the reference experiment's
//   train --resume CKPT [--steps N]        continues a saved run bit for bit
//   train --config run.toml                the settings of a run saved with --save-config
//   train --help                           every flag
//
// Settings: each comes from its flag (or a --config file), else the checkpoint's metadata when
// resuming, else the default of the task and model. Model and data settings must agree with the
// checkpoint; recipe settings (steps, lr, ...) may be changed on resume, with a note.
//
// Data: the text is split 90/10 into training and validation, each read as `batch` streams
// (mnemo/trainer/streams.hpp); the vocabulary is the file's distinct bytes, sorted. The recall task
// (the default without --data) is described there too. Its defaults were chosen by measurement (2
// cores, about 2–4 ms a step): d_model 64, 4 heads, rate 2, 2 layers, d_ff 128, c_mem_len 16 (32
// tokens), n_pos 64, AdamW lr 1e-3 with a cosine decay, 5000 steps. Compressive accuracy 0.999 /
// 0.997 / 0.996 for seeds 1–3 (0.98 with mean, 0.99 with max pooling); Transformer-XL 0.11–0.15,
// chance. A constant lr 1e-3 reached 0.85–0.99.
//
// The Feedback Transformer (--model feedback: per-layer keys/values; feedback-kv: shared ones). On text
// the defaults are labml's feedback experiment: d_model 512, 8 heads, d_ff 2048, 6 layers, n_pos 4096,
// seq_len 128, batch 64, Noam with lr 1 and 2000 warm-up steps (the reference shuffles its sequences;
// here they are read from the streams). Every segment starts from an empty memory, in training and
// validation alike (docs/reference.md §16): no state is carried, so --mem-len and --c-mem-len must be 0 and
// a checkpoint holds no memory. On the recall task the recall recipe applies, with seq_len 64 so that
// a sequence can hold a key and its answer.
//
// Variants of the compressive / XL model (compressive_options): --residual gru, --norm post,
// --memory-layers L (compressive and xl) and --reconstruction autoencoding, --compression
// dilated|most-used (compressive). They are model settings: saved in the metadata, taken from it on
// resume, and an error if a flag disagrees with it.
//
// Checkpoints (--checkpoint PATH): PATH holds the model alone (usable by mnemo_eval and
// tools/reference_eval.py), PATH.state.safetensors what resuming needs besides it; both written as one
// (mnemo/trainer/trainer.hpp, docs/checkpoints.md). A resumed run continues bit for bit: k steps, save,
// resume, k steps equals 2k steps (tests/train_resume.cmake checks the files bytewise), with any
// --threads. --export PATH writes the model file alone, at the end.
//
// --device cuda trains on the GPU (a build with the CUDA backend, docs/cuda.md): the same trainer and
// checkpoints (a checkpoint written on one device resumes on the other), one process.
//
// Several processes (a build with MPI; docs/distributed.md): `mpirun -np N train ...` trains one model
// with N ranks, each on an equal share of the --batch streams (mnemo/trainer/trainer.hpp). Every rank
// reads the data file itself; rank 0 reads the checkpoint for --resume and sends it to the others, and
// alone prints, logs metrics and writes files. The ranks' settings must agree. An error that every
// rank meets (a bad flag, a missing file on some rank, a failed save) ends every rank with one message
// from rank 0; any other ends the job through MPI_Abort.
#include <omp.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cinttypes>
#include <cmath>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <limits>
#include <new>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <mnemo/mnemo.hpp>
#if MNEMO_WITH_MPI
#include <mnemo/dist/mpi.hpp>
#endif

#include "cli.hpp"
#include "model_zoo.hpp"
#include "train_settings.hpp"

namespace {

using mnemo::index_t;
using mnemo::token_t;
namespace ex = mnemo::examples;

constexpr double ln2 = 0.69314718055994530942;
constexpr const char* state_suffix = mnemo::checkpoint_state_suffix;

using namespace mnemo::examples::train_program;

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

// ---------------------------------------------------------------------------------------------
// Data
// ---------------------------------------------------------------------------------------------

using vocabulary = mnemo::byte_vocabulary;  // sorted distinct bytes; token id = index
using mnemo::recall_task;

/// The data: a text split 90/10, or the recall task (train and validation streams from separate keys).
struct corpus {
    task_kind task = task_kind::text;
    vocabulary vocab;
    std::vector<token_t> train, valid;  // text
    mnemo::recall_task recall;
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

// This rank's share of the --batch streams.
mnemo::segment_streams training_streams(const corpus& c, const settings& s, mnemo::stream_slice slice) {
    if (c.task == task_kind::recall) return mnemo::segment_streams(c.recall, c.seed * 2 + 0, s.batch, s.seq_len, slice);
    return mnemo::segment_streams(c.train, s.batch, s.seq_len, "training (90%)", slice);
}
mnemo::segment_streams validation_streams(const corpus& c, const settings& s, mnemo::stream_slice slice) {
    if (c.task == task_kind::recall) return mnemo::segment_streams(c.recall, c.seed * 2 + 1, s.batch, s.seq_len, slice);
    return mnemo::segment_streams(c.valid, s.batch, s.seq_len, "validation (10%)", slice);
}

// ---------------------------------------------------------------------------------------------
// The model and the trainer
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


mnemo::trainer_options trainer_options_of(const settings& s) {
    return {.batch = s.batch,
            .seq_len = s.seq_len,
            .mem_len = s.mem_len,
            .c_mem_len = s.c_mem_len,
            .eval_mem_len = s.eval_mem_len,
            .eval_c_mem_len = s.eval_c_mem_len,
            .optimizer = mnemo::parse_optimizer_kind(s.optimizer, "--optimizer"),
            .schedule = mnemo::parse_schedule_kind(s.schedule, "--schedule"),
            .lr = s.lr,
            .weight_decay = s.weight_decay,
            .clip = s.clip,
            .warmup = s.warmup,
            .steps = s.steps,
            .d_model = s.d_model,
            .seed = s.seed};
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
// Training
// ---------------------------------------------------------------------------------------------

struct run_result {
    mnemo::validation_result final;
    double seconds = 0;
    std::int64_t steps = 0;
};

/// The reconstruction loss's label in progress lines: ar (attention reconstruction) or ae (auto-encoding).
const char* aux_loss_name(const settings& s) {
    return s.reconstruction == mnemo::reconstruction_kind::autoencoding ? "ae" : "ar";
}

void print_validation(std::int64_t step, const mnemo::validation_result& v, const settings& s, double seconds) {
    std::printf("valid  step %6" PRId64 ": loss %.4f bits/char", step, v.ce / ln2);
    if (s.c_mem_len > 0) std::printf("  %s %.5f", aux_loss_name(s), v.ar);
    if (v.answers) std::printf("  recall accuracy %.3f (%" PRId64 " answers)", v.accuracy(), v.answers);
    std::printf("  [%" PRId64 " segments × %td streams, %.1fs]\n", v.segments, s.batch, seconds);
    std::fflush(stdout);
}

template <class Model>
run_result train_model(const settings& s, const corpus& c, const mnemo::trainer_checkpoint_files* resume,
                       mnemo::metrics_log& metrics, mnemo::communicator& comm) {
    const auto t_start = std::chrono::steady_clock::now();
    const auto seconds_since = [](auto t0) {
        return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    };
    constexpr bool feedback = ex::is_feedback_model<Model>;
    const bool printer = comm.rank() == 0;  // the others' stdout is /dev/null; skip their samples
    // Each rank meets the same errors here (the settings agree), so agree() ends them all with one.
    std::optional<Model> model_storage;
    comm.agree([&] {
        model_storage.emplace(model_options<Model>(s, c.vocab.size()));
        model_storage->reset_parameters(s.seed);
        if constexpr (!feedback) model_storage->set_clamp_len(s.clamp_len);
    });
    Model& model = *model_storage;
    auto& ps = model.parameters();
    const mnemo::stream_slice slice = mnemo::stream_slice_of(s.batch, comm);
    mnemo::trainer<Model> t(model, trainer_options_of(s), c.vocab, training_streams(c, s, slice),
                            validation_streams(c, s, slice), comm);
    if (resume) {
        comm.agree([&] { t.restore(*resume, s.resume); });
        std::printf("resumed from %s at step %" PRId64, s.resume.c_str(), t.step_count());
        if constexpr (!feedback)
            std::printf(" (memory %td + %td compressed slots)", t.memory().mem_slots(), t.memory().c_mem_slots());
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
        prompt = t.validation_streams().head(3 * recall_task::episode_len);
        while (prompt.size() > recall_task::episode_len && c.vocab.byte(prompt.back()) != recall_task::query)
            prompt.pop_back();
    }
    if (prompt.empty() && (s.sample_len > 0 || s.eval_sample > 0)) fail("--prompt is empty");
    const auto print_sample = [&](const char* label, std::int64_t count, const mnemo::sampling_options& how) {
        if (!printer) return;
        const std::string out = t.sample_text(prompt, count, how);
        std::string p;
        for (token_t tok : prompt) p += c.vocab.byte(tok);
        std::printf("%s:\n%s|%s\n", label, printable(p).c_str(), printable(out).c_str());
        std::fflush(stdout);
    };
    const std::string run_label = ex::name(s.model);
    const auto tokens_at = [&](std::int64_t step) { return step * std::int64_t(s.seq_len) * s.batch; };
    const auto on_validation = [&](std::int64_t step, const mnemo::validation_result& v, double seconds) {
        print_validation(step, v, s, seconds);
        metrics.valid(run_label, step, tokens_at(step), v.ce, v.ar, v.answers ? v.accuracy() : -1.0, v.segments,
                      seconds_since(t_start));
        if (s.eval_sample > 0) print_sample("sample (greedy)", s.eval_sample, {.greedy = true});
    };

    mnemo::fit_hooks hooks;
    hooks.on_log = [&](const mnemo::fit_progress& p) {
        std::printf("step %6" PRId64 "/%" PRId64 "  loss %.4f bits/char", p.step, p.steps, p.ce / ln2);
        if (s.c_mem_len > 0) std::printf("  %s %.5f", aux_loss_name(s), p.ar);
        std::printf("  |grad| %.3f  lr %.3g  %.0f tok/s  %.1f ms/step", p.grad_norm, p.lr, p.tokens_per_second,
                    1e3 * p.seconds_per_step);
        if (comm.size() > 1)
            std::printf("  exchange %.2f MB/step in %.1f ms", p.exchanged_bytes / 1e6, 1e3 * p.exchange_seconds_per_step);
        std::printf("  ETA %s\n", format_duration(p.eta_seconds).c_str());
        std::fflush(stdout);
        metrics.train(run_label, p.step, tokens_at(p.step), p.ce, p.ar, p.lr, p.grad_norm, p.tokens_per_second,
                      seconds_since(t_start));
    };
    hooks.on_validation = on_validation;
    hooks.checkpoint_metadata = [&] {
        auto meta = settings_metadata(s);
        meta["data_fingerprint"] = c.fingerprint;
        return meta;
    };
    const auto print_saved = [&](std::int64_t step, const std::string& why) {
        std::printf("saved %s and %s%s (%s, step %" PRId64 ")\n", s.checkpoint.c_str(), s.checkpoint.c_str(),
                    state_suffix, why.c_str(), step);
        std::fflush(stdout);
    };
    hooks.on_save = [&](std::int64_t step, const std::string&) {
        print_saved(step, "every " + std::to_string(s.save_every) + " steps");
    };

    // --stop-at ends this session early; the schedules still span --steps.
    const std::int64_t first = t.step_count();
    t.fit({.until = s.stop_at > 0 ? std::min(s.stop_at, s.steps) : s.steps,
           .log_every = s.log_every,
           .eval_every = s.eval_every,
           .eval_segments = s.eval_segments,
           .save_every = s.checkpoint.empty() ? 0 : s.save_every,
           .checkpoint = s.checkpoint},
          hooks);

    run_result result;
    result.steps = t.step_count() - first;
    result.seconds = seconds_since(t_start);
    // Periodic validations read --eval-segments; the final one the whole validation text (recall: the
    // streams never end, so --eval-segments again).
    {
        const auto t0 = std::chrono::steady_clock::now();
        result.final = t.validate(c.task == task_kind::text ? 0 : s.eval_segments);
        on_validation(t.step_count(), result.final, seconds_since(t0));
    }
    // Saved before the closing samples draw from the sampling RNG, so that a run resumed from here
    // samples exactly as an uninterrupted run would.
    if (!s.checkpoint.empty()) {
        t.save(s.checkpoint, hooks.checkpoint_metadata());
        print_saved(t.step_count(), "end of training");
    }

    if (s.sample_len > 0) {
        print_sample("sample (greedy)", s.sample_len, {.greedy = true});
        if (!s.greedy && s.temperature > 0) {
            char label[96];
            int n = std::snprintf(label, sizeof label, "sample (temperature %g", s.temperature);
            if (s.top_k > 0) n += std::snprintf(label + n, sizeof label - std::size_t(n), ", top-k %td", s.top_k);
            if (s.top_p < 1) n += std::snprintf(label + n, sizeof label - std::size_t(n), ", top-p %g", s.top_p);
            std::snprintf(label + n, sizeof label - std::size_t(n), ")");
            print_sample(label, s.sample_len, {.temperature = s.temperature, .top_k = s.top_k, .top_p = s.top_p});
        }
    }
    if (!s.export_path.empty() && printer) {
        auto meta = settings_metadata(s);
        meta["step"] = std::to_string(t.step_count());
        meta["vocab_hex"] = c.vocab.hex();
        mnemo::save_parameters(s.export_path, ps, mnemo::dtype::f32, meta);
        std::printf("exported the model to %s\n", s.export_path.c_str());
    }
    return result;
}

run_result run(const settings& s, const corpus& c, const mnemo::trainer_checkpoint_files* resume,
               mnemo::metrics_log& metrics, mnemo::communicator& comm) {
    return ex::with_model_on(s.device, s.d_model, s.heads, s.rate, s.model, s.compression,
                          [&]<class Model>() { return train_model<Model>(s, c, resume, metrics, comm); });
}

/// The checkpoint for --resume, after finishing or discarding a save that a crash interrupted (rank 0
/// reads it and sends it to the others).
mnemo::trainer_checkpoint_files read_checkpoint(const std::string& path, mnemo::communicator& comm) {
    const auto body = [](const char* what) {
        std::string m = what;
        return m.starts_with("mnemo: ") ? m.substr(7) : m;
    };
    try {
        return mnemo::read_trainer_checkpoint(
            path,
            [&](mnemo::checkpoint_recovery r) {
                if (r == mnemo::checkpoint_recovery::rolled_forward)
                    std::printf("--resume: completed the save of '%s' that was interrupted\n", path.c_str());
                else if (r == mnemo::checkpoint_recovery::discarded)
                    std::printf("--resume: removed the unfinished save of '%s'; the previous checkpoint is intact\n",
                                path.c_str());
            },
            comm);
    } catch (const mnemo::collective_error& e) {
        throw mnemo::collective_error("mnemo: train: --resume: " + body(e.what()));
    } catch (const mnemo::error& e) {
        fail("--resume: ", body(e.what()));
    }
}

/// What must be the same on every rank: every setting that shapes the run (not the paths of the files
/// rank 0 alone writes, nor --threads) and the data itself.
std::string run_signature(const settings& s, const corpus& c) {
    std::string sig;
    for (const auto& [flag, value] : settings_as_flags(s))
        if (flag != "--data" && flag != "--checkpoint" && flag != "--export" && flag != "--metrics")
            sig += flag + " " + value + "\n";
    return sig + "data fingerprint " + c.fingerprint + "\n";
}

/// The first line in which two signatures differ ("--d-model 64" against "--d-model 32").
std::string first_difference(const std::string& mine, const std::string& theirs) {
    std::size_t a = 0, b = 0;
    while (a < mine.size() || b < theirs.size()) {
        const std::size_t ea = std::min(mine.find('\n', a), mine.size()), eb = std::min(theirs.find('\n', b), theirs.size());
        const std::string la = mine.substr(a, ea - a), lb = theirs.substr(b, eb - b);
        if (la != lb) return "'" + la + "' here, '" + lb + "' on rank 0";
        a = ea + 1;
        b = eb + 1;
    }
    return "none";
}

void check_data_matches(const corpus& c, const mnemo::trainer_checkpoint_files& f) {
    const auto& m = f.state.metadata();
    const auto it = m.find("data_fingerprint");
    if (it != m.end() && it->second != c.fingerprint)
        fail("--resume: the data differs from the data the checkpoint was trained on (fingerprint ", c.fingerprint,
             ", checkpoint ", it->second, "); resume with the same --data file");
    if (mnemo::trainer_checkpoint_vocabulary(f).bytes != c.vocab.bytes)
        fail("--resume: the checkpoint's vocabulary differs from the data's");
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

namespace {

/// The processes of this run: MPI's when the build has it and mpirun started this one, else this
/// process alone.
#if MNEMO_WITH_MPI
using process_group = mnemo::mpi_session;
#else
struct process_group {
    process_group(int&, char**&) {}
    mnemo::communicator& communicator() { return mnemo::local_communicator(); }
    [[noreturn]] void abort(int code) { std::exit(code); }
};
#endif

int train_main(int argc, char** argv, mnemo::communicator& comm) {
    // A file-size limit (ulimit -f) then fails a save with EFBIG, reported by name, instead of killing us.
    std::signal(SIGXFSZ, SIG_IGN);
    const bool printer = comm.rank() == 0;
    ex::command_line cl;
    bool help = false;
    comm.agree([&] {
#if !MNEMO_WITH_MPI
        if (mnemo::launched_by_mpi())
            fail("this train was built without MPI, so under mpirun every process would train alone; install "
                 "libopenmpi-dev (tools/install-deps.sh) and rebuild");
#endif
        const std::string about =
            "train: the Compressive Transformer, Transformer-XL or the Feedback Transformer on a text file or the "
            "built-in recall task. Without flags: the main job (recall task, Compressive Transformer vs "
            "Transformer-XL).";
        help = !ex::parse_command_line("train", about, train_flags, argc, argv, cl,
                                       "Model shapes compiled in (others run the generic kernels):\n" +
                                           ex::supported_configs());
    });
    if (help) return 0;
    std::optional<mnemo::trainer_checkpoint_files> resume;
    if (cl.has("--resume")) resume = read_checkpoint(cl.at("--resume"), comm);
    std::optional<settings> resolved;
    std::optional<corpus> data;
    comm.agree([&] {
        resolved = resolve_settings(cl, resume ? &resume->state.metadata() : nullptr);
        const settings& s = *resolved;
        if (s.batch % comm.size() != 0)
            fail("--batch ", s.batch, " must be a multiple of the ", comm.size(), " ranks (each trains --batch / ",
                 comm.size(), " streams)");
        if (printer) {  // rank 0 alone writes files
            check_writable("--checkpoint", s.checkpoint);
            check_writable("--export", s.export_path);
            check_writable("--metrics", s.metrics);
            check_writable("--save-config", s.save_config);
        }
        data = s.task == task_kind::text ? load_text_corpus(s.data) : make_recall_corpus(s.seed);
        if (resume) check_data_matches(*data, *resume);
    });
    const settings& s = *resolved;
    const corpus& c = *data;
    if (comm.size() > 1) {  // one run: every rank's settings and data must be rank 0's
        const std::string mine = run_signature(s, c), first = comm.broadcast(mine, 0);
        comm.agree([&] {
            if (mine != first)
                fail("the settings or the data differ from rank 0's (", first_difference(mine, first),
                     "); every rank must run the same command on the same data");
        });
    }
    omp_set_num_threads(s.threads);
    std::optional<mnemo::metrics_log> metrics;
    comm.agree([&] {
        if (printer && !s.save_config.empty()) {
            ex::write_config(s.save_config, settings_as_flags(s), "train settings; replay with: train --config FILE");
            std::printf("wrote the settings to %s (train --config %s replays them)\n", s.save_config.c_str(),
                        s.save_config.c_str());
        }
        metrics.emplace(printer ? s.metrics : std::string(),
                        resume ? mnemo::read_state_count(resume->state, "trainer.step") : -1);
    });

    const char* mode = s.compare ? "main job: recall task, Compressive Transformer vs Transformer-XL"
                       : resume  ? "resuming a checkpoint"
                                 : "training one model";
    std::printf("train: %s\n", mode);
    std::printf("data: %s\n", c.description.c_str());
    if (s.device == ex::device_kind::cpu) std::printf("threads: %d", s.threads);
#ifdef MNEMO_WITH_CUDA
    else std::printf("device: %s", mnemo::cuda_runtime::describe().c_str());
#endif
    if (comm.size() > 1)
        std::printf(" per rank; processes: %s, %td streams each", comm.description().c_str(), s.batch / comm.size());
    std::printf("\n");
    std::fflush(stdout);

    if (!s.compare) {
        run(s, c, resume ? &*resume : nullptr, *metrics, comm);
        return 0;
    }
    // The main job: the same settings with and without the compressed memory.
    const run_result comp = run(s, c, nullptr, *metrics, comm);
    settings xl = s;
    xl.model = ex::model_kind::xl;
    xl.c_mem_len = 0;
    xl.eval_c_mem_len = 0;
    std::printf("\n");
    const run_result plain = run(xl, c, nullptr, *metrics, comm);
    std::printf("\nrecall accuracy: compressive %.3f, transformer-xl %.3f (chance %.3f; %" PRId64
                " validation answers each; %.0fs + %.0fs)\n",
                comp.final.accuracy(), plain.final.accuracy(), 1.0 / double(recall_task::keys.size()),
                comp.final.answers, comp.seconds, plain.seconds);
    std::printf("validation loss: compressive %.4f, transformer-xl %.4f bits/char\n", comp.final.ce / ln2,
                plain.final.ce / ln2);
    return 0;
}

}  // namespace

int main(int argc, char** argv) {
    std::optional<process_group> group;
    try {
        group.emplace(argc, argv);
    } catch (const std::exception& e) {
        std::fprintf(stderr, "%s\n", e.what());
        return 1;
    }
    mnemo::communicator& comm = group->communicator();
    if (comm.rank() != 0 && !std::freopen("/dev/null", "w", stdout)) std::fclose(stdout);  // rank 0 prints
    try {
        return train_main(argc, argv, comm);
    } catch (const mnemo::collective_error& e) {
        // Every rank threw it: rank 0 says it.
        if (comm.rank() == 0) std::fprintf(stderr, "%s\n", e.what());
        return 1;
    } catch (const std::exception& e) {
        // std::bad_alloc and std::length_error (a vector past max_size) both mean: too big for this machine.
        const bool out_of_memory = dynamic_cast<const std::bad_alloc*>(&e) || dynamic_cast<const std::length_error*>(&e);
        std::string m = out_of_memory ? "mnemo: train: out of memory: the model, --batch or the memory lengths are too "
                                        "large for this machine"
                                      : e.what();
        if (comm.size() > 1) {  // this rank alone: end every rank, or the others wait for it forever
            if (m.starts_with("mnemo: ")) m = m.substr(7);
            std::fprintf(stderr, "mnemo: rank %d: %s\n", comm.rank(), m.c_str());
            std::fflush(stderr);
            group->abort(1);
        }
        std::fprintf(stderr, "%s\n", m.c_str());
        return 1;
    }
}
