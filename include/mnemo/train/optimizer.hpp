#pragma once
// Optimizers over flat buffers: params (T*), grads (const T*) and the optimizer's own moment buffers share
// one layout of n elements (a parameter_set's values()/grads()), so a step is one element-wise loop and
// a checkpoint is the step counter plus the moment buffers. t is the step number, from 1; g the gradient.
//
// adamw      torch.optim.AdamW (PyTorch 1.13, foreach=False; Loshchilov & Hutter, "Decoupled Weight
//            Decay Regularization", 2019):
//              p ← p·(1 − lr·wd)
//              m ← β1·m + (1 − β1)·g          v ← β2·v + (1 − β2)·g·g
//              p ← p − (lr / (1 − β1^t)) · m / (sqrt(v) / sqrt(1 − β2^t) + ε)
// adam       torch.optim.Adam (Kingma & Ba, 2015): g ← g + wd·p (L2), then m, v and p as above.
// sgd        torch.optim.SGD: g ← g + wd·p; with momentum μ: b ← g at t = 1 (no dampening),
//            b ← μ·b + (1 − dampening)·g after; d = g + μ·b (nesterov) or d = b; p ← p − lr·d.
// labml_adam labml_nn's Adam with optimized_update, the update of its AdamWarmup and Noam optimizers
//            (docs/reference.md §11 and §17, confirmed by running the reference):
//              p ← p·(1 − lr·wd)   (decoupled; lr is the base rate, labml's group['lr'])
//              m, v as Adam
//              p ← p − lr_t · sqrt(1 − β2^t)/(1 − β1^t) · m / (sqrt(v) + ε)
//            ε is added to sqrt(v) itself, not to sqrt(v)/sqrt(1 − β2^t) as in PyTorch: the two differ
//            while v is small. lr_t comes from adam_warmup_schedule or noam_schedule (schedule.hpp).
//
// Matching PyTorch to the last bit. Each line above is one ATen kernel, and the loops below repeat its
// arithmetic in its order: Python scalars are combined in double and rounded to T once (as ATen casts a
// Scalar to the tensor's type); mul_ is x·s; add_(y, alpha) is fma(alpha, y, x) and
// addcmul_(y, z, value) is fma(value·y, z, x) (ATen's AVX2 kernels use fused multiply-add, checked
// against torch 1.13 on float32 and float64); addcdiv_(y, z, value) is x + (value·y)/z; tensor / scalar
// is a true division. With hardware FMA (e.g. -march=native on x86-64) the results equal PyTorch's bit for
// bit; without it fmadd falls back to a·b + c, which rounds twice: each such operation may then differ
// from PyTorch by an ulp (as PyTorch's own non-AVX2 builds do), well inside float tolerances.
//
// Threads: each element's update is independent, so results do not depend on the OpenMP thread count.
//
// Speed: under the default -fmath-errno, std::sqrt may set errno, so neither g++ 12 nor clang 14
// vectorises the Adam-family loops. -fno-math-errno (PyTorch builds with it) changes no result and
// makes them vectorise: AdamW float step, n = 4M, one thread: g++ 12 -O3 -march=native 3.6-5.2 ->
// 0.64 ns/element, clang 14 2.8 -> 0.47 ns/element (measured on the AMD EPYC development machine). Those
// loops therefore carry `parallel for` without `simd`, left to the auto-vectoriser, so that clang does
// not warn about a forced vectorisation it cannot do; the loops without sqrt keep `simd`.
// Each Adam loop is a static update() that gets its buffers and coefficients as arguments: written
// inside the lambda it runs in, it read them through the lambda's captures, memory that every store to
// params, m or v might alias, and g++ 12 gave up on the 30 run-time alias checks that needed (its limit
// is 10) and left the loop scalar even under -fno-math-errno. Vectorised, each element still sees the
// same IEEE operations (fma, ·, /, sqrt, +), so the results are the same bits.
//
// Sparse gradients: adamw and labml_adam skip the gradient reads of blocks that never had gradient
// (adam_state::sweep); over a parameter_set, step(set) also passes the runs where the gradient may be
// non-zero (parameter_set::grad_live_ranges()), so the blocks of rows no step touched (the positional
// tables' rows outside the window) are not read at all: they only decay. Bitwise the dense result.
// Over a parameter_set, adamw and labml_adam defer even that decay (parameters.hpp, Deferred weight
// decay): such a block is multiplied by the logged factors only when something reads it. A's
// optimizer step went from 1.2 to 0.5 ms (the decay of 6.3M table parameters was 50 MB of traffic).
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <span>
#include <type_traits>
#include <vector>

