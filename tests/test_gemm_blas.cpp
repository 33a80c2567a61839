// The GEMM's optional OpenBLAS path (kernels/cpu/gemm.hpp, built with -DMNEMO_BLAS=ON): which products
// take it, that it agrees with the Eigen path, overwrites C when beta = 0, gives the same bits for any
// thread count, allocates nothing in steady state, and that the library loaded is OpenBLAS's OpenMP
// build. Without MNEMO_USE_BLAS the dispatching functions are the Eigen path, bit for bit.
//
// The OpenBLAS cases only check something when OpenBLAS's kernels are in use (K::blas_active(): its
// kernels as wide as mnemo's, e.g. OPENBLAS_CORETYPE=Cooperlake or SkylakeX on an AVX-512 machine);
// otherwise they say so and check that every product stays on the Eigen path.
#include <doctest/doctest.h>
#include <omp.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#ifdef MNEMO_USE_BLAS
#include <link.h>
#endif

#include <mnemo/kernels/cpu/ops.hpp>

#include "allocation_counter.hpp"
#include "testing.hpp"

using mnemo::index_t;
using mnemo::testing::form_name;
using mnemo::testing::gemm_form;
using mnemo::testing::gemm_operands;
using mnemo::testing::nn;
using mnemo::testing::nt;
using mnemo::testing::tn;
using K = mnemo::ops<mnemo::cpu>;

namespace {

template <class T>
void run(gemm_form f, bool eigen, const gemm_operands<T>& p, T* c, T beta, T alpha) {
    auto call = [&](auto fn) { fn(p.m, p.n, p.k, p.a.data(), p.lda, p.b.data(), p.ldb, c, p.ldc, beta, alpha); };
    switch (f) {
        case nn: eigen ? call(K::gemm_nn_eigen<T>) : call(K::gemm_nn<T>); break;
        case nt: eigen ? call(K::gemm_nt_eigen<T>) : call(K::gemm_nt<T>); break;
        case tn: eigen ? call(K::gemm_tn_eigen<T>) : call(K::gemm_tn<T>); break;
    }
}

/// The large products of configurations B and C (bench_kernels' model rows), a few odd sizes, and one
/// with fewer rows than two blocks need. The sanitizer build (MNEMO_TEST_SANITIZED), where a product
/// runs some 50 times slower, leaves out B's and C's rows: the odd sizes cross the same blocks.
struct shape {
    index_t m, n, k;
};
#ifdef MNEMO_TEST_SANITIZED
const shape large_shapes[] = {{1000, 250, 130}, {37, 1029, 513}, {513, 77, 2049}, {20, 1400, 1000}};
#else
const shape large_shapes[] = {{1024, 256, 256}, {256, 1024, 1024}, {256, 512, 2048}, {1000, 250, 130},
                              {37, 1029, 513},  {513, 77, 2049},   {20, 1400, 1000}};
#endif

bool blas_in_use() {
#ifdef MNEMO_USE_BLAS
    return K::blas_active();
#else
    return false;
#endif
}

template <class T>
bool dispatched_to_blas(index_t m, index_t n, index_t k) {
#ifdef MNEMO_USE_BLAS
    return K::use_blas<T>(m, n, k);
#else
    (void)m, (void)n, (void)k;
    return false;
#endif
}

}  // namespace

TEST_CASE("gemm dispatch: small per-head products, GEMVs and other types stay on the Eigen path") {
    // Not structured bindings: INFO captures its arguments in a lambda, which clang 14 does not allow
    // for them.
    for (const shape s : {shape{8, 152, 32}, shape{128, 384, 32}, shape{1, 1024, 1024}, shape{2, 4096, 512},
                          shape{64, 64, 64}, shape{1024, 128, 16}}) {
        INFO(s.m << "x" << s.n << "x" << s.k);
        CHECK_FALSE(dispatched_to_blas<float>(s.m, s.n, s.k));
    }
    CHECK_FALSE(dispatched_to_blas<long double>(1024, 1024, 1024));
    // The large products of B and C go to OpenBLAS when it is in use.
    for (const shape s : {shape{1024, 256, 256}, shape{3072, 512, 256}, shape{512, 2048, 1024}}) {
        INFO(s.m << "x" << s.n << "x" << s.k);
        CHECK(dispatched_to_blas<float>(s.m, s.n, s.k) == blas_in_use());
        CHECK(dispatched_to_blas<double>(s.m, s.n, s.k) == blas_in_use());
    }
#ifdef MNEMO_USE_BLAS
    const std::string note = std::string("OpenBLAS core '") + K::blas_core() + "': " +
                             (K::blas_active() ? "in use" : "not in use (narrower kernels than mnemo's; try OPENBLAS_CORETYPE=SkylakeX)");
    MESSAGE(note);
#endif
}

