#pragma once
// Where the threads of a held team wait, loop by loop (opt-in: compile the program with
// -DMNEMO_PROFILE_REGIONS; without it parallel.hpp includes none of this and costs nothing).
//
//   region_profile::start();   ... a model's steps ...   region_profile::stop();
//   region_profile::report(stdout);
//
// Inside hold_threads (a model's entry points: a training segment, a forward, a token), every
// loop handed to the held threads is timed at its start, at the end of thread 0's share, at the end
// of each other thread's share and once all are done, and charged to its site: the source line of
// the outermost parallel_range, parallel_invoke or parallel_team call it ran under (a GEMM's loops
// inside a linear layer's parallel_invoke count as that line's; parallel_phases' loops as the
// parallel_team line inside parallel.hpp). Per site:
//   loops          how many ran
//   time           start to all done, summed
//   thread 0 waits all done − thread 0's end: thread 0's share was the shorter
//   others wait    all done − another thread's end, averaged over the other threads
//   serial before  the previous loop's end (or the hold's start) to this loop's start: thread 0 alone
//                  in the caller's code while the others wait
// and the held time in all (hold_threads' calls, their ends after the last loop included).
// tools/gomp_regions.c times OpenMP's own regions; held loops open none, so this is what sees them.
//
// The tables are the calling thread's (thread_local): start, stop, report and the hold_threads
// calls they measure belong on one thread. Up to max_sites sites; loops of further sites are
// counted in `dropped`. Timing is std::chrono::steady_clock, a few tens of nanoseconds a reading,
// four readings a loop.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <source_location>
#include <span>

