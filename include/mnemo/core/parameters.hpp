#pragma once
// parameter_set<T>: every parameter of a model in one flat buffer, gradients in a second buffer of the
// same layout (and optimizer moments in buffers of that layout too), as llm.c does. Modules declare
// their tensors by dotted name (PyTorch state_dict names) while they are constructed; allocate() then
// fixes the layout. The gradients are allocated at their first use: inference never holds them. A
// param<T> handle addresses one tensor's values and gradient.
//
// Each tensor starts on a 64-byte boundary; the gaps are zero in every buffer and stay zero under
// every optimizer (their gradient is zero), so whole-buffer loops need no special cases.
//
// Row-sparse gradients. A tensor declared with grad_sparsity::rows (the relative-position tables
// [2P, heads, d_k], of which a step reaches only the rows of its window) promises that its gradient is
// written only in rows (slices along the first dimension) that its writer records with
// param::touch_grad_rows(lo, hi); the set keeps, per such tensor, the hull of the rows recorded since
// the last zero_grad(). Invariant: outside what grad_live_ranges() reports, every gradient element is
// exactly +0. zero_grad() then clears only the live ranges, and clip_grad_norm and the optimizers skip
// the rest (with bitwise the results of the dense loops). Every way of reaching the gradient that does
// not name rows keeps the invariant by giving up the saving instead: param::grad() and grad_ptr() count
// the whole tensor as touched, the mutable grads() the whole buffer, until the next zero_grad(). So code
// that fills gradients by hand (tests, finite differences, loading) stays correct, only slower.
//
// Backends. parameter_set<T, Backend> keeps both flat buffers in the backend's memory
// (device_memory<Backend>): value() and grad() are then pointers for that backend's kernels, and host
// code reaches the numbers only through the host path (upload, download, on a param or the whole set),
// which initialisation and checkpoints use. On the CPU backend (the default) the pointers are host
// memory and the host path is a copy.
//
// Deferred weight decay. AdamW's decoupled decay multiplies every parameter by (1 − lr·wd) at every
// step, those without gradient too; for the positional tables' rows outside the window (A: 6.3M of
// 7.5M parameters) that is 50 MB of memory traffic a step for rows nothing reads. The set therefore
// keeps a log of decay factors and, per block of adam_cold_block elements inside a row-sparse tensor,
// the first factor the block has not had (deferred_decay, kernels/optimizer_state.hpp). A decoupled
// optimizer's step over the set logs its factor (log_decay), and its kernel leaves such a block alone
// when it would only decay it. Whoever reads values pays first, through the kernel
// pay_deferred_decay: the attention modules the window of the tables they read (pay_rows), the set's
// host path (values(), download, upload) what it copies. The accessors value(), value_rows() and
// grad() only compute pointers. Paying does not change version(): the values are the ones the steps
// defined, bitwise.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

#include "../kernels/cpu/deferred_decay.hpp"
#include "../kernels/optimizer_state.hpp"
#include "buffer.hpp"
#include "error.hpp"
#include "shape.hpp"

namespace mnemo {

template <class T, class Backend = cpu>
class parameter_set;

/// How a tensor's gradient is written. dense: anywhere, by anyone. rows: only in rows (slices along
/// the first dimension) recorded with param::touch_grad_rows() since the last zero_grad().
enum class grad_sparsity : std::uint8_t { dense, rows };

struct tensor_entry {
    std::string name;
    std::vector<index_t> shape;
    index_t offset = 0;  // in elements, into the flat buffers
    index_t size = 0;    // product of shape
    grad_sparsity sparsity = grad_sparsity::dense;
    /// Elements per row (per index of the first dimension).
    index_t row_size() const { return shape.empty() ? size : size / shape.front(); }
    /// Number of rows (the first extent).
    index_t rows() const { return shape.empty() ? 1 : shape.front(); }
};

template <class T, class Backend = cpu>
class param {
public:
    param() = default;
    param(parameter_set<T, Backend>* set, index_t index) : set_(set), index_(index) {}

