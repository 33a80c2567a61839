#pragma once
// Counts the heap allocations of a test binary: replaces the global operator new/delete AND the C
// allocation functions (malloc, calloc, realloc, aligned_alloc, posix_memalign, memalign), so
// allocations made by Eigen (which uses malloc for its packing buffers), libgomp or libstdc++ count
// too. Include this header from exactly ONE translation unit of a test executable. It counts while a
// window opened by count_allocations is open. Used by the steady-state "no allocation" tests.
// The replacements forward to glibc's __libc_* entry points.
//
// Under AddressSanitizer (tools/sanitize.sh) or ThreadSanitizer (tools/tsan.sh) nothing is replaced:
// the sanitizer's allocator must see every allocation. count_allocations then runs f() (so the code
// still runs under the sanitizer) and returns 0, saying once on stderr that the normal build checks
// the counts.
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <new>

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define MNEMO_TEST_COUNT_ALLOCATIONS 0
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
#define MNEMO_TEST_COUNT_ALLOCATIONS 0
#endif
#endif
#ifndef MNEMO_TEST_COUNT_ALLOCATIONS
#define MNEMO_TEST_COUNT_ALLOCATIONS 1
#endif

// The replacements pair malloc/aligned_alloc with free; g++ cannot see that and warns.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"
#endif

namespace mnemo::testing {
/// False under AddressSanitizer or ThreadSanitizer: count_allocations then returns 0 (see the top of this file), and
/// the checks that the counter itself works are skipped.
inline constexpr bool allocations_counted = MNEMO_TEST_COUNT_ALLOCATIONS != 0;
inline std::atomic<bool> counting_allocations{false};
inline std::atomic<long> allocation_count{0};

inline void note_allocation() {
    if (counting_allocations.load(std::memory_order_relaxed)) allocation_count.fetch_add(1, std::memory_order_relaxed);
}

/// Runs f() and returns the number of heap allocations (operator new or malloc family) it made, on any thread.
template <class F>
long count_allocations(F&& f) {
#if !MNEMO_TEST_COUNT_ALLOCATIONS
    static bool said = false;
    if (!said) std::fputs("allocation_counter: not counted under a sanitizer (the normal build checks it)\n", stderr);
    said = true;
    f();
    return 0;
#endif
    allocation_count = 0;
    counting_allocations = true;
    f();
    counting_allocations = false;
    return allocation_count.load();
}
}  // namespace mnemo::testing

#if MNEMO_TEST_COUNT_ALLOCATIONS
extern "C" {
void* __libc_malloc(std::size_t);
void* __libc_calloc(std::size_t, std::size_t);
void* __libc_realloc(void*, std::size_t);
void* __libc_memalign(std::size_t, std::size_t);
void __libc_free(void*);

void* malloc(std::size_t n) noexcept {
    mnemo::testing::note_allocation();
    return __libc_malloc(n);
}
void* calloc(std::size_t n, std::size_t size) noexcept {
    mnemo::testing::note_allocation();
    return __libc_calloc(n, size);
}
void* realloc(void* p, std::size_t n) noexcept {
    mnemo::testing::note_allocation();
    return __libc_realloc(p, n);
}
void* aligned_alloc(std::size_t al, std::size_t n) noexcept {
    mnemo::testing::note_allocation();
    return __libc_memalign(al, n);
}
void* memalign(std::size_t al, std::size_t n) noexcept {
    mnemo::testing::note_allocation();
    return __libc_memalign(al, n);
}
int posix_memalign(void** out, std::size_t al, std::size_t n) noexcept {
    mnemo::testing::note_allocation();
    void* p = __libc_memalign(al, n);
    if (!p) return 12;  // ENOMEM
    *out = p;
    return 0;
}
}

void* operator new(std::size_t n) {
    mnemo::testing::note_allocation();
    if (void* p = __libc_malloc(n ? n : 1)) return p;
    throw std::bad_alloc();
}
void* operator new(std::size_t n, std::align_val_t a) {
    mnemo::testing::note_allocation();
    const std::size_t al = static_cast<std::size_t>(a);
    if (void* p = __libc_memalign(al, n ? n : 1)) return p;
    throw std::bad_alloc();
}
void operator delete(void* p) noexcept { __libc_free(p); }
void operator delete(void* p, std::size_t) noexcept { __libc_free(p); }
void operator delete(void* p, std::align_val_t) noexcept { __libc_free(p); }
void operator delete(void* p, std::size_t, std::align_val_t) noexcept { __libc_free(p); }
#endif  // MNEMO_TEST_COUNT_ALLOCATIONS
