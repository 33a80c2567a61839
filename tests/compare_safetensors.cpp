// compare_safetensors: checks that two safetensors files hold the same tensors, for tests that run a
// program (mnemo_eval) and compare its output with golden data, without Python.
//
//   compare_safetensors GOT EXPECTED --atol A --rtol R
//
// Both files must hold the same tensor names, each with the same dtype and shape. Floating tensors
// must satisfy |got − expected| <= atol + rtol·|expected| element-wise (NaN never does); integer and
// BOOL tensors must be equal. Prints one line per tensor (the worst error and where) and exits 0 when
// everything agrees, 1 otherwise (2 for bad usage or unreadable files).
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include <mnemo/io/safetensors.hpp>

namespace {

double parse_tolerance(const char* flag, const char* s) {
    std::size_t used = 0;
    double x = -1;
    try {
        x = std::stod(s, &used);
    } catch (const std::exception&) {
        used = 0;
    }
    MNEMO_CHECK(used == std::string(s).size() && x >= 0, "compare_safetensors: ", flag,
                " expects a non-negative number, got '", s, "'");
    return x;
}

// "[i, j, k]": the multi-index of flat element `flat` of `shape`.
std::string index_string(const std::vector<std::int64_t>& shape, std::int64_t flat) {
    std::vector<std::int64_t> idx(shape.size());
    for (std::size_t d = shape.size(); d-- > 0;) {
        idx[d] = flat % shape[d];
        flat /= shape[d];
    }
    return mnemo::shape_string(idx);
}

// Compares one tensor present in both files; prints its line and returns whether it agrees.
bool compare_tensor(const mnemo::safetensors_file& got, const mnemo::safetensors_file& want,
                    const mnemo::safetensors_tensor& w, double atol, double rtol) {
    const mnemo::safetensors_tensor& g = got.at(w.name);
    if (g.type != w.type || g.shape != w.shape) {
        std::printf("FAIL %s: %s %s, expected %s %s\n", w.name.c_str(), std::string(mnemo::dtype_name(g.type)).c_str(),
                    mnemo::shape_string(g.shape).c_str(), std::string(mnemo::dtype_name(w.type)).c_str(),
                    mnemo::shape_string(w.shape).c_str());
        return false;
    }
    const std::int64_t n = w.numel();
    if (mnemo::is_convertible_float(w.type)) {
        const std::vector<double> a = got.to_vector<double>(w.name), b = want.to_vector<double>(w.name);
        std::int64_t worst = -1, bad = 0;
        double worst_excess = 0, max_abs = 0;
        for (std::int64_t i = 0; i < n; ++i) {
            const double diff = std::abs(a[std::size_t(i)] - b[std::size_t(i)]);
            const double excess = diff - (atol + rtol * std::abs(b[std::size_t(i)]));
            if (!(excess <= 0)) ++bad;
            if (!(diff <= max_abs)) max_abs = diff;  // NaN sticks
            if (worst < 0 || excess > worst_excess || std::isnan(excess)) {
                worst = i;
                worst_excess = excess;
            }
        }
        std::printf("%s %s %s: max |error| %.3g", bad ? "FAIL" : "ok  ", w.name.c_str(),
                    mnemo::shape_string(w.shape).c_str(), max_abs);
        if (worst >= 0)
            std::printf(", nearest the limit at %s: got %.9g, expected %.9g", index_string(w.shape, worst).c_str(),
                        a[std::size_t(worst)], b[std::size_t(worst)]);
        if (bad) std::printf(" (%lld of %lld elements beyond atol %g + rtol %g)", static_cast<long long>(bad),
                             static_cast<long long>(n), atol, rtol);
        std::printf("\n");
        return bad == 0;
    }
    const std::vector<std::int64_t> a = got.to_vector<std::int64_t>(w.name), b = want.to_vector<std::int64_t>(w.name);
    for (std::int64_t i = 0; i < n; ++i)
        if (a[std::size_t(i)] != b[std::size_t(i)]) {
            std::printf("FAIL %s: at %s got %lld, expected %lld\n", w.name.c_str(), index_string(w.shape, i).c_str(),
                        static_cast<long long>(a[std::size_t(i)]), static_cast<long long>(b[std::size_t(i)]));
            return false;
        }
    std::printf("ok   %s %s: equal\n", w.name.c_str(), mnemo::shape_string(w.shape).c_str());
    return true;
}

}  // namespace

int main(int argc, char** argv) {
    mnemo::safetensors_file got, want;
    double atol = -1, rtol = -1;
    try {
        std::vector<std::string> files;
        for (int i = 1; i < argc; ++i) {
            const std::string a = argv[i];
            if ((a == "--atol" || a == "--rtol") && i + 1 < argc) {
                (a == "--atol" ? atol : rtol) = parse_tolerance(argv[i], argv[i + 1]);
                ++i;
            } else if (a.rfind("--", 0) == 0)
                mnemo::detail::fail("compare_safetensors: unknown option '", a, "'");
            else
                files.push_back(a);
        }
        MNEMO_CHECK(files.size() == 2 && atol >= 0 && rtol >= 0,
                    "usage: compare_safetensors GOT EXPECTED --atol A --rtol R");
        got = mnemo::read_safetensors(files[0]);
        want = mnemo::read_safetensors(files[1]);
    } catch (const std::exception& e) {
        std::fprintf(stderr, "%s\n", e.what());
        return 2;
    }

    bool ok = true;
    for (const auto& t : got.tensors())
        if (!want.contains(t.name)) {
            std::printf("FAIL %s: in %s but not in %s\n", t.name.c_str(), got.path().c_str(), want.path().c_str());
            ok = false;
        }
    for (const auto& w : want.tensors()) {
        if (!got.contains(w.name)) {
            std::printf("FAIL %s: missing from %s\n", w.name.c_str(), got.path().c_str());
            ok = false;
            continue;
        }
        ok = compare_tensor(got, want, w, atol, rtol) && ok;
    }
    std::printf("compare_safetensors: %s\n", ok ? "all tensors agree" : "MISMATCH");
    return ok ? 0 : 1;
}
