#pragma once
// Counts the heap allocations of a test binary: replaces the global operator new/delete (so include
// this header from exactly ONE translation unit of a test executable) and counts while a window
// opened by count_allocations is open. Used by the steady-state "no allocation" tests.
#include <atomic>
#include <cstdlib>
#include <new>

// The replacements pair malloc/aligned_alloc with free; g++ cannot see that and warns.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"
#endif

namespace mnemo::testing {
inline std::atomic<bool> counting_allocations{false};
inline std::atomic<long> allocation_count{0};

/// Runs f() and returns the number of operator new calls it made (on any thread).
template <class F>
long count_allocations(F&& f) {
    allocation_count = 0;
    counting_allocations = true;
    f();
    counting_allocations = false;
    return allocation_count.load();
}
}  // namespace mnemo::testing

void* operator new(std::size_t n) {
    if (mnemo::testing::counting_allocations.load(std::memory_order_relaxed))
        mnemo::testing::allocation_count.fetch_add(1, std::memory_order_relaxed);
    if (void* p = std::malloc(n ? n : 1)) return p;
    throw std::bad_alloc();
}
void* operator new(std::size_t n, std::align_val_t a) {
    if (mnemo::testing::counting_allocations.load(std::memory_order_relaxed))
        mnemo::testing::allocation_count.fetch_add(1, std::memory_order_relaxed);
    const std::size_t al = static_cast<std::size_t>(a);
    if (void* p = std::aligned_alloc(al, (n + al - 1) / al * al)) return p;
    throw std::bad_alloc();
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
void operator delete(void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete(void* p, std::size_t, std::align_val_t) noexcept { std::free(p); }
