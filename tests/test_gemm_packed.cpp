// The packed SGEMM (kernels/cpu/gemm_packed.hpp: the AVX-512 kernel on AVX-512 builds, the AVX2 one
// on AVX2 + FMA builds) against a double-precision reference on tiny, odd and block-crossing shapes
// in the three forms, strided operands, beta 0 over NaN, beta 1, beta 0.5 and alpha 2; the same bits
// on 1, 2 and 3 threads, with every tuning trait; no allocation in steady state; which float products
// gemm.hpp sends to it; the CPU-model table the traits are chosen by. Builds without AVX2 + FMA have
// no packed path: the test then only says so.
#include <doctest/doctest.h>
#include <omp.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstring>
#include <functional>
#include <string>
#include <initializer_list>
#include <limits>
#include <vector>

#include <mnemo/kernels/cpu/cpu_model.hpp>
#include <mnemo/kernels/cpu/ops.hpp>

#include "allocation_counter.hpp"
#include "testing.hpp"

using mnemo::index_t;
using K = mnemo::ops<mnemo::cpu>;

#ifdef MNEMO_PACKED_GEMM
using GP = mnemo::cpu_kernels::gemm_packed;

namespace {

using mnemo::testing::form_name;
using mnemo::testing::gemm_form;
using mnemo::testing::nn;
using mnemo::testing::nt;
using mnemo::testing::tn;

/// Operands of one product, rows padded by `pad` elements past what they need (filled with
/// sentinels, to see that C's padding is left alone), and the checks of the packed GEMM on them.
struct problem : mnemo::testing::gemm_operands<float> {
    using gemm_operands::gemm_operands;
    double a_at(index_t i, index_t p) const { return f == tn ? a[p * lda + i] : a[i * lda + p]; }
    double b_at(index_t p, index_t j) const { return f == nt ? b[j * ldb + p] : b[p * ldb + j]; }

    /// Kernel Kernel (gemm_packed_t<isa>) blocked by `bl`.
    template <class Kernel>
    void run_kernel(float* out, float beta, float alpha, int threads, const mnemo::cpu_kernels::packed_blocking& bl) const {
        switch (f) {
            case nn: Kernel::template run<Kernel::form::nn>(m, n, k, a.data(), lda, b.data(), ldb, out, ldc, beta, alpha, threads, bl); break;
            case nt: Kernel::template run<Kernel::form::nt>(m, n, k, a.data(), lda, b.data(), ldb, out, ldc, beta, alpha, threads, bl); break;
            case tn: Kernel::template run<Kernel::form::tn>(m, n, k, a.data(), lda, b.data(), ldb, out, ldc, beta, alpha, threads, bl); break;
        }
    }
    /// The kernel this build dispatches to, with this machine's blocking, unless `runner` says otherwise.
    std::function<void(float*, float, float, int)> runner;
    void run(float* out, float beta, float alpha, int threads) const {
        if (runner) return runner(out, beta, alpha, threads);
        run_kernel<GP>(out, beta, alpha, threads, GP::tuning());
    }
    void dispatch(float* out, float beta, float alpha) const {
        switch (f) {
            case nn: K::gemm_nn(m, n, k, a.data(), lda, b.data(), ldb, out, ldc, beta, alpha); break;
            case nt: K::gemm_nt(m, n, k, a.data(), lda, b.data(), ldb, out, ldc, beta, alpha); break;
            case tn: K::gemm_tn(m, n, k, a.data(), lda, b.data(), ldb, out, ldc, beta, alpha); break;
        }
    }

