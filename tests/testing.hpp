#pragma once
// Shared test helpers: seeded random data, tolerant comparison that reports the worst element, a
// scratch directory.
#include <doctest/doctest.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <string>
#include <system_error>
#include <vector>

#include <mnemo/core/rng.hpp>
#include <mnemo/core/shape.hpp>

namespace mnemo::testing {

/// A fresh directory under the system temp directory (named after `what`, the process and a counter),
/// removed with everything in it.
struct temp_dir {
    std::filesystem::path path;
    explicit temp_dir(const std::string& what) {
        static std::atomic<int> counter{0};
        path = std::filesystem::temp_directory_path() /
               ("mnemo_test_" + what + "_" + std::to_string(::getpid()) + "_" + std::to_string(counter++));
        std::filesystem::remove_all(path);
        std::filesystem::create_directories(path);
    }
    temp_dir(const temp_dir&) = delete;
    temp_dir& operator=(const temp_dir&) = delete;
    ~temp_dir() {
        std::error_code ec;
        std::filesystem::remove_all(path, ec);
    }
    std::string file(const std::string& name) const { return (path / name).string(); }
    /// Names of the entries in the directory, sorted.
    std::vector<std::string> listing() const {
        std::vector<std::string> names;
        for (const auto& e : std::filesystem::directory_iterator(path)) names.push_back(e.path().filename().string());
        std::sort(names.begin(), names.end());
        return names;
    }
};

template <class T>
std::vector<T> random_vector(index_t n, std::uint64_t seed, double lo = -1.0, double hi = 1.0) {
    mnemo::rng r(seed);
    std::vector<T> v(static_cast<std::size_t>(n));
    for (auto& x : v) x = static_cast<T>(r.uniform(lo, hi));
    return v;
}

/// n token ids uniform in [0, vocab).
inline std::vector<std::int32_t> random_tokens(index_t n, index_t vocab, std::uint64_t seed) {
    mnemo::rng r(seed);
    std::vector<std::int32_t> t(static_cast<std::size_t>(n));
    for (auto& x : t) x = static_cast<std::int32_t>(r.next_u32() % static_cast<std::uint32_t>(vocab));
    return t;
}

/// Checks |a − b| <= atol + rtol·|b| element-wise; on failure names the tensor, the worst index and values.
template <class T, class U>
void check_close(const std::string& name, const T* a, const U* b, index_t n, double atol, double rtol) {
    index_t worst = -1;
    double worst_excess = 0.0;
    for (index_t i = 0; i < n; ++i) {
        const double x = static_cast<double>(a[i]), y = static_cast<double>(b[i]);
        const double excess = std::abs(x - y) - (atol + rtol * std::abs(y));
        if (!(excess <= 0.0) && (worst < 0 || excess > worst_excess || std::isnan(excess))) {
            worst = i;
            worst_excess = excess;
        }
    }
    INFO(name << ": worst element " << worst << " got " << (worst >= 0 ? double(a[worst]) : 0.0) << " expected "
              << (worst >= 0 ? double(b[worst]) : 0.0) << " (n=" << n << ", atol=" << atol << ", rtol=" << rtol << ")");
    CHECK(worst == -1);
}

template <class T, class U>
void check_close(const std::string& name, const std::vector<T>& a, const std::vector<U>& b, double atol, double rtol) {
    REQUIRE(a.size() == b.size());
    check_close(name, a.data(), b.data(), static_cast<index_t>(a.size()), atol, rtol);
}

/// ‖a − b‖ / ‖a + b‖ (0 when both are zero): the gradient-check metric.
template <class T>
double relative_error(const std::vector<T>& a, const std::vector<T>& b) {
    double num = 0, den = 0;
    for (std::size_t i = 0; i < a.size(); ++i) {
        num += (double(a[i]) - double(b[i])) * (double(a[i]) - double(b[i]));
        den += (double(a[i]) + double(b[i])) * (double(a[i]) + double(b[i]));
    }
    return den == 0 ? std::sqrt(num) : std::sqrt(num / den);
}

}  // namespace mnemo::testing
