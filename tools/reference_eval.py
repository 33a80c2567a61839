#!/usr/bin/env python3
"""The Python twin of mnemo_eval: evaluates a Compressive Transformer / Transformer-XL checkpoint.

    reference_eval.py --model compressive|xl --checkpoint W.safetensors --tokens T.safetensors
                      --out O.safetensors --seq-len N --mem-len M --c-mem-len K
                      [--n-pos P] [--compression conv|max|mean (default conv)]

Sizes come from the checkpoint's shapes: vocab and d_model from src_embed.weight, n_layers from the
layer count, d_ff from feed_forward.layer1.weight, heads and P from key_pos_bias [2P, heads] (--n-pos,
if given, must agree), and the compression rate from compress.conv.weight's kernel. A checkpoint without
conv weights (max/mean pooling, or Transformer-XL) gives the rate in its "__metadata__" entry
"compression_rate"; Transformer-XL never compresses, so it needs no rate.

T.safetensors holds one integer tensor `tokens` [batch, n_tokens] (I64 or I32). Segment s reads
tokens[:, s·N : s·N + N] and predicts tokens[:, s·N + 1 : s·N + N + 1], so there are
n_segments = (n_tokens − 1) // N segments; the tokens after the last whole segment are ignored.
Each segment runs with the memory carried from the earlier ones, then merges its layer inputs into
the memory (compressing the overflow), exactly as in training.

O.safetensors: logits F32 [n_segments, batch, N, vocab]; ce_loss F32 [n_segments] (mean over
batch·N positions); ar_loss F32 [n_segments] (the attention-reconstruction loss, 0 where nothing
was compressed). "--model xl" means c_mem_len 0, and "--c-mem-len 0" is Transformer-XL for either
model; "--model xl" with a non-zero --c-mem-len is an error. Computation is float64 throughout.
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "reference"))

import compressive as C  # noqa: E402
import safetensors_io as st  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=("compressive", "xl"), required=True)
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--tokens", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--seq-len", type=int, required=True)
    p.add_argument("--mem-len", type=int, required=True)
    p.add_argument("--c-mem-len", type=int, required=True)
    p.add_argument("--n-pos", type=int, default=None, help="default: the checkpoint's (key_pos_bias rows / 2)")
    p.add_argument("--compression", choices=("conv", "max", "mean"), default="conv")
    return p.parse_args(argv)


def evaluate(sd, metadata, tokens, args):
    """Returns (logits [S, B, N, V], ce [S], ar [S]) in float64."""
    if args.n_pos is None:
        args.n_pos = sd["transformer.layers.0.self_attn.key_pos_bias"].shape[0] // 2
    if args.seq_len < 1 or args.mem_len < 0 or args.c_mem_len < 0 or args.n_pos < 1:
        raise ValueError("--seq-len must be positive; --mem-len, --c-mem-len non-negative; --n-pos positive")
    if args.model == "xl" and args.c_mem_len != 0:
        raise ValueError("--model xl is Transformer-XL: --c-mem-len must be 0")
    xl = args.c_mem_len == 0
    rate = metadata.get("compression_rate")
    rate = int(rate) if rate is not None else None
    has_conv = "transformer.layers.0.compress.conv.weight" in sd
    compression = args.compression
    if xl and not has_conv:
        # Nothing is ever compressed: any parameter-free compression stands in.
        compression, rate = "max", rate or 1
    cfg = C.config_from_state_dict(sd, args.n_pos, compression, rate)
    model = C.load_model(sd, cfg, torch.float64)
    model.eval()

    if tokens.dim() != 2:
        raise ValueError(f"tokens must be [batch, n_tokens], got {tuple(tokens.shape)}")
    tokens = tokens.long()
    if tokens.numel() and (tokens.min() < 0 or tokens.max() >= cfg.vocab):
        raise ValueError(f"tokens must lie in [0, {cfg.vocab})")
    N = args.seq_len
    n_segments = (tokens.shape[1] - 1) // N
    if n_segments < 1:
        raise ValueError(f"{tokens.shape[1]} tokens do not make one segment of {N} plus its target")

    memory = C.Memory(cfg.n_layers, args.mem_len, args.c_mem_len, cfg.compression_rate)
    logits_all, ce_all, ar_all = [], [], []
    for s in range(n_segments):
        x = tokens[:, s * N : s * N + N].t().contiguous()  # [N, B]
        y = tokens[:, s * N + 1 : s * N + N + 1].t().contiguous()
        logits, ce, ar = C.eval_segment(model, memory, x, y)
        logits_all.append(logits.transpose(0, 1))  # [B, N, V]
        ce_all.append(ce)
        ar_all.append(ar)
    return torch.stack(logits_all), torch.stack(ce_all), torch.stack(ar_all)


def main(argv=None):
    args = parse_args(argv)
    try:
        sd, metadata = st.load(args.checkpoint)
        tok, _ = st.load(args.tokens)
        if "tokens" not in tok or tok["tokens"].dtype not in (torch.int64, torch.int32):
            raise ValueError(f"{args.tokens}: needs an I64 or I32 tensor named 'tokens'")
        logits, ce, ar = evaluate(sd, metadata, tok["tokens"], args)
    except (ValueError, KeyError) as e:
        print(f"reference_eval: error: {e}", file=sys.stderr)
        return 1
    st.save(args.out, {"logits": logits.float(), "ce_loss": ce.float(), "ar_loss": ar.float()})
    for s in range(ce.shape[0]):
        print(f"segment {s}: ce {ce[s].item():.6f} ar {ar[s].item():.6g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
