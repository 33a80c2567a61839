#pragma once
// Memory carried across segments by Transformer-XL and the Compressive Transformer (Rae et al., 2019),
// managed exactly as the reference experiment does (docs/reference.md §8):
//
//   after each segment's forward pass, without gradient, for every layer l:
//     mem ← [mem, new]                       new = this segment's input of layer l (stop-gradient)
//     if |mem| > mem_len:
//       n_old = ceil((|mem| − mem_len) / c) · c       the oldest n_old slots leave the memory
//       c_mem ← [c_mem, f_c(oldest n_old slots)]        n_old / c new compressed slots
//       c_mem ← its newest c_mem_len slots
//
// With c_mem_len = 0 the model is Transformer-XL: the memory keeps its newest mem_len slots and
// nothing is compressed (labml's own code keeps every slot in that case; mnemo does not copy that).
// The slots compressed on the last merge stay readable (compressed_away) for the
// attention-reconstruction loss of that step.
//
// Layout per layer: sequence-major rows (slot·batch + b) × d_model, oldest slot first. Storage is
// reserved up front, so merging allocates nothing in steady state. Each of a layer's memory and
// compressed memory is a window sliding over a buffer with as much slack again: dropping the oldest
// slots only moves the window's start, and the live rows are moved back to the buffer's front only
// when an append would run past its end (once every slack/appended merges; A's merge used to move
// the whole compressed memory, 2 MB per layer, on every segment). The slots compressed away are read
// in place, from just before the memory's window, until the next merge.
//
// Padding: the memory also keeps one pad flag per slot and batch element ([slots·batch], slot·batch + b,
// nonzero = padding), shared by every layer (a position is padding in all layers or in none), shifted
// exactly as the memory on every merge: the new slots take the flags merge() is given (none: not
// padding); a compressed slot is padding iff all `rate` slots it was made from are; the slots
// compressed away keep theirs (compressed_away_pad) for the reconstruction loss. The model masks
// padded slots out of attention (compressive_transformer::forward with a pad mask).
//
// Slot identities: every slot gets a number when it enters the memory (or the compressed memory),
// counting up, so the slots held are always the consecutive ids [mem_first_id, mem_first_id +
// mem_slots) (likewise for the compressed memory), and `epoch` changes whenever the contents are
// replaced wholesale (reset, resize). A model may cache per-slot work (the projected keys and values
// of generation) under these ids: same epoch and id means the same contents.
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <vector>

#include "../core/buffer.hpp"
#include "../core/config.hpp"
#include "../core/error.hpp"
#include "../core/view.hpp"
#include "../kernels/cpu/ops.hpp"
#include "../kernels/kernel_table.hpp"

namespace mnemo {

namespace detail {

/// A window [off, off + size) sliding over a buffer in Backend's memory; elements, not rows.
template <class T, class Backend>
class sliding_window {
public:
    // Empties the window over a buffer of `capacity` elements (allocates only if it grows).
    void reset(index_t capacity) {
        buf_.ensure(capacity);
        off_ = size_ = 0;
    }
    // `n` elements at the buffer's front, contents to be written by the caller.
    void assign_size(index_t n) {
        buf_.ensure(n);
        off_ = 0;
        size_ = n;
    }
    T* data() { return buf_.data() + off_; }
    const T* data() const { return buf_.data() + off_; }
    // Extends the window by n elements at its end and returns them. When they do not fit after
    // the window, the window is first moved to the buffer's front (and the buffer grown if that
    // is still too short, which a merge within reset()'s reserve never needs).
    T* grow(index_t n) {
        if (off_ + size_ + n > buf_.capacity()) {
            if (off_ > 0 && size_ > 0)
                device_memory<Backend>::copy(buf_.data(), buf_.data() + off_, sizeof(T) * std::size_t(size_));
            off_ = 0;
            if (size_ + n > buf_.capacity()) buf_.ensure(2 * (size_ + n));  // keeps the window's contents
        }
        T* p = buf_.data() + off_ + size_;
        size_ += n;
        return p;
    }
    index_t size() const { return size_; }
    void drop_front(index_t n) {
        if (n <= 0) return;
        off_ += n;
        size_ -= n;
    }

private:
    buffer<T, Backend> buf_;
    index_t off_ = 0, size_ = 0;
};

}  // namespace detail

/// D may be `dynamic` (a runtime-shape model): d_model is then given at construction.
template <class T, std::size_t D, class Backend = cpu>
class compressive_memory {
    [[no_unique_address]] extent_holder<D> d_;

public:
    using value_type = T;
    using backend_type = Backend;

