#pragma once
// The data of a training run, read as the reference reads it (sequential batching): `batch` parallel
// streams, each read segment after segment. Segment s of stream b is tokens [s·Q, s·Q + Q) of that
// stream and its targets are the next tokens; batched tokens are sequence-major, row = position·batch
// + b, as the models expect. A model's memory is carried from segment to segment, so it always holds
// the text just before the segment; when the streams run out they start again from the beginning and
// next() says so (the caller then empties the memory).
//
// Two sources: a text (stream b is text[b·n, (b + 1)·n), n = |text| / batch), or the built-in recall
// task (below), whose tokens are pure functions of (stream key, position). Either way a stream's only
// state is its position, which is what a checkpoint saves (offsets()).
//
// A process may read a slice of the streams (stream_slice: data-parallel training gives each rank an
// equal share): stream b of the slice is the run's stream first + b, with the text and key it has in
// the whole run, so the union of the slices reads what one process with the whole batch reads.
//
// The recall task. Each stream is a sequence of episodes of `episode_len` = 32 tokens:
//     K f f f ... f ? K          K: a key, one of 8 symbols A–H; f: random fillers a–p; ?: the query
// The target of the `?` position is the episode's key, seen 30 tokens before. A model with segments of
// Q tokens, memory of m slots and L layers reaches at most Q − 1 + m·L tokens back, so with Q = 8,
// m = 8 and 2 layers Transformer-XL cannot see the key (23 tokens) and answers at chance (1/8), while
// a compressed memory of c slots at rate 2 covers 2·c more tokens. Each stream starts at a random
// phase, so keys fall anywhere in a segment. scored_answer() marks the answer positions whose key lies
// inside the stream (the accuracy is measured on those).
#include <algorithm>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "../core/error.hpp"
#include "../core/rng.hpp"
#include "../core/shape.hpp"
#include "../train/text_data.hpp"

