#pragma once
// Autoregressive use of a segment-recurrent model (compressive_transformer, and Transformer-XL as its
// c_mem_len = 0 case): token sampling, training and evaluation over long sequences split into segments,
// and generation. The role of lucidrains' AutoregressiveWrapper (seed 002), in mnemo's own design.
//
// ── Sampling ──────────────────────────────────────────────────────────────────────────────────────
//   sampling_options { temperature = 1, top_k = 0 (off), top_p = 1 (off), greedy = false }
//   token_t sample_token<T>(std::span<const T> logits, options, rng&, sampling_scratch&)
//
//   greedy            argmax of the logits (the lowest index among equal maxima); draws no random number.
//   otherwise, in this order:
//     1. temperature  z = logits / temperature
//     2. top_k        (k ≥ 1 and k < vocab) keep the k largest logits. Candidates are ranked by
//                     (logit descending, index ascending), so ties at the boundary keep the lower
//                     indices: deterministic, independent of the sort's implementation.
//     3. top_p        (top_p < 1) nucleus of the distribution left by step 2, renormalised: sort the
//                     candidates by descending probability (same ranking) and keep the smallest prefix
//                     whose cumulative probability is ≥ top_p — always at least the most likely token.
//                     (Whether a prefix that sums to exactly top_p qualifies is subject to rounding.)
//     4. draw         one rng::uniform() u ∈ [0, 1): the first kept candidate (in ranking order, or in
//                     index order when neither filter is active) whose cumulative weight exceeds
//                     u · (total kept weight). Probabilities are exp(z − max z) in double precision,
//                     whatever T is. Each non-greedy call advances the rng by exactly one uniform().
//   Validation (mnemo::error, message naming the parameter): temperature finite and > 0 (checked even
//   when greedy: a bad option is a bug either way; use greedy = true, not temperature 0, for argmax),
//   top_k ≥ 0, 0 < top_p ≤ 1; logits non-empty, no NaN or +inf, not all −inf (−inf logits are allowed
//   and never sampled: use them to mask tokens).
//   The scratch (sampling_scratch, or the wrapper's own) grows to the vocabulary once; from then on
//   sampling performs no heap allocation. The overload without scratch allocates a fresh one per call.
//
// ── autoregressive_wrapper<Model> ─────────────────────────────────────────────────────────────────
//   Holds a reference to the model (which must outlive it) and the segment length seg_len, memory length
//   mem_len and compressed-memory length c_mem_len. The model needs: memory_type, make_memory(mem_len,
//   c_mem_len), forward(tokens, batch, mem), update_memory(mem), train_segment, eval_segment, logits()
//   (a host view, [rows, vocab]) and vocab() — compressive_transformer's API.
//
//   train_sequence(seq, batch, mem [, after_segment])     seq [n · batch], sequence-major (position·batch + b)
//     Inputs are positions [0, n − 1), targets positions [1, n) of every batch column. The n − 1 input
//     positions are split into segments of seg_len (the last one may be shorter), run in order with
//     model.train_segment, carrying `mem` (forward → merge/compress → CE + attention-reconstruction
//     loss → backward). In the sequence-major layout a segment's inputs and targets are contiguous
//     sub-spans of seq, so nothing is copied. Returns one segment_losses per segment: ce is the mean
//     over that segment's own targets, so the sequence's token-weighted mean CE is
//     Σ ce_s · segment_length(s, n) / (n − 1). (A negative token is an ignored target; since every
//     position but the last is also an input, only the last position may hold one — the embedding
//     rejects it anywhere else.)
//     Gradients: train_segment adds (+=) each segment's gradient, so without a callback the parameter
//     gradients hold the SUM over segments of d(ce_s + ar_s)/dθ; the caller zeroes them before and
//     clips / steps the optimizer after, i.e. one step per sequence. With after_segment(index_t s,
//     const segment_losses&) — called right after segment s's backward — the caller can instead clip,
//     step and zero per segment, as the seed's loop does with (loss + aux_loss).backward() per segment;
//     the next segment's forward then runs with the updated weights. The results are bitwise those of
//     calling model.train_segment on the segments by hand.
//   eval_sequence(seq, batch, mem [, after_segment])
//     The same with model.eval_segment: no gradients; the memory is still carried and compressed. The
//     callback can read model.logits() of segment s (e.g. for accuracy).
//   The memory: the caller's, carried across calls (a long stream can be fed sequence by sequence). It
//   must have been made with this wrapper's lengths (make_memory()); an EMPTY memory is (re)set here for
//   `batch` with room for seg_len-long segments, so merges never allocate; a non-empty memory of another
//   batch is an error (from the model).
//
//   generate(prime, n_new, options, rng, end_token) → std::vector<token_t>            (batch 1)
//   generate_into(prime, out, options, rng, end_token) → number of tokens written     (no allocation)
//     Starts from an EMPTY memory (the wrapper's own, reused from call to call) and feeds the prime in
//     segments of seg_len through forward + update_memory, exactly as training streams a sequence: a
//     prime longer than seg_len reaches the model through the memory (and the compressed memory), not
//     through one long attention window — the model is never shown a segment longer than seg_len, so
//     n_pos ≥ c_mem_len + mem_len + seg_len suffices. The last row of the last prime segment's logits
//     gives the first new token. Then one token at a time: each new token is fed as a 1-position
//     segment (forward, then merge into the memory; compression every `rate` tokens once the memory is
//     full), and the last logits row is sampled. This is the streaming recurrence, O(memory) per token;
//     it differs from re-evaluating the growing partial segment each step (which reproduces the training
//     attention pattern inside a segment at O(seg_len) more cost per token) — mnemo's examples/train.cpp
//     samples the same way.
//     Stops after n_new tokens (out.size() for generate_into), or right after sampling end_token: the
//     end token IS included in the output (it is the last element), as the seed's generate appends the
//     sampled token before testing for its eos_token. Only the new tokens are returned, never the prime.
//     The last sampled token is not fed to the model (nothing would read its logits), so afterwards
//     model.logits() and generation_memory() describe the prime plus all new tokens but the last. With
//     n_new = 0 the prime is still fed (the model's logits and generation_memory() describe it).
//     Errors: empty prime, n_new < 0, end_token outside [0, vocab), invalid options (checked before any
//     work), prime tokens outside the vocabulary (from the model's embedding).
//     After one call has grown the model's buffers, the memory and the sampling scratch, a generate_into
//     call with the same prime length and at most as many tokens performs no heap allocation.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>
#include <numeric>
#include <optional>
#include <span>
#include <type_traits>
#include <utility>
#include <vector>