    /// The tensor's values.
    T* value() const { return set_->value_ptr(index_); }
    /// The values of rows [lo, hi) (slices along the first dimension), as a pointer to row lo. A
    /// row-sparse tensor's rows may owe deferred decay: pay_rows(lo, hi) first.
    T* value_rows(index_t lo, index_t hi) const { return set_->value_rows_ptr(index_, lo, hi); }
    /// Pays rows [lo, hi) their deferred weight decay (see parameters.hpp), through the backend's
    /// kernel; a no-op for a dense tensor. Call it before a kernel reads those rows.
    void pay_rows(index_t lo, index_t hi) const {
        const tensor_entry& e = entry();
        if (e.sparsity == grad_sparsity::rows) set_->pay(e.offset + lo * e.row_size(), e.offset + hi * e.row_size());
    }
    /// The tensor's whole gradient. For a grad_sparsity::rows tensor this counts every row as touched
    /// until the next zero_grad() (whoever holds the pointer may write anywhere); its writer uses
    /// touch_grad_rows() instead.
    T* grad() const { return set_->grad_ptr(index_); }
    /// Records that rows [lo, hi) of the gradient may be written (the recorded interval grows to the
    /// hull of every call since the last zero_grad()) and returns the gradient of row lo. No allocation;
    /// not thread-safe (call it from serial code). On a dense tensor it only returns the pointer.
    T* touch_grad_rows(index_t lo, index_t hi) const { return set_->touch_grad_rows(index_, lo, hi); }
    /// The rows [lo, hi) whose gradient may be non-zero now: all of them for a dense tensor.
    std::pair<index_t, index_t> touched_grad_rows() const { return set_->touched_grad_rows(index_); }
    index_t size() const { return set_->entries()[static_cast<std::size_t>(index_)].size; }
    const tensor_entry& entry() const { return set_->entries()[static_cast<std::size_t>(index_)]; }
    explicit operator bool() const { return set_ != nullptr; }

    /// Host path: the tensor's values from host memory (size() elements); counts as a change.
    void upload(std::span<const T> host) const { set_->upload_values(index_, host); }
    /// Host path: the tensor's values into host memory (size() elements).
    void download(std::span<T> host) const { set_->download_values(index_, host); }
    /// Host path: value i = next() for i = 0, 1, … (initialisers draw in the tensor's element order),
    /// formed in host memory and uploaded.
    template <class F>
    void generate(F&& next) const {
        std::vector<T> host(static_cast<std::size_t>(size()));
        for (T& v : host) v = static_cast<T>(next());
        upload(host);
    }
    /// Host path: every value = v.
    void fill(T v) const {
        generate([v] { return v; });
    }

private:
    parameter_set<T, Backend>* set_ = nullptr;
    index_t index_ = -1;
};

template <class T, class Backend>
class parameter_set {
    using memory = device_memory<Backend>;

public:
    static constexpr index_t alignment_elems = static_cast<index_t>(buffer_alignment / sizeof(T));

    parameter_set() = default;
    parameter_set(const parameter_set&) = delete;  // modules hold pointers to this set
    parameter_set& operator=(const parameter_set&) = delete;

    /// Declares a tensor `name` of `shape`. Only before allocate(); names must be unique. With
    /// grad_sparsity::rows its gradient may be written only in rows recorded with touch_grad_rows().
    param<T, Backend> declare(std::string name, std::vector<index_t> shape, grad_sparsity sparsity = grad_sparsity::dense) {
        MNEMO_CHECK(!allocated_, "parameter_set: cannot declare '", name, "' after allocate()");
        MNEMO_CHECK(!index_.contains(name), "parameter_set: tensor '", name, "' declared twice");
        index_t size = 1;
        for (index_t d : shape) {
            MNEMO_CHECK(d > 0, "parameter_set: tensor '", name, "' has a non-positive extent ", d);
            size *= d;
        }
        MNEMO_CHECK(sparsity == grad_sparsity::dense || !shape.empty(), "parameter_set: tensor '", name,
                    "' is a scalar and cannot have row-sparse gradients");
        tensor_entry e{std::move(name), std::move(shape), total_, size, sparsity};
        total_ += (size + alignment_elems - 1) / alignment_elems * alignment_elems;
        index_.emplace(e.name, static_cast<index_t>(entries_.size()));
        entries_.push_back(std::move(e));
        return param<T, Backend>(this, static_cast<index_t>(entries_.size() - 1));
    }

    /// Fixes the layout and allocates the values, zero. The gradients (zero as well) are allocated at
    /// their first use, so a model that only runs inference never holds them (C's generation: 204 MB
    /// of its 697).
    void allocate() {
        MNEMO_CHECK(!allocated_, "parameter_set: allocate() called twice");
        memory::fill_zero(values_.ensure(total_), bytes(total_));
        // Deferred decay: a block may owe only if it lies inside one row-sparse tensor.
        const index_t blocks = (total_ + adam_cold_block - 1) / adam_cold_block;
        deferrable_.assign(std::size_t(blocks), 0);
        for (const tensor_entry& e : entries_)
            if (e.sparsity == grad_sparsity::rows)
                for (index_t b = (e.offset + adam_cold_block - 1) / adam_cold_block; (b + 1) * adam_cold_block <= e.offset + e.size; ++b)
                    deferrable_[std::size_t(b)] = 1;
        owed_from_.assign(std::size_t(blocks), 0);
        decay_log_.reserve(max_deferred);
        touched_.assign(entries_.size(), row_interval{});
        for (std::size_t i = 0; i < entries_.size(); ++i)
            if (entries_[i].sparsity == grad_sparsity::dense) touched_[i] = {0, entries_[i].rows()};
        live_.reserve(entries_.size() + 1);  // never more runs than tensors: no allocation later
        all_touched_ = false;
        live_dirty_ = true;
        allocated_ = true;
    }