namespace mnemo {

/// SplitMix64's finaliser: a well-mixed 64-bit function of x (stream keys, seeds derived from seeds).
constexpr std::uint64_t splitmix64(std::uint64_t x) {
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

/// The built-in recall task (see the header comment).
struct recall_task {
    static constexpr std::string_view keys = "ABCDEFGH";
    static constexpr std::string_view fillers = "abcdefghijklmnop";
    static constexpr char query = '?';
    static constexpr std::int64_t episode_len = 32;  // key to query: 30 tokens

    byte_vocabulary vocab = byte_vocabulary::of_bytes(alphabet());

    static std::vector<std::uint8_t> alphabet() {
        const std::string a = std::string(keys) + std::string(fillers) + query;
        return {a.begin(), a.end()};
    }

    /// A stream's phase: where in an episode its position 0 falls.
    static std::int64_t phase(std::uint64_t key) { return std::int64_t(splitmix64(key ^ 0x5EEDull) % episode_len); }
    static std::uint32_t word(std::uint64_t key, std::int64_t index) { return random_u32(key, std::uint64_t(index)); }

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

/// Which of a run's streams a process reads: streams [first, first + count) of `batch` (data-parallel
/// training gives each rank an equal, contiguous share; count -1: all of them).
struct stream_slice {
    index_t first = 0, count = -1;
};

/// `batch` parallel streams read segment after segment (see the header comment), or a slice of them.
class segment_streams {
public:
    /// Streams over a text: stream b is text[b·n, (b + 1)·n), n = |text| / batch. `what` names the
    /// text in errors ("training (90%)"). The text must outlive the streams.
    segment_streams(std::span<const token_t> text, index_t batch, index_t seq_len, const char* what,
                    stream_slice slice = {})
        : text_(text), total_(batch), seq_len_(seq_len), length_(std::int64_t(text.size()) / std::max<index_t>(batch, 1)) {
        set_slice(slice);
        const std::int64_t need = std::int64_t(batch) * (seq_len + 1);
        MNEMO_CHECK(std::int64_t(text.size()) >= need, "the text is too short: its ", what, " part has ", text.size(),
                    " characters, but one batch of segments needs batch·(seq_len + 1) = ", batch, "·", seq_len + 1,
                    " = ", need);
    }
    /// Streams of the recall task, keyed by (seed, stream). The task must outlive the streams.
    segment_streams(const recall_task& task, std::uint64_t seed, index_t batch, index_t seq_len, stream_slice slice = {})
        : task_(&task), seed_(seed), total_(batch), seq_len_(seq_len), length_(INT64_MAX / 2) {
        set_slice(slice);
        for (index_t b = first_; b < first_ + batch_; ++b) keys_.push_back(key(b));
    }

    /// The streams this object reads (the slice's count).
    index_t batch() const { return batch_; }
    /// The run's streams, and the first of them this object reads.
    index_t total_batch() const { return total_; }
    index_t first_stream() const { return first_; }
    index_t seq_len() const { return seq_len_; }
    /// Whole segments in one pass over the streams.
    std::int64_t segments_per_pass() const { return (length_ - 1) / seq_len_; }
    /// The next segment's offset within each stream.
    std::int64_t position() const { return position_; }
    void set_position(std::int64_t p) {
        // p may sit at the end of a pass (the next segment then starts the next pass).
        MNEMO_CHECK(p >= 0 && p % seq_len_ == 0 && p / seq_len_ <= segments_per_pass(), "the saved data position ", p,
                    " does not fit these streams (", segments_per_pass(), " segments of ", seq_len_, ")");
        position_ = p;
    }
    /// Every stream's absolute offset of the next segment, all `total_batch()` of them (what a
    /// checkpoint saves; the streams of a slice move together with the others).
    std::vector<std::int64_t> offsets() const {
        std::vector<std::int64_t> o(static_cast<std::size_t>(total_));
        for (index_t b = 0; b < total_; ++b) o[std::size_t(b)] = (task_ ? 0 : b * length_) + position_;
        return o;
    }
    void set_offsets(std::span<const std::int64_t> o) {
        MNEMO_CHECK(index_t(o.size()) == total_, "the saved data position has ", o.size(), " streams, batch is ", total_);
        set_position(o[0]);
        MNEMO_CHECK(std::ranges::equal(o, offsets()), "the saved stream offsets do not match these streams");
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
    /// The first n tokens of the run's stream 0 (a prompt), whichever slice this is.
    std::vector<token_t> head(std::int64_t n) const {
        std::vector<token_t> out;
        for (std::int64_t p = 0; p < std::min(n, length_); ++p)
            out.push_back(task_ ? task_->token(key(0), p) : text_[std::size_t(p)]);
        return out;
    }

private:
    void set_slice(stream_slice slice) {
        MNEMO_CHECK(total_ >= 1 && seq_len_ >= 1, "segment_streams: batch (", total_, ") and seq_len (", seq_len_,
                    ") must be at least 1");
        first_ = slice.first;
        batch_ = slice.count < 0 ? total_ - first_ : slice.count;
        MNEMO_CHECK(first_ >= 0 && batch_ >= 1 && first_ + batch_ <= total_, "segment_streams: streams [", first_, ", ",
                    first_ + batch_, ") are not a slice of the ", total_, " streams");
    }
    std::uint64_t key(index_t global) const { return splitmix64(seed_ * 0x100000001B3ull + std::uint64_t(global)); }
    // Token p of this slice's stream b.
    token_t at(index_t b, std::int64_t p) const {
        return task_ ? task_->token(keys_[std::size_t(b)], p) : text_[std::size_t((first_ + b) * length_ + p)];
    }

    std::span<const token_t> text_;
    const recall_task* task_ = nullptr;
    std::uint64_t seed_ = 0;
    std::vector<std::uint64_t> keys_;  // recall: this slice's streams' keys
    index_t total_, first_ = 0, batch_ = 0, seq_len_;
    std::int64_t length_;
    std::int64_t position_ = 0;
};

}  // namespace mnemo
