#pragma once
// trainer<Model>: the training loop of a segment-recurrent model (compressive_transformer, and
// Transformer-XL as its c_mem_len = 0 case) or of a feedback_transformer, as the reference trains:
// one segment of every stream per optimizer step, the memory carried from step to step.
//
//   mnemo::trainer t(model, options, vocab, train_streams, valid_streams);
//   for (...) { mnemo::step_result r = t.step(); ... }      // or t.fit(fit_options, hooks)
//   mnemo::validation_result v = t.validate(0);              // one pass over the validation streams
//   std::string s = t.sample(prompt, 200, {.greedy = true});
//   t.save("run.safetensors", metadata);                      // model file + state file, one commit
//   t.restore(mnemo::read_trainer_checkpoint("run.safetensors"));  // continues bit for bit
//
// A step: the next segment of the training streams (the memory is emptied when they start a new
// pass), zero the gradients, forward and backward (parameter gradients of the cross-entropy plus the
// compression's reconstruction loss), the global gradient norm (clipped when options.clip > 0), the
// learning rate of the step from the optimizer's schedule, the optimizer step. A NaN or infinity in the
// loss, the reconstruction loss or the gradient norm throws mnemo::error naming the step and which one,
// before the optimizer step would spread it into the parameters; the last checkpoint this trainer
// saved or restored is named in the message and left as it is.
//
// The optimizers (options.optimizer): adamw (torch.optim.AdamW, with a linear warm-up and a constant
// or cosine schedule), adam_warmup (labml's AdamWarmup, which the reference's experiment calls AdamW:
// labml_adam with lr·min(1, t/warmup)) and noam (labml's Noam: labml_adam with the Noam schedule).
//
// The checkpoint (docs/checkpoints.md): PATH holds the model alone, under the PyTorch state_dict
// names, with the caller's metadata; PATH.state.safetensors holds what resuming needs besides it:
// optimizer.exp_avg.<name>, optimizer.exp_avg_sq.<name>, trainer.step, trainer.data_position (each
// training stream's next segment), trainer.sample_rng (the sampling RNG's offset), trainer.vocab, and
// memory.<layer>.mem / .c_mem (/ .usage for most-used compression) for each memory layer. Both are
// written as one (mnemo/train/checkpoint.hpp): a crash at any instant leaves the previous pair or this
// one. A restored run continues bit for bit, with any thread count.
//
// Data parallelism (mnemo/dist/communicator.hpp, docs/distributed.md). Given a communicator of N
// processes (ranks), the options' batch is the whole run's and each rank reads an equal, contiguous
// share of the streams (stream_slice_of), so its memory holds its own streams and never travels. The
// trainer broadcasts rank 0's parameters at construction; a step averages the gradient over the ranks
// (only the live rows of the positional tables: gradient_averager) before the norm and the clip, and
// the losses, so every rank holds the same gradient, takes the same optimizer step and sees the same
// figures (a NaN stops every rank at the same step). validate() reads each rank's share of the
// validation streams and averages. save() gathers every stream's memory to rank 0, which alone writes
// the pair; an error there is thrown on every rank (collective_error). restore() reads the file's whole
// state and keeps this rank's streams, so a run may resume on another number of ranks. fit()'s hooks run
// on every rank with the same figures (print on rank 0). Bitwise the same run to run for a given N;
// across different N the gradient sums add in another order (float tolerance).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <deque>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "../core/error.hpp"
#include "../core/rng.hpp"
#include "../dist/communicator.hpp"
#include "../kernels/cpu/ops.hpp"
#include "../models/autoregressive.hpp"
#include "../train/checkpoint.hpp"
#include "../train/clip.hpp"
#include "../train/optimizer.hpp"
#include "../io/safetensors.hpp"
#include "../train/schedule.hpp"
#include "../train/text_data.hpp"
#include "streams.hpp"

