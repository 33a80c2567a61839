#!/usr/bin/env python3
"""Train the PyTorch reference (tools/reference/compressive.py) on a text file, as examples/train does.

This is the yardstick for "mnemo reaches the loss the PyTorch reference reaches in the same number of
steps": the data pipeline is the trainer's, step for step:

  * vocabulary: the distinct bytes of the file, sorted;
  * a 90/10 split (by bytes) into training and validation text;
  * each part cut into `batch` contiguous streams (stream b = part[b·n, (b+1)·n), n = len // batch),
    read segment after segment (segment s: tokens [s·Q, s·Q + Q), targets the next token); when the
    streams run out they start again with an empty memory;
  * memory carried across segments, merged after the forward pass, attention-reconstruction loss on
    steps that compress, clipping by global norm, then the optimizer.

Optimizers: `adam-warmup` (labml's AdamWarmup, the reference experiment's "AdamW": docs/reference.md §11),
`noam`, or `adamw` (torch.optim.AdamW). Validation: mean cross-entropy over the first
--eval-segments segments of the validation streams, from an empty memory, in bits per character.

    /usr/bin/python3 tools/reference_train.py --data ../shared/data/tinyshakespeare.txt --steps 2000

Defaults are the reference experiment's (d_model 128, heads 4, d_ff 256, 6 layers, seq 8, mem 8,
c_mem 128, rate 2, batch 32, lr 2.5e-4, warm-up 2000, clip 1.0). `--init W.safetensors` starts from
given weights (e.g. a checkpoint examples/train wrote at step 0) so the two runs can be compared from
identical weights.
"""
import argparse
import math
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "reference"))
import compressive as ref  # noqa: E402
import safetensors_io  # noqa: E402

LN2 = math.log(2.0)


class Streams:
    """`batch` contiguous streams over a token tensor, read segment after segment."""

    def __init__(self, tokens: torch.Tensor, batch: int, seq_len: int):
        n = len(tokens) // batch
        if n < seq_len + 1:
            raise SystemExit(f"reference_train: the text is too short for {batch} streams of {seq_len + 1} tokens")
        self.streams = tokens[: n * batch].view(batch, n)  # [B, n]
        self.seq_len = seq_len
        self.per_pass = (n - 1) // seq_len
        self.pos = 0

    def next(self):
        """(inputs, targets) [Q, B] and whether this segment starts a new pass (memory reset)."""
        restart = self.pos == 0
        s = self.pos * self.seq_len
        x = self.streams[:, s : s + self.seq_len].t().contiguous()
        y = self.streams[:, s + 1 : s + self.seq_len + 1].t().contiguous()
        self.pos = (self.pos + 1) % self.per_pass
        return x, y, restart