#include "../kernels/cpu/parallel.hpp"
#include "../core/buffer.hpp"
#include "../core/error.hpp"
#include "../core/parameters.hpp"
#include "../core/shape.hpp"
#include "clip.hpp"
#include "schedule.hpp"

namespace mnemo {

namespace detail::optim {

// fmadd (a·b + c with PyTorch's rounding), product (a·b rounded once, never fused into a later addition)
// and MNEMO_HAS_FAST_FMA are defined in clip.hpp, which shares them.

// Whether x[0, n) is all ±0 (as x_i == 0 for every i): an OR of the bits without the sign, which
// vectorises where a chain of `zero &= x_i == 0` does not. NaN and every other value have bits left.
template <class T>
bool all_zero(const T* x, index_t n) {
    using U = std::conditional_t<sizeof(T) == 4, std::uint32_t, std::uint64_t>;
    static_assert(sizeof(U) == sizeof(T));
    U bits = 0;
    for (index_t i = 0; i < n; ++i) bits |= std::bit_cast<U>(x[i]) << 1;
    return bits == 0;
}

inline void check_lr(double lr, const char* who) {
    MNEMO_CHECK(std::isfinite(lr) && lr >= 0.0, who, ": lr must be finite and >= 0, got ", lr);
}
inline void check_beta(double beta, const char* who, const char* name) {
    MNEMO_CHECK(std::isfinite(beta) && beta >= 0.0 && beta < 1.0, who, ": ", name, " must be in [0, 1), got ",
                beta);
}
inline void check_eps(double eps, const char* who) {
    MNEMO_CHECK(std::isfinite(eps) && eps > 0.0, who, ": eps must be finite and > 0, got ", eps);
}
inline void check_weight_decay(double wd, const char* who) {
    MNEMO_CHECK(std::isfinite(wd) && wd >= 0.0, who, ": weight_decay must be finite and >= 0, got ", wd);
}

/// The hyper-parameters every Adam-family optimizer shares (lr, betas, eps, weight_decay).
template <class Options>
inline void check_adam_options(const Options& o, const char* who) {
    check_lr(o.lr, who);
    check_beta(o.beta1, who, "beta1");
    check_beta(o.beta2, who, "beta2");
    check_eps(o.eps, who);
    check_weight_decay(o.weight_decay, who);
}
inline void check_size(index_t n, const char* who) {
    MNEMO_CHECK(n >= 0, who, ": the number of elements must be >= 0, got ", n);
}

// The checks every step() makes before touching memory.
template <class T>
void check_step(const T* params, const T* grads, index_t n, index_t expected, double lr, const char* who) {
    MNEMO_CHECK(n == expected, who, ": buffer size mismatch: the optimizer holds state for ", expected,
                " elements, step() was given ", n);
    MNEMO_CHECK(n == 0 || (params != nullptr && grads != nullptr), who, ": params or grads is null");
    check_lr(lr, who);
}

template <class T>
void check_state_span(std::span<const T> s, index_t expected, const char* who, const char* name) {
    MNEMO_CHECK(static_cast<index_t>(s.size()) == expected, who, ": set_state: ", name, " has ", s.size(),
                " elements, the optimizer holds ", expected);
}

// Copies saved state into an optimizer's buffer of the same size; passing the optimizer's own buffer
// back (set_state(opt.step_count(), opt.exp_avg(), ...)) is a no-op rather than an overlapping copy.
template <class T>
void copy_state(std::span<const T> from, T* to) {
    if (from.data() != to) std::copy(from.begin(), from.end(), to);
}

// step() overloads shared by every optimizer: the rate from the options, an explicit rate, a schedule
// (asked for the rate of the next step, schedule.lr(step_count())), and the same over a parameter_set.
// Derived provides step(T* params, const T* grads, index_t n, double lr), options().lr and step_count();
// where it also provides step(params, grads, n, lr, live) (the gradient is +0 outside the runs `live`),
// the parameter_set overloads pass it the set's grad_live_ranges(). They read the gradients through the
// const grads(), which leaves the set's record of touched rows as it is.
template <class Derived, class T>
class step_overloads {
public:
    void step(T* params, const T* grads, index_t n) { self().step(params, grads, n, self().options().lr); }
    template <lr_schedule S>
    void step(T* params, const T* grads, index_t n, const S& schedule) {
        self().step(params, grads, n, static_cast<double>(schedule.lr(self().step_count())));
    }
    void step(parameter_set<T>& set) { step(set, self().options().lr); }
    void step(parameter_set<T>& set, double lr) {
        const parameter_set<T>& cset = set;
        if constexpr (requires { Derived::defers_decay; }) {  // adamw, labml_adam: see parameters.hpp
            self().run(nullptr, cset.grads(), set.size(), lr, cset.grad_live_ranges(), &set);
            return;
        }
        T* values = set.values();
        if constexpr (requires(Derived& d, T* p, const T* g, std::span<const flat_range> live) { d.step(p, g, index_t(0), 0.0, live); })
            self().step(values, cset.grads(), set.size(), lr, cset.grad_live_ranges());
        else
            self().step(values, cset.grads(), set.size(), lr);
    }
    template <lr_schedule S>
    void step(parameter_set<T>& set, const S& schedule) {
        step(set, static_cast<double>(schedule.lr(self().step_count())));
    }

private:
    Derived& self() { return static_cast<Derived&>(*this); }
};

}  // namespace detail::optim

/// The state of the Adam family: the step counter t and the two moment buffers m (exp_avg) and v
/// (exp_avg_sq), each in the parameters' layout. This is what a checkpoint saves and restores.
template <class T>
class adam_state {
public:
    static_assert(std::is_floating_point_v<T>, "mnemo: optimizers are defined for float and double");