TEST_CASE_TEMPLATE("gemm: the dispatching forms agree with the Eigen path; beta 0 overwrites NaN", T, float, double) {
    const double tol = std::is_same_v<T, float> ? 1e-4 : 1e-12;
    std::uint64_t seed = 10;
    for (const auto& s : large_shapes) {
        for (gemm_form f : {nn, nt, tn}) {
            for (const auto& scalars : {std::pair{T(0), T(1)}, {T(1), T(1)}, {T(0.5), T(-0.75)}}) {
                const T beta = scalars.first, alpha = scalars.second;  // not bindings: INFO's lambda (clang 14)
                {
                    gemm_operands<T> p(f, s.m, s.n, s.k, 5, seed++);
                    std::vector<T> got = p.c, ref = p.c;
                    if (beta == T(0))  // C's elements (not the padding between its rows) hold NaN
                        for (index_t i = 0; i < s.m; ++i)
                            std::fill_n(got.begin() + i * p.ldc, s.n, std::numeric_limits<T>::quiet_NaN());
                    run(f, false, p, got.data(), beta, alpha);
                    run(f, true, p, ref.data(), beta, alpha);
                    INFO(form_name(f) << " " << s.m << "x" << s.n << "x" << s.k << " beta=" << beta << " alpha=" << alpha
                                      << " blas=" << dispatched_to_blas<T>(s.m, s.n, s.k));
                    // Products of up to 2049 terms of [-1, 1]: compare on the scale of sqrt(k).
                    mnemo::testing::check_close("gemm", got, ref, tol * std::sqrt(double(s.k)), tol);
                    // Bitwise Eigen's where Eigen runs (the packed AVX-512 kernel rounds its own way).
#ifdef MNEMO_PACKED_GEMM
                    const bool packed = std::is_same_v<T, float> && K::use_packed(s.m, s.n, s.k);
#else
                    const bool packed = false;
#endif
                    if (!blas_in_use() && !packed)
                        CHECK(std::memcmp(got.data(), ref.data(), got.size() * sizeof(T)) == 0);
                }
            }
        }
    }
}

TEST_CASE_TEMPLATE("gemm: results are bitwise the same on 1, 2 and 3 threads", T, float, double) {
    std::uint64_t seed = 40;
    for (const auto& s : large_shapes) {
        for (gemm_form f : {nn, nt, tn}) {
            for (T beta : {T(0), T(1)}) {
                gemm_operands<T> p(f, s.m, s.n, s.k, 0, seed++);
                std::vector<T> out[3];
                const int saved = omp_get_max_threads();
                for (int t = 1; t <= 3; ++t) {
                    omp_set_num_threads(t);
                    out[t - 1] = p.c;
                    run(f, false, p, out[t - 1].data(), beta, T(1));
                }
                omp_set_num_threads(saved);
                INFO(form_name(f) << " " << s.m << "x" << s.n << "x" << s.k << " beta=" << beta
                                  << " blas=" << dispatched_to_blas<T>(s.m, s.n, s.k));
                CHECK(out[1] == out[0]);
                CHECK(out[2] == out[0]);
            }
        }
    }
}

TEST_CASE("gemm: called from inside a parallel region, each call runs on its own thread with the same bits") {
    const auto count_threads = [] {
        int n = 0;
#ifdef __linux__
        if (FILE* f = std::fopen("/proc/self/status", "r")) {
            char line[256];
            while (std::fgets(line, sizeof line, f))
                if (std::strncmp(line, "Threads:", 8) == 0) n = std::atoi(line + 8);
            std::fclose(f);
        }
#endif
        return n;
    };
    gemm_operands<float> p(nt, 1024, 256, 256, 0, 77);
    std::vector<float> serial = p.c;
    run(nt, false, p, serial.data(), 0.0f, 1.0f);
    std::vector<float> c[2] = {p.c, p.c};
    // Warm up the OpenMP pool (and OpenBLAS's buffers) before counting threads.
#pragma omp parallel num_threads(2)
    run(nt, false, p, c[omp_get_thread_num()].data(), 0.0f, 1.0f);
    // A smaller team releases the pool's extra threads (the 3-thread test before this one left
    // one), which exit in their own time: on a loaded machine one was still counted here and gone
    // after the loop. Wait for the count to settle (up to a second); a nested team would only add.
    int before = count_threads();
    for (int i = 0; i < 100; ++i) {
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
        const int now = count_threads();
        if (now == before) break;
        before = now;
    }
#pragma omp parallel num_threads(2)
    for (int i = 0; i < 3; ++i) run(nt, false, p, c[omp_get_thread_num()].data(), 0.0f, 1.0f);
    CHECK(count_threads() <= before);  // no nested team was started
    CHECK(c[0] == serial);
    CHECK(c[1] == serial);
}

TEST_CASE("gemm: a steady-state large GEMM allocates nothing, on 1 and 2 threads") {
    gemm_operands<float> p(nn, 1024, 256, 256, 0, 90);
    gemm_operands<float> q(tn, 256, 256, 1024, 0, 91);
    gemm_operands<float> r(nt, 1024, 512, 256, 0, 92);
    std::vector<float> c(1024 * 512);
    const int saved = omp_get_max_threads();
    for (int t : {1, 2}) {
        omp_set_num_threads(t);
        auto step = [&] {
            run(nn, false, p, c.data(), 0.0f, 1.0f);
            run(tn, false, q, c.data(), 1.0f, 1.0f);
            run(nt, false, r, c.data(), 0.0f, 1.0f);
        };
        step();  // buffers grow here
        INFO("threads " << t);
        CHECK(mnemo::testing::count_allocations([&] {
                  for (int i = 0; i < 3; ++i) step();
              }) == 0);
    }
    omp_set_num_threads(saved);
}

#ifdef MNEMO_USE_BLAS
TEST_CASE("gemm: the OpenBLAS loaded is its OpenMP build") {
    const std::string config = openblas_get_config();
    INFO("openblas_get_config(): " << config);
    CHECK(config.find("USE_OPENMP") != std::string::npos);
    CHECK(openblas_get_parallel() == 2);  // 0 sequential, 1 pthreads, 2 OpenMP
    // And the file it came from (CMake links it by path with an rpath to its directory).
    std::string path;
    dl_iterate_phdr(
        [](dl_phdr_info* info, std::size_t, void* out) {
            if (info->dlpi_name && std::strstr(info->dlpi_name, "libopenblas")) *static_cast<std::string*>(out) = info->dlpi_name;
            return 0;
        },
        &path);
    INFO("loaded from " << path);
    CHECK(path.find("openblas-pthread") == std::string::npos);
    CHECK(path.find("openblas-serial") == std::string::npos);
}
#endif