namespace mnemo {

enum class optimizer_kind { adamw, adam_warmup, noam };
enum class schedule_kind { constant, cosine };

inline const char* name(optimizer_kind k) {
    switch (k) {
        case optimizer_kind::adamw: return "adamw";
        case optimizer_kind::adam_warmup: return "adam-warmup";
        case optimizer_kind::noam: return "noam";
    }
    return "?";
}
inline const char* name(schedule_kind k) { return k == schedule_kind::cosine ? "cosine" : "constant"; }

/// "adamw", "adam-warmup" or "noam"; `what` names the source in the error (a flag, a metadata key).
inline optimizer_kind parse_optimizer_kind(std::string_view s, std::string_view what = "optimizer") {
    for (optimizer_kind k : {optimizer_kind::adamw, optimizer_kind::adam_warmup, optimizer_kind::noam})
        if (s == name(k)) return k;
    detail::fail("unknown ", what, " '", s, "' (expected adamw, adam-warmup or noam)");
}
inline schedule_kind parse_schedule_kind(std::string_view s, std::string_view what = "schedule") {
    if (s == "constant") return schedule_kind::constant;
    if (s == "cosine") return schedule_kind::cosine;
    detail::fail("unknown ", what, " '", s, "' (expected constant or cosine)");
}

/// What a training run needs besides the model and the data.
struct trainer_options {
    index_t batch = 32, seq_len = 8;  // the streams' (checked against them)
    index_t mem_len = 8, c_mem_len = 0;
    index_t eval_mem_len = -1, eval_c_mem_len = -1;  // validation's memory lengths; -1: as in training
    optimizer_kind optimizer = optimizer_kind::adamw;
    schedule_kind schedule = schedule_kind::constant;  // adamw only: constant, or a cosine down to lr/10
    double lr = 1e-3;
    double weight_decay = 0.01;
    double clip = 1.0;            // global gradient-norm clip; 0: off
    std::int64_t warmup = 0;      // adamw: linear warm-up steps; adam_warmup, noam: their warm-up (>= 1)
    std::int64_t steps = 0;       // the run's length (the cosine schedule decays over it)
    index_t d_model = 0;          // noam's model size; 0: the model's own (trainer<Model> reads it)
    std::uint64_t seed = 1;       // the sampling RNG's
};

/// AdamW, AdamWarmup or Noam over the flat parameter buffer (in Backend's memory), and the learning
/// rate of each step.
template <class Backend = cpu>
class trainer_optimizer {
public:
    trainer_optimizer(const trainer_options& o, index_t n) : o_(o) {
        if (o.optimizer == optimizer_kind::adamw)
            adamw_.emplace(n, adamw_options{.lr = o.lr, .weight_decay = o.weight_decay});
        else
            labml_.emplace(n, labml_adam_options{.lr = o.lr, .weight_decay = o.weight_decay});
        MNEMO_CHECK(o.optimizer == optimizer_kind::adamw || o.schedule == schedule_kind::constant, "trainer: schedule ",
                    name(o.schedule), " is for the adamw optimizer; ", name(o.optimizer), " has its own");
        MNEMO_CHECK(o.optimizer != optimizer_kind::noam || o.d_model > 0,
                    "trainer: the noam optimizer needs options.d_model");
        (void)lr();  // checks the schedule's settings now
    }

    adam_state<float, Backend>& state() {
        if (adamw_) return *adamw_;
        return *labml_;
    }
    std::int64_t step_count() { return state().step_count(); }

