#pragma once
// What the CUDA tests share: device copies of host vectors, random inputs, and the comparison of a
// GPU result with the CPU kernel's (tolerances stated by each test).
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <span>
#include <string>
#include <vector>

#include <mnemo/cuda.hpp>

namespace cuda_testing {

using mnemo::index_t;

/// A device buffer holding a copy of host values (and back).
template <class T>
struct device_vector {
    mnemo::buffer<T, mnemo::cuda> buf;
    index_t n = 0;
    device_vector() = default;
    explicit device_vector(index_t size) : n(size) {
        mnemo::device_memory<mnemo::cuda>::fill_zero(buf.ensure(std::max<index_t>(size, 1)), sizeof(T) * std::size_t(size));
    }
    explicit device_vector(const std::vector<T>& host) : n(index_t(host.size())) {
        buf.ensure(std::max<index_t>(n, 1));
        mnemo::device_memory<mnemo::cuda>::upload(buf.data(), host.data(), sizeof(T) * host.size());
    }
    T* data() { return buf.data(); }
    const T* data() const { return buf.data(); }
    std::vector<T> host() const {
        std::vector<T> out(static_cast<std::size_t>(n));
        mnemo::device_memory<mnemo::cuda>::download(out.data(), buf.data(), sizeof(T) * out.size());
        return out;
    }
};

/// n values uniform in [lo, hi), from seed.
template <class T>
std::vector<T> random_values(std::size_t n, std::uint64_t seed, double lo = -1.0, double hi = 1.0) {
    std::mt19937_64 g(seed);
    std::uniform_real_distribution<double> u(lo, hi);
    std::vector<T> v(n);
    for (T& x : v) x = T(u(g));
    return v;
}

/// max |gpu − cpu| / max(1, max |cpu|): the normalised error of GEMM-based results.
template <class T>
double normalized_error(std::span<const T> gpu, std::span<const T> cpu) {
    REQUIRE(gpu.size() == cpu.size());
    double scale = 1.0, err = 0.0;
    for (std::size_t i = 0; i < cpu.size(); ++i) scale = std::max(scale, std::abs(double(cpu[i])));
    for (std::size_t i = 0; i < cpu.size(); ++i) {
        const double d = std::abs(double(gpu[i]) - double(cpu[i]));
        if (!(d <= err)) err = std::isnan(d) ? INFINITY : d;  // NaN counts as infinite
    }
    return err / scale;
}

/// Largest distance in units in the last place (of the CPU value) over the elements: element-wise
/// kernels and softmax are held to a few ulp.
template <class T>
double max_ulp(std::span<const T> gpu, std::span<const T> cpu) {
    REQUIRE(gpu.size() == cpu.size());
    double worst = 0;
    for (std::size_t i = 0; i < cpu.size(); ++i) {
        if (gpu[i] == cpu[i]) continue;
        if (std::isnan(double(gpu[i])) != std::isnan(double(cpu[i]))) return INFINITY;
        const T ref = cpu[i];
        const double ulp = std::max(double(std::nextafter(std::abs(ref), T(INFINITY)) - std::abs(ref)),
                                    double(std::numeric_limits<T>::denorm_min()));
        worst = std::max(worst, std::abs(double(gpu[i]) - double(ref)) / ulp);
    }
    return worst;
}

}  // namespace cuda_testing
