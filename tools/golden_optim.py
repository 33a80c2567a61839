#!/usr/bin/env python3
"""Golden data for mnemo's optimizers, gradient clipping and learning-rate schedules.

Runs PyTorch 1.13 (Debian's python3-torch, CPU) and writes tests/golden/optim_golden.hpp, which
tests/test_optimizer.cpp compares against, so the tests need no Python:

    /usr/bin/python3 tools/golden_optim.py            # rewrites tests/golden/optim_golden.hpp

What it records, in float32 and float64 from the same float64 inputs (a float32 run starts from the
float64 values rounded to float32, which is what the C++ test does with static_cast<float>):
  * five steps of torch.optim.AdamW, AdamW under a LambdaLR warm-up, Adam with L2 weight decay, SGD with
    Nesterov momentum, SGD with momentum and dampening, and plain SGD (foreach=False, the single-tensor
    path), on three tensors of shapes (7,), (3, 5) and (2, 17): the parameters after every step and the
    optimizer state after the last;
  * labml_nn's Adam update (optimized_update) under its AdamWarmup and Noam rates, written out here from
    the formulas of docs/reference.md §11 and §17 (labml_nn is not a dependency);
  * torch.nn.utils.clip_grad_norm_ with max_norm below and above the gradient norm;
  * learning rates of LambdaLR (linear warm-up from 0 and from a start factor, warm-up + cosine),
    CosineAnnealingLR, and the noam and adam_warmup formulas, for steps 0, 1, 2, ...

Gradients include one tensor scaled by 1e-4 (so eps matters and the PyTorch and labml denominators
differ) and exact zeros.
"""
import math
import os
import sys

import torch

STEPS = 5
SHAPES = [(7,), (3, 5), (2, 17)]
SEED = 20240611

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, os.pardir, "tests", "golden", "optim_golden.hpp")


def make_inputs():
    g = torch.Generator().manual_seed(SEED)
    params = [torch.randn(s, generator=g, dtype=torch.float64) for s in SHAPES]
    grads = []
    for step in range(STEPS):
        gs = [torch.randn(s, generator=g, dtype=torch.float64) * (0.5 + step * 0.25) for s in SHAPES]
        gs[1] = gs[1] * 1e-4  # small gradients: sqrt(v) is comparable to eps
        gs[0][3] = 0.0        # a parameter whose gradient vanishes on every step
        if step == 2:
            gs[2][0, 5] = 0.0
        grads.append(gs)
    return params, grads


def flat(tensors):
    return torch.cat([t.detach().reshape(-1) for t in tensors]).tolist()


# ---- optimizers -----------------------------------------------------------------------------------------

def run_torch(make_opt, make_sched, params0, grads, dtype):
    ps = [torch.nn.Parameter(p.to(dtype).clone()) for p in params0]
    opt = make_opt(ps)
    sched = make_sched(opt) if make_sched else None
    history = []
    for step in range(STEPS):
        for p, g in zip(ps, grads[step]):
            p.grad = g.to(dtype).clone()
        opt.step()
        if sched:
            sched.step()
        history.append(flat(ps))
    return history, opt, ps


def adam_state(opt, ps):
    return [flat([opt.state[p]["exp_avg"] for p in ps]), flat([opt.state[p]["exp_avg_sq"] for p in ps])]


def sgd_state(opt, ps):
    bufs = [opt.state[p].get("momentum_buffer") for p in ps]
    if bufs[0] is None:
        return []
    return [flat(bufs)]