#include "../core/buffer.hpp"
#include "../core/error.hpp"
#include "../core/rng.hpp"
#include "../core/shape.hpp"
#include "compressive_transformer.hpp"

namespace mnemo {

/// How sample_token picks the next token (see the header comment for the exact order of steps).
struct sampling_options {
    double temperature = 1.0;  // logits are divided by it; finite and > 0
    index_t top_k = 0;         // keep the k most likely tokens; 0: off
    double top_p = 1.0;        // nucleus: smallest prefix with cumulative probability ≥ top_p; 1: off
    bool greedy = false;       // argmax (the other settings are still validated)
};

/// Reusable scratch for sample_token: grows to the vocabulary once, then sampling does not allocate.
struct sampling_scratch {
    buffer<double> weights;  // exp(z − max z) per token
    buffer<index_t> order;   // candidate token ids, best first
};

/// Throws mnemo::error naming the first invalid setting.
inline void check_sampling_options(const sampling_options& o) {
    MNEMO_CHECK(std::isfinite(o.temperature) && o.temperature > 0, "sampling: temperature must be a finite number > 0, got ",
                o.temperature, " (for argmax use greedy = true)");
    MNEMO_CHECK(o.top_k >= 0, "sampling: top_k must be >= 0 (0 turns it off), got ", o.top_k);
    MNEMO_CHECK(o.top_p > 0 && o.top_p <= 1, "sampling: top_p must be in (0, 1] (1 turns it off), got ", o.top_p);
}

/// The next token from one row of logits [vocab]; see the header comment.
template <class T>
token_t sample_token(std::span<const T> logits, const sampling_options& o, rng& r, sampling_scratch& scratch) {
    check_sampling_options(o);
    const index_t v = index_t(logits.size());
    MNEMO_CHECK(v >= 1, "sample_token: the logits are empty");
    constexpr double inf = std::numeric_limits<double>::infinity();
    index_t best = 0;
    for (index_t i = 0; i < v; ++i) {
        const double x = double(logits[std::size_t(i)]);
        MNEMO_CHECK(!std::isnan(x) && x != inf, "sample_token: logit ", i, " is ", x, "; NaN and +inf cannot be sampled");
        if (x > double(logits[std::size_t(best)])) best = i;
    }
    const double top = double(logits[std::size_t(best)]);
    MNEMO_CHECK(top > -inf, "sample_token: every one of the ", v, " logits is -inf");
    if (o.greedy) return token_t(best);

    double* w = scratch.weights.ensure(v);
    for (index_t i = 0; i < v; ++i) w[i] = std::exp((double(logits[std::size_t(i)]) - top) / o.temperature);

    const index_t k = o.top_k > 0 && o.top_k < v ? o.top_k : v;
    const bool nucleus = o.top_p < 1;
    // The draw: the first candidate whose running weight exceeds u · total, summing in the same order
    // as the total so that u < total is reached. Zero-weight (−inf) candidates are never chosen.
    const auto draw = [&](auto&& token_at, index_t n, double total) {
        const double u = r.uniform() * total;
        double cum = 0;
        index_t last_positive = token_at(0);
        for (index_t j = 0; j < n; ++j) {
            const index_t t = token_at(j);
            if (w[t] <= 0) continue;
            cum += w[t];
            last_positive = t;
            if (u < cum) return token_t(t);
        }
        return token_t(last_positive);  // only when rounding put u at the very top
    };
    if (k == v && !nucleus) {  // plain sampling, candidates in index order
        double total = 0;
        for (index_t i = 0; i < v; ++i)
            if (w[i] > 0) total += w[i];
        return draw([](index_t j) { return j; }, v, total);
    }

    index_t* ord = scratch.order.ensure(v);
    std::iota(ord, ord + v, index_t(0));
    std::partial_sort(ord, ord + k, ord + v, [&](index_t a, index_t b) {
        const T la = logits[std::size_t(a)], lb = logits[std::size_t(b)];
        return la > lb || (la == lb && a < b);
    });
    double total = 0;
    for (index_t j = 0; j < k; ++j)
        if (w[ord[j]] > 0) total += w[ord[j]];
    index_t n = k;
    if (nucleus) {
        const double target = o.top_p * total;
        double cum = 0;
        for (index_t j = 0; j < k; ++j) {
            if (w[ord[j]] > 0) cum += w[ord[j]];
            if (cum >= target) {
                n = j + 1;
                break;
            }
        }
        total = cum;  // the kept prefix's weight, summed in draw's order
    }
    return draw([ord](index_t j) { return ord[j]; }, n, total);
}

/// The same with a scratch of its own (allocates on every call).
template <class T>
token_t sample_token(std::span<const T> logits, const sampling_options& o, rng& r) {
    sampling_scratch scratch;
    return sample_token<T>(logits, o, r, scratch);
}

template <class Model>
class autoregressive_wrapper {
public:
    using model_type = Model;
    using memory_type = typename Model::memory_type;
    using value_type = typename std::remove_cvref_t<decltype(std::declval<const Model&>().logits())>::value_type;