    /// Runs the packed GEMM on a copy of C (its elements NaN when beta = 0) on each thread count and
    /// checks every element against a double-precision reference, relative to the sum of the
    /// magnitudes of its terms; the padding between C's rows must stay as it was.
    void check(float beta, float alpha, std::initializer_list<int> thread_counts) const {
        std::vector<double> ref(std::size_t(m * n)), scale(std::size_t(m * n));
        for (index_t i = 0; i < m; ++i)
            for (index_t j = 0; j < n; ++j) {
                double sum = 0, mag = 0;
                for (index_t p = 0; p < k; ++p) {
                    const double t = a_at(i, p) * b_at(p, j);
                    sum += t;
                    mag += std::abs(t);
                }
                const double prev = beta == 0.0f ? 0.0 : double(beta) * c[i * ldc + j];
                ref[i * n + j] = double(alpha) * sum + prev;
                scale[i * n + j] = std::abs(double(alpha)) * mag + std::abs(prev);
            }
        for (int threads : thread_counts) {
            std::vector<float> out = c;
            if (beta == 0.0f)
                for (index_t i = 0; i < m; ++i) std::fill_n(out.begin() + i * ldc, n, std::numeric_limits<float>::quiet_NaN());
            run(out.data(), beta, alpha, threads);
            index_t bad = 0, first = -1;
            double worst = 0;
            for (index_t i = 0; i < m; ++i)
                for (index_t j = 0; j < ldc; ++j) {
                    const float got = out[i * ldc + j];
                    bool ok;
                    if (j >= n) {
                        ok = std::memcmp(&got, &c[i * ldc + j], sizeof got) == 0;
                    } else {
                        const double err = std::abs(double(got) - ref[i * n + j]), s = scale[i * n + j];
                        ok = err <= 1e-5 * s;  // false for NaN
                        if (s > 0) worst = std::max(worst, err / s);
                    }
                    if (!ok && bad++ == 0) first = i * ldc + j;
                }
            INFO(form_name(f) << " " << m << "x" << n << "x" << k << " lda " << lda << " ldb " << ldb << " ldc " << ldc
                              << " beta " << beta << " alpha " << alpha << " threads " << threads << ": " << bad
                              << " bad elements, the first at " << first << "; worst relative error " << worst);
            CHECK(bad == 0);
        }
    }
};

}  // namespace

TEST_CASE("gemm_packed: every shape from 1 to 70 on each side, strided, against a double reference") {
    // Each of m, n and k runs through 1..70 against the other two drawn from it in different orders:
    // every partial tile (rows mod 14, columns mod 32) and K depths not a multiple of 16.
    std::uint64_t seed = 1;
    for (gemm_form f : {nn, nt, tn})
        for (index_t t = 0; t < 70; ++t) {
            const index_t x = 1 + t, y = 1 + (t * 17 + 5) % 70, z = 1 + (t * 29 + 11) % 70;
            for (auto [m, n, k] : {std::array<index_t, 3>{x, y, z}, {z, x, y}, {y, z, x}}) {
                const index_t pad = 1 + (m + n + k) % 5;
                const problem p(f, m, n, k, pad, seed += 3);
                p.check(0.0f, 1.0f, {1, 2});
                p.check(1.0f, 1.0f, {1});
                p.check(0.5f, 2.0f, {1, 3});
            }
        }
}

TEST_CASE("gemm_packed: shapes that cross blocks, on 1 to 3 threads") {
    // Several K blocks (kc 512), several row blocks a thread (mc 252 on AVX-512, 72 on AVX2),
    // several column blocks (nc 2048 on AVX-512; 4096 on AVX2: 20×4100), and a B too large to share (over 4M floats packed), each with partial tiles at the edges.
    struct shape {
        index_t m, n, k;
    };
    std::uint64_t seed = 500;
    for (gemm_form f : {nn, nt, tn})
        for (auto [m, n, k] : {shape{97, 70, 1100}, shape{600, 45, 37}, shape{30, 2100, 40}, shape{20, 4100, 700},
                               shape{1000, 250, 130}}) {
            const problem p(f, m, n, k, 3, seed += 3);
            p.check(0.0f, 1.0f, {1, 2, 3});
            p.check(0.5f, 2.0f, {1, 2});
        }
}