class LabmlAdam:
    """labml_nn's Adam step with optimized_update = True (docs/reference.md §11), rate from get_lr(t):
    WeightDecay (decoupled, scaled by the base lr), then t += 1, then m, v, then
    p -= lr_t * sqrt(1 - b2^t) / (1 - b1^t) * m / (sqrt(v) + eps)."""

    def __init__(self, params, lr, betas, eps, weight_decay, get_lr):
        self.params, self.lr, self.betas, self.eps, self.wd, self.get_lr = params, lr, betas, eps, weight_decay, get_lr
        self.state = {p: {"step": 0, "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}
                      for p in params}

    @torch.no_grad()
    def step(self):
        beta1, beta2 = self.betas
        for p in self.params:
            st = self.state[p]
            grad = p.grad
            p.mul_(1.0 - self.lr * self.wd)
            st["step"] += 1
            m, v = st["exp_avg"], st["exp_avg_sq"]
            m.mul_(beta1).add_(grad, alpha=1 - beta1)
            v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            bias_correction1 = 1 - beta1 ** st["step"]
            bias_correction2 = 1 - beta2 ** st["step"]
            lr_t = self.get_lr(st["step"])
            denominator = v.sqrt().add_(self.eps)
            step_size = lr_t * math.sqrt(bias_correction2) / bias_correction1
            p.addcdiv_(m, denominator, value=-step_size)


def adam_warmup_lr(lr, warmup):
    # labml_nn/optimizers/adam_warmup.py, t counted from 1
    return lambda t: 1e-8 + t * lr / warmup if warmup > t else lr


def noam_lr(lr, d_model, warmup):
    # labml_nn/optimizers/noam.py, t counted from 1
    return lambda t: lr * (d_model ** (-0.5) * min(t ** (-0.5), t * warmup ** (-1.5)))


def linear_warmup_lambda(warmup, start):
    return lambda s: start + (1.0 - start) * s / warmup if s < warmup else 1.0


def warmup_cosine_lambda(base, min_lr, warmup, total, start=0.0):
    def f(s):
        if s < warmup:
            return start + (1.0 - start) * s / warmup
        if s >= total:
            return min_lr / base
        progress = (s - warmup) / (total - warmup)
        return (min_lr + (base - min_lr) * (1.0 + math.cos(math.pi * progress)) / 2.0) / base
    return f


# Each case: name, hyper-parameters (emitted into the header), optimizer factory, schedule factory, state.
CASES = [
    ("adamw", dict(lr=0.01, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1),
     lambda h: (lambda ps: torch.optim.AdamW(ps, lr=h["lr"], betas=(h["beta1"], h["beta2"]), eps=h["eps"],
                                             weight_decay=h["weight_decay"], foreach=False)),
     None, "adam"),
    ("adamw_warmup", dict(lr=0.02, beta1=0.85, beta2=0.99, eps=1e-6, weight_decay=0.05, warmup=3,
                          start_factor=0.2),
     lambda h: (lambda ps: torch.optim.AdamW(ps, lr=h["lr"], betas=(h["beta1"], h["beta2"]), eps=h["eps"],
                                             weight_decay=h["weight_decay"], foreach=False)),
     lambda h: (lambda opt: torch.optim.lr_scheduler.LambdaLR(
         opt, linear_warmup_lambda(h["warmup"], h["start_factor"]))), "adam"),
    ("adam", dict(lr=0.01, beta1=0.8, beta2=0.99, eps=1e-6, weight_decay=0.05),
     lambda h: (lambda ps: torch.optim.Adam(ps, lr=h["lr"], betas=(h["beta1"], h["beta2"]), eps=h["eps"],
                                            weight_decay=h["weight_decay"], foreach=False)),
     None, "adam"),
    ("sgd_nesterov", dict(lr=0.1, momentum=0.9, dampening=0.0, weight_decay=1e-3, nesterov=True),
     lambda h: (lambda ps: torch.optim.SGD(ps, lr=h["lr"], momentum=h["momentum"], dampening=h["dampening"],
                                           weight_decay=h["weight_decay"], nesterov=h["nesterov"], foreach=False)),
     None, "sgd"),
    ("sgd_dampening", dict(lr=0.05, momentum=0.8, dampening=0.3, weight_decay=0.0, nesterov=False),
     lambda h: (lambda ps: torch.optim.SGD(ps, lr=h["lr"], momentum=h["momentum"], dampening=h["dampening"],
                                           weight_decay=h["weight_decay"], nesterov=h["nesterov"], foreach=False)),
     None, "sgd"),
    ("sgd_plain", dict(lr=0.1, momentum=0.0, dampening=0.0, weight_decay=0.01, nesterov=False),
     lambda h: (lambda ps: torch.optim.SGD(ps, lr=h["lr"], weight_decay=h["weight_decay"], foreach=False)),
     None, "sgd"),
    ("labml_adam_warmup", dict(lr=0.01, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.02, warmup=3),
     lambda h: (lambda ps: LabmlAdam(ps, h["lr"], (h["beta1"], h["beta2"]), h["eps"], h["weight_decay"],
                                     adam_warmup_lr(h["lr"], h["warmup"]))),
     None, "adam"),
    ("labml_noam", dict(lr=1.0, beta1=0.9, beta2=0.98, eps=1e-8, weight_decay=0.0, warmup=3, d_model=16),
     lambda h: (lambda ps: LabmlAdam(ps, h["lr"], (h["beta1"], h["beta2"]), h["eps"], h["weight_decay"],
                                     noam_lr(h["lr"], h["d_model"], h["warmup"]))),
     None, "adam"),
]


# ---- schedules --------------------------------------------------------------------------------------------

def scheduler_lrs(base, make_sched, count):
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=base)
    sched = make_sched(opt)
    lrs = []
    for _ in range(count):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()  # no gradients: a no-op that keeps the optimizer-before-scheduler order
        sched.step()
    return lrs


