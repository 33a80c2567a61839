#pragma once
// Finite-difference gradient checks in double (central differences), as dlib's test_layer and
// mlpack's gradient checks: the metric is ‖analytic − numeric‖ / ‖analytic + numeric‖.
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include <mnemo/core/parameters.hpp>

#include "testing.hpp"

namespace mnemo::testing {

/// Every parameter ~ U(lo, hi).
template <class T>
void randomize_parameters(mnemo::parameter_set<T>& ps, std::uint64_t seed, double lo = -1, double hi = 1) {
    mnemo::rng r(seed);
    for (const auto& e : ps.entries())
        for (index_t i = 0; i < e.size; ++i) ps.values()[e.offset + i] = static_cast<T>(r.uniform(lo, hi));
}

/// A model's parameters ~ U(−scale, scale), layer-norm weights ~ 1 + U(−scale, scale), so every path
/// (positional tables included) carries signal and the norms stay well conditioned.
template <class T>
void randomize_model(mnemo::parameter_set<T>& ps, std::uint64_t seed, double scale = 0.5) {
    mnemo::rng r(seed);
    for (const auto& e : ps.entries()) {
        const bool norm_weight = e.name.find("norm") != std::string::npos && e.name.ends_with(".weight");
        for (index_t i = 0; i < e.size; ++i)
            ps.values()[e.offset + i] = static_cast<T>((norm_weight ? 1.0 : 0.0) + r.uniform(-scale, scale));
    }
}

/// One buffer to perturb, and the analytic gradient of the loss with respect to it.
struct grad_target {
    std::string name;
    double* value;
    std::vector<double> analytic;
};

/// Targets for every tensor of a parameter set (analytic = its gradient buffer now).
inline std::vector<grad_target> parameter_targets(mnemo::parameter_set<double>& ps) {
    std::vector<grad_target> out;
    for (const auto& e : ps.entries())
        out.push_back({e.name, ps.values() + e.offset,
                       std::vector<double>(ps.grads() + e.offset, ps.grads() + e.offset + e.size)});
    return out;
}

/// Checks each target's analytic gradient against central differences of `loss`. `loss` must only
/// run forward passes. Every gradient must also be non-zero somewhere, so the check cannot pass vacuously.
inline void check_gradients(const std::function<double()>& loss, std::vector<grad_target> targets,
                            double tolerance = 1e-6, double eps = 1e-6) {
    for (auto& t : targets) {
        std::vector<double> numeric(t.analytic.size());
        for (std::size_t i = 0; i < t.analytic.size(); ++i) {
            const double old = t.value[i];
            t.value[i] = old + eps;
            const double lp = loss();
            t.value[i] = old - eps;
            const double lm = loss();
            t.value[i] = old;
            numeric[i] = (lp - lm) / (2 * eps);
        }
        const double err = relative_error(t.analytic, numeric);
        double norm = 0;
        for (double g : t.analytic) norm += g * g;
        INFO("gradient of " << t.name << ": relative error " << err << ", |analytic|^2 = " << norm);
        CHECK(err < tolerance);
        CHECK(norm > 0);
    }
}

/// Backward accumulates into parameter gradients: runs `backward` once on zeroed gradients (the clean
/// gradient), then again over gradients pre-filled with U(−1, 1); the result must be prefill + clean
/// to 1e-14 (atol and rtol) in every element.
inline void check_accumulates(mnemo::parameter_set<double>& ps, const std::function<void()>& backward) {
    ps.zero_grad();
    backward();
    std::vector<double> clean(ps.grads(), ps.grads() + ps.size());
    auto prefill = random_vector<double>(ps.size(), 99);
    std::memcpy(ps.grads(), prefill.data(), sizeof(double) * prefill.size());
    backward();
    std::vector<double> expected(clean.size());
    for (std::size_t i = 0; i < clean.size(); ++i) expected[i] = prefill[i] + clean[i];
    check_close("accumulated parameter gradients", ps.grads(), expected.data(), ps.size(), 1e-14, 1e-14);
}

/// Σ y ⊙ r: a scalar loss whose gradient with respect to y is r.
inline double project(const std::vector<double>& y, const std::vector<double>& r) {
    double s = 0;
    for (std::size_t i = 0; i < y.size(); ++i) s += y[i] * r[i];
    return s;
}

}  // namespace mnemo::testing
