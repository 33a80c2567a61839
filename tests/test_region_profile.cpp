// The held loops' timing (kernels/cpu/region_profile.hpp, on with MNEMO_PROFILE_REGIONS): each loop
// is charged to its call's line, and the waits land on the side that waited. The loops sleep on one
// side, so the checks are lower bounds on the sleeps (a slow machine only adds to the waits).
#define MNEMO_PROFILE_REGIONS 1
#include <doctest/doctest.h>
#include <omp.h>

#include <chrono>
#include <cstring>
#include <thread>

#include <mnemo/mnemo.hpp>

namespace {

using mnemo::index_t;
namespace rp = mnemo::region_profile;

void sleep_ms(int ms) { std::this_thread::sleep_for(std::chrono::milliseconds(ms)); }

const rp::site* find(unsigned line) {
    for (const rp::site& s : rp::sites())
        if (s.line == line && std::strstr(s.file, "test_region_profile.cpp")) return &s;
    return nullptr;
}

}  // namespace

TEST_CASE("region_profile charges each held loop's waits to its line") {
    if (omp_get_max_threads() < 2) omp_set_num_threads(2);
    rp::reset();
    rp::start();
    unsigned line_a = 0, line_b = 0, line_c = 0;
    mnemo::hold_threads([&] {
        // thread 1's share sleeps: thread 0 waits for it
        line_a = __LINE__ + 1;
        mnemo::parallel_range(2, true, [&](index_t b, index_t) { if (b == 1) sleep_ms(30); });
        sleep_ms(10);  // serial code: the other thread waits between loops
        line_b = __LINE__ + 1;
        mnemo::parallel_range(2, true, [&](index_t b, index_t) { if (b == 0) sleep_ms(20); });
        line_c = __LINE__ + 1;
        mnemo::parallel_invoke(true, [] {}, [] { sleep_ms(15); });
    });
    rp::stop();
    // Not timed once stopped.
    mnemo::hold_threads([&] { mnemo::parallel_range(2, true, [](index_t, index_t) {}); });

    const rp::site* a = find(line_a);
    const rp::site* b = find(line_b);
    const rp::site* c = find(line_c);
    REQUIRE(a);
    REQUIRE(b);
    REQUIRE(c);
    CHECK(a->loops == 1);
    CHECK(b->loops == 1);
    CHECK(c->loops == 1);
    CHECK(a->seconds >= 0.029);
    CHECK(a->thread0_wait >= 0.025);  // thread 0 idle while thread 1 slept
    CHECK(a->others_wait < a->thread0_wait);
    CHECK(b->others_wait >= 0.015);   // thread 1 idle while thread 0 slept
    CHECK(b->thread0_wait < b->others_wait);
    CHECK(b->serial_before >= 0.009);  // the sleep between the loops
    CHECK(c->thread0_wait >= 0.012);   // parallel_invoke's g on thread 1
    CHECK(rp::held_seconds() >= a->seconds + b->seconds + c->seconds + b->serial_before);
    long loops = 0;
    for (const rp::site& s : rp::sites()) loops += s.loops;
    CHECK(loops == 3);
    rp::reset();
    CHECK(rp::sites().empty());
}
