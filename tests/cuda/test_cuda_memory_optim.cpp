// The CUDA backend's compression, most-used, key-usage and optimizer kernels (src/cuda/compression.cu,
// src/cuda/optimizer.cu) against the CPU kernels (ops<cpu>) on the same inputs, in the style of ggml's
// test-backend-ops: awkward shapes (rates 1 to 4, batch 1 and 3, odd feature counts, row strides wider
// than the rows, buffers with rows and columns no kernel should touch), ties and NaNs where a kernel
// picks an argmax, several optimizer steps with blocks of zero gradient.
//
// Tolerances:
//   copies and selections (im2col, col2im, max pool, most used, their backward): exact values, exact indices
//   mean pool, key usage: 0 ulp expected (the same additions and division in the same order); held to 1
//   Adam family, SGD, scale_live: 0 ulp expected with hardware FMA on the host (the CPU build uses
//     -march=native); held to 2 ulp, an fmadd that rounds twice on a host without FMA
//   cold flags: exact
//   sum_squares_live: relative error 1e-12 (both sum in double, in different orders); the GPU's own result
//     is bitwise the same over the live runs and over the whole buffer
#include <cmath>
#include <cstdint>
#include <limits>
#include <span>
#include <vector>

#include "cuda_testing.hpp"

namespace {

using cuda_testing::device_vector;
using cuda_testing::random_values;
using mnemo::index_t;
using cpu_ops = mnemo::ops<mnemo::cpu>;
using gpu_ops = mnemo::ops<mnemo::cuda>;
constexpr std::size_t dyn = mnemo::dynamic;

template <class T>
double ulp(const std::vector<T>& gpu, const std::vector<T>& cpu) {
    return cuda_testing::max_ulp<T>(gpu, cpu);
}

// n values drawn from {-2, -1, 0, 1, 2} (ties everywhere), with every `nan_every`-th one NaN (0: none).
template <class T>
std::vector<T> tied_values(std::size_t n, std::uint64_t seed, std::size_t nan_every = 0) {
    std::vector<T> v = random_values<T>(n, seed, -2.5, 2.5);
    for (std::size_t i = 0; i < n; ++i) {
        v[i] = std::round(v[i]);
        if (nan_every && i % nan_every == nan_every / 2) v[i] = std::numeric_limits<T>::quiet_NaN();
    }
    return v;
}

struct pool_shape {
    index_t rate, batch, n, d;
    index_t out_rows() const { return n * batch; }
    index_t ldm() const { return d + 3; }
    index_t ldo() const { return d + 2; }
    index_t mem_rows() const { return n * rate * batch + 2; }  // two rows past the windows: never touched
};

std::vector<pool_shape> pool_shapes() {
    std::vector<pool_shape> s;
    for (index_t rate : {1, 2, 3, 4})
        for (index_t batch : {1, 3})
            for (index_t n : {1, 5})
                for (index_t d : {1, 7, 33}) s.push_back({rate, batch, n, d});
    return s;
}

#define SHAPE_INFO(s) \
    INFO("rate " << (s).rate << ", batch " << (s).batch << ", n " << (s).n << ", d " << (s).d)

// max pool forward and backward with index type I.
template <class T, class I>
void check_max_pool(const pool_shape& s, std::size_t nan_every, std::uint64_t seed) {
    SHAPE_INFO(s);
    const index_t rows = s.out_rows(), d = s.d;
    const auto mem = tied_values<T>(std::size_t(s.mem_rows() * s.ldm()), seed, nan_every);
    auto out_cpu = random_values<T>(std::size_t(rows * s.ldo()), seed + 1);
    std::vector<I> arg_cpu(std::size_t(rows * d), I(7));
    device_vector<T> mem_d(mem), out_d(out_cpu);
    device_vector<I> arg_d(arg_cpu);
    cpu_ops::max_pool_time_forward<dyn>(rows, s.batch, d, mem.data(), s.ldm(), out_cpu.data(), s.ldo(), arg_cpu.data(),
                                        s.rate);
    gpu_ops::max_pool_time_forward<dyn>(rows, s.batch, d, mem_d.data(), s.ldm(), out_d.data(), s.ldo(), arg_d.data(),
                                        s.rate);
    CHECK(ulp(out_d.host(), out_cpu) == 0);
    CHECK(arg_d.host() == arg_cpu);

    const auto d_out = random_values<T>(std::size_t(rows * s.ldo()), seed + 2);
    auto d_mem_cpu = random_values<T>(std::size_t(s.mem_rows() * s.ldm()), seed + 3);
    device_vector<T> d_out_d(d_out), d_mem_d(d_mem_cpu);
    cpu_ops::max_pool_time_backward<dyn>(rows, s.batch, d, d_out.data(), s.ldo(), arg_cpu.data(), d_mem_cpu.data(),
                                         s.ldm(), s.rate);
    gpu_ops::max_pool_time_backward<dyn>(rows, s.batch, d, d_out_d.data(), s.ldo(), arg_d.data(), d_mem_d.data(),
                                         s.ldm(), s.rate);
    CHECK(ulp(d_mem_d.host(), d_mem_cpu) == 0);
}

// most-used forward and backward with index type I.
template <class T, class I>
void check_most_used(const pool_shape& s, std::size_t nan_every, std::uint64_t seed) {
    SHAPE_INFO(s);
    const index_t rows = s.out_rows(), d = s.d;
    const auto usage = tied_values<T>(std::size_t(s.mem_rows()), seed, nan_every);
    const auto mem = random_values<T>(std::size_t(s.mem_rows() * s.ldm()), seed + 1);
    auto out_cpu = random_values<T>(std::size_t(rows * s.ldo()), seed + 2);
    std::vector<I> arg_cpu(std::size_t(rows), I(9));
    device_vector<T> usage_d(usage), mem_d(mem), out_d(out_cpu);
    device_vector<I> arg_d(arg_cpu);
    cpu_ops::most_used_forward<dyn>(rows, s.batch, d, usage.data(), mem.data(), s.ldm(), out_cpu.data(), s.ldo(),
                                    arg_cpu.data(), s.rate);
    gpu_ops::most_used_forward<dyn>(rows, s.batch, d, usage_d.data(), mem_d.data(), s.ldm(), out_d.data(), s.ldo(),
                                    arg_d.data(), s.rate);
    CHECK(ulp(out_d.host(), out_cpu) == 0);
    CHECK(arg_d.host() == arg_cpu);

    const auto d_out = random_values<T>(std::size_t(rows * s.ldo()), seed + 3);
    auto d_mem_cpu = random_values<T>(std::size_t(s.mem_rows() * s.ldm()), seed + 4);
    device_vector<T> d_out_d(d_out), d_mem_d(d_mem_cpu);
    cpu_ops::most_used_backward<dyn>(rows, s.batch, d, d_out.data(), s.ldo(), arg_cpu.data(), d_mem_cpu.data(), s.ldm(),
                                     s.rate);
    gpu_ops::most_used_backward<dyn>(rows, s.batch, d, d_out_d.data(), s.ldo(), arg_d.data(), d_mem_d.data(), s.ldm(),
                                     s.rate);
    CHECK(ulp(d_mem_d.host(), d_mem_cpu) == 0);
}

}  // namespace

