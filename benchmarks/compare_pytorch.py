#!/usr/bin/env python3
"""Side by side: the PyTorch reference models and mnemo, timed on the same configurations in one run.

    cmake --build build --target bench_models bench_feedback
    /usr/bin/python3 benchmarks/compare_pytorch.py                 # full run (about 15-20 minutes on 2 idle cores)
    /usr/bin/python3 benchmarks/compare_pytorch.py --quick         # smoke run of the plumbing
    /usr/bin/python3 benchmarks/compare_pytorch.py --json out.json # also save the results

Prints a markdown table (row, PyTorch time, mnemo time, ratio PyTorch/mnemo) and the set-up: CPU,
cores, date, torch version, BLAS library, thread count.

PyTorch side: tools/reference/compressive.py and tools/reference/feedback.py in float32, on
`--threads` threads (default 2). Each row mirrors the mnemo benchmark it is compared with:

  Compressive Transformer, configurations A, B, C (benchmarks/bench_models.cpp):
    training step   memories full (steady state); forward with memory -> merge + compression (no
                    gradient, current weights) -> cross-entropy + attention-reconstruction loss ->
                    backward -> clip_grad_norm_(1.0) -> AdamW (torch.optim.AdamW, lr 2.5e-4, weight
                    decay 0.01, foreach=False, the update mnemo::adamw reproduces) -> next step.
                    Same tokens every step, as BM_train_X.                              ms/step
    forward         one segment without gradient, with full memory; no merge (BM_forward_X).   ms
    generation      batch 1, one token at a time, memory carried and merged (compressing every c
                    tokens), greedy next token (BM_generate_X). Timed in blocks of --gen-tokens
                    tokens so that compressing and non-compressing steps are both counted.  ms/token
                    The reference recomputes the memory's keys/values every token. When the mnemo
                    binary has BM_generate_recompute_X, BM_generate_X caches them, and there are two
                    rows: mnemo cached, and mnemo recomputing (like for like).
  Feedback Transformer, plain and shared-KV variants (benchmarks/bench_feedback.cpp, its "reference"
  configuration: d_model 512, 8 heads, d_ff 2048, 6 layers, seq 128, batch 64, vocab 65; --quick
  uses its "small" one):
    training step   forward over the whole sequence from an empty memory -> mean cross-entropy ->
                    backward through time -> AdamW (lr 1e-4, weight decay 0.01); no clipping, as
                    BM_train_step.                                                       ms/step
    forward         the whole sequence without gradient: every step's logits, no loss
                    (BM_forward: feedback_transformer::forward, which also keeps the activations
                    a backward would read).                                              ms
    generation      the batch advanced one token per step over seq_len steps from an empty memory,
                    logits at every step, averaged over the sequence (BM_generate).  ms/step of the batch

mnemo side: the Google Benchmark binaries (--mnemo-dir, default build/benchmarks) run with
--benchmark_format=json and OMP_NUM_THREADS=--threads, after the PyTorch measurements (never at the
same time). Times are Google Benchmark's real_time (bench_models) or the ms_per_step counter the
benchmark computes itself (bench_feedback: per training step, forward sequence or generation step), the median over --mnemo-repetitions repetitions.

Methodology (PyTorch): --warmup untimed iterations, then the median of --iterations timed ones.
A row whose iterations are slow gets fewer (at least 2) so that it stays within about --budget
seconds; the iteration count is in the --json output.

BLAS: torch's matrix products go to the system BLAS (Debian's torch is built with BLAS_INFO=generic,
i.e. libblas.so.3). When /usr/lib/x86_64-linux-gnu/openblas-openmp exists (Debian package
libopenblas0-openmp) this script re-executes itself with LD_LIBRARY_PATH pointing there before it
imports torch, so that torch gets OpenBLAS's OpenMP build whatever the system's BLAS alternative is,
and prints the BLAS library the process actually mapped.
"""
import argparse
import ctypes
import datetime
import gc
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
OPENBLAS_OPENMP_DIR = "/usr/lib/x86_64-linux-gnu/openblas-openmp"
REEXEC_MARK = "MNEMO_COMPARE_REEXEC"
ORIG_LD_PATH = "MNEMO_COMPARE_ORIG_LD_LIBRARY_PATH"

# ---------------------------------------------------------------------------------------------------
# Configurations (the same numbers as bench_models.cpp and bench_feedback.cpp)
# ---------------------------------------------------------------------------------------------------

COMPRESSIVE = {
    "A": dict(d_model=128, heads=4, d_ff=256, layers=6, seq=8, mem=8, c_mem=128, rate=2, batch=32, vocab=65),
    "B": dict(d_model=256, heads=8, d_ff=1024, layers=6, seq=128, mem=128, c_mem=128, rate=4, batch=8, vocab=65),
    "C": dict(d_model=512, heads=8, d_ff=2048, layers=6, seq=256, mem=256, c_mem=256, rate=4, batch=4, vocab=256),
}
COMPRESSIVE_LR = 2.5e-4  # bench_models.cpp: mnemo::adamw<float> {.lr = 2.5e-4}, other options default
FEEDBACK = {
    "reference": dict(d_model=512, heads=8, d_ff=2048, layers=6, seq=128, batch=64, vocab=65),
    "small": dict(d_model=128, heads=4, d_ff=512, layers=2, seq=32, batch=8, vocab=65),
}
FEEDBACK_LR = 1e-4  # bench_feedback.cpp: mnemo::adamw<float> {.lr = 1e-4}
ADAMW_WEIGHT_DECAY = 0.01  # mnemo::adamw_options' default, as torch.optim.AdamW's
N_POS = 4096  # both benches and both references


