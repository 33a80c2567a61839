#!/usr/bin/env python3
"""GPU side by side: PyTorch eager (the reference models) and mnemo's CUDA backend on the same card, in one run.

    cmake --build build --target bench_cuda
    python3 benchmarks/compare_pytorch_cuda.py                    # every row (tools/gpu_check.sh BENCH=1 runs it)
    python3 benchmarks/compare_pytorch_cuda.py --rows train_A,generate_A --json out.json

Rows (benchmarks/bench_cuda.cpp has the same; configurations in benchmarks/model_shapes.hpp):
  train_X      Compressive Transformer steady-state training step: memories full, forward, merge and
               compression (no gradient), cross-entropy + attention-reconstruction loss, backward,
               clip_grad_norm_(1.0), AdamW (lr 2.5e-4, weight decay 0.01, fused=True)        ms/step
  forward_X    one segment without gradient, memories full, no merge                         ms
  generate_X   batch 1, one token at a time, memory carried and merged, greedy next token    ms/token
               (the reference recomputes the memory's keys and values every token)
  X: A, B, C, and A_x8, A_x16, B_x8, B_x16 (the batch 8x and 16x; no generation rows)
  feedback_train, feedback_kv_train: the Feedback Transformer at its reference size (d_model 512, 8 heads,
               6 layers, seq 128, batch 64): forward over the sequence, cross-entropy, backward
               through time, AdamW (lr 1e-4, fused=True)                                     ms/step
  feedback_generate, feedback_kv_generate: the batch one token per step over the sequence, keys and
               values cached (compare_pytorch.py's FeedbackStepper)                          ms/step
PyTorch in float32 twice: TF32 off (torch.backends.cuda.matmul.allow_tf32 = False, cudnn likewise), then
on. Timing: --warmup untimed iterations, then the median of --iterations, each ended by
torch.cuda.synchronize(); peak memory from torch.cuda.max_memory_allocated, reset per row.
mnemo: the bench_cuda binary (--mnemo), run after PyTorch, never at the same time.
Prints a markdown table with the card's name; --json saves everything.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "tools", "reference"))
import compare_pytorch as cp  # noqa: E402  the CPU comparison's configurations and feedback stepper

BATCH_MULTIPLES = {"A_x8": ("A", 8), "A_x16": ("A", 16), "B_x8": ("B", 8), "B_x16": ("B", 16)}


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mnemo", default=os.path.join(ROOT, "build", "benchmarks", "bench_cuda"), help="bench_cuda binary")
    p.add_argument("--rows", default="", help="comma-separated rows (default: all)")
    p.add_argument("--iterations", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--skip-pytorch", action="store_true")
    p.add_argument("--skip-mnemo", action="store_true")
    p.add_argument("--json", metavar="OUT")
    a = p.parse_args(argv)
    a.rows = [r.strip() for r in a.rows.split(",") if r.strip()]
    return a


def wanted(args, row):
    return not args.rows or row in args.rows


def measure(torch, fn, args, units=1):
    for _ in range(args.warmup):
        fn()
    torch.cuda.synchronize()
    ms = []
    for _ in range(args.iterations):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        ms.append(1e3 * (time.perf_counter() - t0) / units)
    return statistics.median(ms)


def compressive_rows(torch, ref, args, name, s, dev):
    F = torch.nn.functional
    out = {}
    cfg = ref.ModelConfig(vocab=s["vocab"], d_model=s["d_model"], heads=s["heads"], d_ff=s["d_ff"],
                          n_layers=s["layers"], compression_rate=s["rate"], compression="conv", n_pos=cp.N_POS)

    def new_model():
        torch.manual_seed(1)
        return ref.AutoregressiveModel(cfg).float().to(dev)

    def tokens(q, b, seed):
        g = torch.Generator().manual_seed(seed)
        return torch.randint(0, s["vocab"], (q, b), generator=g).to(dev)

    def filled(model, batch):
        memory = ref.Memory(s["layers"], s["mem"], s["c_mem"], s["rate"])
        with torch.no_grad():
            for i in range((s["mem"] + s["c_mem"] * s["rate"]) // s["seq"] + 2):
                _, new_mem = model(tokens(s["seq"], batch, 1000 + i), *ref._mem_lists(memory))
                memory.merge(new_mem, model)
        return memory

    rows = s["seq"] * s["batch"]
    if wanted(args, f"train_{name}"):
        torch.cuda.reset_peak_memory_stats()
        model = new_model()
        memory = filled(model, s["batch"])
        params = list(model.parameters())
        opt = torch.optim.AdamW(params, lr=cp.COMPRESSIVE_LR, weight_decay=cp.ADAMW_WEIGHT_DECAY, fused=True)
        x, y = tokens(s["seq"], s["batch"], 1), tokens(s["seq"], s["batch"], 2)

        def step():
            opt.zero_grad(set_to_none=True)
            logits, new_mem = model(x, *ref._mem_lists(memory))
            old = memory.merge(new_mem, model)
            ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
            ar = ref.attention_reconstruction_loss(model, new_mem, old) if old is not None else torch.zeros_like(ce)
            (ce + ar).backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()

        ms = measure(torch, step, args)
        out[f"train_{name}"] = dict(ms=ms, tokens_per_s=rows / (ms * 1e-3),
                                    peak_mib=torch.cuda.max_memory_allocated() / 2**20)
    if wanted(args, f"forward_{name}"):
        torch.cuda.reset_peak_memory_stats()
        model = new_model()
        memory = filled(model, s["batch"])
        x = tokens(s["seq"], s["batch"], 1)

        def forward():
            with torch.no_grad():
                model(x, *ref._mem_lists(memory))

        ms = measure(torch, forward, args)
        out[f"forward_{name}"] = dict(ms=ms, tokens_per_s=rows / (ms * 1e-3),
                                      peak_mib=torch.cuda.max_memory_allocated() / 2**20)
    if name in cp.COMPRESSIVE and wanted(args, f"generate_{name}"):
        torch.cuda.reset_peak_memory_stats()
        model = new_model()
        memory = filled(model, 1)
        tok = [torch.ones(1, 1, dtype=torch.long, device=dev)]
        block = 4 * s["rate"]

        def generate():
            with torch.no_grad():
                for _ in range(block):
                    logits, new_mem = model(tok[0], *ref._mem_lists(memory))
                    memory.merge(new_mem, model)
                    tok[0] = logits[-1, 0].argmax().view(1, 1)

        ms = measure(torch, generate, args, units=block)
        out[f"generate_{name}"] = dict(ms=ms, tokens_per_s=1e3 / ms, peak_mib=torch.cuda.max_memory_allocated() / 2**20)
    return out


def feedback_rows(torch, fb, args, dev):
    F = torch.nn.functional
    s = cp.FEEDBACK["reference"]
    T, B = s["seq"], s["batch"]
    g = torch.Generator().manual_seed(2)
    x = torch.randint(0, s["vocab"], (T, B), generator=g).to(dev)
    y = torch.randint(0, s["vocab"], (T, B), generator=g).to(dev)
    out = {}
    for prefix, shared in (("feedback", False), ("feedback_kv", True)):
        cfg = fb.FeedbackConfig(vocab=s["vocab"], d_model=s["d_model"], heads=s["heads"], d_ff=s["d_ff"],
                                n_layers=s["layers"], kv_shared=shared, n_pos=cp.N_POS)
        torch.manual_seed(1)
        model = fb.AutoregressiveModel(cfg).float().to(dev)
        if wanted(args, f"{prefix}_train"):
            torch.cuda.reset_peak_memory_stats()
            opt = torch.optim.AdamW(model.parameters(), lr=cp.FEEDBACK_LR, weight_decay=cp.ADAMW_WEIGHT_DECAY, fused=True)
            forward = (lambda: model(x)) if shared else (lambda: cp.feedback_logits(torch, model, x, "cached"))

            def step():
                opt.zero_grad(set_to_none=True)
                logits = forward()
                F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)).backward()
                opt.step()

            ms = measure(torch, step, args)
            out[f"{prefix}_train"] = dict(ms=ms, tokens_per_s=T * B / (ms * 1e-3),
                                          peak_mib=torch.cuda.max_memory_allocated() / 2**20)
        if wanted(args, f"{prefix}_generate"):
            torch.cuda.reset_peak_memory_stats()

            def generate():
                with torch.no_grad():
                    st = cp.FeedbackStepper(torch, model, B, T, "cached", preallocate=True)
                    for t in range(T):
                        model.generator(model.transformer.norm(st.step(model.src_embed(x[t]))))

            ms = measure(torch, generate, args, units=T)
            out[f"{prefix}_generate"] = dict(ms=ms, tokens_per_s=B / (ms * 1e-3),
                                             peak_mib=torch.cuda.max_memory_allocated() / 2**20)
    return out


def pytorch_all(args):
    import torch
    import compressive as ref
    import feedback as fb
    if not torch.cuda.is_available():
        raise SystemExit("compare_pytorch_cuda: torch sees no CUDA device")
    dev = torch.device("cuda")
    results = {}
    for tf32 in (False, True):
        torch.backends.cuda.matmul.allow_tf32 = tf32
        torch.backends.cudnn.allow_tf32 = tf32
        got = {}
        configs = dict(cp.COMPRESSIVE)
        for name, (base, k) in BATCH_MULTIPLES.items():
            configs[name] = dict(cp.COMPRESSIVE[base], batch=cp.COMPRESSIVE[base]["batch"] * k)
        # Each row's figure goes to stderr as it is measured, so that a run cut short keeps what it had.
        def report(name, rows):
            print(f"PyTorch (TF32 {'on' if tf32 else 'off'}): {name}: " +
                  ", ".join(f"{r} {v['ms']:.3f} ms" for r, v in rows.items()), file=sys.stderr, flush=True)
            got.update(rows)
        for name, s in configs.items():
            if any(wanted(args, f"{kind}_{name}") for kind in ("train", "forward", "generate")):
                report(name, compressive_rows(torch, ref, args, name, s, dev))
        report("feedback", feedback_rows(torch, fb, args, dev))
        results["tf32" if tf32 else "fp32"] = got
    return torch.cuda.get_device_name(0), torch.__version__, results


def mnemo_all(args):
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "mnemo.json")
        cmd = [args.mnemo, "--iterations", str(args.iterations), "--warmup", str(args.warmup), "--json", path]
        if args.rows:
            cmd += ["--rows", ",".join(args.rows)]
        r = subprocess.run(cmd, stdout=sys.stderr)
        if r.returncode != 0:
            raise SystemExit(f"compare_pytorch_cuda: {' '.join(cmd)} failed ({r.returncode})")
        with open(path) as f:
            data = json.load(f)
    return data["device"], {row["row"]: row for row in data["rows"]}


def main(argv=None):
    args = parse_args(argv if argv is not None else sys.argv[1:])
    card, torch_version, pt = ("n/a", "n/a", {"fp32": {}, "tf32": {}}) if args.skip_pytorch else pytorch_all(args)
    device, mn = ("n/a", {}) if args.skip_mnemo else mnemo_all(args)
    rows = sorted(set(pt["fp32"]) | set(pt["tf32"]) | set(mn))
    fmt = lambda v: "n/a" if v is None else f"{v:.3f}"  # noqa: E731
    print(f"GPU: {card} (PyTorch {torch_version}); mnemo: {device}; {time.strftime('%Y-%m-%d')}\n")
    print("| row | PyTorch fp32 ms | PyTorch TF32 ms | mnemo ms | fp32 / mnemo | mnemo launches | "
          "PyTorch peak MiB | mnemo peak MiB | mnemo TFLOP/s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        a, b, m = pt["fp32"].get(r, {}), pt["tf32"].get(r, {}), mn.get(r, {})
        ratio = a["ms"] / m["ms"] if a.get("ms") and m.get("ms") else None
        print(f"| {r} | {fmt(a.get('ms'))} | {fmt(b.get('ms'))} | {fmt(m.get('ms'))} | "
              f"{'n/a' if ratio is None else f'{ratio:.2f}'} | {m.get('launches', 'n/a')} | "
              f"{fmt(a.get('peak_mib'))} | {fmt(m.get('peak_mib'))} | {fmt(m.get('tflops'))} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(card=card, torch=torch_version, mnemo_device=device, pytorch=pt, mnemo=mn), f, indent=1)


if __name__ == "__main__":
    main()