TEST_CASE_TEMPLATE("cuda im2col_time and col2im_time equal the CPU's", T, float, double) {
    SUBCASE("every shape") {
        std::uint64_t seed = 100;
        for (const pool_shape& s : pool_shapes()) {
            SHAPE_INFO(s);
            const index_t rows = s.out_rows(), d = s.d, width = d * s.rate;
            const auto mem = random_values<T>(std::size_t(s.mem_rows() * s.ldm()), ++seed);
            std::vector<T> x_cpu(std::size_t(rows * width), T(5));
            device_vector<T> mem_d(mem), x_d(x_cpu);
            cpu_ops::im2col_time<dyn>(rows, s.batch, d, mem.data(), s.ldm(), x_cpu.data(), s.rate);
            gpu_ops::im2col_time<dyn>(rows, s.batch, d, mem_d.data(), s.ldm(), x_d.data(), s.rate);
            CHECK(ulp(x_d.host(), x_cpu) == 0);

            const auto dx = random_values<T>(std::size_t(rows * width), ++seed);
            auto d_mem_cpu = random_values<T>(std::size_t(s.mem_rows() * s.ldm()), ++seed);  // padding and spare rows
            device_vector<T> dx_d(dx), d_mem_d(d_mem_cpu);
            cpu_ops::col2im_time<dyn>(rows, s.batch, d, dx.data(), d_mem_cpu.data(), s.ldm(), s.rate);
            gpu_ops::col2im_time<dyn>(rows, s.batch, d, dx_d.data(), d_mem_d.data(), s.ldm(), s.rate);
            CHECK(ulp(d_mem_d.host(), d_mem_cpu) == 0);
        }
    }
    SUBCASE("a static rate, as the dilated convolution passes it") {
        const pool_shape s{2, 3, 4, 9};
        const index_t rows = s.out_rows();
        const auto mem = random_values<T>(std::size_t(s.mem_rows() * s.ldm()), 7);
        std::vector<T> x_cpu(std::size_t(rows * s.d * 2), T(0));
        device_vector<T> mem_d(mem), x_d(x_cpu);
        cpu_ops::im2col_time<2>(rows, s.batch, s.d, mem.data(), s.ldm(), x_cpu.data());
        gpu_ops::im2col_time<2>(rows, s.batch, s.d, mem_d.data(), s.ldm(), x_d.data());
        CHECK(ulp(x_d.host(), x_cpu) == 0);
    }
    SUBCASE("nothing to do: no rows") {
        device_vector<T> x(index_t(4));
        gpu_ops::im2col_time<dyn>(0, 3, 5, x.data(), 5, x.data(), 3);
        gpu_ops::col2im_time<dyn>(0, 3, 5, x.data(), x.data(), 5, 3);
        CHECK(x.host() == std::vector<T>(4, T(0)));
    }
}