    bool allocated() const { return allocated_; }
    /// Whether the gradient buffer exists yet (it is allocated, zero, at the first use of a gradient).
    bool grads_allocated() const { return allocated_ && grads_.capacity() >= total_ && total_ > 0; }
    /// Length of the flat buffers (including alignment gaps).
    index_t size() const { return total_; }
    /// Number of scalar parameters (excluding gaps).
    index_t count() const {
        index_t n = 0;
        for (const auto& e : entries_) n += e.size;
        return n;
    }

    /// Mutable access to every value counts as a change: version() moves on, so caches derived from
    /// the parameters (the generation cache of a model's projected memory) know to rebuild. Write
    /// through param::value() instead and call mark_changed() yourself.
    T* values() {
        ++version_;
        pay(0, total_);
        return checked(values_).data();
    }
    const T* values() const {
        pay(0, total_);
        return checked(values_).data();
    }
    /// The whole gradient buffer, writable: every gradient counts as touched until the next zero_grad()
    /// (clipping and the optimizers then read all of it, and zero_grad() clears all of it).
    T* grads() {
        T* g = grad_storage();
        touch_all_grads();
        return g;
    }
    const T* grads() const { return grad_storage(); }
    /// The gradient buffer for in-place transforms that map +0 to +0 and never write outside
    /// grad_live_ranges() (clip_grad_norm's scaling by a finite factor): unlike grads() it keeps the
    /// record of touched rows.
    T* grads_preserving_zeros() { return grad_storage(); }
    /// Counts every gradient as touched until the next zero_grad(), as grads() does.
    void touch_all_grads() {
        if (!all_touched_) {
            all_touched_ = true;
            live_dirty_ = true;
        }
    }
    /// Counter of changes to the values (see values()); equal counters mean unchanged parameters.
    std::uint64_t version() const { return version_; }
    void mark_changed() { ++version_; }
    /// Sets every gradient to +0: clears the live ranges (everything else is +0 already) and empties the
    /// touched rows of the row-sparse tensors.
    void zero_grad() {
        T* g = grad_storage();
        if (all_touched_) {
            memory::fill_zero(g, bytes(total_));
        } else {
            for (const flat_range& r : grad_live_ranges()) memory::fill_zero(g + r.begin, bytes(r.end - r.begin));
        }
        for (std::size_t i = 0; i < entries_.size(); ++i)
            if (entries_[i].sparsity != grad_sparsity::dense) touched_[i] = {};
        all_touched_ = false;
        live_dirty_ = true;
    }

    /// The runs of the flat gradient buffer that may hold non-zero values: sorted, disjoint and not
    /// adjacent; every gradient element outside them is exactly +0. Dense tensors are live whole
    /// (with the gap that follows them), row-sparse ones over their touched rows. Valid until the next
    /// change to the touched rows (touch_grad_rows, grad(), grads(), zero_grad()); computed on demand
    /// into storage reserved by allocate(), so it does not allocate. Not thread-safe.
    std::span<const flat_range> grad_live_ranges() const {
        MNEMO_CHECK(allocated_, "parameter_set: allocate() must be called before parameters are used");
        if (live_dirty_) rebuild_live();
        return {live_.data(), live_.size()};
    }
    /// Whether every gradient in [begin, end) is known to be +0 (no live range meets it).
    bool grad_known_zero(index_t begin, index_t end) const {
        const auto live = grad_live_ranges();
        const auto it = std::partition_point(live.begin(), live.end(), [&](const flat_range& r) { return r.end <= begin; });
        return it == live.end() || it->begin >= end;
    }