namespace {

/// Every blocking of Kernel's tuning traits (and one deliberately small, to cross every block on
/// small shapes): right against the reference, and the same bits on 1, 2 and 3 threads.
template <class Kernel, class Tuning>
void check_every_tuning(std::initializer_list<mnemo::cpu_kernels::packed_blocking> traits) {
    using mnemo::cpu_kernels::packed_blocking;
    struct shape {
        index_t m, n, k;
    };
    std::uint64_t seed = 3000;
    std::vector<packed_blocking> all(traits);
    all.push_back(packed_blocking{"small", 2 * Kernel::lanes, 2 * Kernel::mr, 2 * Kernel::task_cols, 0});
    all.push_back(packed_blocking{"small, columns split", 2 * Kernel::lanes, 2 * Kernel::mr, 2 * Kernel::task_cols, 4096});
    for (const packed_blocking& bl : all) {
        INFO(std::string(Kernel::isa::name) << " blocking " << std::string(bl.measured_on) << ": kc " << bl.kc << " mc " << bl.mc << " nc " << bl.nc);
        CHECK(bl.kc % Kernel::lanes == 0);
        CHECK(bl.kc <= Kernel::isa::kc_cap);
        CHECK(bl.mc % Kernel::mr == 0);
        CHECK(bl.nc % Kernel::task_cols == 0);
        for (gemm_form f : {nn, nt, tn})
            for (auto [m, n, k] : {shape{97, 70, 1100}, shape{301, 300, 129}, shape{40, 600, 77}, shape{200, 700, 130}}) {
                problem p(f, m, n, k, 2, seed += 3);
                p.runner = [&p, &bl](float* out, float beta, float alpha, int threads) {
                    p.run_kernel<Kernel>(out, beta, alpha, threads, bl);
                };
                p.check(0.0f, 1.0f, {1, 2, 3});
                p.check(0.5f, 2.0f, {1, 3});
                std::vector<float> out[3];
                for (int t = 1; t <= 3; ++t) {
                    out[t - 1] = p.c;
                    p.run(out[t - 1].data(), 1.0f, 1.0f, t);
                }
                CHECK(std::memcmp(out[1].data(), out[0].data(), out[0].size() * sizeof(float)) == 0);
                CHECK(std::memcmp(out[2].data(), out[0].data(), out[0].size() * sizeof(float)) == 0);
            }
    }
}

}  // namespace

TEST_CASE("gemm_packed: every tuning trait of every kernel this build has, on 1 to 3 threads") {
    using namespace mnemo::cpu_kernels;
    using avx2 = packed_tuning<packed_isa_avx2>;
    check_every_tuning<gemm_packed_t<packed_isa_avx2>, avx2>({avx2::zen2, avx2::zen3, avx2::other});
#ifdef __AVX512F__
    using avx512 = packed_tuning<packed_isa_avx512>;
    check_every_tuning<gemm_packed_t<packed_isa_avx512>, avx512>({avx512::zen5, avx512::zen4, avx512::xeon_spr, avx512::xeon_gnr});
#endif
    MESSAGE("this machine: " << std::string(cpu_model_name(this_cpu_model())) << ", kernel " << std::string(GP::isa::name) << ", blocking "
                             << std::string(GP::tuning().measured_on) << " (kc " << GP::tuning().kc << ", mc " << GP::tuning().mc
                             << ", nc " << GP::tuning().nc << ")");
}

TEST_CASE("gemm_packed: the AVX2 kernel by name passes a shape sweep (on AVX-512 builds too)") {
    // The AVX2 kernel is what AVX2-only machines run; on an AVX-512 host this runs it as well (the
    // sweep of the first case, fewer shapes).
    using K2 = mnemo::cpu_kernels::gemm_packed_t<mnemo::cpu_kernels::packed_isa_avx2>;
    std::uint64_t seed = 5000;
    for (gemm_form f : {nn, nt, tn})
        for (index_t t = 0; t < 20; ++t) {
            const index_t x = 1 + 3 * t, y = 1 + (t * 17 + 5) % 60, z = 1 + (t * 29 + 11) % 60;
            problem p(f, x, y, z, 1 + t % 3, seed += 3);
            p.runner = [&p](float* out, float beta, float alpha, int threads) {
                p.run_kernel<K2>(out, beta, alpha, threads, K2::tuning());
            };
            p.check(0.0f, 1.0f, {1, 2});
            p.check(0.5f, 2.0f, {1});
        }
}