TEST_CASE_TEMPLATE("cuda max_pool_time equals the CPU's: first of ties, NaN wins, both index types", T, float, double) {
    std::uint64_t seed = 200;
    for (const pool_shape& s : pool_shapes()) {
        check_max_pool<T, std::uint8_t>(s, 0, ++seed);
        check_max_pool<T, std::uint32_t>(s, 0, ++seed);
        check_max_pool<T, std::uint8_t>(s, 5, ++seed);   // NaNs: a NaN slot wins, a later NaN replaces it
        check_max_pool<T, std::uint32_t>(s, 3, ++seed);
    }
}

TEST_CASE_TEMPLATE("cuda mean_pool_time equals the CPU's", T, float, double) {
    std::uint64_t seed = 300;
    for (const pool_shape& s : pool_shapes()) {
        SHAPE_INFO(s);
        const index_t rows = s.out_rows(), d = s.d;
        const auto mem = random_values<T>(std::size_t(s.mem_rows() * s.ldm()), ++seed);
        auto out_cpu = random_values<T>(std::size_t(rows * s.ldo()), ++seed);
        device_vector<T> mem_d(mem), out_d(out_cpu);
        cpu_ops::mean_pool_time_forward<dyn>(rows, s.batch, d, mem.data(), s.ldm(), out_cpu.data(), s.ldo(), s.rate);
        gpu_ops::mean_pool_time_forward<dyn>(rows, s.batch, d, mem_d.data(), s.ldm(), out_d.data(), s.ldo(), s.rate);
        CHECK(ulp(out_d.host(), out_cpu) <= 1);

        const auto d_out = random_values<T>(std::size_t(rows * s.ldo()), ++seed);
        auto d_mem_cpu = random_values<T>(std::size_t(s.mem_rows() * s.ldm()), ++seed);
        device_vector<T> d_out_d(d_out), d_mem_d(d_mem_cpu);
        cpu_ops::mean_pool_time_backward<dyn>(rows, s.batch, d, d_out.data(), s.ldo(), d_mem_cpu.data(), s.ldm(),
                                              s.rate);
        gpu_ops::mean_pool_time_backward<dyn>(rows, s.batch, d, d_out_d.data(), s.ldo(), d_mem_d.data(), s.ldm(),
                                              s.rate);
        CHECK(ulp(d_mem_d.host(), d_mem_cpu) <= 1);
    }
}