    /// Number of steps taken (PyTorch's state['step']).
    std::int64_t step_count() const { return step_; }
    /// Number of elements the optimizer was built for.
    index_t size() const { return n_; }
    std::span<T> exp_avg() { return {m_.data(), m_.size()}; }
    std::span<const T> exp_avg() const { return {m_.data(), m_.size()}; }
    std::span<T> exp_avg_sq() { return {v_.data(), v_.size()}; }
    std::span<const T> exp_avg_sq() const { return {v_.data(), v_.size()}; }

    /// Restores a saved state (resume): the next step is step + 1 and continues bit for bit.
    void set_state(std::int64_t step, std::span<const T> exp_avg, std::span<const T> exp_avg_sq) {
        MNEMO_CHECK(step >= 0, who_, ": set_state: step must be >= 0, got ", step);
        detail::optim::check_state_span(exp_avg, n_, who_, "exp_avg");
        detail::optim::check_state_span(exp_avg_sq, n_, who_, "exp_avg_sq");
        detail::optim::copy_state(exp_avg, m_.data());
        detail::optim::copy_state(exp_avg_sq, v_.data());
        step_ = step;
        for (index_t b = 0; b < index_t(cold_.size()); ++b) {
            const index_t i0 = b * cold_block, i1 = std::min(n_, i0 + cold_block);
            bool zero = true;
            for (index_t i = i0; i < i1 && zero; ++i) zero = m_[std::size_t(i)] == T(0) && v_[std::size_t(i)] == T(0);
            cold_[std::size_t(b)] = zero;
        }
    }

protected:
    adam_state(index_t n, const char* who)
        : n_((detail::optim::check_size(n, who), n)),
          m_(static_cast<std::size_t>(n), T(0)),
          v_(static_cast<std::size_t>(n), T(0)),
          cold_(static_cast<std::size_t>((n + cold_block - 1) / cold_block), 1),
          who_(who) {}

