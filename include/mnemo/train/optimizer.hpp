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
// Backends. Each optimizer takes the backend of its parameters (adamw<T, Backend>, default cpu): its
// moment buffers live in that backend's memory, a step forms its coefficients on the host and hands
// the element-wise update to the backend's kernel (ops<Backend>::adam_step, sgd_step;
// kernels/cpu/optimizer.hpp keeps the order of operations above, and says how the CPU loops
// vectorise). The state's host path is set_state (upload) and download_state. Results do not depend
// on the OpenMP thread count.
//
// Sparse gradients: adamw and labml_adam skip the gradient reads of blocks that never had gradient
// (cold blocks: kernels/optimizer_state.hpp); over a parameter_set, step(set) also passes the runs
// where the gradient may be non-zero (parameter_set::grad_live_ranges()), so the blocks of rows no step
// touched (the positional tables' rows outside the window) are not read at all: they only decay.
// Bitwise the dense result.
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <span>
#include <type_traits>
#include <vector>

#include "../core/buffer.hpp"
#include "../core/error.hpp"
#include "../core/parameters.hpp"
#include "../core/shape.hpp"
#include "../kernels/cpu/ops.hpp"  // the CPU kernels; other backends add their ops<> specialisation
#include "../kernels/kernel_table.hpp"
#include "../kernels/optimizer_state.hpp"
#include "clip.hpp"
#include "schedule.hpp"

namespace mnemo {

namespace detail::optim {

// fmadd (a·b + c with PyTorch's rounding) and product (a·b rounded once, never fused into a later
// addition) are defined with the kernels (kernels/cpu/optimizer.hpp); the coefficients below use
// product() on the host too, so that 1 − lr·wd rounds as PyTorch rounds it.

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
void check_state_span(std::span<const T> s, index_t expected, const char* who, const char* what, const char* name) {
    MNEMO_CHECK(static_cast<index_t>(s.size()) == expected, who, ": ", what, ": ", name, " has ", s.size(),
                " elements, the optimizer holds ", expected);
}

// Host path of optimizer state: saved state into an optimizer's buffer of the same size (Backend
// memory). Passing a CPU optimizer's own buffer back (set_state(opt.step_count(), opt.exp_avg(), ...))
// is a no-op rather than an overlapping copy.
template <class Backend, class T>
void upload_state(std::span<const T> from, T* to) {
    if (from.data() != to && !from.empty()) device_memory<Backend>::upload(to, from.data(), from.size_bytes());
}
template <class Backend, class T>
void download_state(const T* from, std::span<T> to) {
    if (from != to.data() && !to.empty()) device_memory<Backend>::download(to.data(), from, to.size_bytes());
}

// A zeroed buffer of n elements in Backend's memory.
template <class Backend, class T>
void zeroed(buffer<T, Backend>& b, index_t n) {
    if (n > 0) device_memory<Backend>::fill_zero(b.ensure(n), sizeof(T) * static_cast<std::size_t>(n));
}

// step() overloads shared by every optimizer: the rate from the options, an explicit rate, a schedule
// (asked for the rate of the next step, schedule.lr(step_count())), and the same over a parameter_set.
// Derived provides step(T* params, const T* grads, index_t n, double lr), options().lr and step_count();
// where it also provides step(params, grads, n, lr, live) (the gradient is +0 outside the runs `live`),
// the parameter_set overloads pass it the set's grad_live_ranges(). They read the gradients through the
// const grads(), which leaves the set's record of touched rows as it is.
template <class Derived, class T, class Backend>
class step_overloads {
public:
    void step(T* params, const T* grads, index_t n) { self().step(params, grads, n, self().options().lr); }
    template <lr_schedule S>
    void step(T* params, const T* grads, index_t n, const S& schedule) {
        self().step(params, grads, n, static_cast<double>(schedule.lr(self().step_count())));
    }
    void step(parameter_set<T, Backend>& set) { step(set, self().options().lr); }
    void step(parameter_set<T, Backend>& set, double lr) {
        const parameter_set<T, Backend>& cset = set;
        if constexpr (requires { Derived::defers_decay; }) {  // adamw, labml_adam: see parameters.hpp
            self().take(nullptr, cset.grads(), set.size(), lr, cset.grad_live_ranges(), &set);
            return;
        }
        T* values = set.values();
        if constexpr (requires(Derived& d, T* p, const T* g, std::span<const flat_range> live) { d.step(p, g, index_t(0), 0.0, live); })
            self().step(values, cset.grads(), set.size(), lr, cset.grad_live_ranges());
        else
            self().step(values, cset.grads(), set.size(), lr);
    }
    template <lr_schedule S>
    void step(parameter_set<T, Backend>& set, const S& schedule) {
        step(set, static_cast<double>(schedule.lr(self().step_count())));
    }

private:
    Derived& self() { return static_cast<Derived&>(*this); }
};

}  // namespace detail::optim

/// The state of the Adam family: the step counter t and the two moment buffers m (exp_avg) and v
/// (exp_avg_sq), each in the parameters' layout and in Backend's memory. This is what a checkpoint
/// saves (download_state) and restores (set_state).
template <class T, class Backend = cpu>
class adam_state {
public:
    static_assert(std::is_floating_point_v<T>, "mnemo: optimizers are defined for float and double");