TEST_CASE_TEMPLATE("cuda most_used equals the CPU's: first of ties, NaN never wins, both index types", T, float,
                   double) {
    std::uint64_t seed = 400;
    for (const pool_shape& s : pool_shapes()) {
        check_most_used<T, std::uint8_t>(s, 0, ++seed);
        check_most_used<T, std::uint32_t>(s, 0, ++seed);
        check_most_used<T, std::uint8_t>(s, 2, ++seed);  // NaN usage, including a window's first slot
        check_most_used<T, std::uint32_t>(s, 3, ++seed);
    }
    check_most_used<T, std::uint32_t>(pool_shape{3, 2, 2, 4}, 1, 7);  // every usage NaN: the first slot
}

TEST_CASE_TEMPLATE("cuda accumulate_key_usage equals the CPU's", T, float, double) {
    std::uint64_t seed = 500;
    for (index_t batch : {1, 3})
        for (index_t heads : {1, 2})
            for (index_t q : {1, 7})
                for (index_t k : {1, 5, 33, 300}) {
                    INFO("batch " << batch << ", heads " << heads << ", q " << q << ", k " << k);
                    const auto probs = random_values<T>(std::size_t(batch * heads * q * k), ++seed, 0.0, 1.0);
                    auto usage_cpu = random_values<T>(std::size_t(k * batch), ++seed, 0.0, 4.0);
                    device_vector<T> probs_d(probs), usage_d(usage_cpu);
                    cpu_ops::accumulate_key_usage(batch, heads, q, k, probs.data(), usage_cpu.data());
                    gpu_ops::accumulate_key_usage(batch, heads, q, k, probs_d.data(), usage_d.data());
                    CHECK(ulp(usage_d.host(), usage_cpu) <= 1);
                }
}

// ---- optimizers ---------------------------------------------------------------------------------------------