def schedules():
    out = []
    h = dict(lr=0.1, warmup=4, start_factor=0.0)
    out.append(("linear_warmup_zero", h, scheduler_lrs(h["lr"], lambda o: torch.optim.lr_scheduler.LambdaLR(
        o, linear_warmup_lambda(h["warmup"], h["start_factor"])), 10)))
    h2 = dict(lr=0.1, warmup=5, start_factor=0.25)
    out.append(("linear_warmup_start", h2, scheduler_lrs(h2["lr"], lambda o: torch.optim.lr_scheduler.LambdaLR(
        o, linear_warmup_lambda(h2["warmup"], h2["start_factor"])), 10)))
    h3 = dict(lr=0.1, total=8, min_lr=1e-3)
    out.append(("cosine_annealing", h3, scheduler_lrs(h3["lr"], lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(
        o, T_max=h3["total"], eta_min=h3["min_lr"]), h3["total"] + 1)))
    h4 = dict(lr=0.1, total=10, min_lr=0.01, warmup=3)
    out.append(("warmup_cosine", h4, scheduler_lrs(h4["lr"], lambda o: torch.optim.lr_scheduler.LambdaLR(
        o, warmup_cosine_lambda(h4["lr"], h4["min_lr"], h4["warmup"], h4["total"])), 13)))
    h5 = dict(lr=1.0, d_model=16, warmup=4)
    f = noam_lr(h5["lr"], h5["d_model"], h5["warmup"])
    out.append(("noam", h5, [f(s + 1) for s in range(10)]))
    h6 = dict(lr=0.01, warmup=4)
    f = adam_warmup_lr(h6["lr"], h6["warmup"])
    out.append(("adam_warmup", h6, [f(s + 1) for s in range(10)]))
    return out


# ---- clipping ---------------------------------------------------------------------------------------------

def clip_cases(grads0):
    norm64 = math.sqrt(sum(float((g * g).sum()) for g in grads0))
    out = []
    for name, max_norm in (("clip_below", round(0.5 * norm64, 3)), ("clip_above", round(2.0 * norm64, 3))):
        res = {}
        for tag, dtype in (("f32", torch.float32), ("f64", torch.float64)):
            ps = [torch.nn.Parameter(torch.zeros(g.shape, dtype=dtype)) for g in grads0]
            for p, g in zip(ps, grads0):
                p.grad = g.to(dtype).clone()
            total = torch.nn.utils.clip_grad_norm_(ps, max_norm)
            res[tag] = (float(total), flat([p.grad for p in ps]))
        out.append((name, max_norm, res))
    return out


# ---- writing ------------------------------------------------------------------------------------------------

