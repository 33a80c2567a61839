#pragma once
// Learning-rate schedules: small value types with `double lr(std::int64_t step) const`.
//
// Step convention (all schedules): `step` counts the optimizer steps already taken, from 0. lr(step) is
// the rate for the (step + 1)-th update, so a loop reads
//     opt.step(params, grads, n, schedule.lr(opt.step_count()));
// This is PyTorch's LambdaLR / CosineAnnealingLR convention: after k calls of scheduler.step() (one per
// optimizer.step()) the group's lr is base_lr * lambda(k). The labml schedules (noam, adam_warmup) are
// written in terms of t = step + 1, the optimizer's own counter after it is incremented.
//
//   constant:       lr
//   linear warm-up: lr · (f0 + (1 − f0) · s / W)              for s < W, then lr
//                   (= torch.optim.lr_scheduler.LinearLR(start_factor=f0, total_iters=W) in closed form)
//   cosine:         warm-up as above for s < W; then with p = (s − W) / (S − W):
//                   lr_min + (lr − lr_min) · (1 + cos(π·p)) / 2  for W ≤ s ≤ S, then lr_min
//                   (W = 0: torch.optim.lr_scheduler.CosineAnnealingLR(T_max=S, eta_min=lr_min) for s ≤ S;
//                   past S PyTorch's cosine climbs back up, this one stays at lr_min)
//   noam:           lr · d_model^−0.5 · min(t^−0.5, t · W^−1.5), t = s + 1
//                   (labml_nn/optimizers/noam.py; "Attention Is All You Need", eq. 3)
//   adam_warmup:    1e-8 + t · lr / W while t < W, else lr, t = s + 1
//                   (labml_nn/optimizers/adam_warmup.py, the Compressive Transformer experiment's optimizer)
#include <algorithm>
#include <cmath>
#include <concepts>
#include <cstdint>
#include <numbers>

#include "../core/error.hpp"

