#pragma once
// Owning, 64-byte aligned storage. A buffer grows on demand and never shrinks, so once a module has
// seen its largest shape, forward and backward stop allocating (the steady state).
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <new>
#include <vector>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#include "shape.hpp"

namespace mnemo {

inline constexpr std::size_t buffer_alignment = 64;

/// Buffers of at least this many bytes ask Linux for transparent huge pages (2 MiB) over the whole
/// 2 MiB-aligned part of them (madvise, where THP is in its "madvise" mode, Debian's default). Streaming
/// a generated token's weights from DRAM with 4 KiB pages ran 3-5% slower (measured on Zen 1).
inline constexpr std::size_t huge_page_min_bytes = std::size_t(8) << 20;

/// madvise(MADV_HUGEPAGE) over the 2 MiB pages wholly inside [p, p + bytes); nothing elsewhere or on failure.
inline void advise_huge_pages([[maybe_unused]] void* p, [[maybe_unused]] std::size_t bytes) noexcept {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    constexpr std::uintptr_t huge = std::uintptr_t(2) << 20;
    const std::uintptr_t begin = (reinterpret_cast<std::uintptr_t>(p) + huge - 1) & ~(huge - 1);
    const std::uintptr_t end = (reinterpret_cast<std::uintptr_t>(p) + bytes) & ~(huge - 1);
    if (end > begin) (void)madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);
#endif
}

template <class T>
struct aligned_allocator {
    using value_type = T;
    aligned_allocator() = default;
    template <class U>
    constexpr aligned_allocator(const aligned_allocator<U>&) noexcept {}
    T* allocate(std::size_t n) {
        T* p = static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t{buffer_alignment}));
        if (n * sizeof(T) >= huge_page_min_bytes) advise_huge_pages(p, n * sizeof(T));
        return p;
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