    /// seg_len ≥ 1; mem_len and c_mem_len as for model.make_memory (checked there).
    autoregressive_wrapper(Model& model, index_t seg_len, index_t mem_len, index_t c_mem_len)
        : model_(model),
          seg_len_(check_seg_len(seg_len)),
          mem_len_(mem_len),
          c_mem_len_(c_mem_len),
          gen_mem_(model.make_memory(mem_len, c_mem_len)) {}

    /// A memory with this wrapper's lengths, for train_sequence / eval_sequence.
    memory_type make_memory() const { return model_.make_memory(mem_len_, c_mem_len_); }

    /// Segments of a sequence of n_positions positions: ceil((n_positions − 1) / seg_len).
    index_t segment_count(index_t n_positions) const {
        return n_positions < 2 ? 0 : (n_positions - 1 + seg_len_ - 1) / seg_len_;
    }
    /// Positions (input tokens per batch column) of segment s of such a sequence.
    index_t segment_length(index_t s, index_t n_positions) const {
        return std::min(seg_len_, n_positions - 1 - s * seg_len_);
    }

    /// Trains on seq [n · batch] segment by segment; parameter gradients += (see the header comment).
    std::vector<segment_losses> train_sequence(std::span<const token_t> seq, index_t batch, memory_type& mem) {
        return run_sequence(seq, batch, mem, true, [](index_t, const segment_losses&) {}, "train_sequence");
    }
    /// The same, calling after_segment(s, losses) right after segment s's backward.
    template <class AfterSegment>
    std::vector<segment_losses> train_sequence(std::span<const token_t> seq, index_t batch, memory_type& mem,
                                               AfterSegment&& after_segment) {
        return run_sequence(seq, batch, mem, true, after_segment, "train_sequence");
    }
    /// Evaluates seq segment by segment (no gradients), carrying the memory.
    std::vector<segment_losses> eval_sequence(std::span<const token_t> seq, index_t batch, memory_type& mem) {
        return run_sequence(seq, batch, mem, false, [](index_t, const segment_losses&) {}, "eval_sequence");
    }
    template <class AfterSegment>
    std::vector<segment_losses> eval_sequence(std::span<const token_t> seq, index_t batch, memory_type& mem,
                                              AfterSegment&& after_segment) {
        return run_sequence(seq, batch, mem, false, after_segment, "eval_sequence");
    }