namespace {

// The coefficients of step t as train/optimizer.hpp forms them (in double, rounded to T once).
template <class T>
mnemo::adam_coefficients<T> adam_coefficients_at(mnemo::adam_rule rule, std::int64_t t) {
    const double lr = 1e-2, wd = 0.1, beta1 = 0.9, beta2 = 0.999, eps = 1e-8;
    const double bc1 = 1.0 - std::pow(beta1, double(t)), bc2 = 1.0 - std::pow(beta2, double(t));
    mnemo::adam_coefficients<T> c;
    c.beta1 = T(beta1);
    c.one_minus_beta1 = T(1.0 - beta1);
    c.beta2 = T(beta2);
    c.one_minus_beta2 = T(1.0 - beta2);
    c.eps = T(eps);
    switch (rule) {
    case mnemo::adam_rule::adamw:
        c.decay = T(1.0 - lr * wd);
        c.bias_correction2_sqrt = T(std::sqrt(bc2));
        c.neg_step_size = T(-(lr / bc1));
        break;
    case mnemo::adam_rule::adam:
        c.l2 = true;
        c.wd = T(wd);
        c.bias_correction2_sqrt = T(std::sqrt(bc2));
        c.neg_step_size = T(-(lr / bc1));
        break;
    case mnemo::adam_rule::labml:
        c.decay = T(1.0 - lr * wd);
        c.neg_step_size = T(-(lr * std::sqrt(bc2) / bc1));
        break;
    }
    return c;
}

template <mnemo::adam_rule R, class T>
void run_adam(bool restored) {
    using mnemo::flat_range;
    constexpr index_t n = 3000;  // blocks [0, 1024), [1024, 2048), [2048, 3000)
    constexpr index_t blocks = (n + mnemo::adam_cold_block - 1) / mnemo::adam_cold_block;
    auto p_cpu = random_values<T>(n, 11);
    std::vector<T> m_cpu(n, T(0)), v_cpu(n, T(0));
    if (restored) {  // moments from a checkpoint: block 1 still zero (cold), the others warm
        m_cpu = random_values<T>(n, 12, -0.1, 0.1);
        v_cpu = random_values<T>(n, 13, 0.0, 0.01);
        for (index_t i = 1024; i < 2048; ++i) m_cpu[i] = v_cpu[i] = T(0);
        m_cpu[2500] = T(0);  // one zero in a warm block: still warm
        v_cpu[2500] = T(0);
    }
    device_vector<T> p_d(p_cpu), m_d(m_cpu), v_d(v_cpu);
    const bool flags = R != mnemo::adam_rule::adam;
    std::vector<std::uint8_t> cold_cpu(blocks, std::uint8_t(7));
    device_vector<std::uint8_t> cold_d(cold_cpu);
    cpu_ops::adam_cold_blocks(m_cpu.data(), v_cpu.data(), n, cold_cpu.data());
    gpu_ops::adam_cold_blocks(m_d.data(), v_d.data(), n, cold_d.data());
    CHECK(cold_d.host() == cold_cpu);
    CHECK(cold_cpu == (restored ? std::vector<std::uint8_t>{0, 1, 0} : std::vector<std::uint8_t>{1, 1, 1}));

    for (std::int64_t t = 1; t <= 4; ++t) {
        INFO("step " << t);
        // Block 1 gets no gradient (−0 in the part a live run covers, +0 outside) until step 3; block 0 has
        // exact zeros among its values.
        auto g = random_values<T>(n, 20 + std::uint64_t(t));
        for (index_t i = 0; i < n; i += 13) g[std::size_t(i)] = T(0);
        std::vector<flat_range> live{{0, 1100}, {2048, n}};
        for (index_t i = 1024; i < 2048; ++i) g[std::size_t(i)] = i < 1100 ? T(-0.0) : T(0);
        if (t >= 3) {
            g[1500] = T(0.5);
            live = {{0, n}};
        }
        device_vector<T> g_d(g);
        mnemo::adam_step_args<T> a;
        a.params = p_cpu.data();
        a.grads = g.data();
        a.m = m_cpu.data();
        a.v = v_cpu.data();
        a.n = n;
        a.cold = flags ? cold_cpu.data() : nullptr;
        a.live = live;
        a.c = adam_coefficients_at<T>(R, t);
        cpu_ops::adam_step<R>(a);
        a.params = p_d.data();
        a.grads = g_d.data();
        a.m = m_d.data();
        a.v = v_d.data();
        a.cold = flags ? cold_d.data() : nullptr;
        gpu_ops::adam_step<R>(a);
        CHECK(ulp(p_d.host(), p_cpu) <= 2);
        CHECK(ulp(m_d.host(), m_cpu) <= 2);
        CHECK(ulp(v_d.host(), v_cpu) <= 2);
        if (flags) {
            CHECK(cold_d.host() == cold_cpu);
            CHECK(cold_cpu[1] == (t < 3 ? 1 : 0));
        }
    }
}

}  // namespace

TEST_CASE_TEMPLATE("cuda adam_step (adamw, adam, labml) and adam_cold_blocks equal the CPU's", T, float, double) {
    for (bool restored : {false, true}) {
        INFO("restored moments " << restored);
        {
            INFO("adamw");
            run_adam<mnemo::adam_rule::adamw, T>(restored);
        }
        {
            INFO("adam (L2)");
            run_adam<mnemo::adam_rule::adam, T>(restored);
        }
        {
            INFO("labml");
            run_adam<mnemo::adam_rule::labml, T>(restored);
        }
    }
}

