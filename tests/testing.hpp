#pragma once
// Shared test helpers: seeded random data, tolerant and bitwise comparison, golden-file metadata and
// tolerances, the shapes the compression tests share, GEMM operands, a scratch directory.
#include <doctest/doctest.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <string>
#include <system_error>
#include <vector>

#include <mnemo/core/backend.hpp>
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
/// n elements of backend B's memory at p, copied to the host (device_memory<B>'s host path).
template <class B, class T>
std::vector<T> to_host(const T* p, index_t n) {
    std::vector<T> h(static_cast<std::size_t>(n));
    if (n > 0) mnemo::device_memory<B>::download(h.data(), p, sizeof(T) * h.size());
    return h;
}

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

/// The bytes of a[0, n) and b[0, n) are the same (bitwise equality: NaNs and signed zeros included).
template <class T>
bool same_bits(const T* a, const T* b, index_t n) {
    return std::memcmp(a, b, sizeof(T) * static_cast<std::size_t>(n)) == 0;
}

/// max |a − b| over two std::vectors of the same size, or two 2-D mnemo::views of the same shape (read
/// row by row, so strided views work). NaN as soon as one difference is NaN, so `max_diff(a, b) < tol`
/// cannot pass over a NaN.
template <class A, class B>
double max_diff(const A& a, const B& b) {
    double m = 0;
    auto take = [&m](double x, double y) {
        const double d = std::abs(x - y);
        if (std::isnan(d) || d > m) m = d;  // once m is NaN, d > m is false: it stays NaN
    };
    if constexpr (requires { a.rows(); a.cols(); a.row(0); }) {
        REQUIRE(a.rows() == b.rows());
        REQUIRE(a.cols() == b.cols());
        for (index_t i = 0; i < a.rows(); ++i)
            for (index_t j = 0; j < a.cols(); ++j)
                take(static_cast<double>(a.row(i)[j]), static_cast<double>(b.row(i)[j]));
    } else {
        REQUIRE(a.size() == b.size());
        for (std::size_t i = 0; i < a.size(); ++i) take(static_cast<double>(a[i]), static_cast<double>(b[i]));
    }
    return m;
}

// ---- golden files (tools/golden_*.py, read with mnemo::read_safetensors) ----

/// An integer / a number of a golden file's metadata (`File` is mnemo::safetensors_file; a template so
/// that this header needs no safetensors include).
template <class File>
index_t meta_int(const File& f, const char* key) {
    return std::stoll(f.metadata().at(key));
}
template <class File>
double meta_double(const File& f, const char* key) {
    return std::stod(f.metadata().at(key));
}

/// The atol and rtol of a check_close.
struct tolerance {
    double atol, rtol;
};
/// Model-level parity with a float64 PyTorch reference run, in float64: the same math to ~1e-10 (the
/// reference sums in a different order).
constexpr tolerance golden_fp64{1e-10, 1e-9};
/// The same in float32, as the issue asks: atol 1e-5, rtol 1e-4.
constexpr tolerance golden_fp32{1e-5, 1e-4};
/// Weights after an Adam-family step in float32: early steps move each weight by ~lr·sign(g) whatever
/// |g|, so an element whose gradient is ~0 in one implementation and ~1e-9 in the other (float32 noise)
/// moves differently; those are compared with an absolute tolerance of a few percent of the step.
constexpr tolerance golden_fp32_after{5e-4, 1e-4};

// ---- shapes and operands shared by several tests ----

/// Case<D, Rate>::run(batch, n) over the shapes the compression tests share (test_compression,
/// test_autoencoding): rates 1, 2 and 3, odd and even D, 1 to 3 compressed slots n, batch 1 and 3.
template <template <std::size_t, std::size_t> class Case>
void run_compression_shapes() {
    for (index_t batch : {1, 3}) {
        Case<5, 1>::run(batch, 3);
        Case<5, 2>::run(batch, 2);
        Case<7, 3>::run(batch, 2);
        Case<4, 3>::run(batch, 1);
        Case<6, 2>::run(batch, 3);
    }
}

/// The three GEMM forms: C = A·B (nn), A·Bᵀ (nt), Aᵀ·B (tn).
enum gemm_form { nn, nt, tn };
inline const char* form_name(gemm_form f) { return f == nn ? "nn" : f == nt ? "nt" : "tn"; }

/// Operands of one m×n×k product in form f, rows padded by `pad` elements past what they need; A, B and
/// C (padding included) ~ U(−1, 1) from seeds seed, seed + 1, seed + 2.
template <class T>
struct gemm_operands {
    gemm_form f;
    index_t m, n, k, lda, ldb, ldc;
    std::vector<T> a, b, c;
    gemm_operands(gemm_form f_, index_t m_, index_t n_, index_t k_, index_t pad, std::uint64_t seed)
        : f(f_), m(m_), n(n_), k(k_) {
        lda = (f == tn ? m : k) + pad;
        ldb = (f == nt ? k : n) + pad;
        ldc = n + pad;
        a = random_vector<T>((f == tn ? k : m) * lda, seed);
        b = random_vector<T>((f == nt ? n : k) * ldb, seed + 1);
        c = random_vector<T>(m * ldc, seed + 2);
    }
};

}  // namespace mnemo::testing
