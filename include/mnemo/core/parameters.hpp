#pragma once
// parameter_set<T>: every parameter of a model in one flat buffer, gradients in a second buffer of the
// same layout (and optimizer moments in buffers of that layout too), as llm.c does. Modules declare
// their tensors by dotted name (PyTorch state_dict names) while they are constructed; allocate() then
// fixes the layout. A param<T> handle addresses one tensor's values and gradient.
//
// Each tensor starts on a 64-byte boundary; the gaps are zero in every buffer and stay zero under
// every optimizer (their gradient is zero), so whole-buffer loops need no special cases.
#include <cstdint>
#include <cstring>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "buffer.hpp"
#include "error.hpp"
#include "shape.hpp"

namespace mnemo {

template <class T>
class parameter_set;

struct tensor_entry {
    std::string name;
    std::vector<index_t> shape;
    index_t offset = 0;  // in elements, into the flat buffers
    index_t size = 0;    // product of shape
};

template <class T>
class param {
public:
    param() = default;
    param(parameter_set<T>* set, index_t index) : set_(set), index_(index) {}

    T* value() const { return set_->value_ptr(index_); }
    T* grad() const { return set_->grad_ptr(index_); }
    index_t size() const { return set_->entries()[static_cast<std::size_t>(index_)].size; }
    const tensor_entry& entry() const { return set_->entries()[static_cast<std::size_t>(index_)]; }
    explicit operator bool() const { return set_ != nullptr; }

private:
    parameter_set<T>* set_ = nullptr;
    index_t index_ = -1;
};

template <class T>
class parameter_set {
public:
    static constexpr index_t alignment_elems = static_cast<index_t>(buffer_alignment / sizeof(T));

    parameter_set() = default;
    parameter_set(const parameter_set&) = delete;  // modules hold pointers to this set
    parameter_set& operator=(const parameter_set&) = delete;

    /// Declares a tensor `name` of `shape`. Only before allocate(); names must be unique.
    param<T> declare(std::string name, std::vector<index_t> shape) {
        MNEMO_CHECK(!allocated_, "parameter_set: cannot declare '", name, "' after allocate()");
        MNEMO_CHECK(!index_.contains(name), "parameter_set: tensor '", name, "' declared twice");
        index_t size = 1;
        for (index_t d : shape) {
            MNEMO_CHECK(d > 0, "parameter_set: tensor '", name, "' has a non-positive extent ", d);
            size *= d;
        }
        tensor_entry e{std::move(name), std::move(shape), total_, size};
        total_ += (size + alignment_elems - 1) / alignment_elems * alignment_elems;
        index_.emplace(e.name, static_cast<index_t>(entries_.size()));
        entries_.push_back(std::move(e));
        return param<T>(this, static_cast<index_t>(entries_.size() - 1));
    }

    /// Fixes the layout and allocates values and gradients, both zero.
    void allocate() {
        MNEMO_CHECK(!allocated_, "parameter_set: allocate() called twice");
        values_.assign(static_cast<std::size_t>(total_), T(0));
        grads_.assign(static_cast<std::size_t>(total_), T(0));
        allocated_ = true;
    }

    bool allocated() const { return allocated_; }
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
        return checked(values_).data();
    }
    const T* values() const { return checked(values_).data(); }
    T* grads() { return checked(grads_).data(); }
    const T* grads() const { return checked(grads_).data(); }
    /// Counter of changes to the values (see values()); equal counters mean unchanged parameters.
    std::uint64_t version() const { return version_; }
    void mark_changed() { ++version_; }
    void zero_grad() { std::memset(grads(), 0, sizeof(T) * static_cast<std::size_t>(total_)); }

    const std::vector<tensor_entry>& entries() const { return entries_; }
    /// The entry named `name`, or nullptr.
    const tensor_entry* find(const std::string& name) const {
        auto it = index_.find(name);
        return it == index_.end() ? nullptr : &entries_[static_cast<std::size_t>(it->second)];
    }

    T* value_ptr(index_t i) { return checked(values_).data() + entries_[static_cast<std::size_t>(i)].offset; }
    T* grad_ptr(index_t i) { return grads() + entries_[static_cast<std::size_t>(i)].offset; }

private:
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

    std::vector<tensor_entry> entries_;
    std::unordered_map<std::string, index_t> index_;
    index_t total_ = 0;
    bool allocated_ = false;
    std::uint64_t version_ = 0;
    aligned_vector<T> values_;
    aligned_vector<T> grads_;
};

}  // namespace mnemo