TEST_CASE("gemm_packed: k = 0 scales C by beta (beta 0 clears it, NaN or not)") {
    for (gemm_form f : {nn, nt, tn}) {
        const problem p(f, 20, 40, 0, 2, 900);
        for (float beta : {0.0f, 1.0f, 0.5f}) {
            std::vector<float> out = p.c;
            if (beta == 0.0f)
                for (index_t i = 0; i < p.m; ++i) std::fill_n(out.begin() + i * p.ldc, p.n, std::numeric_limits<float>::quiet_NaN());
            p.run(out.data(), beta, 2.0f, 1);
            for (index_t i = 0; i < p.m; ++i)
                for (index_t j = 0; j < p.n; ++j) CHECK(out[i * p.ldc + j] == beta * p.c[i * p.ldc + j]);
        }
    }
}

TEST_CASE("gemm_packed: the same bits on 1, 2 and 3 threads, shared or private B, and through gemm.hpp") {
    struct shape {
        index_t m, n, k;
    };
    // Blocks crossed: k past kc (512), m past mc (72-252), n past nc (2048-4096). The sanitizer build
    // (MNEMO_TEST_SANITIZED), where a product runs some 50 times slower, keeps the shapes that cross
    // them with the fewest multiply-adds.
#ifdef MNEMO_TEST_SANITIZED
    const shape shapes[] = {{513, 77, 2049}, {80, 4100, 520}, {29, 300, 600}};
#else
    const shape shapes[] = {{1024, 256, 256}, {256, 1024, 1024}, {513, 77, 2049}, {301, 4100, 700}, {29, 300, 600}};
#endif
    std::uint64_t seed = 700;
    for (gemm_form f : {nn, nt, tn})
        for (const shape& sh : shapes) {
            const index_t m = sh.m, n = sh.n, k = sh.k;  // not a structured binding: clang 14 cannot capture those (INFO)
            for (float beta : {0.0f, 1.0f}) {
                const problem p(f, m, n, k, 0, seed += 3);
                std::vector<float> out[3];
                for (int t = 1; t <= 3; ++t) {
                    out[t - 1] = p.c;
                    p.run(out[t - 1].data(), beta, 1.0f, t);
                }
                INFO(form_name(f) << " " << m << "x" << n << "x" << k << " beta " << beta);
                CHECK(std::memcmp(out[1].data(), out[0].data(), out[0].size() * sizeof(float)) == 0);
                CHECK(std::memcmp(out[2].data(), out[0].data(), out[0].size() * sizeof(float)) == 0);
                // Through the dispatching forms with omp_set_num_threads: the same bits again
                // wherever they take the packed path.
                if (!K::use_packed(m, n, k)) continue;
#ifdef MNEMO_USE_BLAS
                if (K::use_blas<float>(m, n, k)) continue;
#endif
                const int saved = omp_get_max_threads();
                for (int t = 1; t <= 3; ++t) {
                    omp_set_num_threads(t);
                    std::vector<float> via = p.c;
                    p.dispatch(via.data(), beta, 1.0f);
                    CHECK(std::memcmp(via.data(), out[0].data(), via.size() * sizeof(float)) == 0);
                }
                omp_set_num_threads(saved);
            }
        }
}