    /// Up to n_new tokens continuing `prime` (batch 1); see the header comment.
    std::vector<token_t> generate(std::span<const token_t> prime, index_t n_new, const sampling_options& options,
                                  rng& r, std::optional<token_t> end_token = std::nullopt) {
        MNEMO_CHECK(n_new >= 0, "generate: n_new must be >= 0, got ", n_new);
        std::vector<token_t> out(static_cast<std::size_t>(n_new));
        out.resize(static_cast<std::size_t>(generate_into(prime, out, options, r, end_token)));
        return out;
    }

    /// Writes up to out.size() new tokens into out and returns how many (fewer when end_token came).
    index_t generate_into(std::span<const token_t> prime, std::span<token_t> out, const sampling_options& options,
                          rng& r, std::optional<token_t> end_token = std::nullopt) {
        check_sampling_options(options);
        MNEMO_CHECK(!prime.empty(), "generate: the prime is empty; generation needs at least one token to start from");
        MNEMO_CHECK(!end_token || (*end_token >= 0 && *end_token < model_.vocab()), "generate: end_token ",
                    end_token.value_or(0), " is outside the vocabulary [0, ", model_.vocab(), ")");
        gen_mem_.reset(1, seg_len_);
        // The model's generation cache (projected memory keys and values kept between tokens) is on
        // and its gradients off while generating, both put back as they were afterwards, even on an
        // exception.
        struct cache_scope {
            Model& m;
            bool was, grad;
            ~cache_scope() {
                m.cache_memory_projections(was);
                if constexpr (requires { m.set_grad_enabled(grad); }) m.set_grad_enabled(grad);
            }
        } scope{model_, model_.caches_memory_projections(), grad_enabled(model_)};
        model_.cache_memory_projections(true);
        if constexpr (requires { model_.set_grad_enabled(false); }) model_.set_grad_enabled(false);
        const std::size_t seg = std::size_t(seg_len_);
        for (std::size_t i = 0; i < prime.size(); i += seg) {
            model_.forward(prime.subspan(i, std::min(seg, prime.size() - i)), 1, gen_mem_);
            model_.update_memory(gen_mem_);
        }
        const index_t want = index_t(out.size());
        index_t n = 0;
        while (n < want) {
            const auto logits = model_.logits();  // the last segment's rows; its last row predicts the next token
            // The host path: the row to sample from (vocab numbers per token).
            using logits_backend = typename std::remove_cvref_t<decltype(logits)>::backend_type;
            value_type* row = last_row_.ensure(logits.cols());
            device_memory<logits_backend>::download(row, logits.row(logits.rows() - 1),
                                                    sizeof(value_type) * std::size_t(logits.cols()));
            const token_t next =
                sample_token<value_type>(std::span<const value_type>(row, std::size_t(logits.cols())), options, r, scratch_);
            out[std::size_t(n++)] = next;
            if (n == want || (end_token && next == *end_token)) break;
            model_.forward(out.subspan(std::size_t(n - 1), 1), 1, gen_mem_);
            model_.update_memory(gen_mem_);
        }
        return n;
    }

