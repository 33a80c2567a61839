#!/usr/bin/env python3
"""Golden data for mnemo's gru_gate (include/mnemo/nn/gru_gate.hpp).

    /usr/bin/python3 tools/golden_gru.py        # rewrites tests/golden/gru_gate.safetensors

The GRU gating of Parisotto et al. (2019) as lucidrains' compressive-transformer-pytorch `GRUGating`:
one torch.nn.GRUCell(D, D) step called as gru(y, x), input y = the sub-layer output, hidden x = the
residual stream. Runs in float64 on CPU with one thread and a fixed seed, so the file is byte-identical
from run to run. The loss is sum(out * r) for a fixed random r, so d loss / d out = r.

The file holds (all F64; ROWS = 5, D = 8):
    __metadata__             d_model, rows, description (strings)
    x, y, r                  [ROWS, D]  hidden (stream), input (sub-layer output), loss weights
    gru.weight_ih            [3D, D]    torch.nn.GRUCell's parameters (rows r | z | n)
    gru.weight_hh            [3D, D]
    gru.bias_ih, gru.bias_hh [3D]
    out                      [ROWS, D]  gru(y, x)
    grad.x, grad.y           [ROWS, D]  d loss / d x, d loss / d y
    grad.gru.<param>         gradients of the four parameters
"""
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "reference"))

import safetensors_io as st  # noqa: E402

OUT_PATH = os.path.join(HERE, os.pardir, "tests", "golden", "gru_gate.safetensors")
D = 8
ROWS = 5
SEED = 7


def main():
    torch.set_num_threads(1)
    torch.manual_seed(SEED)
    gru = torch.nn.GRUCell(D, D).double()  # default init: U(-1/sqrt(D), 1/sqrt(D))
    x = torch.randn(ROWS, D, dtype=torch.float64, requires_grad=True)
    y = torch.randn(ROWS, D, dtype=torch.float64, requires_grad=True)
    r = torch.randn(ROWS, D, dtype=torch.float64)

    out = gru(y, x)
    (out * r).sum().backward()

    tensors = {"x": x.detach().clone(), "y": y.detach().clone(), "r": r, "out": out.detach().clone(),
               "grad.x": x.grad.clone(), "grad.y": y.grad.clone()}
    for name, p in gru.named_parameters():
        tensors[f"gru.{name}"] = p.detach().clone()
        tensors[f"grad.gru.{name}"] = p.grad.clone()
    meta = {"d_model": str(D), "rows": str(ROWS), "seed": str(SEED), "torch": torch.__version__,
            "description": "torch.nn.GRUCell(D, D)(y, x) in float64; loss = sum(out * r)"}
    os.makedirs(os.path.dirname(OUT_PATH), exist_ok=True)
    st.save(OUT_PATH, tensors, meta)
    print(f"{os.path.relpath(OUT_PATH)}: {len(tensors)} tensors, {os.path.getsize(OUT_PATH)} bytes")


if __name__ == "__main__":
    main()