TEST_CASE("gemm_packed: a bias added as the last K block's tiles store C gives the bits of the product, then add_bias_rows") {
    // y = x·Wᵀ + b in one pass (gemm_nt_bias, a linear layer's forward) against gemm_nt followed by
    // add_bias_rows: full and partial tiles, one K block and several (k past kc, and a blocking of
    // kc = 2·lanes), 1 to 3 threads, C's padding left alone; k = 0 gives the bias alone.
    struct shape {
        index_t m, n, k;
    };
    std::uint64_t seed = 1900;
    const mnemo::cpu_kernels::packed_blocking small{"small", 2 * GP::lanes, 2 * GP::mr, 2 * GP::task_cols, 0};
    for (auto [m, n, k] : {shape{256, 128, 128}, shape{97, 70, 1100}, shape{301, 300, 129}, shape{29, 45, 37}, shape{20, 40, 0}}) {
        const problem p(nt, m, n, k, 3, seed += 3);
        const std::vector<float> bias = mnemo::testing::random_vector<float>(n, seed + 7);
        for (const mnemo::cpu_kernels::packed_blocking* bl : {&GP::tuning(), &small}) {
            std::vector<float> ref = p.c;
            GP::run<GP::form::nt>(m, n, k, p.a.data(), p.lda, p.b.data(), p.ldb, ref.data(), p.ldc, 0.0f, 1.0f, 1, *bl);
            K::add_bias_rows(m, n, bias.data(), ref.data(), p.ldc);
            for (int t = 1; t <= 3; ++t) {
                std::vector<float> out = p.c;
                GP::run<GP::form::nt>(m, n, k, p.a.data(), p.lda, p.b.data(), p.ldb, out.data(), p.ldc, 0.0f, 1.0f, t, *bl,
                                      {}, bias.data());
                INFO(m << "x" << n << "x" << k << " blocking " << std::string(bl->measured_on) << " threads " << t);
                CHECK(std::memcmp(out.data(), ref.data(), ref.size() * sizeof(float)) == 0);
            }
        }
        // Through the kernel table (W's rows unpadded, as a linear layer's), whatever path the shape takes.
        const problem q(nt, m, n, k, 0, seed + 11);
        std::vector<float> ref = q.c, out = q.c;
        K::gemm_nt(m, n, k, q.a.data(), q.lda, q.b.data(), q.ldb, ref.data(), q.ldc);
        K::add_bias_rows(m, n, bias.data(), ref.data(), q.ldc);
        K::linear_forward(m, k, n, q.a.data(), q.lda, q.b.data(), bias.data(), out.data(), q.ldc);
        INFO(m << "x" << n << "x" << k << " through linear_forward, packed path " << K::use_packed(m, n, k));
        CHECK(std::memcmp(out.data(), ref.data(), ref.size() * sizeof(float)) == 0);
    }
}

TEST_CASE("gemm_packed: a packing task another thread never finishes is packed again, not waited for") {
    std::atomic<int> done{2}, stuck{1};
    CHECK(GP::packed(done));
    CHECK_FALSE(GP::packed(stuck));
}

TEST_CASE("gemm_packed: called inside a parallel region, each call runs on its own thread with the same bits") {
    const problem p(nt, 1024, 256, 256, 0, 77);
    std::vector<float> serial = p.c;
    p.dispatch(serial.data(), 0.0f, 1.0f);
    std::vector<float> c[2] = {p.c, p.c};
#pragma omp parallel num_threads(2)
    p.dispatch(c[omp_get_thread_num()].data(), 0.0f, 1.0f);
    CHECK(c[0] == serial);
    CHECK(c[1] == serial);
}

TEST_CASE("gemm_packed: a steady-state GEMM allocates nothing, on 1 and 2 threads, B shared or not") {
    const problem p(nn, 1024, 256, 256, 0, 90), q(tn, 256, 256, 1024, 0, 91), r(nt, 1024, 512, 256, 0, 92),
        big(nt, 200, 4100, 700, 0, 93);
    std::vector<float> c(200 * 4100);
    const int saved = omp_get_max_threads();
    for (int t : {1, 2}) {
        omp_set_num_threads(t);
        auto step = [&] {
            p.dispatch(c.data(), 0.0f, 1.0f);
            q.dispatch(c.data(), 1.0f, 1.0f);
            r.dispatch(c.data(), 0.0f, 1.0f);
            big.dispatch(c.data(), 0.0f, 1.0f);
        };
        step();  // buffers grow here
        INFO("threads " << t);
        CHECK(mnemo::testing::count_allocations([&] {
                  for (int i = 0; i < 2; ++i) step();
              }) == 0);
    }
    omp_set_num_threads(saved);
}