namespace mnemo {

/// Anything with `lr(step)`; optimizers accept one in place of an explicit rate.
template <class S>
concept lr_schedule = requires(const S& s, std::int64_t step) {
    { s.lr(step) } -> std::convertible_to<double>;
};

namespace detail::optim {
inline void check_schedule_lr(double lr, const char* who, const char* what = "lr") {
    MNEMO_CHECK(std::isfinite(lr) && lr >= 0.0, who, ": ", what, " must be finite and >= 0, got ", lr);
}
inline void check_schedule_step(std::int64_t step, const char* who) {
    MNEMO_CHECK(step >= 0, who, ": step must be >= 0 (it counts the optimizer steps taken), got ", step);
}
// The warm-up factor f0 + (1 − f0)·s/W, in this order of operations so that it equals the Python
// lambda `f0 + (1.0 - f0) * s / W` bit for bit.
inline double warmup_factor(double start_factor, std::int64_t step, std::int64_t warmup_steps) {
    return start_factor + (1.0 - start_factor) * static_cast<double>(step) / static_cast<double>(warmup_steps);
}
}  // namespace detail::optim

/// The same rate at every step.
class constant_schedule {
public:
    explicit constant_schedule(double lr) : lr_(lr) { detail::optim::check_schedule_lr(lr, "constant_schedule"); }
    double lr(std::int64_t step) const {
        detail::optim::check_schedule_step(step, "constant_schedule");
        return lr_;
    }
    double base_lr() const { return lr_; }

private:
    double lr_;
};

/// Linear warm-up from start_factor·lr (0 by default, as most warm-ups) to lr over warmup_steps steps,
/// then constant. warmup_steps = 0 means no warm-up.
class linear_warmup_schedule {
public:
    linear_warmup_schedule(double lr, std::int64_t warmup_steps, double start_factor = 0.0)
        : lr_(lr), warmup_(warmup_steps), start_(start_factor) {
        detail::optim::check_schedule_lr(lr, "linear_warmup_schedule");
        MNEMO_CHECK(warmup_steps >= 0, "linear_warmup_schedule: warmup_steps must be >= 0, got ", warmup_steps);
        MNEMO_CHECK(std::isfinite(start_factor) && start_factor >= 0.0 && start_factor <= 1.0,
                    "linear_warmup_schedule: start_factor must be in [0, 1], got ", start_factor);
    }
    double lr(std::int64_t step) const {
        detail::optim::check_schedule_step(step, "linear_warmup_schedule");
        if (step < warmup_) return lr_ * detail::optim::warmup_factor(start_, step, warmup_);
        return lr_;
    }
    double base_lr() const { return lr_; }
    std::int64_t warmup_steps() const { return warmup_; }
    double start_factor() const { return start_; }

private:
    double lr_;
    std::int64_t warmup_;
    double start_;
};

/// Optional linear warm-up (as linear_warmup_schedule) over warmup_steps, then a half cosine from lr down
/// to min_lr, reached at step total_steps and held from then on.
class cosine_schedule {
public:
    cosine_schedule(double lr, std::int64_t total_steps, double min_lr = 0.0, std::int64_t warmup_steps = 0,
                    double warmup_start_factor = 0.0)
        : lr_(lr), min_lr_(min_lr), total_(total_steps), warmup_(warmup_steps), start_(warmup_start_factor) {
        detail::optim::check_schedule_lr(lr, "cosine_schedule");
        detail::optim::check_schedule_lr(min_lr, "cosine_schedule", "min_lr");
        MNEMO_CHECK(warmup_steps >= 0, "cosine_schedule: warmup_steps must be >= 0, got ", warmup_steps);
        MNEMO_CHECK(total_steps > warmup_steps, "cosine_schedule: total_steps (", total_steps,
                    ") must be greater than warmup_steps (", warmup_steps, ")");
        MNEMO_CHECK(std::isfinite(warmup_start_factor) && warmup_start_factor >= 0.0 && warmup_start_factor <= 1.0,
                    "cosine_schedule: warmup_start_factor must be in [0, 1], got ", warmup_start_factor);
    }
    double lr(std::int64_t step) const {
        detail::optim::check_schedule_step(step, "cosine_schedule");
        if (step < warmup_) return lr_ * detail::optim::warmup_factor(start_, step, warmup_);
        if (step >= total_) return min_lr_;
        const double progress = static_cast<double>(step - warmup_) / static_cast<double>(total_ - warmup_);
        return min_lr_ + (lr_ - min_lr_) * (1.0 + std::cos(std::numbers::pi * progress)) / 2.0;
    }
    double base_lr() const { return lr_; }
    double min_lr() const { return min_lr_; }
    std::int64_t total_steps() const { return total_; }
    std::int64_t warmup_steps() const { return warmup_; }

private:
    double lr_, min_lr_;
    std::int64_t total_, warmup_;
    double start_;
};

/// Noam: lr · d_model^−0.5 · min(t^−0.5, t · warmup^−1.5), t = step + 1. Rises linearly for
/// warmup steps, peaks at t = warmup, then decays as t^−0.5. Pair with labml_adam (docs/reference.md §17).
class noam_schedule {
public:
    noam_schedule(double lr, std::int64_t d_model, std::int64_t warmup_steps)
        : lr_(lr), d_model_(d_model), warmup_(warmup_steps) {
        detail::optim::check_schedule_lr(lr, "noam_schedule");
        MNEMO_CHECK(d_model >= 1, "noam_schedule: d_model must be >= 1, got ", d_model);
        MNEMO_CHECK(warmup_steps >= 1, "noam_schedule: warmup_steps must be >= 1, got ", warmup_steps);
    }
    double lr(std::int64_t step) const {
        detail::optim::check_schedule_step(step, "noam_schedule");
        const double t = static_cast<double>(step + 1);
        // Same grouping as labml: lr * (d_model^-0.5 * min(...)).
        const double factor = std::pow(static_cast<double>(d_model_), -0.5) *
                              std::min(std::pow(t, -0.5), t * std::pow(static_cast<double>(warmup_), -1.5));
        return lr_ * factor;
    }
    double base_lr() const { return lr_; }
    std::int64_t d_model() const { return d_model_; }
    std::int64_t warmup_steps() const { return warmup_; }

private:
    double lr_;
    std::int64_t d_model_, warmup_;
};

/// labml's AdamWarmup rate: 1e-8 + t · lr / warmup while t < warmup, else lr, t = step + 1
/// (docs/reference.md §11). The 1e-8 offset is labml's; it is kept so the rates agree bit for bit.
class adam_warmup_schedule {
public:
    adam_warmup_schedule(double lr, std::int64_t warmup_steps) : lr_(lr), warmup_(warmup_steps) {
        detail::optim::check_schedule_lr(lr, "adam_warmup_schedule");
        MNEMO_CHECK(warmup_steps >= 0, "adam_warmup_schedule: warmup_steps must be >= 0, got ", warmup_steps);
    }
    double lr(std::int64_t step) const {
        detail::optim::check_schedule_step(step, "adam_warmup_schedule");
        const std::int64_t t = step + 1;
        if (warmup_ > t) return 1e-8 + static_cast<double>(t) * lr_ / static_cast<double>(warmup_);
        return lr_;
    }
    double base_lr() const { return lr_; }
    std::int64_t warmup_steps() const { return warmup_; }

private:
    double lr_;
    std::int64_t warmup_;
};

}  // namespace mnemo