    /// The rate of the next step (schedules count the steps already taken).
    double lr() {
        const std::int64_t t = step_count();
        switch (o_.optimizer) {
            case optimizer_kind::adam_warmup: return adam_warmup_schedule(o_.lr, o_.warmup).lr(t);
            case optimizer_kind::noam: return noam_schedule(o_.lr, o_.d_model, o_.warmup).lr(t);
            case optimizer_kind::adamw: break;
        }
        if (o_.schedule == schedule_kind::cosine) return cosine_schedule(o_.lr, o_.steps, o_.lr / 10, o_.warmup).lr(t);
        return linear_warmup_schedule(o_.lr, o_.warmup).lr(t);
    }
    void step(parameter_set<float, Backend>& ps, double lr) {
        if (adamw_) adamw_->step(ps, lr);
        else labml_->step(ps, lr);
    }

private:
    trainer_options o_;
    std::optional<adamw<float, Backend>> adamw_;
    std::optional<labml_adam<float, Backend>> labml_;
};

/// This rank's share of `batch` streams: an equal, contiguous slice (batch must divide evenly).
inline stream_slice stream_slice_of(index_t batch, const communicator& comm) {
    const index_t n = comm.size();
    MNEMO_CHECK(batch >= n && batch % n == 0, "the batch (", batch, " streams) must be a multiple of the ", n,
                " ranks, so that each rank trains as many streams");
    return {index_t(comm.rank()) * (batch / n), batch / n};
}

/// A model that carries a memory from segment to segment (compressive_transformer); the Feedback
/// Transformer starts every segment from an empty memory and has none.
template <class Model>
concept memory_model = requires(Model& m) { m.make_memory(index_t(), index_t()); };

/// Stands in for the memory of a model that carries none.
struct no_memory {
    void reset(index_t, index_t) {}
};

/// An empty memory of the given lengths for `batch` streams of segments of seq_len.
template <class Model>
auto make_trainer_memory(Model& model, index_t mem_len, index_t c_mem_len, index_t batch, index_t seq_len) {
    if constexpr (memory_model<Model>) {
        auto memory = model.make_memory(mem_len, c_mem_len);
        memory.reset(batch, seq_len);
        return memory;
    } else {
        return no_memory{};
    }
}

/// One optimizer step's figures.
struct step_result {
    std::int64_t step = 0;  // the step just taken, counted from 1
    double ce = 0;          // mean cross-entropy of the segment (nats)
    double ar = 0;          // the compression's reconstruction loss (0 where nothing was compressed)
    double grad_norm = 0;   // the global gradient norm before clipping
    double lr = 0;          // the step's learning rate
    double seconds = 0;     // wall time of the step
    std::uint64_t exchanged_bytes = 0;  // gradient bytes this rank summed with the others (0: one rank)
    double exchange_seconds = 0;        // wall time of that exchange and of the losses' (part of seconds)
};

/// A validation's figures: means over segments.
struct validation_result {
    double ce = 0, ar = 0;  // CE in nats
    std::int64_t segments = 0;
    std::int64_t answers = 0, correct = 0;  // recall task: answer positions scored, argmax right
    double accuracy() const { return answers ? double(correct) / double(answers) : 0.0; }
};

/// A checkpoint read for resuming: the model file and the state file.
struct trainer_checkpoint_files {
    safetensors_file model, state;
};

/// Reads PATH and PATH.state.safetensors for resuming, after finishing or discarding a save that a
/// crash interrupted (mnemo/train/checkpoint.hpp; `on_recovery`, when given, is told which). Errors name
/// the file: missing, a model-only file, a state file of another format, a pair from two runs.
///
/// With a communicator of several ranks, rank 0 alone touches the files (the recovery renames them)
/// and broadcasts their bytes, so the checkpoint needs to exist on rank 0's machine only; every rank
/// parses and checks them, and an error anywhere is thrown on every rank (collective_error).
inline trainer_checkpoint_files read_trainer_checkpoint(
    const std::string& path, const std::function<void(checkpoint_recovery)>& on_recovery = {},
    communicator& comm = local_communicator()) {
    const std::string state_path = checkpoint_state_path(path);
    trainer_checkpoint_files f;
    std::string model_bytes, state_bytes;
    const auto read_bytes = [](const std::string& file) {
        std::ifstream in(file, std::ios::binary);
        MNEMO_CHECK(in, "cannot open '", file, "' for reading");
        std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
        MNEMO_CHECK(!in.bad(), "cannot read '", file, "'");
        return bytes;
    };
    const auto check = [&] {
        const auto& st = f.state.metadata();
        MNEMO_CHECK(st.contains("format") && st.at("format") == "mnemo-train-1", "'", state_path,
                    "' is not a train state file (no format mnemo-train-1 in its metadata)");
        check_checkpoint_pair(f.model, f.state);
    };
    const auto read = [&] {
        std::error_code ec;
        MNEMO_CHECK(std::filesystem::exists(path, ec), "checkpoint '", path, "' does not exist");
        const checkpoint_recovery r = recover_checkpoint(path);
        if (on_recovery) on_recovery(r);
        MNEMO_CHECK(std::filesystem::exists(state_path, ec), "'", state_path, "' (the trainer state saved with '",
                    path, "') does not exist; a model-only file (from --export) cannot be resumed");
        if (comm.size() == 1) {
            f = {read_safetensors(path), read_safetensors(state_path)};
            check();
        } else {
            model_bytes = read_bytes(path);
            state_bytes = read_bytes(state_path);
        }
    };
    if (comm.size() == 1) {
        read();
        return f;
    }
    comm.agree([&] {
        if (comm.rank() == 0) read();
    });
    model_bytes = comm.broadcast(std::move(model_bytes), 0);
    state_bytes = comm.broadcast(std::move(state_bytes), 0);
    comm.agree([&] {
        f = {parse_safetensors(model_bytes.data(), model_bytes.size(), path),
             parse_safetensors(state_bytes.data(), state_bytes.size(), state_path)};
        check();
    });
    return f;
}

/// The vocabulary a checkpoint's state file holds (trainer.vocab).
inline byte_vocabulary trainer_checkpoint_vocabulary(const trainer_checkpoint_files& f) {
    return byte_vocabulary::of_bytes(read_state_bytes(f.state, "trainer.vocab"));
}

/// How fit() runs: until which step, how often it reports, validates and saves.
struct fit_options {
    std::int64_t until = 0;           // the step to stop after
    std::int64_t log_every = 100;     // on_log every N steps (and at the last one)
    std::int64_t eval_every = 0;      // on_validation every N steps, not at the last one; 0: never
    std::int64_t eval_segments = 0;   // segments per stream of those validations; 0: one pass
    std::int64_t save_every = 0;      // save every N steps, not at the last one; 0: never
    std::string checkpoint;           // where (required with save_every)
};

/// What fit() reports: means over the steps since the last report.
struct fit_progress {
    std::int64_t step = 0, steps = 0;  // done, and the run's length (options.steps)
    double ce = 0, ar = 0, grad_norm = 0, lr = 0;
    double tokens_per_second = 0, seconds_per_step = 0;
    double eta_seconds = 0;            // at the pace of this session's steps so far
    double train_seconds = 0;          // this session's step time so far (validation excluded)
    double exchanged_bytes = 0;        // gradient bytes summed per step and rank (0: one rank)
    double exchange_seconds_per_step = 0;  // the time those exchanges took, per step
};

/// fit()'s callbacks (each may be empty).
struct fit_hooks {
    std::function<void(const fit_progress&)> on_log;
    std::function<void(std::int64_t step, const validation_result&, double seconds)> on_validation;
    std::function<safetensors_metadata()> checkpoint_metadata;   // the model file's metadata for a save
    std::function<void(std::int64_t step, const std::string& path)> on_save;
};

template <class Model>
class trainer {
public:
    using backend_type = typename Model::backend_type;
    using memory_type = decltype(make_trainer_memory(std::declval<Model&>(), 0, 0, 0, 0));
    static constexpr bool carries_memory = memory_model<Model>;