    /// The update loop of the decoupled-decay Adam variants, by blocks of cold_block elements. A block
    /// whose moments are still exactly zero ("cold": it has never had a non-zero gradient) and whose
    /// gradient is all zero gets only decay(i0, i1): for such an element Adam's update is exactly
    /// p·(1 − lr·wd), since m and v stay 0 and the step term is ±0 / ε. Every other block gets
    /// update(i0, i1) and is warm from then on. Results are bitwise those of the plain loop; the
    /// saving is the traffic over parameters that never receive gradient, such as the rows of the
    /// relative-position tables (P = 4096) outside the window a model's lengths ever reach.
    /// The gradient is +0 outside the sorted, disjoint runs `live` (a parameter_set's
    /// grad_live_ranges(), or all of [0, n)): a cold block that no run meets is known zero without
    /// reading its gradient, and one that runs meet is checked over those runs only.
    /// With `deferral` (a parameter_set in a step begun with begin_deferred_decay), a cold block with
    /// zero gradient is left alone instead (it owes the step's decay, see parameters.hpp), and every
    /// other block is settled before its update.
    template <class Update, class Decay>
    void sweep(const T* grads, std::span<const flat_range> live, Update&& update, Decay&& decay,
               parameter_set<T>* deferral = nullptr) {
        static_assert(cold_block == parameter_set<T>::deferred_block);
        const index_t blocks = index_t(cold_.size());
        const flat_range* live_end = live.data() + live.size();
        parallel_range(blocks, n_ >= detail::optim::elementwise_parallel_threshold, [&](index_t b0, index_t b1) {
            const flat_range* r = detail::optim::first_live_after(live, b0 * cold_block);
            for (index_t b = b0; b < b1; ++b) {
                const index_t i0 = b * cold_block, i1 = std::min(n_, i0 + cold_block);
                while (r != live_end && r->end <= i0) ++r;  // r: the first run that ends after i0
                if (cold_[std::size_t(b)]) {
                    bool zero = true;
                    for (const flat_range* q = r; q != live_end && q->begin < i1 && zero; ++q) {
                        const index_t a = std::max(i0, q->begin), e = std::min(i1, q->end);
                        zero = detail::optim::all_zero(grads + a, e - a);
                    }
                    if (zero) {
                        if (!deferral) decay(i0, i1);
                        continue;
                    }
                    cold_[std::size_t(b)] = 0;
                }
                if (deferral) deferral->settle_block(b);
                update(i0, i1);
            }
        });
    }

    // The checks on the runs a step is given: sorted, disjoint, inside [0, n).
    void check_live(std::span<const flat_range> live) const {
        index_t at = 0;
        for (const flat_range& r : live) {
            MNEMO_CHECK(r.begin >= at && r.end >= r.begin && r.end <= n_, who_, ": the live ranges of the gradient must be "
                        "sorted, disjoint and inside [0, ", n_, "); got [", r.begin, ", ", r.end, ") after ", at);
            at = r.end;
        }
    }

    /// The whole update of a cold block with zero gradient: p ← p·(1 − lr·wd), as the full loop computes it.
    static void decay_only(T* params, index_t i_begin, index_t i_end, T decay) {
        if (decay != T(1))
            for (index_t i = i_begin; i < i_end; ++i) params[i] = detail::optim::product(params[i], decay);
    }

    static constexpr index_t cold_block = 1024;
    index_t n_;
    std::int64_t step_ = 0;
    aligned_vector<T> m_;  // (n) first moment
    aligned_vector<T> v_;  // (n) second moment
    std::vector<std::uint8_t> cold_;  // per block of cold_block: moments known to be exactly zero
    const char* who_;
};

/// Options of torch.optim.AdamW; the defaults are PyTorch's (weight_decay 1e-2).
struct adamw_options {
    double lr = 1e-3;
    double beta1 = 0.9;
    double beta2 = 0.999;
    double eps = 1e-8;
    double weight_decay = 1e-2;
};

/// torch.optim.AdamW (decoupled weight decay).
template <class T>
class adamw : public adam_state<T>, public detail::optim::step_overloads<adamw<T>, T> {
public:
    using detail::optim::step_overloads<adamw<T>, T>::step;

    explicit adamw(index_t n, adamw_options options = {}) : adam_state<T>(n, "adamw"), o_(options) {
        detail::optim::check_adam_options(o_, "adamw");
    }

    const adamw_options& options() const { return o_; }

