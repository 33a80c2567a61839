#pragma once
// Owning, 64-byte aligned storage in a backend's memory. A buffer grows on demand and never shrinks,
// so once a module has seen its largest shape, forward and backward stop allocating (the steady state).
// Growth keeps the contents it had (the rest is unspecified on other backends, zero on the CPU).
#include <cstddef>
#include <span>
#include <utility>
#include <vector>

#include "../kernels/cpu/memory.hpp"
#include "backend.hpp"
#include "shape.hpp"

namespace mnemo {

template <class T>
struct aligned_allocator {
    using value_type = T;
    aligned_allocator() = default;
    template <class U>
    constexpr aligned_allocator(const aligned_allocator<U>&) noexcept {}
    T* allocate(std::size_t n) { return static_cast<T*>(device_memory<cpu>::allocate(n * sizeof(T))); }
    void deallocate(T* p, std::size_t n) noexcept { device_memory<cpu>::deallocate(p, n * sizeof(T)); }
    template <class U>
    bool operator==(const aligned_allocator<U>&) const noexcept { return true; }
};

/// Host memory with the CPU backend's alignment (and huge pages for big blocks).
template <class T>
using aligned_vector = std::vector<T, aligned_allocator<T>>;

/// Scratch that grows to the largest size asked for and is reused from then on, in Backend's memory.
template <class T, class Backend = cpu>
class buffer {
    using memory = device_memory<Backend>;

public:
    buffer() = default;
    buffer(const buffer&) = delete;
    buffer& operator=(const buffer&) = delete;
    buffer(buffer&& o) noexcept : data_(std::exchange(o.data_, nullptr)), size_(std::exchange(o.size_, 0)) {}
    buffer& operator=(buffer&& o) noexcept {
        std::swap(data_, o.data_);
        std::swap(size_, o.size_);
        return *this;
    }
    ~buffer() {
        if (data_) memory::deallocate(data_, bytes(size_));
    }

    /// At least n elements; the first capacity() elements keep their contents through growth.
    T* ensure(index_t n) {
        if (n > size_) {
            T* p = static_cast<T*>(memory::allocate(bytes(n)));
            if (data_) {
                memory::copy(p, data_, bytes(size_));
                memory::deallocate(data_, bytes(size_));
            }
            data_ = p;
            size_ = n;
        }
        return data_;
    }
    T* data() { return data_; }
    const T* data() const { return data_; }
    index_t capacity() const { return size_; }
    /// Host path: the first host.size() elements from host memory (growing as ensure() does).
    T* upload(std::span<const T> host) {
        T* p = ensure(static_cast<index_t>(host.size()));
        if (!host.empty()) memory::upload(p, host.data(), host.size_bytes());
        return p;
    }

private:
    static std::size_t bytes(index_t n) { return sizeof(T) * static_cast<std::size_t>(n); }
    T* data_ = nullptr;
    index_t size_ = 0;
};

/// The CPU's buffer: a host vector (growth value-initialises the new elements).
template <class T>
class buffer<T, cpu> {
public:
    T* ensure(index_t n) {
        if (static_cast<std::size_t>(n) > data_.size()) data_.resize(static_cast<std::size_t>(n));
        return data_.data();
    }
    T* data() { return data_.data(); }
    const T* data() const { return data_.data(); }
    index_t capacity() const { return static_cast<index_t>(data_.size()); }
    /// Host path: the first host.size() elements from host memory (growing as ensure() does).
    T* upload(std::span<const T> host) {
        T* p = ensure(static_cast<index_t>(host.size()));
        if (!host.empty()) device_memory<cpu>::upload(p, host.data(), host.size_bytes());
        return p;
    }

private:
    aligned_vector<T> data_;
};

}  // namespace mnemo