    /// The model (its parameters initialised or loaded by the caller), the options, the vocabulary
    /// (saved with checkpoints, used to print samples) and the streams, which must have the options'
    /// batch and seq_len; with a communicator of several ranks, the streams are this rank's slice
    /// (stream_slice_of). The model, the vocabulary and the communicator must outlive the trainer.
    trainer(Model& model, const trainer_options& options, const byte_vocabulary& vocab, segment_streams train,
            segment_streams valid, communicator& comm = local_communicator())
        : model_(model),
          o_(with_model_width(options, model)),
          vocab_(vocab),
          comm_(comm),
          slice_(stream_slice_of(options.batch, comm)),
          train_(std::move(train)),
          valid_(std::move(valid)),
          optimizer_(o_, model.parameters().size()),
          memory_(make_trainer_memory(model, options.mem_len, options.c_mem_len, slice_.count, options.seq_len)),
          sample_rng_(splitmix64(options.seed ^ 0x53414D504C45ull)) {
        for (const segment_streams* s : {&train_, &valid_})
            MNEMO_CHECK(s->total_batch() == o_.batch && s->seq_len() == o_.seq_len && s->first_stream() == slice_.first &&
                            s->batch() == slice_.count,
                        "trainer: streams [", s->first_stream(), ", ", s->first_stream() + s->batch(), ") of batch ",
                        s->total_batch(), " and seq_len ", s->seq_len(), " for options of batch ", o_.batch,
                        " and seq_len ", o_.seq_len, " (rank ", comm.rank(), " of ", comm.size(), " reads streams [",
                        slice_.first, ", ", slice_.first + slice_.count, "))");
        MNEMO_CHECK(o_.clip >= 0 && std::isfinite(o_.clip), "trainer: clip must be >= 0, got ", o_.clip);
        if (o_.eval_mem_len < 0) o_.eval_mem_len = o_.mem_len;
        if (o_.eval_c_mem_len < 0) o_.eval_c_mem_len = o_.c_mem_len;
        if (comm_.size() > 1) {  // every rank starts from rank 0's parameters
            MNEMO_CHECK((std::is_same_v<backend_type, cpu>), "trainer: several ranks need a model on the CPU backend: "
                        "the gradient exchange (gradient_averager over the communicator) sums host memory, and this "
                        "model's parameters are on backend ", backend_type::name);
            auto& ps = model_.parameters();
            std::vector<float> values(std::size_t(ps.size()));
            ps.download_all_values(values);
            comm_.broadcast(values.data(), sizeof(float) * values.size(), 0);
            ps.upload_all_values(values);
        }
    }


    Model& model() { return model_; }
    communicator& comm() { return comm_; }
    /// The streams this rank trains.
    stream_slice slice() const { return slice_; }
    const trainer_options& options() const { return o_; }
    trainer_optimizer<backend_type>& optimizer() { return optimizer_; }
    memory_type& memory() { return memory_; }
    segment_streams& train_streams() { return train_; }
    const segment_streams& validation_streams() const { return valid_; }
    rng& sample_rng() { return sample_rng_; }
    std::int64_t step_count() { return optimizer_.step_count(); }
    /// The step of the checkpoint this trainer last saved or restored (-1: none) and its path.
    std::int64_t last_saved_step() const { return last_saved_; }
    const std::string& last_saved_path() const { return last_saved_path_; }