    /// mem_len: uncompressed slots kept; c_mem_len: compressed slots kept (0: Transformer-XL);
    /// rate: the compression rate c of the model.
    compressive_memory(index_t n_layers, index_t mem_len, index_t c_mem_len, index_t rate) requires(D != dynamic)
        : compressive_memory(n_layers, mem_len, c_mem_len, rate, static_cast<index_t>(D)) {}
    /// d_model given too (must equal D when that is static).
    compressive_memory(index_t n_layers, index_t mem_len, index_t c_mem_len, index_t rate, index_t d_model)
        : d_(d_model), n_layers_(n_layers), mem_len_(mem_len), c_mem_len_(c_mem_len), rate_(rate),
          layers_(std::size_t(n_layers)) {
        check_extent<D>(d_model, "memory", "d_model");
        MNEMO_CHECK(n_layers >= 1, "memory: n_layers must be at least 1, got ", n_layers);
        MNEMO_CHECK(mem_len >= 0, "memory: mem_len must be >= 0, got ", mem_len);
        MNEMO_CHECK(c_mem_len >= 0, "memory: c_mem_len must be >= 0, got ", c_mem_len);
        MNEMO_CHECK(rate >= 1, "memory: the compression rate must be at least 1, got ", rate);
        MNEMO_CHECK(c_mem_len == 0 || mem_len >= rate - 1, "memory: mem_len = ", mem_len,
                    " is too short for compression rate ", rate, ": the memory must hold at least rate − 1 = ",
                    rate - 1, " slots so that whole groups of ", rate, " can be compressed");
    }

    /// Empties the memory for a batch of `batch` streams; reserves room for segments of up to
    /// `max_segment` tokens so that merges never allocate.
    void reset(index_t batch, index_t max_segment = 0) {
        MNEMO_CHECK(batch >= 1, "memory: batch must be at least 1, got ", batch);
        batch_ = batch;
        mem_slots_ = c_mem_slots_ = away_slots_ = 0;
        new_epoch();
        const index_t m = mem_len_ + max_segment + rate_;
        const index_t cm = c_mem_len_ + (max_segment + mem_len_) / rate_ + 1;
        for (auto& l : layers_) {
            l.mem.reset(2 * m * batch * d_);
            l.c_mem.reset(c_mem_len_ > 0 ? 2 * cm * batch * d_ : 0);
            l.away = nullptr;
        }
        for (auto* p : {&pad_, &away_pad_}) {
            p->reserve(std::size_t(m * batch));
            p->clear();
        }
        c_pad_.reserve(std::size_t(cm * batch));
        c_pad_.clear();
    }

    index_t n_layers() const { return n_layers_; }
    index_t mem_len() const { return mem_len_; }
    index_t c_mem_len() const { return c_mem_len_; }
    index_t rate() const { return rate_; }
    index_t batch() const { return batch_; }
    bool compressive() const { return c_mem_len_ > 0; }
    /// Slots now held (the same for every layer).
    index_t mem_slots() const { return mem_slots_; }
    index_t c_mem_slots() const { return c_mem_slots_; }
    /// Slots compressed away by the last merge (0 when nothing was compressed).
    index_t compressed_away_slots() const { return away_slots_; }
    /// Identity of the contents (see the header comment): changes on reset and resize.
    std::uint64_t epoch() const { return epoch_; }
    /// Id of the oldest memory / compressed-memory slot; the others follow consecutively.
    std::int64_t mem_first_id() const { return mem_first_id_; }
    std::int64_t c_mem_first_id() const { return c_mem_first_id_; }

