#!/usr/bin/env python3
"""Golden data for mnemo's dilated_conv_compression (include/mnemo/nn/compression/dilated_conv.hpp).

    /usr/bin/python3 tools/golden_dilated.py     # rewrites tests/golden/dilated_compression.safetensors

The Compressive Transformer paper's "stack of dilated convolutions reducing by c", written as PyTorch
does it for c a power of two: log2(c) layers of nn.Conv1d(D, D, kernel_size=2, stride=2) with a ReLU
between consecutive layers (none after the last), applied over time to mem.permute(1, 2, 0)
[batch, D, len] as labml's Conv1dCompression applies its single convolution, the result permuted back
(2, 0, 1) to [len / c, batch, D]. Layer k is `convs.<k>` (an nn.ModuleList, so the state_dict names are
convs.<k>.weight [D, D, 2] and convs.<k>.bias [D]; mnemo prefixes them with the module's name).

Run in float64 on CPU with one thread, so the file is byte-identical from run to run. The loss is
sum(out * grad_out) with a random grad_out, so the gradients below are d loss / d x.

The file holds (F64; D = d_model, B = batch, L = slots):
    __metadata__               d_model, rate, batch, slots, layers, description (strings)
    convs.<k>.weight, .bias    the parameters (PyTorch's default init from the seed, biases shifted so
                               that the hidden ReLUs both pass and block)
    mem                        [L, B, D]
    out                        [L / rate, B, D]
    grad_out                   [L / rate, B, D]
    grad.mem                   [L, B, D]
    grad.convs.<k>.weight, grad.convs.<k>.bias
"""
import math
import os
import sys

import torch
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "reference"))

import safetensors_io as st  # noqa: E402

OUT_PATH = os.path.join(HERE, os.pardir, "tests", "golden", "dilated_compression.safetensors")
D_MODEL, RATE, BATCH, SLOTS, SEED = 6, 4, 2, 8, 5


class DilatedConvCompression(nn.Module):
    """log2(rate) Conv1d(D, D, 2, stride=2) over time with ReLU between: [S, B, D] -> [S / rate, B, D]."""

    def __init__(self, rate: int, d_model: int):
        super().__init__()
        layers = int(round(math.log2(rate)))
        assert rate >= 2 and 2**layers == rate, "rate must be a power of two >= 2"
        self.convs = nn.ModuleList(nn.Conv1d(d_model, d_model, kernel_size=2, stride=2) for _ in range(layers))

    def forward(self, mem: torch.Tensor) -> torch.Tensor:
        x = mem.permute(1, 2, 0)  # [B, D, S]
        for k, conv in enumerate(self.convs):
            x = conv(x)
            if k + 1 < len(self.convs):
                x = torch.relu(x)
        return x.permute(2, 0, 1)  # [S / rate, B, D]


def main():
    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float64)
    torch.manual_seed(SEED)
    model = DilatedConvCompression(RATE, D_MODEL).double()
    with torch.no_grad():
        for conv in model.convs:
            conv.bias.add_(0.1)
    mem = torch.randn(SLOTS, BATCH, D_MODEL, requires_grad=True)
    out = model(mem)
    grad_out = torch.randn_like(out)
    (out * grad_out).sum().backward()

    # The hidden ReLU must both pass and block some values, or the test would not exercise it.
    hidden = torch.relu(model.convs[0](mem.detach().permute(1, 2, 0)))
    assert (hidden > 0).any() and (hidden == 0).any()

    tensors = {k: v.detach().clone() for k, v in model.state_dict().items()}
    tensors["mem"] = mem.detach().clone()
    tensors["out"] = out.detach().clone()
    tensors["grad_out"] = grad_out
    tensors["grad.mem"] = mem.grad.clone()
    for k, p in model.named_parameters():
        tensors[f"grad.{k}"] = p.grad.clone()
    meta = dict(d_model=str(D_MODEL), rate=str(RATE), batch=str(BATCH), slots=str(SLOTS),
                layers=str(len(model.convs)), seed=str(SEED),
                description="log2(rate) x nn.Conv1d(D, D, kernel_size=2, stride=2), ReLU between, over "
                            "mem.permute(1, 2, 0); out permuted (2, 0, 1); loss = sum(out * grad_out)")
    os.makedirs(os.path.dirname(OUT_PATH), exist_ok=True)
    st.save(OUT_PATH, tensors, meta)
    print(f"{os.path.relpath(OUT_PATH)}: {len(tensors)} tensors, {os.path.getsize(OUT_PATH)} bytes")


if __name__ == "__main__":
    main()