def parse_args(argv):
    p = argparse.ArgumentParser(description="Times the PyTorch reference and mnemo on the same configurations.",
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--quick", action="store_true",
                   help="smoke run: 1 warm-up, 2 iterations, 1 mnemo repetition, feedback 'small' configuration")
    p.add_argument("--iterations", type=int, default=None, help="timed PyTorch iterations per row (default 10; quick 2)")
    p.add_argument("--warmup", type=int, default=None, help="untimed PyTorch iterations per row (default 3; quick 1)")
    p.add_argument("--budget", type=float, default=None,
                   help="about this many seconds per PyTorch row at most: slow rows get fewer iterations "
                        "(default 60; quick 10)")
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads and OMP_NUM_THREADS (default 2)")
    p.add_argument("--configs", default="A,B,C", help="Compressive Transformer configurations (default A,B,C; '' for none)")
    p.add_argument("--feedback", choices=("reference", "small", "none"), default=None,
                   help="Feedback Transformer configuration of bench_feedback.cpp (default reference; quick small)")
    p.add_argument("--reproject-train", action="store_true",
                   help="also time the plain feedback training step with feedback.py's own forward, which "
                        "re-projects the whole memory with every layer's key/value at every step (at the "
                        "reference configuration: minutes per step and about 20 GiB for autograd; skipped when "
                        "the memory is not there)")
    p.add_argument("--no-reproject", action="store_true",
                   help="skip the plain feedback generation row that re-projects the memory as feedback.py does")
    p.add_argument("--gen-tokens", type=int, default=None,
                   help="tokens per timed generation block, a multiple of every compression rate (default 32; quick 8)")
    p.add_argument("--mnemo-dir", default=os.path.join(ROOT, "build", "benchmarks"),
                   help="directory of bench_models and bench_feedback (default build/benchmarks)")
    p.add_argument("--mnemo-repetitions", type=int, default=None,
                   help="--benchmark_repetitions for the mnemo binaries; the median is used (default 5; quick 1)")
    p.add_argument("--mnemo-min-time", type=float, default=None,
                   help="--benchmark_min_time (seconds) for the mnemo binaries (default: the library's)")
    p.add_argument("--skip-pytorch", action="store_true", help="mnemo only (PyTorch columns n/a)")
    p.add_argument("--skip-mnemo", action="store_true", help="PyTorch only (mnemo columns n/a)")
    p.add_argument("--json", metavar="OUT", help="write the results and the set-up to this JSON file")
    a = p.parse_args(argv)
    q = a.quick
    a.iterations = a.iterations if a.iterations is not None else (2 if q else 10)
    a.warmup = a.warmup if a.warmup is not None else (1 if q else 3)
    a.budget = a.budget if a.budget is not None else (10.0 if q else 60.0)
    a.feedback = a.feedback or ("small" if q else "reference")
    a.gen_tokens = a.gen_tokens if a.gen_tokens is not None else (8 if q else 32)
    a.mnemo_repetitions = a.mnemo_repetitions if a.mnemo_repetitions is not None else (1 if q else 5)
    a.configs = [c.strip().upper() for c in a.configs.split(",") if c.strip()]
    for c in a.configs:
        if c not in COMPRESSIVE:
            p.error(f"unknown configuration {c!r} (A, B or C)")
    if a.iterations < 1 or a.warmup < 0 or a.threads < 1 or a.mnemo_repetitions < 1:
        p.error("--iterations, --threads and --mnemo-repetitions must be >= 1, --warmup >= 0")
    for c in a.configs:
        if a.gen_tokens % COMPRESSIVE[c]["rate"]:
            p.error(f"--gen-tokens {a.gen_tokens} is not a multiple of configuration {c}'s compression rate")
    return a


def reexec_with_openblas_openmp():
    """Before torch is imported: re-run this script with OpenBLAS's OpenMP build first on the library path.

    Returns a warning line when that build is not installed, else None (or does not return).
    """
    if not os.path.isdir(OPENBLAS_OPENMP_DIR):
        return (f"WARNING: {OPENBLAS_OPENMP_DIR} does not exist: torch uses whatever libblas.so.3 the system "
                "provides. Install OpenBLAS's OpenMP build (sudo apt-get install libopenblas0-openmp, or "
                "tools/install-deps.sh --python) for representative PyTorch timings.")
    if os.environ.get(REEXEC_MARK) == "1":
        return None
    env = dict(os.environ)
    old = env.get("LD_LIBRARY_PATH", "")
    env[ORIG_LD_PATH] = old
    env["LD_LIBRARY_PATH"] = OPENBLAS_OPENMP_DIR + (":" + old if old else "")
    env[REEXEC_MARK] = "1"
    sys.stdout.flush()
    os.execve(sys.executable, [sys.executable, os.path.abspath(__file__)] + sys.argv[1:], env)
    return None  # not reached


# ---------------------------------------------------------------------------------------------------
# Set-up information
# ---------------------------------------------------------------------------------------------------