    /// Pad flags [mem_slots·batch], [c_mem_slots·batch], [compressed_away_slots·batch] (nonzero = padding),
    /// the same for every layer.
    const std::uint8_t* mem_pad() const { return pad_.data(); }
    const std::uint8_t* c_mem_pad() const { return c_pad_.data(); }
    const std::uint8_t* compressed_away_pad() const { return away_pad_.data(); }
    /// Whether any slot held (memory or compressed memory) is padding.
    bool has_padding() const {
        for (std::uint8_t f : pad_)
            if (f) return true;
        for (std::uint8_t f : c_pad_)
            if (f) return true;
        return false;
    }
    /// Mutable access for loading a saved state (after resize).
    std::uint8_t* mem_pad_data() { return pad_.data(); }
    std::uint8_t* c_mem_pad_data() { return c_pad_.data(); }

    view<const T, D, Backend> mem(index_t l) const { return rows(layers_[std::size_t(l)].mem.data(), mem_slots_); }
    view<const T, D, Backend> c_mem(index_t l) const {
        return rows(layers_[std::size_t(l)].c_mem.data(), c_mem_slots_);
    }
    /// The slots the last merge compressed away [compressed_away_slots·batch, D]; valid until the next
    /// merge, reset or resize.
    view<const T, D, Backend> compressed_away(index_t l) const {
        return rows(layers_[std::size_t(l)].away, away_slots_);
    }
    /// Mutable access for loading a saved state (the trainer's resume).
    T* mem_data(index_t l) { return layers_[std::size_t(l)].mem.data(); }
    T* c_mem_data(index_t l) { return layers_[std::size_t(l)].c_mem.data(); }
    /// Sets the slot counts (contents then written through mem_data / c_mem_data; pad flags cleared).
    void resize(index_t mem_slots, index_t c_mem_slots) {
        MNEMO_CHECK(batch_ >= 1, "memory: reset(batch) before resize");
        MNEMO_CHECK(mem_slots >= 0 && mem_slots <= mem_len_ && c_mem_slots >= 0 && c_mem_slots <= c_mem_len_,
                    "memory: ", mem_slots, " memory and ", c_mem_slots, " compressed slots do not fit mem_len ",
                    mem_len_, " and c_mem_len ", c_mem_len_);
        mem_slots_ = mem_slots;
        c_mem_slots_ = c_mem_slots;
        away_slots_ = 0;
        new_epoch();
        for (auto& l : layers_) {
            l.mem.assign_size(mem_slots * batch_ * d_);
            l.c_mem.assign_size(c_mem_slots * batch_ * d_);
            l.away = nullptr;
        }
        pad_.assign(std::size_t(mem_slots * batch_), 0);
        c_pad_.assign(std::size_t(c_mem_slots * batch_), 0);
        away_pad_.clear();
    }