TEST_CASE_TEMPLATE("cuda adamw optimizer on the GPU steps as on the CPU", T, float, double) {
    constexpr index_t n = 2077;
    auto p_cpu = random_values<T>(n, 31);
    device_vector<T> p_d(p_cpu);
    mnemo::adamw<T, mnemo::cpu> opt_cpu(n);
    mnemo::adamw<T, mnemo::cuda> opt_gpu(n);
    for (int t = 0; t < 3; ++t) {
        const auto g = random_values<T>(n, 40 + std::uint64_t(t));
        device_vector<T> g_d(g);
        opt_cpu.step(p_cpu.data(), g.data(), n, 3e-3);
        opt_gpu.step(p_d.data(), g_d.data(), n, 3e-3);
        CHECK(ulp(p_d.host(), p_cpu) <= 2);
    }
}

TEST_CASE_TEMPLATE("cuda sgd_step equals the CPU's: momentum, dampening, nesterov, L2, the first step", T, float,
                   double) {
    struct config {
        double momentum, dampening;
        bool nesterov, l2;
    };
    const config configs[] = {{0, 0, false, false}, {0, 0, false, true}, {0.9, 0, false, false},
                              {0.9, 0, true, true}, {0.5, 0.1, false, true}, {0.5, 0.1, true, false}};
    constexpr index_t n = 777;
    for (const config& cf : configs) {
        INFO("momentum " << cf.momentum << ", dampening " << cf.dampening << ", nesterov " << cf.nesterov << ", l2 "
                         << cf.l2);
        auto p_cpu = random_values<T>(n, 51);
        std::vector<T> b_cpu(n, T(0));
        device_vector<T> p_d(p_cpu), b_d(b_cpu);
        for (int t = 0; t < 3; ++t) {
            INFO("step " << t);
            auto g = random_values<T>(n, 60 + std::uint64_t(t));
            for (index_t i = 0; i < n; i += 11) g[std::size_t(i)] = T(0);
            device_vector<T> g_d(g);
            mnemo::sgd_step_args<T> a;
            a.n = n;
            a.first = t == 0;
            a.l2 = cf.l2;
            a.nesterov = cf.nesterov;
            a.wd = T(0.05);
            a.momentum = T(cf.momentum);
            a.one_minus_dampening = T(1.0 - cf.dampening);
            a.neg_lr = T(-0.1);
            a.params = p_cpu.data();
            a.grads = g.data();
            a.b = cf.momentum != 0 ? b_cpu.data() : nullptr;
            cpu_ops::sgd_step(a);
            a.params = p_d.data();
            a.grads = g_d.data();
            a.b = cf.momentum != 0 ? b_d.data() : nullptr;
            gpu_ops::sgd_step(a);
            CHECK(ulp(p_d.host(), p_cpu) <= 2);
            CHECK(ulp(b_d.host(), b_cpu) <= 2);
        }
    }
}

namespace {

// Sorted, disjoint runs inside [0, n), some empty, some one element long.
std::vector<mnemo::flat_range> some_runs(index_t n) {
    std::vector<mnemo::flat_range> runs;
    index_t at = 0;
    const auto add = [&](index_t b, index_t e) {
        b = std::max(b, at);
        e = std::min(std::max(e, b), n);
        if (b > n) return;
        runs.push_back({b, e});
        at = e;
    };
    add(0, 3);
    add(n / 7, n / 7);  // empty
    add(n / 5, n / 3);
    add(n / 2, n / 2 + 1);
    add(n / 2 + 5, n / 2 + 5);  // empty
    add(n - n / 10, n);
    add(n, n);  // empty, at the end
    return runs;
}

}  // namespace