    /// One optimizer step (see the header comment).
    step_result step() {
        const auto t0 = std::chrono::steady_clock::now();
        auto& ps = model_.parameters();
        if (train_.next(inputs_, targets_)) memory_.reset(slice_.count, o_.seq_len);  // a new pass over the text
        ps.zero_grad();
        segment_losses l = run_segment(inputs_, targets_, memory_, /*train=*/true);
        double exchange_seconds = 0;
        if (comm_.size() > 1) {  // the mean over every rank's streams, as one process with the whole batch
            const auto e0 = std::chrono::steady_clock::now();
            if constexpr (std::is_same_v<backend_type, cpu>) averager_.reduce(comm_, ps);  // (checked at construction)
            double losses[2] = {l.ce, l.ar};
            comm_.sum(losses, 2);
            l.ce = losses[0] / double(comm_.size());
            l.ar = losses[1] / double(comm_.size());
            exchange_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - e0).count();
        }
        const double norm = o_.clip > 0 ? clip_grad_norm(ps, o_.clip) : grad_norm(ps);
        const std::int64_t step = optimizer_.step_count() + 1;
        if (!std::isfinite(l.ce) || !std::isfinite(l.ar) || !std::isfinite(norm)) {
            const bool ce_bad = !std::isfinite(l.ce), ar_bad = !ce_bad && !std::isfinite(l.ar);
            char value[32];
            std::snprintf(value, sizeof value, "%g", ce_bad ? l.ce : ar_bad ? l.ar : norm);
            detail::fail_as<collective_error>("step ", step, ": ", ce_bad ? "the loss" : ar_bad ? "the reconstruction loss" : "the gradient norm",
                         " is ", value, "; stopped before the optimizer step (",
                         last_saved_ < 0 ? std::string("nothing was saved")
                                         : "the last checkpoint, '" + last_saved_path_ + "' at step " +
                                               std::to_string(last_saved_) + ", is kept",
                         "; a lower --lr or a --clip may help)");
        }
        const double lr = optimizer_.lr();
        optimizer_.step(ps, lr);
        return {.step = step,
                .ce = l.ce,
                .ar = l.ar,
                .grad_norm = norm,
                .lr = lr,
                .seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(),
                .exchanged_bytes = averager_.last_bytes(),
                .exchange_seconds = exchange_seconds};
    }

    /// Validation from the start of the validation streams with a fresh memory of the options'
    /// validation lengths; max_segments 0 = one pass (the recall streams never end: give a count).
    validation_result validate(std::int64_t max_segments) {
        segment_streams streams = valid_;
        auto memory = make_trainer_memory(model_, o_.eval_mem_len, o_.eval_c_mem_len, slice_.count, o_.seq_len);
        const std::int64_t n =
            max_segments > 0 ? std::min(max_segments, streams.segments_per_pass()) : streams.segments_per_pass();
        std::vector<token_t> inputs, targets;
        validation_result v;
        for (std::int64_t i = 0; i < n; ++i) {
            streams.next(inputs, targets);
            const segment_losses l = run_segment(inputs, targets, memory, /*train=*/false);
            v.ce += l.ce;
            v.ar += l.ar;
            const auto logits = model_.logits();  // [Q·B, vocab]
            for (index_t r = 0; r < logits.rows(); ++r) {
                if (!streams.scored_answer(r)) continue;
                const float* row = host_row(logits, r);
                const token_t best = token_t(std::max_element(row, row + logits.cols()) - row);
                ++v.answers;
                v.correct += best == targets[std::size_t(r)];
            }
        }
        v.segments = n;
        v.ce /= double(std::max<std::int64_t>(n, 1));
        v.ar /= double(std::max<std::int64_t>(n, 1));
        if (comm_.size() > 1) {  // every rank read as many segments of its streams
            double losses[2] = {v.ce, v.ar};
            comm_.sum(losses, 2);
            v.ce = losses[0] / double(comm_.size());
            v.ar = losses[1] / double(comm_.size());
            std::int64_t counts[2] = {v.answers, v.correct};
            comm_.sum(counts, 2);
            v.answers = counts[0];
            v.correct = counts[1];
        }
        return v;
    }