    Model& model() const { return model_; }
    index_t seg_len() const { return seg_len_; }
    index_t mem_len() const { return mem_len_; }
    index_t c_mem_len() const { return c_mem_len_; }
    /// The memory of the last generate call (batch 1).
    const memory_type& generation_memory() const { return gen_mem_; }

private:
    /// The model's gradient setting (models without one always compute what backward needs).
    static bool grad_enabled(const Model& m) {
        if constexpr (requires { m.grad_enabled(); }) return m.grad_enabled();
        else return true;
    }
    static index_t check_seg_len(index_t seg_len) {
        MNEMO_CHECK(seg_len >= 1, "autoregressive_wrapper: seg_len must be at least 1, got ", seg_len);
        return seg_len;
    }

    template <class AfterSegment>
    std::vector<segment_losses> run_sequence(std::span<const token_t> seq, index_t batch, memory_type& mem, bool train,
                                             AfterSegment&& after_segment, const char* who) {
        MNEMO_CHECK(batch >= 1, who, ": batch must be at least 1, got ", batch);
        MNEMO_CHECK(index_t(seq.size()) % batch == 0, who, ": ", seq.size(),
                    " tokens do not form a whole number of positions of batch ", batch);
        const index_t n = index_t(seq.size()) / batch;
        MNEMO_CHECK(n >= 2, who, ": a sequence needs at least 2 positions (inputs and their next-token targets), got ", n);
        MNEMO_CHECK(mem.mem_len() == mem_len_ && mem.c_mem_len() == c_mem_len_, who, ": the memory has mem_len ",
                    mem.mem_len(), " and c_mem_len ", mem.c_mem_len(), " but the wrapper uses mem_len ", mem_len_,
                    " and c_mem_len ", c_mem_len_, " (make it with the wrapper's make_memory())");
        if (mem.mem_slots() + mem.c_mem_slots() == 0) mem.reset(batch, seg_len_);
        const index_t n_seg = segment_count(n);
        std::vector<segment_losses> out;
        out.reserve(std::size_t(n_seg));
        for (index_t s = 0; s < n_seg; ++s) {
            const index_t start = s * seg_len_, len = segment_length(s, n);
            const auto tokens = seq.subspan(std::size_t(start * batch), std::size_t(len * batch));
            const auto targets = seq.subspan(std::size_t((start + 1) * batch), std::size_t(len * batch));
            out.push_back(train ? model_.train_segment(tokens, targets, batch, mem)
                                : model_.eval_segment(tokens, targets, batch, mem));
            after_segment(s, std::as_const(out.back()));
        }
        return out;
    }

    Model& model_;
    index_t seg_len_, mem_len_, c_mem_len_;
    memory_type gen_mem_;
    sampling_scratch scratch_;
    buffer<value_type> last_row_;  // the sampled row of logits, on the host
};

}  // namespace mnemo
