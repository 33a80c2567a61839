#!/usr/bin/env python3
"""Writes a random-weight Compressive Transformer or Feedback Transformer checkpoint and a random tokens
file, for checking mnemo_eval against tools/reference_eval.py and tools/reference/feedback.py:

    make_random_checkpoint.py --vocab 11 --d-model 16 --heads 2 --d-ff 24 --n-layers 2
        --compression-rate 2 [--compression conv|max|mean] [--n-pos 16] [--batch 2] [--n-tokens 33]
        [--seed 0] [--dtype f32|f64] [--token-dtype i64|i32]
        --checkpoint W.safetensors --tokens T.safetensors
    make_random_checkpoint.py --model feedback|feedback-kv --vocab 11 --d-model 16 --heads 2 --d-ff 24
        --n-layers 2 [--n-pos 16] ... (no compression flags)

Every parameter is random, the positional tables R, S and u included (compressive.random_init; for the
Feedback Transformer also the layer weights transformer.weights). The checkpoint has labml's state_dict
names and "__metadata__" entries for the sizes (the compression rate among them, which max/mean pooling
checkpoints need since they have no conv weights). n_pos is P: the compressive tables have 2P rows, the
feedback tables P. The tokens file holds `tokens` [batch, n_tokens], uniform in [0, vocab).
The same arguments always give the same bytes.
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "reference"))

import compressive as C  # noqa: E402
import feedback as FB  # noqa: E402
import safetensors_io as st  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description="random checkpoint + tokens for interop checks")
    p.add_argument("--model", choices=("compressive", "feedback", "feedback-kv"), default="compressive")
    p.add_argument("--vocab", type=int, required=True)
    p.add_argument("--d-model", type=int, required=True)
    p.add_argument("--heads", type=int, required=True)
    p.add_argument("--d-ff", type=int, required=True)
    p.add_argument("--n-layers", type=int, required=True)
    p.add_argument("--compression-rate", type=int, help="compressive only (required there)")
    p.add_argument("--compression", choices=("conv", "max", "mean"), help="compressive only (default conv)")
    p.add_argument("--n-pos", type=int, default=16)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--n-tokens", type=int, default=33)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--std", type=float, default=0.3, help="standard deviation of the weights")
    p.add_argument("--dtype", choices=("f32", "f64"), default="f32")
    p.add_argument("--token-dtype", choices=("i64", "i32"), default="i64")
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--tokens", required=True)
    a = p.parse_args(argv)

    sizes = {"vocab": str(a.vocab), "d_model": str(a.d_model), "heads": str(a.heads), "d_ff": str(a.d_ff),
             "n_layers": str(a.n_layers)}
    if a.model == "compressive":
        if a.compression_rate is None:
            p.error("--model compressive needs --compression-rate")
        compression = a.compression or "conv"
        cfg = C.ModelConfig(vocab=a.vocab, d_model=a.d_model, heads=a.heads, d_ff=a.d_ff, n_layers=a.n_layers,
                            compression_rate=a.compression_rate, compression=compression, n_pos=a.n_pos)
        model = C.AutoregressiveModel(cfg).double()
        meta = {**sizes, "compression_rate": str(a.compression_rate), "compression": compression}
    else:
        if a.compression_rate is not None or a.compression is not None:
            p.error(f"--model {a.model} has no compression: --compression-rate and --compression do not apply")
        cfg = FB.FeedbackConfig(vocab=a.vocab, d_model=a.d_model, heads=a.heads, d_ff=a.d_ff, n_layers=a.n_layers,
                                kv_shared=a.model == "feedback-kv", n_pos=a.n_pos)
        model = FB.AutoregressiveModel(cfg).double()
        meta = {"model": a.model, **sizes}
    meta.update({"n_pos": str(a.n_pos), "seed": str(a.seed),
                 "description": "random weights from tools/make_random_checkpoint.py"})
    C.random_init(model, a.seed, std=a.std)
    dtype = torch.float32 if a.dtype == "f32" else torch.float64
    tensors = {k: v.to(dtype) for k, v in model.state_dict().items()}
    st.save(a.checkpoint, tensors, meta)

    g = torch.Generator().manual_seed(a.seed + 1)
    tokens = torch.randint(0, a.vocab, (a.batch, a.n_tokens), generator=g)
    tokens = tokens.to(torch.int64 if a.token_dtype == "i64" else torch.int32)
    st.save(a.tokens, {"tokens": tokens})
    return 0


if __name__ == "__main__":
    sys.exit(main())