TEST_CASE_TEMPLATE("cuda sum_squares_live equals the CPU's and does not depend on the runs", T, float, double) {
    SUBCASE("a few runs, some empty") {
        for (index_t n : {1, 5000, 100003, 9000001}) {
            INFO("n " << n);
            const auto runs = some_runs(n);
            auto x = random_values<T>(std::size_t(n), std::uint64_t(n));
            std::vector<char> inside(std::size_t(n), 0);
            for (const auto& r : runs)
                for (index_t i = r.begin; i < r.end; ++i) inside[std::size_t(i)] = 1;
            for (index_t i = 0; i < n; ++i)
                if (!inside[std::size_t(i)]) x[std::size_t(i)] = T(0);  // +0 outside the live runs
            device_vector<T> x_d(x);
            const double cpu = cpu_ops::sum_squares_live(x.data(), n, std::span<const mnemo::flat_range>(runs));
            const double gpu = gpu_ops::sum_squares_live(x_d.data(), n, std::span<const mnemo::flat_range>(runs));
            CHECK(cpu > 0);
            CHECK(std::abs(gpu - cpu) <= 1e-12 * cpu);
            const mnemo::flat_range all{0, n};
            const double dense = gpu_ops::sum_squares_live(x_d.data(), n, std::span<const mnemo::flat_range>(&all, 1));
            CHECK(dense == gpu);  // bitwise
            CHECK(gpu_ops::sum_squares_live(x_d.data(), n, std::span<const mnemo::flat_range>(runs)) == gpu);  // run to run
            CHECK(gpu_ops::sum_squares_live(x_d.data(), n, std::span<const mnemo::flat_range>()) == 0.0);
        }
    }
    SUBCASE("many runs") {
        constexpr index_t n = 70001;
        std::vector<mnemo::flat_range> runs;
        for (index_t b = 0; b + 40 <= n; b += 97) runs.push_back({b, b + (b % 3 == 0 ? 0 : 40)});
        auto x = random_values<T>(std::size_t(n), 77);
        std::vector<T> sparse(std::size_t(n), T(0));
        for (const auto& r : runs)
            for (index_t i = r.begin; i < r.end; ++i) sparse[std::size_t(i)] = x[std::size_t(i)];
        device_vector<T> x_d(sparse);
        const double cpu = cpu_ops::sum_squares_live(sparse.data(), n, std::span<const mnemo::flat_range>(runs));
        const double gpu = gpu_ops::sum_squares_live(x_d.data(), n, std::span<const mnemo::flat_range>(runs));
        CHECK(std::abs(gpu - cpu) <= 1e-12 * cpu);
    }
}

TEST_CASE_TEMPLATE("cuda scale_live equals the CPU's and touches nothing outside the runs", T, float, double) {
    SUBCASE("a few runs") {
        constexpr index_t n = 50000;
        const auto runs = some_runs(n);
        auto x_cpu = random_values<T>(std::size_t(n), 81);
        device_vector<T> x_d(x_cpu);
        cpu_ops::scale_live(x_cpu.data(), std::span<const mnemo::flat_range>(runs), T(0.37));
        gpu_ops::scale_live(x_d.data(), std::span<const mnemo::flat_range>(runs), T(0.37));
        CHECK(ulp(x_d.host(), x_cpu) == 0);
    }
    SUBCASE("more runs than one launch takes") {
        constexpr index_t n = 100000;
        std::vector<mnemo::flat_range> runs;
        for (index_t b = 0; b + 300 <= n; b += 331) runs.push_back({b, b + (b % 5 == 0 ? 0 : 1 + b % 300)});
        REQUIRE(runs.size() > 256);
        auto x_cpu = random_values<T>(std::size_t(n), 82);
        device_vector<T> x_d(x_cpu);
        cpu_ops::scale_live(x_cpu.data(), std::span<const mnemo::flat_range>(runs), T(-1.5));
        gpu_ops::scale_live(x_d.data(), std::span<const mnemo::flat_range>(runs), T(-1.5));
        CHECK(ulp(x_d.host(), x_cpu) == 0);
    }
    SUBCASE("no runs, empty runs") {
        auto x_cpu = random_values<T>(10, 83);
        device_vector<T> x_d(x_cpu);
        gpu_ops::scale_live(x_d.data(), std::span<const mnemo::flat_range>(), T(2));
        const std::vector<mnemo::flat_range> empty{{0, 0}, {4, 4}, {10, 10}};
        gpu_ops::scale_live(x_d.data(), std::span<const mnemo::flat_range>(empty), T(2));
        CHECK(x_d.host() == x_cpu);
    }
}