    /// See param::touch_grad_rows(): records rows [lo, hi) of tensor i and returns the gradient of row lo.
    T* touch_grad_rows(index_t i, index_t lo, index_t hi) {
        T* g = grad_storage();
        const tensor_entry& e = entries_[static_cast<std::size_t>(i)];
        MNEMO_CHECK(0 <= lo && lo <= hi && hi <= e.rows(), "parameter_set: touch_grad_rows(", lo, ", ", hi,
                    ") on tensor '", e.name, "' outside its ", e.rows(), " rows");
        row_interval& t = touched_[static_cast<std::size_t>(i)];
        if (lo < hi && (lo < t.lo || hi > t.hi)) {
            t = t.lo < t.hi ? row_interval{std::min(t.lo, lo), std::max(t.hi, hi)} : row_interval{lo, hi};
            live_dirty_ = true;
        }
        return g + e.offset + lo * e.row_size();
    }
    /// The rows [lo, hi) of tensor i whose gradient may be non-zero (lo == hi: none).
    std::pair<index_t, index_t> touched_grad_rows(index_t i) const {
        MNEMO_CHECK(allocated_, "parameter_set: allocate() must be called before parameters are used");
        const tensor_entry& e = entries_[static_cast<std::size_t>(i)];
        if (all_touched_) return {0, e.rows()};
        const row_interval t = touched_[static_cast<std::size_t>(i)];
        return {t.lo, t.hi};
    }

    const std::vector<tensor_entry>& entries() const { return entries_; }
    /// The entry named `name`, or nullptr.
    const tensor_entry* find(const std::string& name) const {
        auto it = index_.find(name);
        return it == index_.end() ? nullptr : &entries_[static_cast<std::size_t>(it->second)];
    }

    /// Tensor i's values.
    T* value_ptr(index_t i) {
        return checked(values_).data() + entries_[static_cast<std::size_t>(i)].offset;
    }
    /// Rows [lo, hi) of tensor i, as a pointer to row lo.
    T* value_rows_ptr(index_t i, index_t lo, index_t hi) {
        T* v = checked(values_).data();
        const tensor_entry& e = entries_[static_cast<std::size_t>(i)];
        MNEMO_CHECK(0 <= lo && lo <= hi && hi <= e.rows(), "parameter_set: value_rows(", lo, ", ", hi, ") on tensor '",
                    e.name, "' outside its ", e.rows(), " rows");
        return v + e.offset + lo * e.row_size();
    }

    /// Host path: tensor i's values from / into host memory (entry size elements). Upload counts as a
    /// change (version() moves on).
    void upload_values(index_t i, std::span<const T> host) {
        const tensor_entry& e = host_entry(i, host.size(), "upload");
        pay(e.offset, e.offset + e.size);  // (the blocks it shares with neighbours owe too)
        memory::upload(value_ptr(i), host.data(), bytes(e.size));
        ++version_;
    }
    void download_values(index_t i, std::span<T> host) {
        const tensor_entry& e = host_entry(i, host.size(), "download");
        pay(e.offset, e.offset + e.size);
        memory::download(host.data(), value_ptr(i), bytes(e.size));
    }
    /// Host path over the whole flat buffers (size() elements, alignment gaps included).
    void upload_all_values(std::span<const T> host) {
        MNEMO_CHECK(index_t(host.size()) == total_, "parameter_set: upload of ", host.size(), " values into a set of ",
                    total_);
        memory::upload(values(), host.data(), bytes(total_));
    }
    void download_all_values(std::span<T> host) const {
        MNEMO_CHECK(index_t(host.size()) == total_, "parameter_set: download of ", total_, " values into ", host.size());
        memory::download(host.data(), values(), bytes(total_));
    }
    void download_all_grads(std::span<T> host) const {
        MNEMO_CHECK(index_t(host.size()) == total_, "parameter_set: download of ", total_, " gradients into ",
                    host.size());
        memory::download(host.data(), grads(), bytes(total_));
    }

    /// Factors the deferred-decay log holds before it is paid off.
    static constexpr std::size_t max_deferred = 256;

