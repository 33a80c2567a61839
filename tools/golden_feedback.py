#!/usr/bin/env python3
"""Golden data for mnemo's Feedback Transformer (both variants).

    /usr/bin/python3 tools/golden_feedback.py     # rewrites tests/golden/feedback_tiny.safetensors
                                                  #      and tests/golden/feedback_kv_tiny.safetensors

Runs the independent PyTorch reference (tools/reference/feedback.py) in float64 on CPU with one thread,
so the files are byte-identical from run to run. Each configuration trains for N_STEPS steps, each on
its own random sequence (every sequence starts from an empty memory, docs/reference.md §16):

    forward (token by token) -> mean CE -> backward through time
    -> clip_grad_norm_(all parameters, CLIP) -> optimizer step

feedback_tiny uses torch.optim.AdamW (foreach=False); feedback_kv_tiny uses labml's Noam optimizer
(labml's Adam update with lr_t = lr · d_model^−0.5 · min(t^−0.5, t · warmup^−1.5), docs/reference.md §17),
reusing tools/golden_optim.py's implementation. Every parameter starts random, including the positional
tables R, S, u and the layer weights w (the reference initialises them to zero and one), so every path
is exercised. n_pos is small (8) so the tests also cover the table window [P − T + 1, P − 1].

Each file holds (F64 unless noted; T = seq_len, B = batch, V = vocab):
    __metadata__            sizes, variant, optimizer settings, description (all strings)
    init.<param>            every parameter before step 1 (labml state_dict names)
    data, target            I64 [n_steps, T, B]; target is data shifted by one token
    step{s}.logits          [T, B, V]
    step{s}.loss            0-d mean cross-entropy
    step{s}.grad_norm       0-d, the global gradient norm before clipping
    step{s}.grad.<param>    the gradient before clipping
    step{s}.after.<param>   the parameters after the optimizer step
"""
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "reference"))
sys.path.insert(0, HERE)

import feedback as FB  # noqa: E402
import safetensors_io as st  # noqa: E402
from golden_optim import LabmlAdam, noam_lr  # noqa: E402

OUT_DIR = os.path.join(HERE, os.pardir, "tests", "golden")
N_STEPS = 3
N_POS = 8

_TINY = dict(d_model=16, heads=2, d_ff=24, n_layers=2, vocab=11, seq_len=5, batch=2, seed=3)

CONFIGS = {
    "feedback_tiny": dict(_TINY, kv_shared=False, optimizer="adamw", lr=1e-2, weight_decay=0.01, clip=4.2,
                          description="Feedback Transformer (per-layer keys/values), AdamW, clipped on some steps"),
    "feedback_kv_tiny": dict(_TINY, kv_shared=True, optimizer="noam", lr=1.0, warmup=3, betas=(0.9, 0.98),
                             clip=5.0, seed=4,
                             description="Feedback Transformer with shared keys/values (FeedbackTransformerKV), "
                                         "labml Noam"),
}


def make_optimizer(c, params):
    if c["optimizer"] == "adamw":
        return torch.optim.AdamW(params, lr=c["lr"], betas=(0.9, 0.999), eps=1e-8, weight_decay=c["weight_decay"],
                                 foreach=False)
    return LabmlAdam(params, c["lr"], c["betas"], 1e-8, 0.0, noam_lr(c["lr"], c["d_model"], c["warmup"]))


def run_config(name, c):
    cfg = FB.FeedbackConfig(vocab=c["vocab"], d_model=c["d_model"], heads=c["heads"], d_ff=c["d_ff"],
                            n_layers=c["n_layers"], kv_shared=c["kv_shared"], n_pos=N_POS)
    model = FB.AutoregressiveModel(cfg).double()
    FB.random_init(model, c["seed"])
    out = {f"init.{k}": v.detach().clone() for k, v in model.state_dict().items()}

    T, B = c["seq_len"], c["batch"]
    g = torch.Generator().manual_seed(1000 + c["seed"])
    stream = torch.randint(0, cfg.vocab, (N_STEPS, T + 1, B), generator=g)
    data, target = stream[:, :T].contiguous(), stream[:, 1:].contiguous()
    out["data"], out["target"] = data, target

    optimizer = make_optimizer(c, list(model.parameters()))
    norms = []
    for s in range(N_STEPS):
        r = FB.train_step(model, optimizer, data[s], target[s], c["clip"])
        out[f"step{s}.logits"] = r["logits"]
        out[f"step{s}.loss"] = r["loss"]
        out[f"step{s}.grad_norm"] = r["grad_norm"]
        norms.append(r["grad_norm"].item())
        for k, v in r["grads"].items():
            out[f"step{s}.grad.{k}"] = v
        for k, v in model.named_parameters():
            out[f"step{s}.after.{k}"] = v.detach().clone()

    # The clip must bite on some steps and not on others, with a margin either way.
    clipped = [n > c["clip"] for n in norms]
    assert any(clipped) and not all(clipped) and all(abs(n / c["clip"] - 1) > 0.01 for n in norms), (name, norms)

    meta = {k: str(c[k]) for k in ("d_model", "heads", "d_ff", "n_layers", "vocab", "seq_len", "batch", "clip",
                                   "seed", "optimizer", "lr", "description")}
    meta.update(n_pos=str(N_POS), n_steps=str(N_STEPS), variant="feedback-kv" if c["kv_shared"] else "feedback",
                eps="1e-08", clip_rule="torch.nn.utils.clip_grad_norm_: g *= min(1, clip / (norm + 1e-6))")
    if c["optimizer"] == "adamw":
        meta.update(weight_decay=repr(c["weight_decay"]), betas="0.9,0.999",
                    optimizer_rule="torch.optim.AdamW(foreach=False)")
    else:
        meta.update(warmup=str(c["warmup"]), betas=f"{c['betas'][0]!r},{c['betas'][1]!r}", weight_decay="0.0",
                    optimizer_rule="labml Noam: Adam (optimized_update) at lr * d_model^-0.5 * "
                                   "min(t^-0.5, t * warmup^-1.5), t from 1")
    return out, meta, norms


def main():
    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float64)
    os.makedirs(OUT_DIR, exist_ok=True)
    for name, c in CONFIGS.items():
        tensors, meta, norms = run_config(name, c)
        path = os.path.join(OUT_DIR, f"{name}.safetensors")
        st.save(path, tensors, meta)
        print(f"{os.path.relpath(path)}: {len(tensors)} tensors, {os.path.getsize(path)} bytes, "
              f"grad norms {[round(n, 3) for n in norms]} (clip {c['clip']})")


if __name__ == "__main__":
    main()
