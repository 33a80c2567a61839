#pragma once
// Owning, 64-byte aligned storage. A buffer grows on demand and never shrinks, so once a module has
// seen its largest shape, forward and backward stop allocating (the steady state).
#include <cstddef>
#include <cstdlib>
#include <new>
#include <vector>

#include "shape.hpp"

namespace mnemo {

inline constexpr std::size_t buffer_alignment = 64;

template <class T>
struct aligned_allocator {
    using value_type = T;
    aligned_allocator() = default;
    template <class U>
    constexpr aligned_allocator(const aligned_allocator<U>&) noexcept {}
    T* allocate(std::size_t n) {
        return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t{buffer_alignment}));
    }
    void deallocate(T* p, std::size_t) noexcept { ::operator delete(p, std::align_val_t{buffer_alignment}); }
    template <class U>
    bool operator==(const aligned_allocator<U>&) const noexcept { return true; }
};

template <class T>
using aligned_vector = std::vector<T, aligned_allocator<T>>;

/// Scratch that grows to the largest size asked for and is reused from then on.
template <class T>
class buffer {
public:
    /// At least n elements; contents are unspecified after growth.
    T* ensure(index_t n) {
        if (static_cast<std::size_t>(n) > data_.size()) data_.resize(static_cast<std::size_t>(n));
        return data_.data();
    }
    T* data() { return data_.data(); }
    const T* data() const { return data_.data(); }
    index_t capacity() const { return static_cast<index_t>(data_.size()); }

private:
    aligned_vector<T> data_;
};

}  // namespace mnemo