    /// The deferred decay's state, for kernels (the optimizers', pay_deferred_decay).
    deferred_decay<T> deferral() const {
        MNEMO_CHECK(allocated_, "parameter_set: allocate() must be called before parameters are used");
        return {values_.data(), total_, decay_log_.data(), static_cast<std::uint32_t>(decay_log_.size()),
                owed_from_.data(), deferrable_.data()};
    }
    /// For a decoupled optimizer's step over the set: logs the step's decay factor (a full log is paid
    /// off and emptied first) and returns the state with it counted. Serial code only. The step
    /// changes the values: version() moves on.
    deferred_decay<T> log_decay(T factor) {
        if (decay_log_.size() == max_deferred) {
            pay(0, total_);
            decay_log_.clear();
            std::fill(owed_from_.begin(), owed_from_.end(), 0u);
        }
        decay_log_.push_back(factor);
        ++version_;
        return deferral();
    }
    /// Pays the elements [begin, end) their deferred decay (the backend's kernel pay_deferred_decay).
    void pay(index_t begin, index_t end) const {
        if (decay_log_.empty()) return;
        if constexpr (std::is_same_v<Backend, cpu>)
            cpu_kernels::deferred_decay_payment::pay_deferred_decay(deferral(), begin, end);
        else
            ops<Backend>::pay_deferred_decay(deferral(), begin, end);
    }
    /// Whether some block owes deferred decay.
    bool decay_owed() const {
        for (std::size_t b = 0; b < owed_from_.size(); ++b)
            if (deferrable_[b] && owed_from_[b] < decay_log_.size()) return true;
        return false;
    }

    /// Tensor i's whole gradient; a row-sparse tensor counts as touched in every row (see param::grad()).
    T* grad_ptr(index_t i) {
        const tensor_entry& e = entries_[static_cast<std::size_t>(i)];
        if (e.sparsity == grad_sparsity::dense) return grad_storage() + e.offset;
        return touch_grad_rows(i, 0, e.rows());
    }

private:
    static std::size_t bytes(index_t n) { return sizeof(T) * static_cast<std::size_t>(n); }
    const tensor_entry& host_entry(index_t i, std::size_t n, const char* what) const {
        MNEMO_CHECK(0 <= i && i < index_t(entries_.size()), "parameter_set: ", what, " of tensor ", i, " of ",
                    entries_.size());
        const tensor_entry& e = entries_[static_cast<std::size_t>(i)];
        MNEMO_CHECK(index_t(n) == e.size, "parameter_set: ", what, " of ", n, " values for tensor '", e.name, "' of ",
                    e.size);
        return e;
    }
    template <class V>
    V& checked(V& v) const {
        MNEMO_CHECK(allocated_, "parameter_set: allocate() must be called before parameters are used");
        return v;
    }
    template <class V>
    const V& checked(const V& v) const {
        MNEMO_CHECK(allocated_, "parameter_set: allocate() must be called before parameters are used");
        return v;
    }

    struct row_interval {
        index_t lo = 0, hi = 0;  // [lo, hi) in rows; empty when lo == hi
    };

    /// The gradient buffer, allocated and zeroed at the first call (every gradient is +0 until then).
    T* grad_storage() const {
        MNEMO_CHECK(allocated_, "parameter_set: allocate() must be called before parameters are used");
        if (grads_.capacity() < total_) memory::fill_zero(grads_.ensure(total_), bytes(total_));
        return grads_.data();
    }

    // The live runs from the touched rows: each tensor's touched part, a whole tensor's part running on
    // over its trailing gap, merged with its neighbours where they meet.
    void rebuild_live() const {
        live_.clear();
        if (all_touched_) {
            if (total_ > 0) live_.push_back({0, total_});
        } else {
            for (std::size_t i = 0; i < entries_.size(); ++i) {
                const tensor_entry& e = entries_[i];
                const row_interval t = touched_[i];
                if (t.lo >= t.hi) continue;
                const index_t padded = e.offset + (e.size + alignment_elems - 1) / alignment_elems * alignment_elems;
                const flat_range r{e.offset + t.lo * e.row_size(), t.hi == e.rows() ? padded : e.offset + t.hi * e.row_size()};
                if (!live_.empty() && live_.back().end == r.begin) live_.back().end = r.end;
                else live_.push_back(r);
            }
        }
        live_dirty_ = false;
    }

    std::vector<tensor_entry> entries_;
    std::unordered_map<std::string, index_t> index_;
    index_t total_ = 0;
    bool allocated_ = false;
    std::uint64_t version_ = 0;
    mutable buffer<T, Backend> values_;  // mutable: reading pays the deferred decay (the same values)
    std::vector<T> decay_log_;                          // the deferred steps' factors, oldest first
    mutable std::vector<std::uint32_t> owed_from_;      // per block: the first logged factor it has not had
    std::vector<std::uint8_t> deferrable_;              // per block: inside one row-sparse tensor
    mutable buffer<T, Backend> grads_;  // mutable: allocated at the first use (grad_storage)
    std::vector<row_interval> touched_;  // per tensor: the rows whose gradient may be non-zero
    bool all_touched_ = false;           // grads() handed out: the whole buffer may be non-zero
    mutable std::vector<flat_range> live_;  // grad_live_ranges(), rebuilt when live_dirty_
    mutable bool live_dirty_ = true;
};

}  // namespace mnemo