namespace mnemo::region_profile {

using clock = std::chrono::steady_clock;

struct site {
    const char* file = nullptr;  // std::source_location's file name (static storage)
    unsigned line = 0;
    long loops = 0;
    double seconds = 0, thread0_wait = 0, others_wait = 0, serial_before = 0;
};

inline constexpr int max_sites = 256;

struct table {
    site sites[max_sites];
    int used = 0;
    long dropped = 0;
    bool on = false;
    double held = 0;             // seconds inside hold_threads while on
    clock::time_point last_end;  // the last loop's end in the current hold (or the hold's start)
    clock::time_point hold_start;
};

namespace detail {
inline thread_local table current;
/// The site of the outermost parallel_* call running on this thread (null: none yet).
inline thread_local const char* site_file = nullptr;
inline thread_local unsigned site_line = 0;

inline double seconds(clock::time_point a, clock::time_point b) { return std::chrono::duration<double>(b - a).count(); }

inline site* find_or_add(const char* file, unsigned line) {
    table& t = current;
    for (int i = 0; i < t.used; ++i)
        if (t.sites[i].line == line && (t.sites[i].file == file || std::strcmp(t.sites[i].file, file) == 0))
            return &t.sites[i];
    if (t.used == max_sites) return nullptr;
    site& s = t.sites[t.used++];
    s = site{};
    s.file = file;
    s.line = line;
    return &s;
}

/// Marks the outermost parallel_* call's line for the loops it runs (parallel.hpp).
struct site_mark {
    bool set = false;
    explicit site_mark(const std::source_location& where) {
        if (site_file == nullptr) {
            site_file = where.file_name();
            site_line = unsigned(where.line());
            set = true;
        }
    }
    ~site_mark() {
        if (set) site_file = nullptr;
    }
    site_mark(const site_mark&) = delete;
    site_mark& operator=(const site_mark&) = delete;
};

/// One held loop's clocks (held_team::run): the other threads add their end times (as nanoseconds
/// after the loop's start) into `others_end`.
struct loop_clock {
    clock::time_point start = clock::now();
    std::atomic<std::int64_t> others_end{0};
    void other_done() {
        others_end.fetch_add(std::chrono::duration_cast<std::chrono::nanoseconds>(clock::now() - start).count(),
                             std::memory_order_relaxed);
    }
    /// Thread 0 ended its share at `own_end`; every thread is done now; nt threads took part.
    void record(clock::time_point own_end, std::int64_t nt) {
        table& t = current;
        if (!t.on) return;
        const clock::time_point all = clock::now();
        site* s = find_or_add(site_file ? site_file : "(no site)", site_file ? site_line : 0);
        if (!s) {
            ++t.dropped;
            t.last_end = all;
            return;
        }
        const double total = seconds(start, all);
        ++s->loops;
        s->seconds += total;
        s->thread0_wait += seconds(own_end, all);
        if (nt > 1) s->others_wait += total - double(others_end.load(std::memory_order_relaxed)) * 1e-9 / double(nt - 1);
        s->serial_before += seconds(t.last_end, start);
        t.last_end = all;
    }
};

inline void hold_begin() {
    table& t = current;
    t.hold_start = t.last_end = clock::now();
}
inline void hold_end() {
    table& t = current;
    if (!t.on) return;
    const clock::time_point now = clock::now();
    t.held += seconds(t.hold_start, now);
    if (site* s = find_or_add("(after the last loop)", 0)) s->serial_before += seconds(t.last_end, now);
}
}  // namespace detail

/// Starts (or resumes) timing this thread's held loops.
inline void start() { detail::current.on = true; }
/// Stops timing; the tables stay until reset().
inline void stop() { detail::current.on = false; }
/// Clears this thread's tables (and stops).
inline void reset() {
    detail::current.used = 0;
    detail::current.dropped = 0;
    detail::current.held = 0;
    detail::current.on = false;
}
/// The sites timed so far on this thread, in the order first seen.
inline std::span<const site> sites() { return {detail::current.sites, std::size_t(detail::current.used)}; }
/// Seconds spent inside hold_threads while timing.
inline double held_seconds() { return detail::current.held; }

/// The tables as text: the totals over the held time, then one line per site, the sites with the
/// most waiting first.
inline void report(std::FILE* out) {
    const table& t = detail::current;
    site sorted[max_sites];
    std::copy(t.sites, t.sites + t.used, sorted);
    std::sort(sorted, sorted + t.used, [](const site& a, const site& b) {
        return a.thread0_wait + a.others_wait + a.serial_before > b.thread0_wait + b.others_wait + b.serial_before;
    });
    double loops = 0, w0 = 0, wo = 0, serial = 0;
    for (int i = 0; i < t.used; ++i) {
        loops += sorted[i].seconds;
        w0 += sorted[i].thread0_wait;
        wo += sorted[i].others_wait;
        serial += sorted[i].serial_before;
    }
    const double held = t.held > 0 ? t.held : 1;
    std::fprintf(out,
                 "held %.3f s: loops %.1f%%, thread 0 waits %.2f%%, the others wait %.2f%% in loops and %.2f%% between "
                 "them (%% of the held time)\n",
                 t.held, 100 * loops / held, 100 * w0 / held, 100 * wo / held, 100 * serial / held);
    std::fprintf(out, "%-40s %9s %8s %8s %8s %8s\n", "site", "loops", "time%", "t0 wait%", "others%", "serial%");
    for (int i = 0; i < t.used; ++i) {
        const site& s = sorted[i];
        const char* base = std::strrchr(s.file, '/');
        char name[64];
        std::snprintf(name, sizeof name, "%s:%u", base ? base + 1 : s.file, s.line);
        std::fprintf(out, "%-40s %9ld %8.2f %8.2f %8.2f %8.2f\n", name, s.loops, 100 * s.seconds / held,
                     100 * s.thread0_wait / held, 100 * s.others_wait / held, 100 * s.serial_before / held);
    }
    if (t.dropped) std::fprintf(out, "(%ld loops of sites past the first %d not shown)\n", t.dropped, max_sites);
}

}  // namespace mnemo::region_profile
