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
//   parallel_invoke(worth_it, f, g);
//
// f() and g() at the same time, one per thread (in order on one thread): two independent pieces of
// work of about the same size, such as a linear layer's dW = dyᵀ·x and dx = dy·W, each then on one
// thread instead of each split over both with a join between them.
//
//   hold_threads(fn);
//
// fn() on the calling thread while the other OpenMP threads wait for work in one region held open
// around it: every loop above that fn's code runs (and parallel_team, team_barrier) is handed to them
// through a few shared atomics instead of opening a region of its own. Same split, same results;
// what changes is a loop's start and end: on the 2-core Zen 5 VM (g++ 12, libgomp; bench_kernels'
// BM_parallel_region, BM_phases_region, BM_held_loop) an empty libgomp region took 2.9-3.0 µs and
// 4.4-4.6 with a barrier inside, the same loops held 0.92-1.04 and 0.96-1.25 µs (a cache line
// there and back: 0.43-0.45). A model's entry points (a segment's forward, the memory's
// update, a training segment) each hold the threads, through ops<cpu>::hold_threads: a generated
// token of configuration B opens about 33 loops. While fn runs its serial code the waiting threads
// spin (a pause instruction at a time, yielding the core from the 4096th on), as libgomp's own idle
// threads do between regions. Not nested: inside fn, inside another OpenMP region, or on one
// thread, hold_threads is fn(). An exception from fn, or from thread 0's share of a loop, reaches
// hold_threads' caller once the other threads are done with the loop.
//
//   parallel_team(threads, [&](index_t t, index_t nt) { ... });   team_barrier();
//
// body(t, nt) on each of `threads` threads (available_threads() or fewer): a held team's or an
// OpenMP region's; t is the thread's omp_get_thread_num() in either. team_barrier() inside body
// waits for the body's other threads.
//
// Compiled with -DMNEMO_PROFILE_REGIONS, the loops of a held team are timed site by site: where the
// threads wait, and for how long (region_profile.hpp).
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <exception>
#include <optional>
#include <thread>
#include <type_traits>
#include <utility>

#include "../../core/shape.hpp"

#ifdef MNEMO_PROFILE_REGIONS
#include "region_profile.hpp"
// The calling line of parallel_range, parallel_invoke and parallel_team, as a defaulted last argument.
#define MNEMO_REGION_SITE , std::source_location region_site_ = std::source_location::current()
#define MNEMO_REGION_MARK region_profile::detail::site_mark region_mark_(region_site_)
#else
#define MNEMO_REGION_SITE
#define MNEMO_REGION_MARK (void)0
#endif

namespace mnemo {

namespace detail {
/// One step of a spin wait: a pause instruction, and the core yielded from the 4096th step on, so
/// that a waiting thread does not starve one that shares its core (more threads than cores).
inline void spin_wait_step(unsigned& spins) {
    if (++spins < 4096) {
#if defined(__x86_64__) || defined(__i386__)
        __builtin_ia32_pause();
#endif
    } else {
        std::this_thread::yield();
    }
}

/// The threads hold_threads keeps: thread 0 runs the caller's code and hands each parallel loop to
/// the others as a job (a function and its context), then waits for them.
struct held_team {
    using job_fn = void (*)(void*, index_t, index_t);
    static constexpr std::uint64_t released = ~std::uint64_t(0);

    // The job, on the cache line the waiting threads watch: one line to fetch when it changes.
    alignas(64) std::atomic<std::uint64_t> jobs{0};  // jobs handed out; `released` ends the hold
    job_fn job = nullptr;
    void* context = nullptr;
    index_t job_threads = 0;
    alignas(64) std::atomic<std::uint64_t> done{0};    // jobs finished, summed over the waiting threads
    alignas(64) std::atomic<std::uint64_t> rounds{0};  // team_barrier's rounds
    std::atomic<index_t> arrived{0};                   // threads at the current round's barrier
    alignas(64) index_t threads = 1;  // the region's threads, thread 0 included (thread 0's alone from here)
    bool in_job = false;  // thread 0 is running its share of a job (loops inside run on one thread)
#ifdef MNEMO_PROFILE_REGIONS
    // The job's clocks while timing, else null: set by run before each job, read only during one.
    region_profile::detail::loop_clock* loop_timing = nullptr;
#endif

