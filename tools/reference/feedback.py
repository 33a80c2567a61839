#!/usr/bin/env python3
"""An independent PyTorch reference for mnemo's Feedback Transformer, both variants.

Written from the math in docs/reference.md (§12-17), not translated from labml; the
parameter names match labml's state_dict so checkpoints are interchangeable:

    src_embed.weight                                             [vocab, D]
    transformer.layers.{l}.attn.query.linear.weight              [D, D]   (no bias)
    transformer.layers.{l}.attn.key.linear.weight                [D, D]   (no bias; original variant only)
    transformer.layers.{l}.attn.value.linear.weight / .bias      [D, D] / [D]      (original variant only)
    transformer.layers.{l}.attn.output.weight / .bias
    transformer.layers.{l}.attn.key_pos_embeddings               R [P, heads, d_k]
    transformer.layers.{l}.attn.key_pos_bias                     S [P, heads]
    transformer.layers.{l}.attn.query_pos_bias                   u [heads, d_k]
    transformer.layers.{l}.feed_forward.layer1.weight / .bias    [d_ff, D] / [d_ff]
    transformer.layers.{l}.feed_forward.layer2.weight / .bias    [D, d_ff] / [D]
    transformer.layers.{l}.norm_self_attn.weight / .bias, .norm_ff.weight / .bias
    transformer.weights                                          [n_layers + 1]   (ones at initialisation)
    transformer.key.linear.weight, transformer.value.linear.weight  [D, D]  (shared-KV variant only, no bias)
    transformer.norm.weight / .bias
    generator.weight / .bias                                     [vocab, D] / [vocab]

The recurrence, step by step (tokens [T, B], sequence-major), every sequence starting from an empty memory:

    y_0 = embed(token_t);   for each layer:  x += attn(LN(x), K[0..t-1], V[0..t-1])  (skipped at t = 0)
                                             x += FFN(LN(x))
    mem_t = Σ_l softmax(w)_l · y_l   (y_l: the output of layer l, y_0 the embedding)
    score_j = ((q + u)·k_j + q·R[P − (t − j)] + S[P − (t − j)]) / sqrt(d_k),  softmax over j < t.

The original variant re-projects the whole stacked memory with each layer's key/value projections at every
step (as labml does); the shared variant projects each memory slot once with the shared projections and
stacks the results (the last slot's keys/values are computed and never read). Plain Python loops over
steps with torch autograd: slow, but transparent. Works in any floating dtype; the golden data uses float64.

As a script, evaluates a checkpoint on token sequences (the Python twin of `mnemo_eval --model feedback`):

    feedback.py --model feedback|feedback-kv --checkpoint W.safetensors --tokens T.safetensors
                --out O.safetensors --seq-len N [--n-pos P] [--mem-len 0] [--c-mem-len 0]

T.safetensors holds `tokens` [batch, n_tokens] (I64 or I32). Sequence s reads tokens[:, s·N : s·N + N] and
predicts tokens[:, s·N + 1 : s·N + N + 1]; each sequence starts from an empty memory (no memory is carried
between sequences, so --mem-len and --c-mem-len, accepted for a uniform command line, must be 0).
O.safetensors: logits F32 [n_sequences, batch, N, vocab], ce_loss F32 [n_sequences], and ar_loss F32
[n_sequences], all zeros (the model has no reconstruction loss), so that the file has the same tensors as
mnemo_eval's and tools/reference_eval.py's.
"""
import argparse
import math
import os
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from compressive import LAYER_NORM_EPS, FeedForward, HeadProjection, random_init  # noqa: E402,F401
import safetensors_io as st  # noqa: E402


@dataclass(frozen=True)
class FeedbackConfig:
    vocab: int
    d_model: int
    heads: int
    d_ff: int
    n_layers: int
    kv_shared: bool = False  # False: the original model (per-layer K/V); True: FeedbackTransformerKV
    n_pos: int = 4096  # P: the positional tables have P rows

    def __post_init__(self):
        if self.d_model % self.heads != 0:
            raise ValueError(f"d_model {self.d_model} is not a multiple of heads {self.heads}")