def fmt(v, tag):
    # 9 significant digits round-trip a float, 17 a double; the exponent form always parses as floating.
    return ("%.8ef" % v) if tag == "f32" else ("%.16e" % v)


def array(name, values, tag, per_line=4):
    ctype = "float" if tag == "f32" else "double"
    lines = []
    for i in range(0, len(values), per_line):
        lines.append("    " + ", ".join(fmt(v, tag) for v in values[i:i + per_line]) + ",")
    return "inline constexpr %s %s[%d] = {\n%s\n};\n" % (ctype, name, len(values), "\n".join(lines))


def array2(name, rows, tag, per_line=4):
    ctype = "float" if tag == "f32" else "double"
    body = []
    for r in rows:
        lines = [", ".join(fmt(v, tag) for v in r[i:i + per_line]) for i in range(0, len(r), per_line)]
        body.append("  {\n    " + ",\n    ".join(lines) + ",\n  },")
    return "inline constexpr %s %s[%d][%d] = {\n%s\n};\n" % (ctype, name, len(rows), len(rows[0]), "\n".join(body))


def scalar(name, v):
    if isinstance(v, bool):
        return "inline constexpr bool %s = %s;\n" % (name, "true" if v else "false")
    if isinstance(v, int):
        return "inline constexpr std::int64_t %s = %d;\n" % (name, v)
    return "inline constexpr double %s = %s;\n" % (name, repr(float(v)))


def main():
    torch.set_num_threads(1)
    params, grads = make_inputs()
    n = sum(math.prod(s) for s in SHAPES)
    out = []
    w = out.append
    w("#pragma once\n")
    w("// Generated by tools/golden_optim.py with torch %s; do not edit by hand.\n" % torch.__version__)
    w("// Inputs in double; *_f32 arrays are PyTorch's float32 results from those inputs rounded to float,\n")
    w("// *_f64 its float64 results. Parameter buffers are the tensors (7), (3, 5), (2, 17) flattened and\n")
    w("// concatenated; params_*[k] holds them after step k + 1.\n")
    w("#include <cstdint>\n\nnamespace mnemo::golden::optim {\n\n")
    w("inline constexpr int steps = %d;\n" % STEPS)
    w("inline constexpr int n = %d;\n" % n)
    w("inline constexpr int tensor_sizes[%d] = {%s};\n\n" % (len(SHAPES), ", ".join(str(math.prod(s)) for s in SHAPES)))
    w(array("init_params", flat(params), "f64"))
    w(array2("grads", [flat(g) for g in grads], "f64"))
    w("\n")

    for name, hyper, make_opt, make_sched, kind in CASES:
        w("namespace %s {\n" % name)
        for k, v in hyper.items():
            w(scalar(k, v))
        for tag, dtype in (("f32", torch.float32), ("f64", torch.float64)):
            history, opt, ps = run_torch(make_opt(hyper), make_sched(hyper) if make_sched else None, params, grads,
                                         dtype)
            w(array2("params_" + tag, history, tag))
            state = adam_state(opt, ps) if kind == "adam" else sgd_state(opt, ps)
            for i, s in enumerate(state):
                w(array("state%d_%s" % (i, tag), s, tag))
        w("}  // namespace %s\n\n" % name)

    for name, max_norm, res in clip_cases(grads[0]):
        w("namespace %s {\n" % name)
        w(scalar("max_norm", max_norm))
        for tag in ("f32", "f64"):
            total, clipped = res[tag]
            w(scalar("total_norm_" + tag, total))
            w(array("grads_" + tag, clipped, tag))
        w("}  // namespace %s\n\n" % name)

    for name, hyper, lrs in schedules():
        w("namespace %s {\n" % name)
        for k, v in hyper.items():
            w(scalar(k, v))
        w(array("lrs", lrs, "f64"))
        w("}  // namespace %s\n\n" % name)

    w("}  // namespace mnemo::golden::optim\n")
    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    with open(OUT, "w") as f:
        f.write("".join(out))
    print("wrote", os.path.normpath(OUT), file=sys.stderr)


if __name__ == "__main__":
    main()