    /// One step at rate lr (PyTorch's group['lr'], e.g. as set by a scheduler; the decay uses it too).
    void step(T* params, const T* grads, index_t n, double lr) {
        const flat_range all{0, n};
        step(params, grads, n, lr, std::span<const flat_range>(&all, 1));
    }
    /// The same step for a gradient known to be +0 outside the sorted, disjoint runs `live` (what
    /// parameter_set::grad_live_ranges() reports; step(set) passes it): bitwise the same result,
    /// without reading the gradient of blocks that never had any.
    void step(T* params, const T* grads, index_t n, double lr, std::span<const flat_range> live) {
        run(params, grads, n, lr, live, nullptr);
    }

private:
    friend class detail::optim::step_overloads<adamw<T>, T>;
    // step(set) defers the decay of the blocks that get no gradient (parameters.hpp).
    static constexpr bool defers_decay = true;

    // With `deferral`, params is null and comes from deferral->begin_deferred_decay(), after the checks
    // (a rejected step must not log a factor).
    void run(T* params, const T* grads, index_t n, double lr, std::span<const flat_range> live,
             parameter_set<T>* deferral) {
        detail::optim::check_step(deferral ? grads : params, grads, n, this->n_, lr, "adamw");
        this->check_live(live);
        const std::int64_t t = ++this->step_;
        const double bias_correction1 = 1.0 - std::pow(o_.beta1, static_cast<double>(t));
        const double bias_correction2 = 1.0 - std::pow(o_.beta2, static_cast<double>(t));
        const T decay = static_cast<T>(1.0 - detail::optim::product(lr, o_.weight_decay));
        const T beta1 = static_cast<T>(o_.beta1), one_minus_beta1 = static_cast<T>(1.0 - o_.beta1);
        const T beta2 = static_cast<T>(o_.beta2), one_minus_beta2 = static_cast<T>(1.0 - o_.beta2);
        const T bias_correction2_sqrt = static_cast<T>(std::sqrt(bias_correction2));
        const T eps = static_cast<T>(o_.eps);
        const T neg_step_size = static_cast<T>(-(lr / bias_correction1));
        const coefficients c{decay, beta1, one_minus_beta1, beta2, one_minus_beta2, bias_correction2_sqrt, eps, neg_step_size};
        T* m = this->m_.data();
        T* v = this->v_.data();
        if (deferral) params = deferral->begin_deferred_decay(decay);
        this->sweep(grads, live, [&](index_t i_begin, index_t i_end) { update(params, grads, m, v, i_begin, i_end, c); },
                    [&](index_t i_begin, index_t i_end) { this->decay_only(params, i_begin, i_end, decay); }, deferral);
    }

    struct coefficients {
        T decay, beta1, one_minus_beta1, beta2, one_minus_beta2, bias_correction2_sqrt, eps, neg_step_size;
    };
    // The update of [i_begin, i_end). Buffers and coefficients come in as arguments, not as a lambda's
    // captures, for the vectoriser (see Speed in the header comment).
    static void update(T* params, const T* grads, T* m, T* v, index_t i_begin, index_t i_end, const coefficients c) {
        for (index_t i = i_begin; i < i_end; ++i) {
            const T g = grads[i];
            const T p = detail::optim::product(params[i], c.decay);                       // param.mul_(1 - lr*wd)
            const T mi = detail::optim::fmadd(c.one_minus_beta1, g, m[i] * c.beta1);      // m.mul_(b1).add_(g, 1-b1)
            const T vi = detail::optim::fmadd(c.one_minus_beta2 * g, g, v[i] * c.beta2);  // v.mul_(b2).addcmul_(g, g, 1-b2)
            m[i] = mi;
            v[i] = vi;
            const T denom = std::sqrt(vi) / c.bias_correction2_sqrt + c.eps;
            params[i] = p + (c.neg_step_size * mi) / denom;  // param.addcdiv_(m, denom, -step_size)
        }
    }

    adamw_options o_;
};

/// Options of torch.optim.Adam; weight_decay is L2 (added to the gradient), default 0 as in PyTorch.
struct adam_options {
    double lr = 1e-3;
    double beta1 = 0.9;
    double beta2 = 0.999;
    double eps = 1e-8;
    double weight_decay = 0.0;
};

/// torch.optim.Adam (weight decay as L2 regularisation: g ← g + wd·p).
template <class T>
class adam : public adam_state<T>, public detail::optim::step_overloads<adam<T>, T> {
public:
    using detail::optim::step_overloads<adam<T>, T>::step;

    explicit adam(index_t n, adam_options options = {}) : adam_state<T>(n, "adam"), o_(options) {
        detail::optim::check_adam_options(o_, "adam");
    }

