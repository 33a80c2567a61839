#pragma once
// Finite-difference gradient checks in double (central differences), as dlib's test_layer and
// mlpack's gradient checks: the metric is ‖analytic − numeric‖ / ‖analytic + numeric‖. Parameters of a
// set over another backend (the fenced one) are read and perturbed over the host path.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <mnemo/core/parameters.hpp>

#include "testing.hpp"

namespace mnemo::testing {

/// Every parameter ~ U(lo, hi).
template <class T, class B>
void randomize_parameters(mnemo::parameter_set<T, B>& ps, std::uint64_t seed, double lo = -1, double hi = 1) {
    mnemo::rng r(seed);
    std::vector<T> values(std::size_t(ps.size()));
    ps.download_all_values(values);
    for (const auto& e : ps.entries())
        for (index_t i = 0; i < e.size; ++i) values[std::size_t(e.offset + i)] = static_cast<T>(r.uniform(lo, hi));
    ps.upload_all_values(values);
}

/// A model's parameters ~ U(−scale, scale), layer-norm weights ~ 1 + U(−scale, scale), so every path
/// (positional tables included) carries signal and the norms stay well conditioned.
template <class T, class B>
void randomize_model(mnemo::parameter_set<T, B>& ps, std::uint64_t seed, double scale = 0.5) {
    mnemo::rng r(seed);
    std::vector<T> values(std::size_t(ps.size()));
    ps.download_all_values(values);
    for (const auto& e : ps.entries()) {
        const bool norm_weight = e.name.find("norm") != std::string::npos && e.name.ends_with(".weight");
        for (index_t i = 0; i < e.size; ++i)
            values[std::size_t(e.offset + i)] = static_cast<T>((norm_weight ? 1.0 : 0.0) + r.uniform(-scale, scale));
    }
    ps.upload_all_values(values);
}

/// One buffer to perturb, and the analytic gradient of the loss with respect to it. `publish`, when
/// set, is called after every change to value[i] (a backend's parameter: value is a host copy, and
/// publish uploads it; `host` keeps that copy alive).
struct grad_target {
    std::string name;
    double* value;
    std::vector<double> analytic;
    std::function<void()> publish = {};
    std::shared_ptr<std::vector<double>> host = {};
};

/// Targets for every tensor of a parameter set (analytic = its gradient buffer now). Over a backend
/// other than the CPU, each tensor is a host copy uploaded after every perturbation.
template <class B>
std::vector<grad_target> parameter_targets(mnemo::parameter_set<double, B>& ps) {
    std::vector<grad_target> out;
    std::vector<double> grads(std::size_t(ps.size()));
    ps.download_all_grads(grads);
    for (index_t i = 0; i < index_t(ps.entries().size()); ++i) {
        const auto& e = ps.entries()[std::size_t(i)];
        std::vector<double> analytic(grads.begin() + e.offset, grads.begin() + e.offset + e.size);
        if constexpr (std::is_same_v<B, mnemo::cpu>) {
            out.push_back({e.name, ps.values() + e.offset, std::move(analytic)});
        } else {
            const mnemo::param<double, B> p(&ps, i);
            auto host = std::make_shared<std::vector<double>>(std::size_t(e.size));
            p.download(*host);
            out.push_back({e.name, host->data(), std::move(analytic), [p, host] { p.upload(*host); }, host});
        }
    }
    return out;
}

/// Checks each target's analytic gradient against central differences of `loss`. `loss` must only
/// run forward passes. Every gradient must also be non-zero somewhere, so the check cannot pass vacuously.
/// With `sample` > 0, each target is checked at most at `sample` elements: half of them evenly spaced,
/// the other half those with the largest analytic gradient (for the slow fenced backend).
inline void check_gradients(const std::function<double()>& loss, std::vector<grad_target> targets,
                            double tolerance = 1e-6, double eps = 1e-6, std::size_t sample = 0) {
    for (auto& t : targets) {
        const std::size_t n = t.analytic.size();
        std::vector<std::size_t> at;
        if (sample == 0 || sample >= n) {
            for (std::size_t i = 0; i < n; ++i) at.push_back(i);
        } else {
            std::vector<std::size_t> by_size(n);
            for (std::size_t i = 0; i < n; ++i) by_size[i] = i;
            std::stable_sort(by_size.begin(), by_size.end(),
                             [&](std::size_t a, std::size_t b) { return std::abs(t.analytic[a]) > std::abs(t.analytic[b]); });
            std::vector<bool> taken(n, false);
            for (std::size_t k = 0; k < sample / 2; ++k) taken[k * n / (sample / 2)] = true;
            for (std::size_t k = 0; k < sample - sample / 2; ++k) taken[by_size[k]] = true;
            for (std::size_t i = 0; i < n; ++i)
                if (taken[i]) at.push_back(i);
        }
        std::vector<double> analytic, numeric;
        for (std::size_t i : at) {
            const double old = t.value[i];
            const auto set = [&](double v) {
                t.value[i] = v;
                if (t.publish) t.publish();
            };
            set(old + eps);
            const double lp = loss();
            set(old - eps);
            const double lm = loss();
            set(old);
            analytic.push_back(t.analytic[i]);
            numeric.push_back((lp - lm) / (2 * eps));
        }
        const double err = relative_error(analytic, numeric);
        double norm = 0;
        for (double g : analytic) norm += g * g;
        INFO("gradient of " << t.name << " (" << at.size() << " of " << n << " elements): relative error " << err
                            << ", |analytic|^2 = " << norm);
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