def cpu_info():
    info = {"model": "unknown", "family": None, "model_number": None, "logical_cpus": 0, "cores": None,
            "avx512": False}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, val = line.partition(":")
                key, val = key.strip(), val.strip()
                if key == "processor":
                    info["logical_cpus"] += 1
                elif key == "model name" and info["model"] == "unknown":
                    info["model"] = val
                elif key == "cpu family" and info["family"] is None:
                    info["family"] = val
                elif key == "model" and info["model_number"] is None:
                    info["model_number"] = val
                elif key == "cpu cores" and info["cores"] is None:
                    info["cores"] = int(val)
                elif key == "flags" and "avx512f" in val.split():
                    info["avx512"] = True
    except (OSError, ValueError):
        pass
    info["logical_cpus"] = info["logical_cpus"] or os.cpu_count()
    return info


def mapped_blas_libraries():
    """The BLAS-like and OpenMP libraries mapped into this process (after `import torch`)."""
    libs = set()
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 6 and re.search(r"lib(open)?blas|libmkl|libblis|libgomp|libiomp|libomp\b",
                                                  os.path.basename(parts[5])):
                    libs.add(parts[5])
    except OSError:
        pass
    return sorted(libs)


def torch_blas_summary(torch):
    cfg = torch.__config__.show()
    m = re.search(r"BLAS_INFO=([^,\s]+)", cfg)
    libs = mapped_blas_libraries()
    blas = [l for l in libs if re.search(r"blas|mkl|blis", os.path.basename(l))]
    kind = "unknown"
    if any("openblas-openmp" in l for l in blas):
        kind = "OpenBLAS (OpenMP build)"
    elif any("openblas-pthread" in l for l in blas):
        kind = "OpenBLAS (pthread build)"
    elif any("openblas" in l for l in blas):
        kind = "OpenBLAS"
    elif any("mkl" in l for l in blas):
        kind = "MKL"
    elif any("/blas/" in l or os.path.basename(l).startswith("libblas") for l in blas):
        kind = "reference BLAS (netlib): slow"
    return {"torch_blas_info": m.group(1) if m else None, "kind": kind, "mapped": libs}


# ---------------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------------