    const adam_options& options() const { return o_; }

    void step(T* params, const T* grads, index_t n, double lr) {
        detail::optim::check_step(params, grads, n, this->n_, lr, "adam");
        const std::int64_t t = ++this->step_;
        const double bias_correction1 = 1.0 - std::pow(o_.beta1, static_cast<double>(t));
        const double bias_correction2 = 1.0 - std::pow(o_.beta2, static_cast<double>(t));
        const bool l2 = o_.weight_decay != 0.0;  // PyTorch skips the add when wd == 0
        const T wd = static_cast<T>(o_.weight_decay);
        const T beta1 = static_cast<T>(o_.beta1), one_minus_beta1 = static_cast<T>(1.0 - o_.beta1);
        const T beta2 = static_cast<T>(o_.beta2), one_minus_beta2 = static_cast<T>(1.0 - o_.beta2);
        const T bias_correction2_sqrt = static_cast<T>(std::sqrt(bias_correction2));
        const T eps = static_cast<T>(o_.eps);
        const T neg_step_size = static_cast<T>(-(lr / bias_correction1));
        const coefficients c{l2, wd, beta1, one_minus_beta1, beta2, one_minus_beta2, bias_correction2_sqrt, eps, neg_step_size};
        T* m = this->m_.data();
        T* v = this->v_.data();
        parallel_range(n, n >= detail::optim::elementwise_parallel_threshold,
                       [&](index_t i_begin, index_t i_end) { update(params, grads, m, v, i_begin, i_end, c); });
    }

private:
    struct coefficients {
        bool l2;
        T wd, beta1, one_minus_beta1, beta2, one_minus_beta2, bias_correction2_sqrt, eps, neg_step_size;
    };
    // The update of [i_begin, i_end), with its buffers and coefficients as arguments (see Speed in
    // the header comment).
    static void update(T* params, const T* grads, T* m, T* v, index_t i_begin, index_t i_end, const coefficients c) {
        for (index_t i = i_begin; i < i_end; ++i) {
            const T p = params[i];
            const T g = c.l2 ? detail::optim::fmadd(c.wd, p, grads[i]) : grads[i];  // grad.add(param, alpha=wd)
            const T mi = detail::optim::fmadd(c.one_minus_beta1, g, m[i] * c.beta1);
            const T vi = detail::optim::fmadd(c.one_minus_beta2 * g, g, v[i] * c.beta2);
            m[i] = mi;
            v[i] = vi;
            const T denom = std::sqrt(vi) / c.bias_correction2_sqrt + c.eps;
            params[i] = p + (c.neg_step_size * mi) / denom;
        }
    }

    adam_options o_;
};

/// Options of torch.optim.SGD. PyTorch makes lr a required argument; here it defaults to 1e-3 like the
/// other optimizers, so set it. nesterov needs momentum > 0 and dampening == 0 (PyTorch's rule).
struct sgd_options {
    double lr = 1e-3;
    double momentum = 0.0;
    double dampening = 0.0;
    double weight_decay = 0.0;
    bool nesterov = false;
};

/// torch.optim.SGD with momentum, dampening, Nesterov momentum and L2 weight decay.
/// State: the step counter and, when momentum != 0, the momentum buffer (PyTorch's momentum_buffer),
/// which the first step sets to the gradient itself (no dampening), as PyTorch does.
template <class T>
class sgd : public detail::optim::step_overloads<sgd<T>, T> {
public:
    static_assert(std::is_floating_point_v<T>, "mnemo: optimizers are defined for float and double");
    using detail::optim::step_overloads<sgd<T>, T>::step;

    explicit sgd(index_t n, sgd_options options = {}) : n_((detail::optim::check_size(n, "sgd"), n)), o_(options) {
        detail::optim::check_lr(o_.lr, "sgd");
        MNEMO_CHECK(std::isfinite(o_.momentum) && o_.momentum >= 0.0,
                    "sgd: momentum must be finite and >= 0, got ", o_.momentum);
        MNEMO_CHECK(std::isfinite(o_.dampening) && o_.dampening >= 0.0 && o_.dampening <= 1.0,
                    "sgd: dampening must be in [0, 1], got ", o_.dampening);
        detail::optim::check_weight_decay(o_.weight_decay, "sgd");
        MNEMO_CHECK(!o_.nesterov || (o_.momentum > 0.0 && o_.dampening == 0.0),
                    "sgd: nesterov requires momentum > 0 and dampening == 0 (got momentum ", o_.momentum,
                    ", dampening ", o_.dampening, ")");
        if (o_.momentum != 0.0) buf_.assign(static_cast<std::size_t>(n), T(0));
    }