    /// Thread t (≥ 1) of the region: runs its share of every job until the hold ends.
    void serve(index_t t);
    /// body(t, nt) on threads 0..nt−1 (nt ≤ threads), thread 0 being the caller.
    template <class F>
    void run(index_t nt, F& body);
    /// Waits for the job's other threads (nt of them in all).
    void barrier(index_t nt);
    void release() { jobs.store(released, std::memory_order_release); }
};

/// The team the calling thread holds (hold_threads), and the one whose job it is running.
inline thread_local held_team* holding = nullptr;
inline thread_local held_team* in_job_of = nullptr;
inline thread_local index_t job_size = 0;

inline void held_team::serve(index_t t) {
    std::uint64_t seen = 0;
    for (;;) {
        std::uint64_t now;
        unsigned spins = 0;
        while ((now = jobs.load(std::memory_order_acquire)) == seen) spin_wait_step(spins);
        if (now == released) return;
        seen = now;
        if (t < job_threads) {
            in_job_of = this;
            job_size = job_threads;
            job(context, t, job_threads);
#ifdef MNEMO_PROFILE_REGIONS
            if (loop_timing) loop_timing->other_done();
#endif
            in_job_of = nullptr;
        }
        done.fetch_add(1, std::memory_order_acq_rel);
    }
}

template <class F>
inline void held_team::run(index_t nt, F& body) {
    job = [](void* c, index_t t, index_t n) { (*static_cast<F*>(c))(t, n); };
    context = &body;
    job_threads = nt;
#ifdef MNEMO_PROFILE_REGIONS
    std::optional<region_profile::detail::loop_clock> timing;
    if (region_profile::detail::current.on) timing.emplace();
    loop_timing = timing ? &*timing : nullptr;
#endif
    const std::uint64_t n = jobs.load(std::memory_order_relaxed) + 1;
    jobs.store(n, std::memory_order_release);
    in_job = true;
    in_job_of = this;
    job_size = nt;
    auto wait = [&] {
        in_job_of = nullptr;
        in_job = false;
        const std::uint64_t all = n * std::uint64_t(threads - 1);
        unsigned spins = 0;
        while (done.load(std::memory_order_acquire) != all) spin_wait_step(spins);
    };
    try {
        body(index_t(0), nt);
    } catch (...) {  // the other threads still read the body's context: wait for them first
        wait();
        throw;
    }
#ifdef MNEMO_PROFILE_REGIONS
    const auto own_end = region_profile::clock::now();
    wait();
    if (timing) timing->record(own_end, nt);
#else
    wait();
#endif
}

inline void held_team::barrier(index_t nt) {
    const std::uint64_t round = rounds.load(std::memory_order_acquire);
    if (arrived.fetch_add(1, std::memory_order_acq_rel) + 1 == nt) {
        arrived.store(0, std::memory_order_relaxed);
        rounds.store(round + 1, std::memory_order_release);
        return;
    }
    unsigned spins = 0;
    while (rounds.load(std::memory_order_acquire) == round) spin_wait_step(spins);
}
}  // namespace detail

/// Threads a parallel loop may use now: one inside a parallel region or inside a held team's job,
/// the held team's threads inside hold_threads, else omp_get_max_threads().
inline index_t available_threads() {
    if (const detail::held_team* team = detail::holding) return team->in_job ? 1 : team->threads;
    return omp_in_parallel() ? 1 : index_t(omp_get_max_threads());
}

/// body(t, nt) on `threads` threads (2 ≤ threads ≤ available_threads()), see the file's head.
template <class F>
inline void parallel_team(index_t threads, F&& body MNEMO_REGION_SITE) {
    MNEMO_REGION_MARK;
    if (detail::held_team* team = detail::holding) {
        team->run(std::min(threads, team->threads), body);
        return;
    }
#pragma omp parallel num_threads(int(threads))
    body(index_t(omp_get_thread_num()), index_t(omp_get_num_threads()));
}

/// Inside parallel_team's body: waits until every thread of the body has reached it.
inline void team_barrier() {
    if (detail::held_team* team = detail::in_job_of) {
        team->barrier(detail::job_size);
        return;
    }
#pragma omp barrier
}

/// fn() with the threads held (see the file's head); returns what fn returns, rethrows what it throws.
template <class F>
inline decltype(auto) hold_threads(F&& fn) {
    using R = decltype(fn());
    static_assert(!std::is_reference_v<R>, "hold_threads: fn returns a reference");
    const index_t threads = available_threads();
    if (threads < 2 || detail::holding != nullptr) return fn();
    detail::held_team team;
    std::exception_ptr error;
    std::conditional_t<std::is_void_v<R>, bool, std::optional<std::remove_cvref_t<R>>> result{};
#pragma omp parallel num_threads(int(threads))
    {
        const index_t t = omp_get_thread_num();
        if (t == 0) {
            team.threads = omp_get_num_threads();
            detail::holding = &team;
#ifdef MNEMO_PROFILE_REGIONS
            region_profile::detail::hold_begin();
#endif
            try {
                if constexpr (std::is_void_v<R>) fn();
                else result.emplace(fn());
            } catch (...) {
                error = std::current_exception();
            }
#ifdef MNEMO_PROFILE_REGIONS
            region_profile::detail::hold_end();
#endif
            detail::holding = nullptr;
            team.release();
        } else {
            team.serve(t);
        }
    }
    if (error) std::rethrow_exception(error);
    if constexpr (!std::is_void_v<R>) return R(std::move(*result));
}

/// Elements (or multiply-adds) from which a streaming kernel (layer norm, elementwise, activation,
/// compression, dropout) splits its rows over the threads. 2^15 takes in configuration A's segment
/// (256 rows of d 128: its layer norms, residual adds and copies): A's step, Granite Rapids VM, 2
/// threads, 8 interleaved pairs, 27.4-31.1 → 26.1-29.5 ms (serial time between regions 12.3% →
/// 4.6%, tools/gomp_regions.c); 2^14 and 2^12 gained no more.
inline constexpr index_t parallel_min_elements = index_t{1} << 15;

/// Threads a loop of n items may use (1: run it on the calling thread).
inline index_t parallel_threads(index_t n, bool worth_it) {
    return (worth_it && n > 1) ? std::min<index_t>(available_threads(), n) : 1;
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
inline void parallel_range(index_t n, bool worth_it, F&& body MNEMO_REGION_SITE) {
    MNEMO_REGION_MARK;
    if (n <= 0) return;
    const index_t threads = parallel_threads(n, worth_it);
    if (threads <= 1) {
        body(index_t(0), n);
        return;
    }
    parallel_team(threads, [&](index_t t, index_t nt) { detail::run_share(n, t, nt, body); });
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
        if (nt > 1) team_barrier();
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
    parallel_team(threads, [&](index_t t, index_t nt) { detail::run_phases(t, nt, n1, first, n2, second, rest...); });
}

template <class F, class G>
inline void parallel_invoke(bool worth_it, F&& f, G&& g MNEMO_REGION_SITE) {
    MNEMO_REGION_MARK;
    if (parallel_threads(2, worth_it) < 2) {
        f();
        g();
        return;
    }
    parallel_team(2, [&](index_t t, index_t nt) {
        if (t == 0) f();
        if (t == 1 || (t == 0 && nt < 2)) g();  // the team may be smaller than asked
    });
}

}  // namespace mnemo