class FeedbackAttention(nn.Module):
    """One query per batch row against the t earlier memory slots; keys/values come in projected."""

    def __init__(self, heads: int, d_model: int, n_pos: int, own_kv: bool):
        super().__init__()
        self.heads = heads
        self.d_k = d_model // heads
        self.P = n_pos
        self.scale = 1.0 / math.sqrt(self.d_k)
        self.query = HeadProjection(d_model, heads, bias=False)
        if own_kv:
            self.key = HeadProjection(d_model, heads, bias=False)
            self.value = HeadProjection(d_model, heads, bias=True)
        self.output = nn.Linear(d_model, d_model)
        self.key_pos_embeddings = nn.Parameter(torch.zeros(n_pos, heads, self.d_k))
        self.key_pos_bias = nn.Parameter(torch.zeros(n_pos, heads))
        self.query_pos_bias = nn.Parameter(torch.zeros(heads, self.d_k))

    def forward(self, z: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """z [B, D]; k, v [t, B, heads, d_k] (slots oldest first) -> [B, D]."""
        t = k.shape[0]
        if t > self.P:
            raise ValueError(f"{t} memory slots exceed the {self.P} relative positions (n_pos)")
        q = self.query(z)  # [B, H, d_k]
        rows = self.P - (t - torch.arange(t, device=z.device))  # slot j reads table row P − (t − j)
        R = self.key_pos_embeddings[rows]  # [t, H, d_k]
        S = self.key_pos_bias[rows]  # [t, H]
        content = torch.einsum("bhd,jbhd->jbh", q + self.query_pos_bias, k)
        position = torch.einsum("bhd,jhd->jbh", q, R) + S[:, None, :]
        attn = torch.softmax((content + position) * self.scale, dim=0)  # over the memory slots
        ctx = torch.einsum("jbh,jbhd->bhd", attn, v).reshape(z.shape[0], -1)
        return self.output(ctx)


class FeedbackLayer(nn.Module):
    def __init__(self, cfg: FeedbackConfig):
        super().__init__()
        self.attn = FeedbackAttention(cfg.heads, cfg.d_model, cfg.n_pos, own_kv=not cfg.kv_shared)
        self.feed_forward = FeedForward(cfg.d_model, cfg.d_ff)
        self.norm_self_attn = nn.LayerNorm(cfg.d_model, eps=LAYER_NORM_EPS)
        self.norm_ff = nn.LayerNorm(cfg.d_model, eps=LAYER_NORM_EPS)

    def forward(self, x, k, v):
        if k is not None:  # no memory at the first step: the attention sub-layer is skipped entirely
            x = x + self.attn(self.norm_self_attn(x), k, v)
        return x + self.feed_forward(self.norm_ff(x))


class FeedbackTransformer(nn.Module):
    def __init__(self, cfg: FeedbackConfig):
        super().__init__()
        self.cfg = cfg
        self.layers = nn.ModuleList([FeedbackLayer(cfg) for _ in range(cfg.n_layers)])
        self.norm = nn.LayerNorm(cfg.d_model, eps=LAYER_NORM_EPS)
        self.weights = nn.Parameter(torch.ones(cfg.n_layers + 1))
        if cfg.kv_shared:
            self.key = HeadProjection(cfg.d_model, cfg.heads, bias=False)
            self.value = HeadProjection(cfg.d_model, cfg.heads, bias=False)

    def forward(self, x_seq: torch.Tensor) -> torch.Tensor:
        """x_seq [T, B, D] (embeddings) -> LN(last layer's output) [T, B, D]."""
        mix = torch.softmax(self.weights, dim=0)
        outputs, mem, keys, values = [], [], [], []
        for t in range(x_seq.shape[0]):
            x = x_seq[t]
            ys = [x]
            for layer in self.layers:
                k = v = None
                if t > 0:
                    if self.cfg.kv_shared:
                        k, v = torch.stack(keys), torch.stack(values)
                    else:  # re-project every slot with this layer's projections, as the reference
                        m = torch.stack(mem)
                        k, v = layer.attn.key(m), layer.attn.value(m)
                x = layer(x, k, v)
                ys.append(x)
            m_t = sum(mix[l] * y for l, y in enumerate(ys))
            mem.append(m_t)
            if self.cfg.kv_shared:
                keys.append(self.key(m_t))
                values.append(self.value(m_t))
            outputs.append(x)
        return self.norm(torch.stack(outputs))


class AutoregressiveModel(nn.Module):
    """Embedding (no scaling, no absolute positions) -> FeedbackTransformer -> Linear to logits."""

    def __init__(self, cfg: FeedbackConfig):
        super().__init__()
        self.cfg = cfg
        self.src_embed = nn.Embedding(cfg.vocab, cfg.d_model)
        self.transformer = FeedbackTransformer(cfg)
        self.generator = nn.Linear(cfg.d_model, cfg.vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [T, B] -> logits [T, B, vocab], from an empty memory."""
        return self.generator(self.transformer(self.src_embed(tokens)))


def train_step(model: AutoregressiveModel, optimizer, tokens, targets, clip: float):
    """forward, mean CE, backward (through time), clip_grad_norm_, optimizer step.

    Returns logits, loss (0-d), grad_norm (before clipping) and grads (name -> gradient before clipping).
    """
    logits = model(tokens)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
    for p in model.parameters():
        p.grad = None
    loss.backward()
    named = list(model.named_parameters())
    for _, p in named:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    grads = {n: p.grad.detach().clone() for n, p in named}
    norm = torch.nn.utils.clip_grad_norm_([p for _, p in named], clip)
    optimizer.step()
    for p in model.parameters():
        p.grad = None
    return {"logits": logits.detach(), "loss": loss.detach(), "grad_norm": norm.detach(), "grads": grads}


# ---------------------------------------------------------------------------------------------------
# Checkpoints and evaluation
# ---------------------------------------------------------------------------------------------------


def config_from_state_dict(sd, kv_shared=None, n_pos=None) -> FeedbackConfig:
    """Sizes from tensor shapes: vocab, d_model (src_embed), n_layers, d_ff, heads and P (key_pos_bias
    [P, heads]); the variant from the presence of transformer.key.linear.weight. A given kv_shared or
    n_pos must agree with the checkpoint."""
    vocab, d_model = sd["src_embed.weight"].shape
    n_layers = 0
    while f"transformer.layers.{n_layers}.norm_ff.weight" in sd:
        n_layers += 1
    if n_layers == 0:
        raise ValueError("the checkpoint has no transformer layers")
    d_ff = sd["transformer.layers.0.feed_forward.layer1.weight"].shape[0]
    rows, heads = sd["transformer.layers.0.attn.key_pos_bias"].shape
    if n_pos is not None and n_pos != rows:
        raise ValueError(f"the positional tables have {rows} rows, but n_pos is {n_pos}")
    shared = "transformer.key.linear.weight" in sd
    if kv_shared is not None and kv_shared != shared:
        want = "feedback-kv (transformer.key.linear.weight)" if kv_shared else "feedback (per-layer attn.key)"
        raise ValueError(f"the checkpoint is not a {want} model")
    return FeedbackConfig(vocab=int(vocab), d_model=int(d_model), heads=int(heads), d_ff=int(d_ff),
                          n_layers=n_layers, kv_shared=shared, n_pos=int(rows))


def load_model(sd, cfg: FeedbackConfig, dtype=torch.float64) -> AutoregressiveModel:
    """Builds the model and loads `sd` strictly (every tensor used, none missing, shapes equal)."""
    model = AutoregressiveModel(cfg).to(dtype)
    own = model.state_dict()
    extra = [k for k in sd if k not in own]
    missing = [k for k in own if k not in sd]
    if extra or missing:
        raise ValueError(f"checkpoint mismatch: unexpected {extra}, missing {missing}")
    for k, v in own.items():
        if tuple(sd[k].shape) != tuple(v.shape):
            raise ValueError(f"{k}: shape {tuple(sd[k].shape)} in the checkpoint, {tuple(v.shape)} expected")
    model.load_state_dict({k: sd[k].to(dtype) for k in own})
    return model


@torch.no_grad()
def evaluate(sd, tokens: torch.Tensor, seq_len: int, kv_shared=None, n_pos=None, dtype=torch.float64):
    """Evaluates checkpoint `sd` on tokens [batch, n_tokens]: returns (logits [S, B, N, V], ce [S]).

    Sequence s reads tokens[:, s·N : s·N + N] and predicts the next token of each; each sequence starts
    from an empty memory. S = (n_tokens − 1) // N.
    """
    cfg = config_from_state_dict(sd, kv_shared, n_pos)
    model = load_model(sd, cfg, dtype)
    model.eval()
    if tokens.dim() != 2:
        raise ValueError(f"tokens must be [batch, n_tokens], got {tuple(tokens.shape)}")
    tokens = tokens.long()
    if tokens.numel() and (tokens.min() < 0 or tokens.max() >= cfg.vocab):
        raise ValueError(f"tokens must lie in [0, {cfg.vocab})")
    N = seq_len
    if N < 1:
        raise ValueError("--seq-len must be positive")
    if N - 1 > cfg.n_pos:
        raise ValueError(f"a sequence of {N} steps needs {N - 1} relative positions, more than n_pos {cfg.n_pos}")
    n_seq = (tokens.shape[1] - 1) // N
    if n_seq < 1:
        raise ValueError(f"{tokens.shape[1]} tokens do not make one sequence of {N} plus its target")
    logits_all, ce_all = [], []
    for s in range(n_seq):
        x = tokens[:, s * N : s * N + N].t().contiguous()  # [N, B]
        y = tokens[:, s * N + 1 : s * N + N + 1].t().contiguous()
        logits = model(x)
        ce_all.append(F.cross_entropy(logits.reshape(-1, cfg.vocab), y.reshape(-1)))
        logits_all.append(logits.transpose(0, 1))  # [B, N, V]
    return torch.stack(logits_all), torch.stack(ce_all)


def main(argv=None):
    p = argparse.ArgumentParser(description="Evaluates a Feedback Transformer checkpoint (PyTorch reference).")
    p.add_argument("--model", choices=("feedback", "feedback-kv"), required=True)
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--tokens", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--seq-len", type=int, required=True)
    p.add_argument("--n-pos", type=int, default=None, help="default: the checkpoint's (key_pos_bias rows)")
    p.add_argument("--mem-len", type=int, default=0, help="0: no memory is carried (accepted for uniformity)")
    p.add_argument("--c-mem-len", type=int, default=0, help="0: no compressed memory (accepted for uniformity)")
    args = p.parse_args(argv)
    try:
        if args.mem_len != 0 or args.c_mem_len != 0:
            raise ValueError("the Feedback Transformer carries no memory between sequences: "
                             "--mem-len and --c-mem-len must be 0")
        sd, _ = st.load(args.checkpoint)
        tok, _ = st.load(args.tokens)
        if "tokens" not in tok or tok["tokens"].dtype not in (torch.int64, torch.int32):
            raise ValueError(f"{args.tokens}: needs an I64 or I32 tensor named 'tokens'")
        logits, ce = evaluate(sd, tok["tokens"], args.seq_len, args.model == "feedback-kv", args.n_pos)
    except (ValueError, KeyError) as e:
        print(f"feedback.py: error: {e}", file=sys.stderr)
        return 1
    st.save(args.out, {"logits": logits.float(), "ce_loss": ce.float(), "ar_loss": torch.zeros_like(ce).float()})
    for s in range(ce.shape[0]):  # the same lines as mnemo_eval, so the two can be diffed
        print(f"segment {s}: ce {ce[s].item():.6f} ar 0")
    return 0


if __name__ == "__main__":
    sys.exit(main())