    /// Number of steps taken (PyTorch's state['step']).
    std::int64_t step_count() const { return step_; }
    /// Number of elements the optimizer was built for.
    index_t size() const { return n_; }
    /// The moment buffers, in Backend's memory (host memory on the CPU).
    std::span<T> exp_avg() { return {m_.data(), std::size_t(n_)}; }
    std::span<const T> exp_avg() const { return {m_.data(), std::size_t(n_)}; }
    std::span<T> exp_avg_sq() { return {v_.data(), std::size_t(n_)}; }
    std::span<const T> exp_avg_sq() const { return {v_.data(), std::size_t(n_)}; }

    /// Restores a saved state (resume) from host memory: the next step is step + 1 and continues bit
    /// for bit.
    void set_state(std::int64_t step, std::span<const T> exp_avg, std::span<const T> exp_avg_sq) {
        MNEMO_CHECK(step >= 0, who_, ": set_state: step must be >= 0, got ", step);
        detail::optim::check_state_span(exp_avg, n_, who_, "set_state", "exp_avg");
        detail::optim::check_state_span(exp_avg_sq, n_, who_, "set_state", "exp_avg_sq");
        detail::optim::upload_state<Backend>(exp_avg, m_.data());
        detail::optim::upload_state<Backend>(exp_avg_sq, v_.data());
        step_ = step;
        if (n_ > 0) kernels::adam_cold_blocks(m_.data(), v_.data(), n_, cold_.data());
    }
    /// The moments into host memory (size() elements each), for a checkpoint.
    void download_state(std::span<T> exp_avg, std::span<T> exp_avg_sq) const {
        detail::optim::check_state_span(std::span<const T>(exp_avg), n_, who_, "download_state", "exp_avg");
        detail::optim::check_state_span(std::span<const T>(exp_avg_sq), n_, who_, "download_state", "exp_avg_sq");
        detail::optim::download_state<Backend>(m_.data(), exp_avg);
        detail::optim::download_state<Backend>(v_.data(), exp_avg_sq);
    }

protected:
    using kernels = checked_ops<Backend>;

    adam_state(index_t n, const char* who) : n_((detail::optim::check_size(n, who), n)), who_(who) {
        detail::optim::zeroed(m_, n);
        detail::optim::zeroed(v_, n);
        const index_t blocks = (n + adam_cold_block - 1) / adam_cold_block;
        if (blocks > 0) cold_.ensure(blocks);
        if (n > 0) kernels::adam_cold_blocks(m_.data(), v_.data(), n_, cold_.data());  // all cold
    }

