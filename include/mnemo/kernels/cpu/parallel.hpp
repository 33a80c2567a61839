#pragma once
// parallel_range: the one way mnemo's CPU code splits a loop over OpenMP threads.
//
//   parallel_range(n, worth_it, [&](index_t begin, index_t end) { for (i = begin; i < end; ++i) ... });
//
// The body gets one contiguous block of [0, n) per thread (static partition). It runs on the calling
// thread alone, without opening an OpenMP region, when `worth_it` is false, when n < 2, when only one
// thread is available, or when the caller is already inside a parallel region. That matters for
// speed and for the steady-state "no allocation" promise: libgomp allocates (and frees) a new team on
// every region that ends up with one thread, e.g. `#pragma omp parallel for if (false)` or any
// nested region, while a region of several threads reuses the previous team.
// Iterations must be independent, so results never depend on the thread count.
//
//   parallel_phases(worth_it, n1, first, n2, second[, n3, third, ...]);
//
// first(begin, end) over [0, n1) split as parallel_range splits it, then, once every thread is done
// with its share, second(begin, end) over [0, n2), and so on: loops where each reads what any part
// of the one before wrote, in one region with a barrier between each two. On the 2-core Zen 5 VM (g++ 12,
// libgomp) two empty regions in a row took 7.0-7.1 µs and one with a barrier 4.7-5.2 (libomp: 3.8-4.0
// and 2.3-2.4).
//
//   parallel_items(n, worth_it, [&](index_t begin, index_t end) { ... });
//
// The same contract, with the items dealt one at a time to whichever thread is free (a shared
// counter) instead of in fixed blocks: for a few dozen equal, heavy items (a batch element's
// attention), where a thread that a neighbouring VM slows for a while would leave the other waiting
// at the end of a fixed block. The body gets [i, i + 1) per item in parallel, [0, n) on one thread;
// which thread runs an item must not change what it computes.
//
//   parallel_invoke(worth_it, f, g);
//
// f() and g() at the same time, one per thread (in order on one thread): two independent pieces of
// work of about the same size, such as a linear layer's dW = dyᵀ·x and dx = dy·W, each then on one
// thread instead of each split over both with a join between them.
#include <omp.h>

#include <algorithm>
#include <atomic>

#include "../../core/shape.hpp"

namespace mnemo {

/// Elements (or multiply-adds) from which a streaming kernel (layer norm, elementwise, activation,
/// compression, dropout) splits its rows over the threads. 2^15 takes in configuration A's segment
/// (256 rows of d 128: its layer norms, residual adds and copies): A's step, Granite Rapids VM, 2
/// threads, 8 interleaved pairs, 27.4-31.1 → 26.1-29.5 ms (serial time between regions 12.3% →
/// 4.6%, tools/gomp_regions.c); 2^14 and 2^12 gained no more.
inline constexpr index_t parallel_min_elements = index_t{1} << 15;

/// Threads a loop of n items may use (1: run it on the calling thread).
inline index_t parallel_threads(index_t n, bool worth_it) {
    return (worth_it && n > 1 && !omp_in_parallel()) ? std::min<index_t>(index_t(omp_get_max_threads()), n) : 1;
}

namespace detail {
/// body(begin, end) over thread t's block of [0, n) among nt (the static partition), if not empty.
template <class F>
inline void run_share(index_t n, index_t t, index_t nt, F& body) {
    const index_t begin = n * t / nt, end = n * (t + 1) / nt;
    if (begin < end) body(begin, end);
}
}  // namespace detail

template <class F>
inline void parallel_range(index_t n, bool worth_it, F&& body) {
    if (n <= 0) return;
    const index_t threads = parallel_threads(n, worth_it);
    if (threads <= 1) {
        body(index_t(0), n);
        return;
    }
#pragma omp parallel num_threads(int(threads))
    detail::run_share(n, omp_get_thread_num(), omp_get_num_threads(), body);
}

namespace detail {
inline index_t most_items() { return 0; }
template <class F, class... Rest>
inline index_t most_items(index_t n, F&, Rest&... rest) {
    return std::max(n, most_items(rest...));
}
/// The phases' shares of thread t among nt, with a barrier between each two when nt > 1.
template <class F, class... Rest>
inline void run_phases(index_t t, index_t nt, index_t n, F& body, Rest&... rest) {
    run_share(n, t, nt, body);
    if constexpr (sizeof...(Rest) > 0) {
        if (nt > 1) {
#pragma omp barrier
        }
        run_phases(t, nt, rest...);
    }
}
}  // namespace detail

template <class F, class G, class... Rest>
inline void parallel_phases(bool worth_it, index_t n1, F&& first, index_t n2, G&& second, Rest&&... rest) {
    static_assert(sizeof...(Rest) % 2 == 0, "parallel_phases: (items, body) pairs");
    const index_t threads = parallel_threads(detail::most_items(n1, first, n2, second, rest...), worth_it);
    if (threads <= 1) {
        detail::run_phases(0, 1, n1, first, n2, second, rest...);
        return;
    }
#pragma omp parallel num_threads(int(threads))
    detail::run_phases(omp_get_thread_num(), omp_get_num_threads(), n1, first, n2, second, rest...);
}

template <class F>
inline void parallel_items(index_t n, bool worth_it, F&& body) {
    if (n <= 0) return;
    const index_t threads = parallel_threads(n, worth_it);
    if (threads <= 1) {
        body(index_t(0), n);
        return;
    }
    std::atomic<index_t> next{0};
#pragma omp parallel num_threads(int(threads))
    for (index_t i = next.fetch_add(1, std::memory_order_relaxed); i < n; i = next.fetch_add(1, std::memory_order_relaxed))
        body(i, i + 1);
}

template <class F, class G>
inline void parallel_invoke(bool worth_it, F&& f, G&& g) {
    if (parallel_threads(2, worth_it) < 2) {
        f();
        g();
        return;
    }
#pragma omp parallel num_threads(2)
    {
        const int t = omp_get_thread_num();
        if (t == 0) f();
        if (t == 1 || (t == 0 && omp_get_num_threads() < 2)) g();  // the team may be smaller than asked
    }
}

}  // namespace mnemo