class LabmlAdam:
    """labml's Adam update with AdamWarmup or Noam rates (docs/reference.md §11, §17)."""

    def __init__(self, params, lr, warmup, schedule, d_model, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0):
        self.params = list(params)
        self.lr, self.warmup, self.schedule, self.d_model = lr, warmup, schedule, d_model
        self.b1, self.b2, self.eps, self.wd = betas[0], betas[1], eps, weight_decay
        self.m = [torch.zeros_like(p) for p in self.params]
        self.v = [torch.zeros_like(p) for p in self.params]
        self.t = 0

    def rate(self, t):
        if self.schedule == "noam":
            return self.lr * self.d_model ** -0.5 * min(t ** -0.5, t * self.warmup ** -1.5)
        return 1e-8 + t * self.lr / self.warmup if t < self.warmup else self.lr

    @torch.no_grad()
    def step(self):
        self.t += 1
        t = self.t
        lr_t = self.rate(t)
        for p, m, v in zip(self.params, self.m, self.v):
            g = p.grad if p.grad is not None else torch.zeros_like(p)
            if self.wd:
                p.mul_(1 - self.lr * self.wd)
            m.mul_(self.b1).add_(g, alpha=1 - self.b1)
            v.mul_(self.b2).addcmul_(g, g, value=1 - self.b2)
            step = lr_t * math.sqrt(1 - self.b2 ** t) / (1 - self.b1 ** t)
            p.addcdiv_(m, v.sqrt().add_(self.eps), value=-step)

    def zero_grad(self, set_to_none=True):
        for p in self.params:
            p.grad = None


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--d-ff", type=int, default=256)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--rate", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=8)
    ap.add_argument("--mem-len", type=int, default=8)
    ap.add_argument("--c-mem-len", type=int, default=128)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--n-pos", type=int, default=4096)
    ap.add_argument("--lr", type=float, default=2.5e-4)
    ap.add_argument("--warmup", type=int, default=2000)
    ap.add_argument("--optimizer", choices=["adam-warmup", "noam", "adamw"], default="adam-warmup")
    ap.add_argument("--weight-decay", type=float, default=0.0)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--compression", choices=["conv", "max", "mean"], default="conv")
    ap.add_argument("--log-every", type=int, default=100)
    ap.add_argument("--eval-every", type=int, default=500)
    ap.add_argument("--eval-segments", type=int, default=64)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--init", help="start from these weights (safetensors, state_dict names)")
    a = ap.parse_args()

    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    raw = open(a.data, "rb").read()
    if not raw:
        raise SystemExit(f"reference_train: '{a.data}' is empty")
    vocab = sorted(set(raw))
    index = {b: i for i, b in enumerate(vocab)}
    tokens = torch.tensor([index[b] for b in raw], dtype=torch.long)
    split = len(raw) * 9 // 10
    train, valid = Streams(tokens[:split], a.batch, a.seq_len), tokens[split:]

    cfg = ref.ModelConfig(vocab=len(vocab), d_model=a.d_model, heads=a.heads, d_ff=a.d_ff, n_layers=a.layers,
                          compression_rate=a.rate, compression=a.compression, n_pos=a.n_pos)
    model = ref.AutoregressiveModel(cfg).float()
    if a.init:
        sd, _ = safetensors_io.load(a.init)
        model.load_state_dict({k: v.float() for k, v in sd.items()}, strict=True)
    c_mem_len = a.c_mem_len
    if a.optimizer == "adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=a.weight_decay, foreach=False)
    else:
        opt = LabmlAdam(model.parameters(), a.lr, a.warmup, "noam" if a.optimizer == "noam" else "warmup",
                        a.d_model, weight_decay=a.weight_decay)
    print(f"reference_train: {len(raw)} bytes, vocabulary {len(vocab)}, "
          f"{sum(p.numel() for p in model.parameters())} parameters, {a.optimizer}, torch threads {a.threads}")

    def validate():
        vs = Streams(valid, a.batch, a.seq_len)
        memory = ref.Memory(a.layers, a.mem_len, c_mem_len, a.rate)
        total, n = 0.0, min(a.eval_segments, vs.per_pass)
        for _ in range(n):
            x, y, _ = vs.next()
            _, ce, _ = ref.eval_segment(model, memory, x, y)
            total += float(ce)
        return total / n / LN2

    memory = ref.Memory(a.layers, a.mem_len, c_mem_len, a.rate)
    t0, run_loss, run_n = time.time(), 0.0, 0
    for step in range(1, a.steps + 1):
        x, y, restart = train.next()
        if restart:
            memory = ref.Memory(a.layers, a.mem_len, c_mem_len, a.rate)
        mem, c_mem = ref._mem_lists(memory)
        logits, new_mem = model(x, mem, c_mem)
        old = memory.merge(new_mem, model)
        ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        ar = ref.attention_reconstruction_loss(model, new_mem, old) if old is not None else torch.zeros_like(ce)
        opt.zero_grad(set_to_none=True)
        (ce + ar).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), a.clip)
        opt.step()
        run_loss, run_n = run_loss + float(ce), run_n + 1
        if step % a.log_every == 0 or step == a.steps:
            ms = (time.time() - t0) / step * 1e3
            print(f"step {step:6d}  train {run_loss / run_n / LN2:.4f} bits/char  ar {float(ar):.5f}  {ms:.1f} ms/step",
                  flush=True)
            run_loss, run_n = 0.0, 0
        if step % a.eval_every == 0 or step == a.steps:
            print(f"step {step:6d}  validation {validate():.4f} bits/char", flush=True)


if __name__ == "__main__":
    main()