TEST_CASE("gemm dispatch: the large float products go to gemm_packed; small, skinny and double ones do not") {
    struct shape {
        index_t m, n, k;
    };
    // The 17 large products of configurations B and C (bench_kernels' model rows).
    for (index_t d : {256, 512})
        for (const shape& sh : {shape{1024, d, d}, shape{1024, 4 * d, d}, shape{1024, d, 4 * d}, shape{3072, 2 * d, d},
                               shape{3072, d, 2 * d}, shape{d, d, 1024}, shape{4 * d, d, 1024}, shape{d, 4 * d, 1024},
                               shape{2 * d, d, 3072}}) {
            const index_t m = sh.m, n = sh.n, k = sh.k;  // not a structured binding: clang 14 cannot capture those (INFO)
            INFO(m << "x" << n << "x" << k);
            CHECK(K::use_packed(m, n, k));
        }
    // Per-head attention products, generation's GEMVs, skinny and shallow products stay on Eigen.
    for (const shape& sh : {shape{8, 152, 32}, shape{128, 384, 32}, shape{1, 1024, 1024}, shape{2, 4096, 512},
                           shape{64, 64, 64}, shape{16, 1024, 1024}, shape{1024, 1024, 16}, shape{1024, 24, 256}}) {
        const index_t m = sh.m, n = sh.n, k = sh.k;  // not a structured binding: clang 14 cannot capture those (INFO)
        INFO(m << "x" << n << "x" << k);
        CHECK_FALSE(K::use_packed(m, n, k));
    }
}

#else

TEST_CASE("gemm_packed: not compiled (no AVX2 + FMA), every product stays on Eigen") {
    MESSAGE("built without AVX2 + FMA: gemm_packed is not compiled and gemm.hpp uses Eigen throughout");
}

#endif

TEST_CASE("cpu_model: AMD families and models map to their Zen generation, Intel's to the Xeons measured") {
    using mnemo::cpu_kernels::amd_cpu_model;
    using mnemo::cpu_kernels::cpu_model;
    CHECK(amd_cpu_model(0x17, 0x01) == cpu_model::zen1);  // Naples
    CHECK(amd_cpu_model(0x17, 0x08) == cpu_model::zen1);  // Pinnacle Ridge (Zen+)
    CHECK(amd_cpu_model(0x17, 0x31) == cpu_model::zen2);  // Rome
    CHECK(amd_cpu_model(0x17, 0x71) == cpu_model::zen2);  // Matisse
    CHECK(amd_cpu_model(0x19, 0x01) == cpu_model::zen3);  // Milan
    CHECK(amd_cpu_model(0x19, 0x21) == cpu_model::zen3);  // Vermeer
    CHECK(amd_cpu_model(0x19, 0x11) == cpu_model::zen4);  // Genoa
    CHECK(amd_cpu_model(0x19, 0x61) == cpu_model::zen4);  // Raphael
    CHECK(amd_cpu_model(0x19, 0xa0) == cpu_model::zen4);  // Bergamo
    CHECK(amd_cpu_model(0x1a, 0x02) == cpu_model::zen5);  // Turin
    CHECK(amd_cpu_model(0x15, 0x02) == cpu_model::other); // Piledriver
    using mnemo::cpu_kernels::intel_cpu_model;
    CHECK(intel_cpu_model(6, 0x8f) == cpu_model::xeon_spr);  // Sapphire Rapids
    CHECK(intel_cpu_model(6, 0xcf) == cpu_model::xeon_spr);  // Emerald Rapids
    CHECK(intel_cpu_model(6, 0x8f, true) == cpu_model::xeon_spr);
    CHECK(intel_cpu_model(6, 0xad) == cpu_model::xeon_gnr);  // Granite Rapids
    CHECK(intel_cpu_model(6, 0xae) == cpu_model::xeon_gnr);  // Granite Rapids-D
    CHECK(intel_cpu_model(6, 0xa7, true) == cpu_model::xeon_gnr);  // a VM's stand-in model, with AMX
    CHECK(intel_cpu_model(6, 0xa7) == cpu_model::other);     // Rocket Lake (no AMX)
    CHECK(intel_cpu_model(6, 0x55) == cpu_model::other);     // Skylake-SP / Cascade Lake
    CHECK(intel_cpu_model(15, 0x06, true) == cpu_model::other);
    MESSAGE("this machine: " << std::string(cpu_model_name(mnemo::cpu_kernels::this_cpu_model())));
}