    /// Continues `prompt` by `count` tokens with sample_token (mnemo/models/autoregressive.hpp), the
    /// sampling RNG advancing one draw per non-greedy token. A compressive / XL model carries a memory
    /// of batch 1 as the reference streams: the prompt in segments of up to seq_len, then one token per
    /// segment, over the cached memory projections. A feedback model feeds the prompt and the
    /// continuation to its generator as one sequence from an empty memory; a sequence spans at most
    /// n_pos + 1 tokens, so at that length it starts again from the last seq_len tokens.
    std::vector<token_t> sample(std::span<const token_t> prompt, std::int64_t count, const sampling_options& how) {
        MNEMO_CHECK(!prompt.empty(), "sampling: the prompt is empty");
        check_sampling_options(how);
        std::vector<token_t> out;
        if (count <= 0) return out;
        if constexpr (carries_memory) {
            auto memory = make_trainer_memory(model_, o_.mem_len, o_.c_mem_len, 1, o_.seq_len);
            struct cache_scope {
                Model& m;
                ~cache_scope() { m.cache_memory_projections(false); }
            } scope{model_};
            model_.cache_memory_projections(true);
            for (std::size_t i = 0; i < prompt.size(); i += std::size_t(o_.seq_len)) {
                model_.forward(prompt.subspan(i, std::min(prompt.size() - i, std::size_t(o_.seq_len))), 1, memory);
                model_.update_memory(memory);
            }
            for (std::int64_t k = 0; k < count; ++k) {
                const auto logits = model_.logits();  // the last forward's [rows, vocab]; its last row predicts next
                const token_t next = pick(host_row(logits, logits.rows() - 1), logits.cols(), how);
                out.push_back(next);
                if (k + 1 == count) break;
                model_.forward(std::span<const token_t>(&next, 1), 1, memory);
                model_.update_memory(memory);
            }
        } else {
            auto generator = model_.generator(1);
            const index_t window = model_.options().n_pos + 1;
            generator.reserve(std::min<index_t>(window, index_t(prompt.size()) + index_t(count)));
            std::vector<token_t> text;  // every token fed
            const auto feed = [&](token_t t) {
                text.push_back(t);
                if (generator.length() == window) {
                    generator.reset();
                    for (std::size_t i = text.size() - std::size_t(o_.seq_len); i + 1 < text.size(); ++i)
                        generator.step(std::span<const token_t>(&text[i], 1));
                }
                return generator.step(std::span<const token_t>(&text.back(), 1));  // [1, vocab]
            };
            for (std::size_t i = 0; i + 1 < prompt.size(); ++i) feed(prompt[i]);
            auto logits = feed(prompt.back());
            for (std::int64_t k = 0; k < count; ++k) {
                const token_t next = pick(host_row(logits, 0), logits.cols(), how);
                out.push_back(next);
                if (k + 1 == count) break;
                logits = feed(next);
            }
        }
        return out;
    }
    /// The same, as text of the trainer's vocabulary.
    std::string sample_text(std::span<const token_t> prompt, std::int64_t count, const sampling_options& how) {
        std::string s;
        for (token_t t : sample(prompt, count, how)) s += vocab_.byte(t);
        return s;
    }

    /// Saves the model file PATH with `metadata` (plus "format", "step" and "vocab_hex") and the state
    /// file PATH.state.safetensors, as one (see the header comment). With several ranks it is called on
    /// every rank, rank 0 writes, and an error there throws collective_error on every rank.
    void save(const std::string& path, safetensors_metadata metadata) {
        if (comm_.size() > 1) gather_memory();
        comm_.agree([&] {
            if (comm_.rank() == 0) write_checkpoint(path, std::move(metadata));
        });
        last_saved_ = optimizer_.step_count();
        last_saved_path_ = path;
    }

    /// Restores a checkpoint's parameters, optimizer moments, stream positions, sampling RNG and memory
    /// (this rank's streams of it). The vocabulary must be the trainer's. `path` is remembered as the
    /// last checkpoint.
    void restore(const trainer_checkpoint_files& f, const std::string& path = {}) {
        MNEMO_CHECK(trainer_checkpoint_vocabulary(f).bytes == vocab_.bytes,
                    "the checkpoint's vocabulary differs from the data's");
        auto& ps = model_.parameters();
        load_parameters(f.model, ps);  // strict: every tensor, the model's shapes
        const std::int64_t step = read_state_count(f.state, "trainer.step");
        std::vector<float> m(std::size_t(ps.size()), 0.0f), v(std::size_t(ps.size()), 0.0f);
        read_parameter_buffer(f.state, ps, m.data(), "optimizer.exp_avg.");
        read_parameter_buffer(f.state, ps, v.data(), "optimizer.exp_avg_sq.");
        optimizer_.state().set_state(step, m, v);
        train_.set_offsets(f.state.to_vector<std::int64_t>("trainer.data_position"));
        const std::int64_t sample_offset = read_state_count(f.state, "trainer.sample_rng");
        sample_rng_.set_state(sample_rng_.seed(), std::uint64_t(sample_offset));
        memory_.reset(slice_.count, o_.seq_len);
        if constexpr (carries_memory) {  // the memory layers, in the memory's slot order
            std::vector<index_t> layers;
            for (index_t slot = 0; slot < model_.n_memory_layers(); ++slot) layers.push_back(model_.memory_layer(slot));
            read_state_memory(f.state, layers, o_.batch, model_width(), memory_, slice_.first, slice_.count);
        }
        last_saved_ = step;
        last_saved_path_ = path;
    }

