#!/usr/bin/env python3
"""Golden data for mnemo's Compressive Transformer and Transformer-XL training.

    /usr/bin/python3 tools/golden_compressive.py        # rewrites tests/golden/<config>.safetensors

Runs the independent PyTorch reference (tools/reference/compressive.py) in float64 on CPU with one
thread, so the files are byte-identical from run to run. For each configuration it trains for
N_SEGMENTS consecutive segments of one random token stream per batch column, as the reference
experiment does:

    forward with the carried memory -> merge/compress the memory (no gradient, current weights)
    -> CE + attention-reconstruction loss (when something was compressed) -> backward
    -> clip_grad_norm_(all parameters, CLIP) -> torch.optim.AdamW step -> zero the gradients

Every parameter is random at the start (the positional tables R, S and u too, which the reference
initialises to zero), so every path is exercised. A parameter the loss does not reach (the conv on
a step without compression, the conv of Transformer-XL) gets an exactly zero gradient and still
takes the AdamW step, so weight decay shrinks it. CLIP is chosen so that some steps are clipped and
others are not.

Each file holds (F64 unless noted; Q = seq_len, B = batch, V = vocab, D = d_model):
    __metadata__                 sizes, optimizer settings, description (all strings)
    init.<param>                 every parameter before step 1 (labml state_dict names)
    data, target                 I64 [n_segments, Q, B]; target[s] is the token after data[s]
    seg{s}.logits                [Q, B, V]
    seg{s}.ce_loss, .ar_loss     0-d; ar_loss is 0 where nothing was compressed
    seg{s}.grad_norm             0-d, the global gradient norm before clipping
    seg{s}.grad.<param>          gradient of CE + AR, before clipping
    seg{s}.after.<param>         the parameters after the optimizer step
    seg{s}.mem.{l}, .c_mem.{l}   [len, B, D], the memory after this segment's merge; a tensor is
                                 omitted when that memory is empty (c_mem before the first
                                 compression, and always for Transformer-XL)
"""
import dataclasses
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "reference"))

import compressive as C  # noqa: E402
import safetensors_io as st  # noqa: E402

OUT_DIR = os.path.join(HERE, os.pardir, "tests", "golden")
N_SEGMENTS = 4
N_POS = 16
LR = 1e-2
BETAS = (0.9, 0.999)
EPS = 1e-8
WEIGHT_DECAY = 0.01

_TINY = dict(d_model=16, heads=2, compression_rate=2, d_ff=24, n_layers=2, vocab=11, seq_len=4, mem_len=4,
             c_mem_len=3, batch=2, compression="conv", clip=4.2, seed=1)

CONFIGS = {
    "compressive_tiny": dict(_TINY, description="Compressive Transformer, conv compression; c_mem fills and is "
                                                "truncated to its newest 3 slots"),
    "compressive_odd": dict(d_model=12, heads=3, compression_rate=3, d_ff=20, n_layers=2, vocab=7, seq_len=3,
                            mem_len=5, c_mem_len=4, batch=3, compression="conv", clip=4.5, seed=2,
                            description="Compressive Transformer, conv, odd sizes; compresses ceil(1/3)*3 = 3 "
                                        "slots when memory overflows by 1"),
    "xl_tiny": dict(_TINY, c_mem_len=0, clip=3.8, description="Transformer-XL (c_mem_len 0): memory keeps its newest 4 "
                                                    "slots, nothing compressed, conv weights unused"),
    "compressive_tiny_max": dict(_TINY, compression="max", clip=3.8,
                                 description="Compressive Transformer, max-pooling compression (no parameters)"),
    "compressive_tiny_mean": dict(_TINY, compression="mean", clip=3.8,
                                  description="Compressive Transformer, mean-pooling compression (no parameters)"),
}


def run_config(name, c):
    cfg = C.ModelConfig(vocab=c["vocab"], d_model=c["d_model"], heads=c["heads"], d_ff=c["d_ff"],
                        n_layers=c["n_layers"], compression_rate=c["compression_rate"],
                        compression=c["compression"], n_pos=N_POS)
    model = C.AutoregressiveModel(cfg).double()
    # Initialise a conv model and copy what this one has, so that configurations differing only in
    # the compression function (or in c_mem_len) start from the same weights.
    donor = C.AutoregressiveModel(dataclasses.replace(cfg, compression="conv")).double()
    C.random_init(donor, c["seed"])
    model.load_state_dict({k: v for k, v in donor.state_dict().items() if k in model.state_dict()})
    out = {f"init.{k}": v.detach().clone() for k, v in model.state_dict().items()}

    Q, B = c["seq_len"], c["batch"]
    g = torch.Generator().manual_seed(1000 + c["seed"])
    stream = torch.randint(0, cfg.vocab, (N_SEGMENTS * Q + 1, B), generator=g)
    data = torch.stack([stream[s * Q : s * Q + Q] for s in range(N_SEGMENTS)])
    target = torch.stack([stream[s * Q + 1 : s * Q + Q + 1] for s in range(N_SEGMENTS)])
    out["data"], out["target"] = data, target

    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY,
                                  foreach=False)
    memory = C.Memory(cfg.n_layers, c["mem_len"], c["c_mem_len"], cfg.compression_rate)
    norms = []
    for s in range(N_SEGMENTS):
        r = C.train_step(model, optimizer, memory, data[s], target[s], c["clip"])
        out[f"seg{s}.logits"] = r["logits"]
        out[f"seg{s}.ce_loss"] = r["ce_loss"]
        out[f"seg{s}.ar_loss"] = r["ar_loss"]
        out[f"seg{s}.grad_norm"] = r["grad_norm"]
        norms.append(r["grad_norm"].item())
        for k, v in r["grads"].items():
            out[f"seg{s}.grad.{k}"] = v
        for k, v in model.named_parameters():
            out[f"seg{s}.after.{k}"] = v.detach().clone()
        for l in range(cfg.n_layers):
            for kind, t in (("mem", memory.mem[l]), ("c_mem", memory.c_mem[l])):
                if t is not None and t.shape[0] > 0:
                    out[f"seg{s}.{kind}.{l}"] = t.clone()

    # The clip must bite on some steps and not on others, with a margin either way.
    clipped = [n > c["clip"] for n in norms]
    assert any(clipped) and not all(clipped) and all(abs(n / c["clip"] - 1) > 0.01 for n in norms), (name, norms)

    meta = {k: str(c[k]) for k in ("d_model", "heads", "d_ff", "n_layers", "vocab", "compression_rate",
                                   "compression", "seq_len", "mem_len", "c_mem_len", "batch", "clip", "seed")}
    meta.update(n_pos=str(N_POS), n_segments=str(N_SEGMENTS), lr=repr(LR), weight_decay=repr(WEIGHT_DECAY),
                betas=f"{BETAS[0]!r},{BETAS[1]!r}", eps=repr(EPS),
                optimizer="torch.optim.AdamW(foreach=False); unreached parameters get grad 0 and are stepped",
                clip_rule="torch.nn.utils.clip_grad_norm_: g *= min(1, clip / (norm + 1e-6))",
                empty_memory="seg{s}.mem.{l} / seg{s}.c_mem.{l} omitted when that memory is empty",
                description=c["description"])
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