def measure(fn, units, args, min_iters=2):
    """Runs fn (one iteration, `units` timed units) after warm-up; returns the median ms per unit.

    Warm-up stops early once it has taken a quarter of the budget; the timed iterations are cut to
    fit the budget (but never below min_iters, nor above --iterations).
    """
    warm = []
    for _ in range(args.warmup):
        t0 = time.perf_counter()
        fn()
        warm.append(time.perf_counter() - t0)
        if sum(warm) > args.budget / 4:
            break
    n = args.iterations
    if warm:
        per = min(warm)
        if per * n > args.budget:
            n = max(min_iters, min(n, int(args.budget // per)))
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    ms = [1e3 * t / units for t in times]
    return {"ms": statistics.median(ms), "iterations": n, "warmup": len(warm), "samples_ms": ms}


# ---------------------------------------------------------------------------------------------------
# PyTorch: Compressive Transformer (tools/reference/compressive.py)
# ---------------------------------------------------------------------------------------------------


def pytorch_compressive(torch, ref, name, s, args, log):
    F = torch.nn.functional
    out = {}
    cfg = ref.ModelConfig(vocab=s["vocab"], d_model=s["d_model"], heads=s["heads"], d_ff=s["d_ff"],
                          n_layers=s["layers"], compression_rate=s["rate"], compression="conv", n_pos=N_POS)

    def new_model():
        torch.manual_seed(1)
        m = ref.AutoregressiveModel(cfg).float()
        assert all(p.dtype == torch.float32 for p in m.parameters())
        return m

    def tokens(q, b, seed):
        g = torch.Generator().manual_seed(seed)
        return torch.randint(0, s["vocab"], (q, b), generator=g)

    def fill(model, memory, batch):
        # bench_models.cpp fill_memory: (mem + c_mem·c) / seq + 2 segments of forward + merge.
        steps = (s["mem"] + s["c_mem"] * s["rate"]) // s["seq"] + 2
        with torch.no_grad():
            for i in range(steps):
                _, new_mem = model(tokens(s["seq"], batch, 1000 + i), *ref._mem_lists(memory))
                memory.merge(new_mem, model)
        assert all(m.shape[0] == s["mem"] for m in memory.mem), "memory not full after fill"
        assert all(c.shape[0] == s["c_mem"] for c in memory.c_mem), "compressed memory not full after fill"

    # (1) training step, steady state
    model = new_model()
    memory = ref.Memory(s["layers"], s["mem"], s["c_mem"], s["rate"])
    fill(model, memory, s["batch"])
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=COMPRESSIVE_LR, weight_decay=ADAMW_WEIGHT_DECAY, foreach=False)
    x, y = tokens(s["seq"], s["batch"], 1), tokens(s["seq"], s["batch"], 2)

    def train_step():
        opt.zero_grad(set_to_none=True)
        logits, new_mem = model(x, *ref._mem_lists(memory))
        old = memory.merge(new_mem, model)  # no gradient, current weights; compresses every step here
        ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        ar = ref.attention_reconstruction_loss(model, new_mem, old) if old is not None else torch.zeros_like(ce)
        (ce + ar).backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        return ce

    log(f"  PyTorch {name}: training step")
    out["train"] = measure(train_step, 1, args)

    # (2) forward segment without gradient, memory full, not merged
    model = new_model()
    memory = ref.Memory(s["layers"], s["mem"], s["c_mem"], s["rate"])
    fill(model, memory, s["batch"])

    def forward():
        with torch.no_grad():
            return model(x, *ref._mem_lists(memory))[0]

    log(f"  PyTorch {name}: forward segment")
    out["forward"] = measure(forward, 1, args)

    # (3) streaming generation, batch 1
    model = new_model()
    memory = ref.Memory(s["layers"], s["mem"], s["c_mem"], s["rate"])
    fill(model, memory, 1)
    tok = [torch.ones(1, 1, dtype=torch.long)]

    def generate_block():
        with torch.no_grad():
            for _ in range(args.gen_tokens):
                logits, new_mem = model(tok[0], *ref._mem_lists(memory))
                memory.merge(new_mem, model)
                tok[0] = logits[-1, 0].argmax().view(1, 1)

    log(f"  PyTorch {name}: generation")
    out["generate"] = measure(generate_block, args.gen_tokens, args)
    return out


# ---------------------------------------------------------------------------------------------------
# PyTorch: Feedback Transformer (tools/reference/feedback.py)
# ---------------------------------------------------------------------------------------------------


class FeedbackStepper:
    """The reference model's recurrence, one step at a time, built from its own modules.

    mode "reproject": keys/values as feedback.py computes them (plain variant: the whole stacked
    memory through every layer's key/value projections at every step). mode "cached": each slot is
    projected once when it is created (per layer for the plain variant, with the shared projections
    for the KV variant, as feedback.py's KV path), into preallocated [T, B, heads, d_k] buffers when
    `preallocate` (generation, no gradient) or into lists stacked per step (training, with autograd,
    as feedback.py's KV path). Both modes compute the same values as feedback.py's forward.
    """

    def __init__(self, torch, model, batch, steps, mode, preallocate):
        self.torch, self.model, self.mode, self.pre = torch, model, mode, preallocate
        tr = model.transformer
        self.tr, self.cfg = tr, tr.cfg
        self.mix = torch.softmax(tr.weights, dim=0)
        self.t = 0
        self.mem = []
        n_kv = 1 if self.cfg.kv_shared else self.cfg.n_layers
        H, dk = self.cfg.heads, self.cfg.d_model // self.cfg.heads
        if preallocate and not (mode == "reproject" and not self.cfg.kv_shared):
            dtype = tr.norm.weight.dtype
            device = tr.norm.weight.device
            self.kbuf = [torch.empty(steps, batch, H, dk, dtype=dtype, device=device) for _ in range(n_kv)]
            self.vbuf = [torch.empty(steps, batch, H, dk, dtype=dtype, device=device) for _ in range(n_kv)]
        else:
            self.keys = [[] for _ in range(n_kv)]
            self.values = [[] for _ in range(n_kv)]

    def _kv(self, l, layer):
        torch, t = self.torch, self.t
        if t == 0:
            return None, None
        i = 0 if self.cfg.kv_shared else l
        if self.mode == "reproject" and not self.cfg.kv_shared:
            m = torch.stack(self.mem)
            return layer.attn.key(m), layer.attn.value(m)
        if self.pre:
            return self.kbuf[i][:t], self.vbuf[i][:t]
        return torch.stack(self.keys[i]), torch.stack(self.values[i])

    def step(self, x, project=True):
        """x [B, D] (the embedding of step t) -> the last layer's output [B, D]; appends slot t."""
        ys = [x]
        for l, layer in enumerate(self.tr.layers):
            k, v = self._kv(l, layer)
            x = layer(x, k, v)
            ys.append(x)
        m_t = sum(self.mix[l] * y for l, y in enumerate(ys))
        if self.mode == "reproject" and not self.cfg.kv_shared:
            self.mem.append(m_t)
        elif project:  # the last slot of a training sequence is never read: `project` may skip it
            projections = ([(self.tr.key, self.tr.value)] if self.cfg.kv_shared else
                           [(layer.attn.key, layer.attn.value) for layer in self.tr.layers])
            for i, (kp, vp) in enumerate(projections):
                if self.pre:
                    self.kbuf[i][self.t] = kp(m_t)
                    self.vbuf[i][self.t] = vp(m_t)
                else:
                    self.keys[i].append(kp(m_t))
                    self.values[i].append(vp(m_t))
        self.t += 1
        return x


def feedback_logits(torch, model, tokens, mode, preallocate=False):
    """logits [T, B, vocab] of a whole sequence through FeedbackStepper (training or forward)."""
    T, B = tokens.shape
    st = FeedbackStepper(torch, model, B, T, mode, preallocate)
    emb = model.src_embed(tokens)
    outs = [st.step(emb[t], project=t + 1 < T) for t in range(T)]
    return model.generator(model.transformer.norm(torch.stack(outs)))


def feedback_self_check(torch, fb):
    """FeedbackStepper (both modes, training and generation layouts) against feedback.py's forward."""
    worst = 0.0
    for shared in (False, True):
        cfg = fb.FeedbackConfig(vocab=11, d_model=16, heads=2, d_ff=24, n_layers=2, kv_shared=shared, n_pos=64)
        torch.manual_seed(3)
        model = fb.AutoregressiveModel(cfg).double()
        fb.random_init(model, 5)
        tokens = torch.randint(0, 11, (7, 3))
        with torch.no_grad():
            want = model(tokens)
            for mode in ("reproject", "cached"):
                for pre in (False, True):
                    got = feedback_logits(torch, model, tokens, mode, pre)
                    worst = max(worst, float((got - want).abs().max()))
                    st = FeedbackStepper(torch, model, 3, 7, mode, pre)
                    emb = model.src_embed(tokens)
                    steps = torch.stack([model.generator(model.transformer.norm(st.step(emb[t]))) for t in range(7)])
                    worst = max(worst, float((steps - want).abs().max()))
    if worst > 1e-10:
        raise SystemExit(f"compare_pytorch: the stepwise feedback model differs from feedback.py by {worst:g}")
    return worst


def pytorch_feedback(torch, fb, name, s, args, log, skipped):
    F = torch.nn.functional
    out = {}
    T, B = s["seq"], s["batch"]
    g = torch.Generator().manual_seed(2)
    x = torch.randint(0, s["vocab"], (T, B), generator=g)
    y = torch.randint(0, s["vocab"], (T, B), generator=g)
    for variant, shared in (("plain", False), ("kv", True)):
        cfg = fb.FeedbackConfig(vocab=s["vocab"], d_model=s["d_model"], heads=s["heads"], d_ff=s["d_ff"],
                                n_layers=s["layers"], kv_shared=shared, n_pos=N_POS)
        torch.manual_seed(1)
        model = fb.AutoregressiveModel(cfg).float()
        assert all(p.dtype == torch.float32 for p in model.parameters())
        opt = torch.optim.AdamW(model.parameters(), lr=FEEDBACK_LR, weight_decay=ADAMW_WEIGHT_DECAY, foreach=False)

        def train_step(forward):
            opt.zero_grad(set_to_none=True)
            logits = forward()
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
            loss.backward()
            opt.step()
            return loss

        reference_forward = lambda: model(x)  # noqa: E731  feedback.py's own forward
        cached_forward = lambda: feedback_logits(torch, model, x, "cached")  # noqa: E731
        def fits(label, units):
            """Autograd keeps every step's stacked keys/values: about `units` × Σt·B·D·4 bytes (measured
            on torch 1.13: 15 for stacked K/V, 20 for feedback.py's re-projection). Skip rather than
            push a shared machine out of memory."""
            need = units * (T * (T - 1) // 2) * B * s["d_model"] * 4
            avail = mem_available()
            if avail is not None and need > 0.9 * avail:
                log(f"  skipped {label}: needs about {need / 2**30:.0f} GiB for autograd, "
                    f"{avail / 2**30:.0f} GiB available")
                skipped.append(f"feedback {name} {variant} {label}: skipped, needs about {need / 2**30:.0f} GiB "
                               f"({avail / 2**30:.0f} GiB available)")
                return False
            return True

        if shared:
            if fits("training step", 16):
                log(f"  PyTorch feedback {name} {variant}: training step (feedback.py forward)")
                out[f"{variant}/train"] = measure(lambda: train_step(reference_forward), 1, args)
        else:
            if fits("training step (K/V cached)", 16):
                log(f"  PyTorch feedback {name} {variant}: training step (per-layer K/V cached)")
                out[f"{variant}/train"] = measure(lambda: train_step(cached_forward), 1, args)
            if args.reproject_train and fits("training step (re-projecting)", 21):
                log(f"  PyTorch feedback {name} {variant}: training step (feedback.py forward, re-projects)")
                out[f"{variant}/train_reproject"] = measure(lambda: train_step(reference_forward), 1, args)

        def forward():
            with torch.no_grad():
                return feedback_logits(torch, model, x, "cached", preallocate=True)

        log(f"  PyTorch feedback {name} {variant}: forward")
        out[f"{variant}/forward"] = measure(forward, 1, args)

        def generate(mode):
            def run():
                with torch.no_grad():
                    st = FeedbackStepper(torch, model, B, T, mode, preallocate=True)
                    sink = 0.0
                    for t in range(T):
                        h = st.step(model.src_embed(x[t]))
                        logits = model.generator(model.transformer.norm(h))
                        sink += float(logits[0, 0])
                    return sink
            return run

        log(f"  PyTorch feedback {name} {variant}: generation (K/V cached)")
        out[f"{variant}/generate"] = measure(generate("cached"), T, args)
        if not shared and not args.no_reproject:
            log(f"  PyTorch feedback {name} {variant}: generation (re-projects, as feedback.py)")
            out[f"{variant}/generate_reproject"] = measure(generate("reproject"), T, args)
    return out


def release_memory():
    """Returns what earlier rows freed to the system: collects Python's cycles, then asks glibc to
    give back its free heap pages (malloc_trim). PyTorch's CPU tensors come from malloc, and glibc
    keeps freed blocks for reuse, so without this an earlier model's memory would still count as
    used when a later row checks what it can allocate."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def mem_available():
    release_memory()
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


# ---------------------------------------------------------------------------------------------------
# mnemo: the Google Benchmark binaries
# ---------------------------------------------------------------------------------------------------


def mnemo_env(args):
    env = dict(os.environ)
    for k in (REEXEC_MARK,):
        env.pop(k, None)
    if ORIG_LD_PATH in env:  # undo the re-exec's library path: mnemo does not use BLAS
        orig = env.pop(ORIG_LD_PATH)
        if orig:
            env["LD_LIBRARY_PATH"] = orig
        else:
            env.pop("LD_LIBRARY_PATH", None)
    env["OMP_NUM_THREADS"] = str(args.threads)
    return env


def run_benchmark_binary(path, bench_filter, args, log):
    """Runs one binary; returns {run_name: entry} with the median aggregate (or the single run)."""
    cmd = [path, "--benchmark_format=json", f"--benchmark_filter={bench_filter}",
           f"--benchmark_repetitions={args.mnemo_repetitions}"]
    if args.mnemo_repetitions > 1:
        cmd.append("--benchmark_report_aggregates_only=true")
    if args.mnemo_min_time is not None:
        cmd.append(f"--benchmark_min_time={args.mnemo_min_time}")
    log(f"  {' '.join(cmd)}   (OMP_NUM_THREADS={args.threads})")
    proc = subprocess.run(cmd, env=mnemo_env(args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        log(f"  WARNING: {os.path.basename(path)} exited with {proc.returncode}: {proc.stderr.strip()[-2000:]}")
    try:
        doc = json.loads(proc.stdout)
    except json.JSONDecodeError:
        log(f"  WARNING: no JSON from {os.path.basename(path)}")
        return {}, None
    runs, iterations = {}, {}
    for b in doc.get("benchmarks", []):
        if b.get("error_occurred"):
            log(f"  WARNING: {b.get('name')}: {b.get('error_message')}")
            continue
        name = b.get("run_name", b["name"])
        if b.get("run_type") == "aggregate":
            if b.get("aggregate_name") == "median":
                runs[name] = b
        else:
            iterations.setdefault(name, []).append(b)
    for name, its in iterations.items():  # no aggregates (one repetition): the median of the runs
        if name not in runs:
            its = sorted(its, key=lambda e: e["real_time"])
            runs[name] = its[len(its) // 2]
    return runs, doc.get("context")


def list_benchmarks(path, args):
    """The benchmark names a binary registers (--benchmark_list_tests), or [] if it cannot run."""
    try:
        proc = subprocess.run([path, "--benchmark_list_tests"], env=mnemo_env(args), stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return proc.stdout.split()


def to_ms(entry, value):
    scale = {"ns": 1e-6, "us": 1e-3, "ms": 1.0, "s": 1e3}[entry.get("time_unit", "ns")]
    return value * scale


def find_run(runs, prefix):
    """The run whose name is `prefix` or starts with `prefix/` (e.g. .../iterations:2/real_time)."""
    for name, e in runs.items():
        if name == prefix or name.startswith(prefix + "/"):
            return e
    return None


def stale_warning(binaries):
    """A note when a header under include/ is newer than a binary (it may need rebuilding)."""
    built = {}
    for b in binaries:
        try:
            built[b] = os.path.getmtime(b)
        except OSError:
            pass
    if not built:
        return None
    newest, newest_path = 0.0, None
    for d, _, files in os.walk(os.path.join(ROOT, "include")):
        for f in files:
            t = os.path.getmtime(os.path.join(d, f))
            if t > newest:
                newest, newest_path = t, os.path.join(d, f)
    old = [os.path.basename(b) for b, t in built.items() if newest > t]
    if old:
        return (f"NOTE: {os.path.relpath(newest_path, ROOT)} is newer than {' and '.join(old)}: rebuild "
                "(cmake --build build --target bench_models bench_feedback) if the change matters")
    return None


def mnemo_measurements(args, log):
    res, ctx, notes = {}, {}, []
    models = os.path.join(args.mnemo_dir, "bench_models")
    feedback = os.path.join(args.mnemo_dir, "bench_feedback")
    w = stale_warning([b for b, used in ((models, bool(args.configs)), (feedback, args.feedback != "none")) if used])
    if w:
        notes.append(w)
    if args.configs:
        if os.access(models, os.X_OK):
            names = "|".join(args.configs)
            listed = list_benchmarks(models, args)
            # Binaries with a memory K/V cache for generation register BM_generate_X (cached) and
            # BM_generate_recompute_X (every token projects the whole memory again); older ones only
            # BM_generate_X, which recomputes.
            res["generate_cached"] = any(n.startswith("BM_generate_recompute_") for n in listed)
            runs, c = run_benchmark_binary(
                models, f"^BM_(train|forward|generate|generate_recompute)_({names})/", args, log)
            ctx["bench_models"] = c
            for cfg in args.configs:
                for kind in ("train", "forward", "generate", "generate_recompute"):
                    e = find_run(runs, f"BM_{kind}_{cfg}")
                    # real_time is per iteration: one step, one segment, one token
                    res[f"{cfg}/{kind}"] = to_ms(e, e["real_time"]) if e else None
        else:
            notes.append(f"WARNING: {models} not found: build it (cmake --build build --target bench_models)")
    if args.feedback != "none":
        if os.access(feedback, os.X_OK):
            runs, c = run_benchmark_binary(feedback, f"^(train_step|forward|generate)/{args.feedback}/", args, log)
            ctx["bench_feedback"] = c
            for variant, suffix in (("plain", "feedback"), ("kv", "feedback_kv")):
                for kind, bench in (("train", "train_step"), ("forward", "forward"), ("generate", "generate")):
                    e = find_run(runs, f"{bench}/{args.feedback}/{suffix}")
                    # ms_per_step: the bench's own timer; per training step / forward sequence /
                    # generation step (a binary from before BM_forward has no forward rows: n/a)
                    res[f"fb/{variant}/{kind}"] = float(e["ms_per_step"]) if e and "ms_per_step" in e else None
        else:
            notes.append(f"WARNING: {feedback} not found: build it (cmake --build build --target bench_feedback)")
    return res, ctx, notes


# ---------------------------------------------------------------------------------------------------
# K/V caching in generation: what each side does
# ---------------------------------------------------------------------------------------------------


def kv_cache_notes(mn):
    """What each side does with the memory's projected keys/values during generation.

    mnemo's compressive answer comes from the benchmark binary that was run: one that registers
    BM_generate_recompute_X caches in BM_generate_X (compressive_transformer::cache_memory_projections).
    """
    lines = ["Compressive Transformer, PyTorch (tools/reference/compressive.py): NO cache. The memory holds "
             "layer inputs; every generated token re-runs each layer's LayerNorm and key/value projections "
             "over all c_mem + mem + 1 positions."]
    cached = mn.get("generate_cached")
    if cached:
        lines.append("Compressive Transformer, mnemo: BM_generate_X CACHES the memory's projected keys/values "
                     "(cache_memory_projections(true): only new memory slots are projected); "
                     "BM_generate_recompute_X projects the whole memory again every token, as the reference, "
                     "and is the like-for-like row.")
    elif cached is False:
        lines.append("Compressive Transformer, mnemo: NO cache in this binary (it has no BM_generate_recompute_X): "
                     "BM_generate_X normalises [c_mem, mem, x] and projects keys and values for all of its rows "
                     "every token, as the reference does.")
        try:
            with open(os.path.join(HERE, "bench_models.cpp")) as f:
                if "cache_memory_projections" in f.read():
                    lines.append("NOTE: benchmarks/bench_models.cpp now has a cached generation benchmark: "
                                 "rebuild bench_models to time it.")
        except OSError:
            pass
    else:
        lines.append("Compressive Transformer, mnemo: not run.")
    lines += [
        "Feedback Transformer, PyTorch: feedback.py's plain variant re-projects the whole stacked memory "
        "with every layer's key/value at every step (row 're-projects'); its KV variant projects each "
        "slot once. The 'K/V cached' PyTorch rows project each slot once per layer (the same values).",
        "Feedback Transformer, mnemo: both variants compute each slot's keys/values once and cache them "
        "(feedback_generator appends one slot per step; training caches them too).",
    ]
    return lines


# ---------------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------------


def fmt_ms(v):
    if v is None:
        return "n/a"
    if v >= 100:
        return f"{v:.0f} ms"
    if v >= 10:
        return f"{v:.1f} ms"
    if v >= 1:
        return f"{v:.2f} ms"
    return f"{v:.3f} ms"


def build_rows(args, pt, mn):
    rows = []

    def add(label, key_pt, key_mn, unit):
        p = pt.get(key_pt) if key_pt else None
        m = mn.get(key_mn) if key_mn else None
        p_ms = p["ms"] if p else None
        ratio = p_ms / m if (p_ms is not None and m) else None
        rows.append({"row": label, "unit": unit, "pytorch_ms": p_ms, "mnemo_ms": m, "ratio": ratio,
                     "pytorch_iterations": p["iterations"] if p else None,
                     "pytorch_samples_ms": p["samples_ms"] if p else None})

    cached = mn.get("generate_cached")
    for c in args.configs:
        add(f"{c}: training step", f"{c}/train", f"{c}/train", "ms/step")
        add(f"{c}: forward segment (no grad)", f"{c}/forward", f"{c}/forward", "ms")
        if cached:
            add(f"{c}: generation, batch 1 (mnemo K/V cached, PyTorch recomputes)", f"{c}/generate",
                f"{c}/generate", "ms/token")
            add(f"{c}: generation, batch 1 (both recompute K/V)", f"{c}/generate", f"{c}/generate_recompute",
                "ms/token")
        else:
            add(f"{c}: generation, batch 1 (both recompute K/V)" if "generate_cached" in mn else
                f"{c}: generation, batch 1", f"{c}/generate", f"{c}/generate", "ms/token")
    if args.feedback != "none":
        f = f"feedback {args.feedback}"
        add(f"{f} plain: training step (PyTorch K/V cached)", "fb/plain/train", "fb/plain/train", "ms/step")
        if args.reproject_train:
            add(f"{f} plain: training step (PyTorch re-projects, feedback.py)", "fb/plain/train_reproject",
                "fb/plain/train", "ms/step")
        add(f"{f} kv: training step", "fb/kv/train", "fb/kv/train", "ms/step")
        add(f"{f} plain: forward sequence (no grad, PyTorch K/V cached)", "fb/plain/forward", "fb/plain/forward", "ms")
        add(f"{f} kv: forward sequence (no grad)", "fb/kv/forward", "fb/kv/forward", "ms")
        b = FEEDBACK[args.feedback]["batch"]
        add(f"{f} plain: generation, batch {b} (PyTorch K/V cached)", "fb/plain/generate", "fb/plain/generate",
            "ms/step")
        if not args.no_reproject:
            add(f"{f} plain: generation, batch {b} (PyTorch re-projects, feedback.py)", "fb/plain/generate_reproject",
                "fb/plain/generate", "ms/step")
        add(f"{f} kv: generation, batch {b}", "fb/kv/generate", "fb/kv/generate", "ms/step")
    return rows


def markdown_table(rows):
    out = ["| row | PyTorch | mnemo | ratio (PyTorch/mnemo) |", "|---|---|---|---|"]
    for r in rows:
        unit = r["unit"]
        p = fmt_ms(r["pytorch_ms"])
        m = fmt_ms(r["mnemo_ms"])
        if unit != "ms":
            p = p if p == "n/a" else p + unit[2:]
            m = m if m == "n/a" else m + unit[2:]
        ratio = f"{r['ratio']:.2f}×" if r["ratio"] is not None else "n/a"
        out.append(f"| {r['row']} | {p} | {m} | {ratio} |")
    return "\n".join(out)


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    blas_warning = reexec_with_openblas_openmp()
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # read by libgomp when torch loads it

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    import torch  # noqa: E402  (after the re-exec and OMP_NUM_THREADS)

    torch.set_num_threads(args.threads)
    torch.set_default_dtype(torch.float32)
    sys.path.insert(0, os.path.join(ROOT, "tools", "reference"))
    import compressive as ref  # noqa: E402
    import feedback as fb  # noqa: E402

    cpu = cpu_info()
    blas = torch_blas_summary(torch)
    setup = {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "cpu": cpu,
        "machine": platform.machine(),
        "python": platform.python_version(),
        "torch_version": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "threads": args.threads,
        "blas": blas,
        "ld_library_path": os.environ.get("LD_LIBRARY_PATH", ""),
        "load_average": os.getloadavg(),
        "settings": {k: getattr(args, k) for k in ("quick", "iterations", "warmup", "budget", "configs", "feedback",
                                                    "gen_tokens", "mnemo_repetitions", "mnemo_min_time",
                                                    "reproject_train", "no_reproject")},
    }
    print("# mnemo vs PyTorch reference")
    print()
    print(f"- date: {setup['date']}")
    print(f"- CPU: {cpu['model']} (family {cpu['family']}, model {cpu['model_number']}"
          f"{', AVX-512' if cpu['avx512'] else ''}), {cpu['cores'] or '?'} cores, {cpu['logical_cpus']} logical CPUs")
    print(f"- load average at start: {' '.join(f'{x:.2f}' for x in setup['load_average'])}")
    if setup["load_average"][0] > max(0.5, cpu["logical_cpus"] - args.threads):
        print(f"- WARNING: the machine is busy (load {setup['load_average'][0]:.2f} on {cpu['logical_cpus']} CPUs): "
              "other processes share the cores, and both sides' timings suffer (OpenMP threads wait for "
              "each other); compare only runs on an idle machine")
    print(f"- torch {torch.__version__} (BLAS_INFO={blas['torch_blas_info']}), float32, "
          f"{torch.get_num_threads()} threads; mnemo: OMP_NUM_THREADS={args.threads}")
    print(f"- BLAS used by torch: {blas['kind']}: {', '.join(blas['mapped']) or 'none found in /proc/self/maps'}")
    if blas_warning:
        print(f"- {blas_warning}")
    elif "openblas-openmp" not in " ".join(blas["mapped"]):
        print(f"- WARNING: torch did not map {OPENBLAS_OPENMP_DIR}'s library; PyTorch timings may not be representative")
    print(f"- PyTorch: {args.warmup} warm-up + median of up to {args.iterations} iterations per row "
          f"(fewer for rows slower than {args.budget:g} s in all); mnemo: Google Benchmark, median of "
          f"{args.mnemo_repetitions} repetition(s)")
    print(flush=True)

    pt, mn, notes, skipped = {}, {}, [], []
    if not args.skip_pytorch:
        log("PyTorch measurements")
        if args.feedback != "none":
            d = feedback_self_check(torch, fb)
            log(f"  stepwise feedback model = feedback.py's forward (max |Δ logits| {d:.1e}, float64)")
        for c in args.configs:
            r = pytorch_compressive(torch, ref, c, COMPRESSIVE[c], args, log)
            for k, v in r.items():
                pt[f"{c}/{k}"] = v
        if args.feedback != "none":
            r = pytorch_feedback(torch, fb, args.feedback, FEEDBACK[args.feedback], args, log, skipped)
            for k, v in r.items():
                pt[f"fb/{k}"] = v
    if not args.skip_mnemo:
        release_memory()  # PyTorch's freed tensors back to the system before mnemo's binaries run
        log("mnemo measurements (after PyTorch's, never concurrently)")
        mn, ctx, notes = mnemo_measurements(args, log)
        setup["mnemo_context"] = ctx

    rows = build_rows(args, pt, mn)
    print(markdown_table(rows))
    print()
    notes = skipped + notes
    for n in notes:
        print(f"- {n}")
    print("Key/value caching in generation:")
    kv = kv_cache_notes(mn)
    for line in kv:
        print(f"- {line}")
    if args.feedback != "none":
        print("- Feedback rows: mnemo's forward sequence is bench_feedback's forward/ row (every step's logits, "
              "no gradient). The feedback training step has no gradient clipping, as bench_feedback.cpp's.")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"setup": setup, "rows": rows, "kv_cache": kv, "notes": notes}, f, indent=2)
        print(f"\nresults written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