    /// Steps until `fo.until` (at most options.steps), reporting every log_every steps, validating every
    /// eval_every and saving every save_every steps (not at the last step: the caller decides what
    /// ends a run). Returns the number of steps taken.
    std::int64_t fit(const fit_options& fo, const fit_hooks& hooks = {}) {
        MNEMO_CHECK(fo.log_every >= 1, "fit: log_every must be at least 1, got ", fo.log_every);
        MNEMO_CHECK(fo.save_every == 0 || !fo.checkpoint.empty(), "fit: save_every needs a checkpoint path");
        const std::int64_t first = step_count();
        const std::int64_t end = std::min(fo.until, o_.steps);
        double train_seconds = 0, log_seconds = 0, log_ce = 0, log_ar = 0, log_norm = 0, log_bytes = 0, log_exchange = 0;
        std::int64_t log_n = 0;
        for (std::int64_t step = first; step < end; ++step) {
            const step_result r = this->step();
            train_seconds += r.seconds;
            log_seconds += r.seconds;
            log_ce += r.ce;
            log_ar += r.ar;
            log_norm += r.grad_norm;
            log_bytes += double(r.exchanged_bytes);
            log_exchange += r.exchange_seconds;
            ++log_n;
            const std::int64_t done = r.step;
            if (done % fo.log_every == 0 || done == end) {
                const double per_step = log_seconds / double(log_n);  // since the last report
                if (hooks.on_log)
                    hooks.on_log({.step = done,
                                  .steps = o_.steps,
                                  .ce = log_ce / double(log_n),
                                  .ar = log_ar / double(log_n),
                                  .grad_norm = log_norm / double(log_n),
                                  .lr = r.lr,
                                  .tokens_per_second = double(o_.seq_len * o_.batch) / per_step,
                                  .seconds_per_step = per_step,
                                  .eta_seconds = train_seconds / double(done - first) * double(o_.steps - done),
                                  .train_seconds = train_seconds,
                                  .exchanged_bytes = log_bytes / double(log_n),
                                  .exchange_seconds_per_step = log_exchange / double(log_n)});
                log_seconds = log_ce = log_ar = log_norm = log_bytes = log_exchange = 0;
                log_n = 0;
            }
            if (fo.eval_every > 0 && done % fo.eval_every == 0 && done != end) {
                const auto t0 = std::chrono::steady_clock::now();
                const validation_result v = validate(fo.eval_segments);
                if (hooks.on_validation)
                    hooks.on_validation(done, v,
                                        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
            }
            if (fo.save_every > 0 && done % fo.save_every == 0 && done != end) {
                save(fo.checkpoint, hooks.checkpoint_metadata ? hooks.checkpoint_metadata() : safetensors_metadata{});
                if (hooks.on_save) hooks.on_save(done, fo.checkpoint);
            }
        }
        return step_count() - first;
    }

private:
    // The pair's contents (rank 0 with several ranks: the memory from gather_memory()).
    void write_checkpoint(const std::string& path, safetensors_metadata metadata) {
        metadata["format"] = "mnemo-train-1";
        metadata["step"] = std::to_string(optimizer_.step_count());
        metadata["vocab_hex"] = vocab_.hex();
        // Everything the files hold reaches the host first (the host path); `host` keeps it until commit.
        std::deque<std::vector<float>> host;  // a deque: adding keeps the references to what it holds
        const auto& ps = model_.parameters();
        auto& opt = optimizer_.state();
        const std::size_t n = std::size_t(ps.size());
        std::vector<float>& values = host.emplace_back(n);
        std::vector<float>& m = host.emplace_back(n);
        std::vector<float>& v = host.emplace_back(n);
        ps.download_all_values(values);
        opt.download_state(m, v);
        checkpoint_writer cw(path);
        add_parameter_buffer(cw.model(), ps, values.data(), "");
        cw.model().set_metadata(metadata);
        safetensors_writer& w = cw.state();
        add_parameter_buffer(w, ps, m.data(), "optimizer.exp_avg.");
        add_parameter_buffer(w, ps, v.data(), "optimizer.exp_avg_sq.");
        const std::int64_t step = opt.step_count(), sample_offset = std::int64_t(sample_rng_.offset());
        const std::vector<std::int64_t> offsets = train_.offsets();
        w.add("trainer.step", {1}, &step);
        w.add("trainer.data_position", {std::int64_t(offsets.size())}, offsets.data());
        w.add("trainer.sample_rng", {1}, &sample_offset);
        w.add("trainer.vocab", {vocab_.size()}, vocab_.bytes.data());
        if constexpr (carries_memory) {
            const std::int64_t b = o_.batch, d = model_width();
            const bool gathered = comm_.size() > 1;
            const auto local = [&](const float* p, index_t slots, index_t width) {  // this rank's window, on the host
                std::vector<float>& h = host.emplace_back();
                download_to(p, slots * slice_.count * width, h);
                return h.data();
            };
            for (index_t slot = 0; slot < model_.n_memory_layers(); ++slot) {  // named by layer
                const std::string p = "memory." + std::to_string(model_.memory_layer(slot));
                const std::size_t k = std::size_t(slot) * 3;
                w.add(p + ".mem", {memory_.mem_slots(), b, d},
                      gathered ? gathered_[k].data() : local(memory_.mem(slot).data(), memory_.mem_slots(), d));
                w.add(p + ".c_mem", {memory_.c_mem_slots(), b, d},
                      gathered ? gathered_[k + 1].data() : local(memory_.c_mem(slot).data(), memory_.c_mem_slots(), d));
                if constexpr (Model::needs_usage)  // most-used compression: the attention each row received
                    w.add(p + ".usage", {memory_.mem_slots(), b},
                          gathered ? gathered_[k + 2].data() : local(memory_.usage(slot), memory_.mem_slots(), 1));
            }
        }
        w.set_metadata(std::move(metadata));
        cw.commit();
    }

    // Every rank's memory, in the file's layout [slots, batch, width], into gathered_ on rank 0
    // (per memory layer: mem, c_mem, usage). Collective.
    void gather_memory() {
        if constexpr (carries_memory) {
            const index_t n = comm_.size(), local = slice_.count, d = model_width();
            gathered_.resize(std::size_t(model_.n_memory_layers()) * 3);
            const auto gather = [&](const float* mine, index_t slots, index_t width, std::vector<float>& out) {
                const index_t block = slots * local * width;  // this rank's [slots, local, width]
                download_to(mine, block, save_host_);
                received_.resize(std::size_t(block * n));
                comm_.gather(save_host_.data(), sizeof(float) * std::size_t(block), received_.data(), 0);
                if (comm_.rank() != 0) return;
                out.resize(std::size_t(block * n));
                for (index_t r = 0; r < n; ++r)  // rank r's streams are [r·local, (r + 1)·local)
                    ops<cpu>::copy(slots, local * width, received_.data() + r * block, local * width,
                                   out.data() + r * local * width, n * local * width);
            };
            for (index_t slot = 0; slot < model_.n_memory_layers(); ++slot) {
                const std::size_t k = std::size_t(slot) * 3;
                gather(memory_.mem(slot).data(), memory_.mem_slots(), d, gathered_[k]);
                gather(memory_.c_mem(slot).data(), memory_.c_mem_slots(), d, gathered_[k + 1]);
                if constexpr (Model::needs_usage) gather(memory_.usage(slot), memory_.mem_slots(), 1, gathered_[k + 2]);
            }
        }
    }

    template <class Memory>
    segment_losses run_segment(std::span<const token_t> inputs, std::span<const token_t> targets, Memory& memory,
                               bool train) {
        if constexpr (carries_memory)
            return train ? model_.train_segment(inputs, targets, slice_.count, memory)
                         : model_.eval_segment(inputs, targets, slice_.count, memory);
        else
            return {.ce = train ? model_.train_segment(inputs, targets, slice_.count)
                                : model_.eval_segment(inputs, targets, slice_.count)};
    }

    /// d_model, from the embedding's shape [vocab, d_model] (the same for static and runtime shapes).
    static index_t width_of(const Model& model) {
        const tensor_entry* e = model.parameters().find("src_embed.weight");
        MNEMO_CHECK(e && e->shape.size() == 2, "trainer: the model has no src_embed.weight [vocab, d_model]");
        return e->shape[1];
    }
    index_t model_width() const { return width_of(model_); }
    static trainer_options with_model_width(trainer_options o, const Model& model) {
        if (o.d_model == 0) o.d_model = width_of(model);
        return o;
    }

    // n elements of Backend's memory at p, into out on the host.
    static void download_to(const float* p, index_t n, std::vector<float>& out) {
        out.resize(std::size_t(n));
        if (n > 0) device_memory<backend_type>::download(out.data(), p, sizeof(float) * std::size_t(n));
    }

    // Row r of a view of logits, over the host path (valid until the next call).
    template <class V>
    const float* host_row(const V& logits, index_t r) {
        row_host_.resize(std::size_t(logits.cols()));
        device_memory<backend_type>::download(row_host_.data(), logits.row(r), sizeof(float) * row_host_.size());
        return row_host_.data();
    }

    token_t pick(const float* logits, index_t vocab, const sampling_options& how) {
        return sample_token<float>(std::span<const float>(logits, std::size_t(vocab)), how, sample_rng_, scratch_);
    }

    Model& model_;
    trainer_options o_;
    const byte_vocabulary& vocab_;
    communicator& comm_;
    stream_slice slice_;
    segment_streams train_, valid_;
    trainer_optimizer<backend_type> optimizer_;
    memory_type memory_;
    rng sample_rng_;
    sampling_scratch scratch_;
    std::vector<token_t> inputs_, targets_;
    gradient_averager averager_;
    std::vector<std::vector<float>> gathered_;  // rank 0: every stream's memory, for a save
    std::vector<float> received_;
    std::vector<float> row_host_;  // a row of logits, over the host path
    std::vector<float> save_host_;   // a save's scratch: a parameter buffer or a memory window on the host
    std::int64_t last_saved_ = -1;
    std::string last_saved_path_;
};

}  // namespace mnemo