    // One step of rule R at the coefficients c (t is already counted). The decoupled rules skip cold
    // blocks (kernels/optimizer_state.hpp); adam's L2 term reads every parameter, so it has none.
    template <adam_rule R>
    void run(T* params, const T* grads, std::span<const flat_range> live, const adam_coefficients<T>& c,
             parameter_set<T, Backend>* deferring = nullptr) {
        adam_step_args<T> a;
        deferred_decay<T> d;
        if (deferring && !kernels::defers_weight_decay) {  // the backend decays every element now
            params = deferring->values();  // a change: version() moves on, as log_decay() does
            deferring = nullptr;
        }
        if (deferring) {  // after the checks: a rejected step logs no factor
            d = deferring->log_decay(c.decay);
            params = d.values;
            a.deferral = &d;
        }
        a.params = params;
        a.grads = grads;
        a.m = m_.data();
        a.v = v_.data();
        a.n = n_;
        a.cold = R == adam_rule::adam ? nullptr : cold_.data();
        a.live = live;
        a.c = c;
        if (n_ > 0) kernels::template adam_step<R>(a);
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

    // The coefficients every rule shares, formed from the options in double and rounded to T once.
    template <class Options>
    static adam_coefficients<T> moments(const Options& o) {
        adam_coefficients<T> c;
        c.beta1 = static_cast<T>(o.beta1);
        c.one_minus_beta1 = static_cast<T>(1.0 - o.beta1);
        c.beta2 = static_cast<T>(o.beta2);
        c.one_minus_beta2 = static_cast<T>(1.0 - o.beta2);
        c.eps = static_cast<T>(o.eps);
        return c;
    }

    index_t n_;
    std::int64_t step_ = 0;
    buffer<T, Backend> m_;  // (n) first moment
    buffer<T, Backend> v_;  // (n) second moment
    buffer<std::uint8_t, Backend> cold_;  // per block of adam_cold_block: moments known to be exactly zero
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
template <class T, class Backend = cpu>
class adamw : public adam_state<T, Backend>, public detail::optim::step_overloads<adamw<T, Backend>, T, Backend> {
public:
    using detail::optim::step_overloads<adamw<T, Backend>, T, Backend>::step;

    explicit adamw(index_t n, adamw_options options = {}) : adam_state<T, Backend>(n, "adamw"), o_(options) {
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
        take(params, grads, n, lr, live, nullptr);
    }

private:
    friend class detail::optim::step_overloads<adamw<T, Backend>, T, Backend>;
    // step(set) defers the decay of the blocks that get no gradient (parameters.hpp).
    static constexpr bool defers_decay = true;

    // With `set`, params is null: the step runs over the set's values, deferring (see run()).
    void take(T* params, const T* grads, index_t n, double lr, std::span<const flat_range> live,
              parameter_set<T, Backend>* set) {
        detail::optim::check_step(set ? grads : params, grads, n, this->n_, lr, "adamw");
        this->check_live(live);
        const std::int64_t t = ++this->step_;
        const double bias_correction1 = 1.0 - std::pow(o_.beta1, static_cast<double>(t));
        const double bias_correction2 = 1.0 - std::pow(o_.beta2, static_cast<double>(t));
        adam_coefficients<T> c = this->moments(o_);
        c.decay = static_cast<T>(1.0 - detail::optim::product(lr, o_.weight_decay));
        c.bias_correction2_sqrt = static_cast<T>(std::sqrt(bias_correction2));
        c.neg_step_size = static_cast<T>(-(lr / bias_correction1));
        this->template run<adam_rule::adamw>(params, grads, live, c, set);
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
template <class T, class Backend = cpu>
class adam : public adam_state<T, Backend>, public detail::optim::step_overloads<adam<T, Backend>, T, Backend> {
public:
    using detail::optim::step_overloads<adam<T, Backend>, T, Backend>::step;

    explicit adam(index_t n, adam_options options = {}) : adam_state<T, Backend>(n, "adam"), o_(options) {
        detail::optim::check_adam_options(o_, "adam");
    }

    const adam_options& options() const { return o_; }

    void step(T* params, const T* grads, index_t n, double lr) {
        detail::optim::check_step(params, grads, n, this->n_, lr, "adam");
        const std::int64_t t = ++this->step_;
        const double bias_correction1 = 1.0 - std::pow(o_.beta1, static_cast<double>(t));
        const double bias_correction2 = 1.0 - std::pow(o_.beta2, static_cast<double>(t));
        adam_coefficients<T> c = this->moments(o_);
        c.l2 = o_.weight_decay != 0.0;  // PyTorch skips the add when wd == 0
        c.wd = static_cast<T>(o_.weight_decay);
        c.bias_correction2_sqrt = static_cast<T>(std::sqrt(bias_correction2));
        c.neg_step_size = static_cast<T>(-(lr / bias_correction1));
        this->template run<adam_rule::adam>(params, grads, {}, c);
    }

private:
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
/// State: the step counter and, when momentum != 0, the momentum buffer (PyTorch's momentum_buffer, in
/// Backend's memory), which the first step sets to the gradient itself (no dampening), as PyTorch does.
template <class T, class Backend = cpu>
class sgd : public detail::optim::step_overloads<sgd<T, Backend>, T, Backend> {
public:
    static_assert(std::is_floating_point_v<T>, "mnemo: optimizers are defined for float and double");
    using detail::optim::step_overloads<sgd<T, Backend>, T, Backend>::step;

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
        if (o_.momentum != 0.0) {
            detail::optim::zeroed(buf_, n);
            buf_size_ = n;
        }
    }

    const sgd_options& options() const { return o_; }
    std::int64_t step_count() const { return step_; }
    index_t size() const { return n_; }
    /// The momentum buffer (n elements in Backend's memory; empty when momentum == 0). Meaningful once
    /// step_count() > 0.
    std::span<T> momentum_buffer() { return {buf_.data(), std::size_t(buf_size_)}; }
    std::span<const T> momentum_buffer() const { return {buf_.data(), std::size_t(buf_size_)}; }

    /// Restores a saved state from host memory. momentum_buffer must have size() elements, or none when
    /// momentum == 0.
    void set_state(std::int64_t step, std::span<const T> momentum_buffer) {
        MNEMO_CHECK(step >= 0, "sgd: set_state: step must be >= 0, got ", step);
        detail::optim::check_state_span(momentum_buffer, buf_size_, "sgd", "set_state", "momentum_buffer");
        detail::optim::upload_state<Backend>(momentum_buffer, buf_.data());
        step_ = step;
    }
    /// The momentum buffer into host memory (size() elements, or none when momentum == 0).
    void download_state(std::span<T> momentum_buffer) const {
        detail::optim::check_state_span(std::span<const T>(momentum_buffer), buf_size_, "sgd", "download_state",
                                        "momentum_buffer");
        detail::optim::download_state<Backend>(buf_.data(), momentum_buffer);
    }

    void step(T* params, const T* grads, index_t n, double lr) {
        detail::optim::check_step(params, grads, n, n_, lr, "sgd");
        sgd_step_args<T> a;
        a.params = params;
        a.grads = grads;
        a.b = o_.momentum == 0.0 ? nullptr : buf_.data();
        a.n = n;
        a.first = step_ == 0;  // PyTorch: momentum_buffer is None
        a.l2 = o_.weight_decay != 0.0;
        a.nesterov = o_.nesterov;
        a.wd = static_cast<T>(o_.weight_decay);
        a.momentum = static_cast<T>(o_.momentum);
        a.one_minus_dampening = static_cast<T>(1.0 - o_.dampening);
        a.neg_lr = static_cast<T>(-lr);
        ++step_;
        if (n > 0) checked_ops<Backend>::sgd_step(a);
    }

private:
    index_t n_;
    sgd_options o_;
    std::int64_t step_ = 0;
    buffer<T, Backend> buf_;  // (n) or empty
    index_t buf_size_ = 0;
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
template <class T, class Backend = cpu>
class labml_adam : public adam_state<T, Backend>,
                   public detail::optim::step_overloads<labml_adam<T, Backend>, T, Backend> {
public:
    using detail::optim::step_overloads<labml_adam<T, Backend>, T, Backend>::step;

    explicit labml_adam(index_t n, labml_adam_options options = {})
        : adam_state<T, Backend>(n, "labml_adam"), o_(options) {
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
        take(params, grads, n, lr_t, live, nullptr);
    }

private:
    friend class detail::optim::step_overloads<labml_adam<T, Backend>, T, Backend>;
    // step(set) defers the decay of the blocks that get no gradient (parameters.hpp).
    static constexpr bool defers_decay = true;

    // With `set`, params is null: the step runs over the set's values, deferring (see run()).
    void take(T* params, const T* grads, index_t n, double lr_t, std::span<const flat_range> live,
              parameter_set<T, Backend>* set) {
        detail::optim::check_step(set ? grads : params, grads, n, this->n_, lr_t, "labml_adam");
        this->check_live(live);
        const std::int64_t t = ++this->step_;
        const double bias_correction1 = 1.0 - std::pow(o_.beta1, static_cast<double>(t));
        const double bias_correction2 = 1.0 - std::pow(o_.beta2, static_cast<double>(t));
        adam_coefficients<T> c = this->moments(o_);
        c.decay = static_cast<T>(1.0 - detail::optim::product(o_.lr, o_.weight_decay));
        // step_size = lr * math.sqrt(bias_correction2) / bias_correction1, in that order.
        c.neg_step_size = static_cast<T>(-(lr_t * std::sqrt(bias_correction2) / bias_correction1));
        this->template run<adam_rule::labml>(params, grads, live, c, set);
    }

    labml_adam_options o_;
};

}  // namespace mnemo
