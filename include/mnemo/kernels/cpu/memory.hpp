#pragma once
// device_memory<cpu>: the CPU backend's storage. Host memory, 64-byte aligned, with transparent huge
// pages asked for over big blocks; the host path (upload, download) is a plain copy.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <new>
#include <vector>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#include "../../core/backend.hpp"
#include "parallel.hpp"

namespace mnemo {

inline constexpr std::size_t buffer_alignment = 64;

/// Blocks of at least this many bytes (one 2 MiB page) start on a 2 MiB boundary and ask Linux for
/// transparent huge pages (madvise, where THP is in its "madvise" mode, Debian's default) over the
/// whole pages inside them. Streaming a generated token's weights from DRAM with 4 KiB pages ran 3-5%
/// slower (Zen 1, blocks from 8 MiB); from 2 MiB, training steps A and B ran 2-4% faster than from
/// 8 MiB (Zen 2: B's 6 MiB keys and values, its per-layer activations; docs/performance.md).
inline constexpr std::size_t huge_page_bytes = std::size_t(2) << 20;
inline constexpr std::size_t huge_page_min_bytes = huge_page_bytes;

/// madvise(MADV_HUGEPAGE) over the 2 MiB pages wholly inside [p, p + bytes); nothing elsewhere or on failure.
inline void advise_huge_pages([[maybe_unused]] void* p, [[maybe_unused]] std::size_t bytes) noexcept {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    constexpr std::uintptr_t huge = huge_page_bytes;
    const std::uintptr_t begin = (reinterpret_cast<std::uintptr_t>(p) + huge - 1) & ~(huge - 1);
    const std::uintptr_t end = (reinterpret_cast<std::uintptr_t>(p) + bytes) & ~(huge - 1);
    if (end > begin) (void)madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);
#endif
}

template <>
struct device_memory<cpu> {
    static void* allocate(std::size_t bytes) {
        void* p = ::operator new(bytes ? bytes : 1, alignment(bytes));
        if (bytes >= huge_page_min_bytes) advise_huge_pages(p, bytes);
        return p;
    }
    /// bytes: the size it was allocated with (the alignment follows from it).
    static void deallocate(void* p, std::size_t bytes) noexcept { ::operator delete(p, alignment(bytes)); }
    /// Zeroes [p, p + bytes); from fill_parallel_min_bytes on, one contiguous part per thread.
    static void fill_zero(void* p, std::size_t bytes) {
        if (!bytes) return;
        constexpr std::size_t part = 4096;
        const index_t parts = index_t((bytes + part - 1) / part);
        char* c = static_cast<char*>(p);
        parallel_range(parts, bytes >= fill_parallel_min_bytes, [&](index_t begin, index_t end) {
            const std::size_t lo = std::size_t(begin) * part, hi = std::min(bytes, std::size_t(end) * part);
            std::memset(c + lo, 0, hi - lo);
        });
    }
    /// zero_grad's fills before each training step (configuration A: a 0.66 MB and a 78 KB run a
    /// layer, B: 3 MB) took 0.5-0.7% of A's and B's steps on one thread (tools/gomp_regions.c);
    /// 512 KiB is 20-25 µs of memset, several times a region's start and end.
    static constexpr std::size_t fill_parallel_min_bytes = std::size_t(1) << 19;
    /// Within the backend; the ranges may overlap. From copy_parallel_min_bytes on, one contiguous
    /// part of the source per thread. Ranges that overlap by all but `gap` bytes (a window of rows
    /// moved by a few rows) are split too when every part is at least `gap` long: each part but one
    /// first sets aside the `gap` bytes whose destination is its neighbour's source, moves the rest
    /// within its own part, and writes them after every part has been read. The bytes are those of
    /// memmove whatever the threads.
    static void copy(void* dst, const void* src, std::size_t bytes) {
        if (!bytes || dst == src) return;
        char* d = static_cast<char*>(dst);
        const char* s = static_cast<const char*>(src);
        const bool up = d > s;
        const std::size_t gap = up ? std::size_t(d - s) : std::size_t(s - d);
        const index_t threads = parallel_threads(index_t(bytes / copy_part_min_bytes), bytes >= copy_parallel_min_bytes);
        if (threads <= 1 || (gap < bytes && gap > bytes / std::size_t(threads))) {
            std::memmove(d, s, bytes);
            return;
        }
        parallel_team(threads, [&](index_t team_t, index_t team_nt) {
            const std::size_t t = std::size_t(team_t), nt = std::size_t(team_nt);
            const std::size_t lo = bytes * t / nt, hi = bytes * (t + 1) / nt;  // this part of the source
            if (gap >= bytes) {  // apart: no part's destination is another's source
                std::memcpy(d + lo, s + lo, hi - lo);
            } else {
                // Moving down, part t's first gap bytes go to part t − 1's last; moving up, part t's
                // last gap bytes go to part t + 1's first. Part 0 (down) or the last part (up) has
                // no such neighbour.
                const bool edge = up ? t + 1 < nt : t > 0;
                const std::size_t aside = edge ? (up ? hi - gap : lo) : 0;  // offset of the bytes set aside
                char* keep = edge ? set_aside(gap) : nullptr;
                if (edge) std::memcpy(keep, s + aside, gap);
                const std::size_t a = edge && !up ? lo + gap : lo, b = edge && up ? hi - gap : hi;
                std::memmove(d + a, s + a, b - a);
                team_barrier();
                if (edge) std::memcpy(d + aside, keep, gap);
            }
        });
    }
    /// Bytes from which copy splits over the threads, and the least each thread's part gets. When
    /// the memory compresses (every rate-th generated token), a layer's cached keys and values move
    /// by a few rows: 1 MiB in configuration C, 250 KiB in B. From 512 KiB on (256 KiB parts), B's
    /// moves stayed on one thread, the other waiting: 6 a compressing token, a tenth of B's token
    /// time in `perf`. From 128 KiB (64 KiB parts): B's token 0.957-0.978× the time (Zen 4, 2
    /// threads, one process alternating the two, medians of 16 rounds of 300 tokens), A's training
    /// step 0.999×.
    static constexpr std::size_t copy_parallel_min_bytes = std::size_t(1) << 17;
    static constexpr std::size_t copy_part_min_bytes = std::size_t(1) << 16;
    static void upload(void* dst, const void* host, std::size_t bytes) {
        if (bytes) std::memcpy(dst, host, bytes);
    }
    static void download(void* host, const void* src, std::size_t bytes) {
        if (bytes) std::memcpy(host, src, bytes);
    }

private:
    /// This thread's block of at least n bytes for copy's set-aside bytes; grown once, kept.
    static char* set_aside(std::size_t n) {
        thread_local std::vector<char> block;
        if (block.size() < n) block.resize(n);
        return block.data();
    }
    static std::align_val_t alignment(std::size_t bytes) {
        return std::align_val_t{bytes >= huge_page_min_bytes ? huge_page_bytes : buffer_alignment};
    }
};

}  // namespace mnemo
