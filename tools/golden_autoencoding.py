#!/usr/bin/env python3
"""Golden data for mnemo's auto-encoding loss (include/mnemo/losses/autoencoding_reconstruction.hpp).

    /usr/bin/python3 tools/golden_autoencoding.py      # rewrites tests/golden/autoencoding.safetensors

The Compressive Transformer's auto-encoding loss (Rae et al., 2019, §3.2) for one layer, in float64
on CPU with one thread (byte-identical from run to run):

    cm   = f_c(m)            labml's Conv1dCompression: Conv1d(D, D, c, stride=c) over m.permute(1, 2, 0)
    m^   = g(cm)             ConvTranspose1d(D, D, c, stride=c) over cm.permute(1, 2, 0), permuted back
    loss = F.mse_loss(m^, m) (mean), m detached

and the same with max-pooling compression (F.max_pool1d, kernel = stride = c; no parameters) and
the same decoder. D = 6, c = 3, batch 2, 4 compressed slots: m is [12, 2, 6].

Tensors (F64; names as mnemo's parameter_set, prefixes `compress` and `decoder`):
    m                                 [12, 2, 6]   the slots compressed away
    compress.conv.weight, .bias       [6, 6, 3], [6]  (PyTorch default init, then fixed)
    decoder.weight, decoder.bias      [6, 6, 3] ([in, out, kernel]), [6]
    conv.cm, conv.reconstruction      [4, 2, 6], [12, 2, 6]
    conv.loss                         0-d
    conv.grad.<param>                 gradients of conv.loss w.r.t. all four tensors above
    max.loss                          0-d, with max pooling as f_c
    max.grad.decoder.weight, .bias    the decoder's gradients of max.loss
"""
import os
import sys

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "reference"))

import safetensors_io as st  # noqa: E402

OUT = os.path.join(HERE, os.pardir, "tests", "golden", "autoencoding.safetensors")
D, RATE, BATCH, SLOTS, SEED = 6, 3, 2, 4, 7


class Conv1dCompression(torch.nn.Module):
    """labml's Conv1dCompression: [S, B, D] -> [B, D, S] -> conv -> [B, D, S/c] -> [S/c, B, D]."""

    def __init__(self, rate, d_model):
        super().__init__()
        self.conv = torch.nn.Conv1d(d_model, d_model, kernel_size=rate, stride=rate)

    def forward(self, mem):
        return self.conv(mem.permute(1, 2, 0)).permute(2, 0, 1)


class ConvTransposeDecoder(torch.nn.Module):
    """[n, B, D] -> [B, D, n] -> ConvTranspose1d -> [B, D, n·c] -> [n·c, B, D]."""

    def __init__(self, rate, d_model):
        super().__init__()
        self.deconv = torch.nn.ConvTranspose1d(d_model, d_model, kernel_size=rate, stride=rate)

    def forward(self, cm):
        return self.deconv(cm.permute(1, 2, 0)).permute(2, 0, 1)


def main():
    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float64)
    torch.manual_seed(SEED)
    compress = Conv1dCompression(RATE, D)
    decoder = ConvTransposeDecoder(RATE, D)
    m = torch.randn(SLOTS * RATE, BATCH, D)

    out = {
        "m": m.clone(),
        "compress.conv.weight": compress.conv.weight.detach().clone(),
        "compress.conv.bias": compress.conv.bias.detach().clone(),
        "decoder.weight": decoder.deconv.weight.detach().clone(),
        "decoder.bias": decoder.deconv.bias.detach().clone(),
    }
    params = {
        "compress.conv.weight": compress.conv.weight,
        "compress.conv.bias": compress.conv.bias,
        "decoder.weight": decoder.deconv.weight,
        "decoder.bias": decoder.deconv.bias,
    }

    # Conv1d compression: gradient into the compression and the decoder.
    cm = compress(m.detach())
    rec = decoder(cm)
    loss = F.mse_loss(rec, m.detach())
    grads = torch.autograd.grad(loss, list(params.values()))
    out["conv.cm"] = cm.detach().clone()
    out["conv.reconstruction"] = rec.detach().clone()
    out["conv.loss"] = loss.detach().clone()
    for name, g in zip(params, grads):
        out[f"conv.grad.{name}"] = g.clone()

    # Max pooling compression: only the decoder has parameters.
    cm_max = F.max_pool1d(m.detach().permute(1, 2, 0), kernel_size=RATE, stride=RATE).permute(2, 0, 1)
    loss_max = F.mse_loss(decoder(cm_max), m.detach())
    g_w, g_b = torch.autograd.grad(loss_max, [decoder.deconv.weight, decoder.deconv.bias])
    out["max.loss"] = loss_max.detach().clone()
    out["max.grad.decoder.weight"] = g_w.clone()
    out["max.grad.decoder.bias"] = g_b.clone()

    meta = dict(d_model=str(D), compression_rate=str(RATE), batch=str(BATCH), compressed_slots=str(SLOTS),
                seed=str(SEED),
                description="auto-encoding loss mse(ConvTranspose1d(f_c(m)), m) with Conv1d and max-pool f_c")
    st.save(OUT, out, meta)
    print(f"{os.path.relpath(OUT)}: {len(out)} tensors, {os.path.getsize(OUT)} bytes, "
          f"conv loss {loss.item():.6f}, max loss {loss_max.item():.6f}")


if __name__ == "__main__":
    main()