    /// Appends each layer's new inputs (new_inputs(l): [Q·batch, D]) and compresses what overflows with
    /// compress(l, slots_in [n_old·batch, D], slots_out [n_old/c·batch, D]). Returns n_old.
    /// new_pad: the new rows' pad flags [Q·batch] (nonzero = padding); null: none is padding.
    template <class NewInputs, class Compress>
    index_t merge(NewInputs&& new_inputs, Compress&& compress, const std::uint8_t* new_pad = nullptr) {
        MNEMO_CHECK(batch_ >= 1, "memory: reset(batch) must be called before the first segment");
        const index_t q_rows = new_inputs(index_t(0)).rows();
        MNEMO_CHECK(q_rows % batch_ == 0, "memory: ", q_rows, " new rows are not a multiple of the batch ", batch_);
        const index_t q = q_rows / batch_, len = mem_slots_ + q;
        const index_t row = batch_ * d_;  // elements per slot
        index_t n_drop = 0, n_old = 0;
        if (len > mem_len_) {
            if (compressive()) n_old = (len - mem_len_ + rate_ - 1) / rate_ * rate_;
            else n_drop = len - mem_len_;
        }
        const index_t n_new_c = n_old / rate_;
        const index_t c_len = c_mem_slots_ + n_new_c, c_drop = std::max<index_t>(0, c_len - c_mem_len_);
        for (index_t l = 0; l < n_layers_; ++l) {
            auto& s = layers_[std::size_t(l)];
            const auto x = new_inputs(l);
            MNEMO_CHECK(x.rows() == q_rows, "memory: layer ", l, " has ", x.rows(), " new rows, layer 0 has ", q_rows);
            T* fresh = s.mem.grow(q_rows * d_);
            checked_ops<Backend>::copy(q_rows, index_t(d_), x.data(), x.ld(), fresh, index_t(d_));
            s.away = nullptr;
            if (n_old > 0) {
                s.away = s.mem.data();  // stays in place: drop_front moves only the window's start
                T* out = s.c_mem.grow(n_new_c * row);
                compress(l, view<const T, D, Backend>(s.away, n_old * batch_, d_),
                         view<T, D, Backend>(out, n_new_c * batch_, d_));
                s.c_mem.drop_front(c_drop * row);
            }
            s.mem.drop_front((n_old + n_drop) * row);
        }
        // Pad flags, shifted as the memory.
        pad_.resize(std::size_t(len * batch_));
        std::uint8_t* fresh = pad_.data() + mem_slots_ * batch_;
        for (index_t r = 0; r < q_rows; ++r) fresh[r] = new_pad && new_pad[r] ? 1 : 0;
        if (n_old > 0) {
            away_pad_.assign(pad_.begin(), pad_.begin() + n_old * batch_);
            c_pad_.resize(std::size_t(c_len * batch_));
            std::uint8_t* cp = c_pad_.data() + c_mem_slots_ * batch_;
            for (index_t s = 0; s < n_new_c; ++s)
                for (index_t b = 0; b < batch_; ++b) {
                    bool all = true;
                    for (index_t t = 0; t < rate_; ++t) all = all && pad_[std::size_t((s * rate_ + t) * batch_ + b)] != 0;
                    cp[s * batch_ + b] = all ? 1 : 0;
                }
            c_pad_.erase(c_pad_.begin(), c_pad_.begin() + c_drop * batch_);
        } else {
            away_pad_.clear();
        }
        pad_.erase(pad_.begin(), pad_.begin() + (n_old + n_drop) * batch_);
        mem_slots_ = len - n_old - n_drop;
        c_mem_slots_ = c_len - c_drop;
        mem_first_id_ += n_old + n_drop;
        c_mem_first_id_ += c_drop;
        away_slots_ = n_old;
        return n_old;
    }

private:
    struct layer_state {
        detail::sliding_window<T, Backend> mem, c_mem;  // [slots·batch, D]
        const T* away = nullptr;   // the slots the last merge compressed away, in mem's buffer
    };

    view<const T, D, Backend> rows(const T* p, index_t slots) const {
        return view<const T, D, Backend>(p, slots * batch_, d_);
    }
    void new_epoch() {
        static std::atomic<std::uint64_t> counter{0};
        epoch_ = ++counter;
        mem_first_id_ = c_mem_first_id_ = 0;
    }
    index_t n_layers_, mem_len_, c_mem_len_, rate_;
    index_t batch_ = 0, mem_slots_ = 0, c_mem_slots_ = 0, away_slots_ = 0;
    std::uint64_t epoch_ = 0;  // 0: never reset
    std::int64_t mem_first_id_ = 0, c_mem_first_id_ = 0;
    std::vector<layer_state> layers_;
    std::vector<std::uint8_t> pad_, c_pad_, away_pad_;  // pad flags, [slots·batch]
};

}  // namespace mnemo