    const sgd_options& options() const { return o_; }
    std::int64_t step_count() const { return step_; }
    index_t size() const { return n_; }
    /// The momentum buffer (n elements; empty when momentum == 0). Meaningful once step_count() > 0.
    std::span<T> momentum_buffer() { return {buf_.data(), buf_.size()}; }
    std::span<const T> momentum_buffer() const { return {buf_.data(), buf_.size()}; }

    /// Restores a saved state. momentum_buffer must have size() elements, or none when momentum == 0.
    void set_state(std::int64_t step, std::span<const T> momentum_buffer) {
        MNEMO_CHECK(step >= 0, "sgd: set_state: step must be >= 0, got ", step);
        detail::optim::check_state_span(momentum_buffer, static_cast<index_t>(buf_.size()), "sgd", "momentum_buffer");
        detail::optim::copy_state(momentum_buffer, buf_.data());
        step_ = step;
    }

    void step(T* params, const T* grads, index_t n, double lr) {
        detail::optim::check_step(params, grads, n, n_, lr, "sgd");
        const bool first = step_ == 0;  // PyTorch: momentum_buffer is None
        ++step_;
        const bool l2 = o_.weight_decay != 0.0;
        const T wd = static_cast<T>(o_.weight_decay);
        const T neg_lr = static_cast<T>(-lr);
        if (o_.momentum == 0.0) {
            parallel_range(n, n >= detail::optim::elementwise_parallel_threshold, [&](index_t i_begin, index_t i_end) {
            #pragma omp simd
            for (index_t i = i_begin; i < i_end; ++i) {
                const T p = params[i];
                const T g = l2 ? detail::optim::fmadd(wd, p, grads[i]) : grads[i];  // d_p.add(param, alpha=wd)
                params[i] = detail::optim::fmadd(neg_lr, g, p);                      // param.add_(d_p, alpha=-lr)
            }
            });
            return;
        }
        const T momentum = static_cast<T>(o_.momentum);
        const T one_minus_dampening = static_cast<T>(1.0 - o_.dampening);
        const bool nesterov = o_.nesterov;
        T* b = buf_.data();
        parallel_range(n, n >= detail::optim::elementwise_parallel_threshold, [&](index_t i_begin, index_t i_end) {
        #pragma omp simd
        for (index_t i = i_begin; i < i_end; ++i) {
            const T p = params[i];
            const T g = l2 ? detail::optim::fmadd(wd, p, grads[i]) : grads[i];
            // First step: buf = clone(d_p). Later: buf.mul_(momentum).add_(d_p, alpha=1-dampening).
            const T bi = first ? g : detail::optim::fmadd(one_minus_dampening, g, b[i] * momentum);
            b[i] = bi;
            const T d = nesterov ? detail::optim::fmadd(momentum, bi, g) : bi;  // d_p.add(buf, alpha=momentum)
            params[i] = detail::optim::fmadd(neg_lr, d, p);
        }
        });
    }

private:
    index_t n_;
    sgd_options o_;
    std::int64_t step_ = 0;
    aligned_vector<T> buf_;  // (n) or empty
};

/// Options of labml_nn's Adam family. eps = 1e-8 is the Compressive Transformer experiment's value
/// (docs/reference.md §11); labml's own default is 1e-16. weight_decay is decoupled, default 0.
struct labml_adam_options {
    double lr = 1e-3;
    double beta1 = 0.9;
    double beta2 = 0.999;
    double eps = 1e-8;
    double weight_decay = 0.0;
};

/// labml_nn's Adam update (optimized_update = True) at an explicit rate lr_t: with adam_warmup_schedule
/// it is labml's AdamWarmup, with noam_schedule its Noam optimizer:
///     opt.step(params, grads, n, adam_warmup_schedule(lr, 2000));
/// Weight decay is decoupled and scaled by options().lr (labml's group['lr']), not by lr_t.
template <class T>
class labml_adam : public adam_state<T>, public detail::optim::step_overloads<labml_adam<T>, T> {
public:
    using detail::optim::step_overloads<labml_adam<T>, T>::step;

    explicit labml_adam(index_t n, labml_adam_options options = {})
        : adam_state<T>(n, "labml_adam"), o_(options) {
        detail::optim::check_adam_options(o_, "labml_adam");
    }

    const labml_adam_options& options() const { return o_; }

    /// One step at rate lr_t (labml's get_lr(state, group) for t = step_count() + 1).
    void step(T* params, const T* grads, index_t n, double lr_t) {
        const flat_range all{0, n};
        step(params, grads, n, lr_t, std::span<const flat_range>(&all, 1));
    }
    /// The same step for a gradient known to be +0 outside the sorted, disjoint runs `live` (what
    /// parameter_set::grad_live_ranges() reports; step(set) passes it): bitwise the same result,
    /// without reading the gradient of blocks that never had any.
    void step(T* params, const T* grads, index_t n, double lr_t, std::span<const flat_range> live) {
        run(params, grads, n, lr_t, live, nullptr);
    }

private:
    friend class detail::optim::step_overloads<labml_adam<T>, T>;
    // step(set) defers the decay of the blocks that get no gradient (parameters.hpp).
    static constexpr bool defers_decay = true;

    // With `deferral`, params is null and comes from deferral->begin_deferred_decay(), after the checks
    // (a rejected step must not log a factor).
    void run(T* params, const T* grads, index_t n, double lr_t, std::span<const flat_range> live,
             parameter_set<T>* deferral) {
        detail::optim::check_step(deferral ? grads : params, grads, n, this->n_, lr_t, "labml_adam");
        this->check_live(live);
        const std::int64_t t = ++this->step_;
        const double bias_correction1 = 1.0 - std::pow(o_.beta1, static_cast<double>(t));
        const double bias_correction2 = 1.0 - std::pow(o_.beta2, static_cast<double>(t));
        const T decay = static_cast<T>(1.0 - detail::optim::product(o_.lr, o_.weight_decay));
        const T beta1 = static_cast<T>(o_.beta1), one_minus_beta1 = static_cast<T>(1.0 - o_.beta1);
        const T beta2 = static_cast<T>(o_.beta2), one_minus_beta2 = static_cast<T>(1.0 - o_.beta2);
        const T eps = static_cast<T>(o_.eps);
        // step_size = lr * math.sqrt(bias_correction2) / bias_correction1, in that order.
        const T neg_step_size = static_cast<T>(-(lr_t * std::sqrt(bias_correction2) / bias_correction1));
        const coefficients c{decay, beta1, one_minus_beta1, beta2, one_minus_beta2, eps, neg_step_size};
        T* m = this->m_.data();
        T* v = this->v_.data();
        if (deferral) params = deferral->begin_deferred_decay(decay);
        this->sweep(grads, live, [&](index_t i_begin, index_t i_end) { update(params, grads, m, v, i_begin, i_end, c); },
                    [&](index_t i_begin, index_t i_end) { this->decay_only(params, i_begin, i_end, decay); }, deferral);
    }

    struct coefficients {
        T decay, beta1, one_minus_beta1, beta2, one_minus_beta2, eps, neg_step_size;
    };
    // The update of [i_begin, i_end), with its buffers and coefficients as arguments (see Speed in
    // the header comment).
    static void update(T* params, const T* grads, T* m, T* v, index_t i_begin, index_t i_end, const coefficients c) {
        for (index_t i = i_begin; i < i_end; ++i) {
            const T g = grads[i];
            const T p = detail::optim::product(params[i], c.decay);  // WeightDecay: param.mul_(1 - lr*wd), first
            const T mi = detail::optim::fmadd(c.one_minus_beta1, g, m[i] * c.beta1);
            const T vi = detail::optim::fmadd(c.one_minus_beta2 * g, g, v[i] * c.beta2);
            m[i] = mi;
            v[i] = vi;
            const T denom = std::sqrt(vi) + c.eps;  // v.sqrt().add_(eps)
            params[i] = p + (c.neg_step_size * mi) / denom;
        }
    }

    labml_adam_options o_;
};

}  // namespace mnemo
