#!/usr/bin/env python3
"""Self-checks for the PyTorch reference (plain asserts):

    /usr/bin/python3 tools/reference/test_reference.py

(a) the direct-indexing positional term equals Transformer-XL's shift_right trick over table rows
    [P − K, P + Q) at every unmasked position (and differs from the seed text's [P − Q, P + K) slice
    whenever there is memory);
(b) torch.autograd.gradcheck in float64 of the logits and the CE loss with respect to every
    parameter, for one segment with memory and compressed memory, and of the attention-
    reconstruction loss with respect to the compression conv;
(c) the attention-reconstruction loss gives zero gradient to every parameter except compress.conv.*;
(d) a safetensors round trip (every supported dtype, metadata, empty and 0-d tensors, byte-stable);
plus the state_dict names, the memory merge rules, and the reference_eval and feedback.py CLIs end to end.
"""
import math
import os
import subprocess
import sys
import tempfile

import torch
from torch.nn.utils.stateless import functional_call

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import compressive as C  # noqa: E402
import feedback as FB  # noqa: E402
import safetensors_io as st  # noqa: E402

torch.set_default_dtype(torch.float64)


# ---- (a) positional term ---------------------------------------------------------------------------


def shift_right(x):
    """Transformer-XL's shift (labml): row i of x moved i columns to the right, wrapping rows."""
    zero_pad = x.new_zeros(x.shape[0], 1, *x.shape[2:])
    x_padded = torch.cat([x, zero_pad], dim=1)
    x_padded = x_padded.view(x.shape[1] + 1, x.shape[0], *x.shape[2:])
    return x_padded[:-1].view_as(x)


def shifted_position_scores(q, R, S, K, P, lo, hi):
    """labml's B' + D' with the table slice [lo, hi), shifted, keeping the last K columns: [Q, K, B, H]."""
    b = torch.einsum("ibhd,jhd->ijbh", q, R[lo:hi])
    d = S[lo:hi][None, :, None, :]
    return shift_right(b + d)[:, -K:]


def test_positional_term():
    g = torch.Generator().manual_seed(1)
    P, B, H, d = 16, 2, 3, 4
    for Q in (1, 2, 5, 7):
        for mem_len in (0, 1, 3, 9):
            K = mem_len + Q
            if K > P:
                continue
            q = torch.randn(Q, B, H, d, generator=g)
            R = torch.randn(2 * P, H, d, generator=g)
            S = torch.randn(2 * P, H, generator=g)
            direct = C.relative_position_scores(q, R, S, mem_len, P).permute(2, 3, 0, 1)  # [Q, K, B, H]
            # The explicit formula, one (i, j) at a time.
            for i in range(Q):
                for j in range(K):
                    delta = mem_len + i - j
                    want = torch.einsum("bhd,hd->bh", q[i], R[P - delta]) + S[P - delta]
                    assert torch.allclose(direct[i, j], want, atol=1e-13), (Q, mem_len, i, j)
            visible = ~C.future_mask(Q, mem_len)
            shifted = shifted_position_scores(q, R, S, K, P, P - K, P + Q)
            assert torch.allclose(direct[visible], shifted[visible], atol=1e-13), (Q, mem_len)
            # The seed text prints the slice as [P − Q, P + K): that is δ = i − j, ignoring memory.
            literal = shifted_position_scores(q, R, S, K, P, P - Q, P + K)
            same = torch.allclose(direct[visible], literal[visible], atol=1e-13)
            assert same == (mem_len == 0), (Q, mem_len)
    print("(a) positional term: direct indexing == shift_right over rows [P-K, P+Q) at unmasked positions")


# ---- (b), (c) gradients ----------------------------------------------------------------------------


def tiny_setup(compression="conv"):
    cfg = C.ModelConfig(vocab=5, d_model=4, heads=2, d_ff=6, n_layers=2, compression_rate=2,
                        compression=compression, n_pos=8)
    model = C.AutoregressiveModel(cfg)
    C.random_init(model, 7)
    g = torch.Generator().manual_seed(3)
    Q, B, M, CM = 3, 2, 3, 2  # K = 2 + 3 + 3 = 8 = P: the largest span the tables allow
    tokens = torch.randint(0, cfg.vocab, (Q, B), generator=g)
    targets = torch.randint(0, cfg.vocab, (Q, B), generator=g)
    mem = [torch.randn(M, B, cfg.d_model, generator=g) for _ in range(cfg.n_layers)]
    c_mem = [torch.randn(CM, B, cfg.d_model, generator=g) for _ in range(cfg.n_layers)]
    return cfg, model, tokens, targets, mem, c_mem


def test_gradcheck_forward():
    cfg, model, tokens, targets, mem, c_mem = tiny_setup()
    names = [n for n, _ in model.named_parameters()]
    params = tuple(p.detach().clone().requires_grad_(True) for _, p in model.named_parameters())

    def f(*ps):
        logits, _ = functional_call(model, dict(zip(names, ps)), (tokens, mem, c_mem))
        ce = torch.nn.functional.cross_entropy(logits.reshape(-1, cfg.vocab), targets.reshape(-1))
        return logits, ce

    assert torch.autograd.gradcheck(f, params, eps=1e-6, atol=1e-7, rtol=1e-5)
    # The memory's LayerNorm rows feed the gradient of norm_self_attn: without memory it changes.
    logits, _ = model(tokens, mem, c_mem)
    gw = torch.autograd.grad(logits.sum(), model.transformer.layers[0].norm_self_attn.weight)[0]
    logits0, _ = model(tokens)
    gw0 = torch.autograd.grad(logits0.sum(), model.transformer.layers[0].norm_self_attn.weight)[0]
    assert not torch.allclose(gw, gw0)
    print(f"(b) gradcheck of logits and CE w.r.t. all {sum(p.numel() for p in params)} parameters: ok")


class _ARLoss(torch.nn.Module):
    """Wraps attention_reconstruction_loss so functional_call can substitute parameters."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, h, old):
        return C.attention_reconstruction_loss(self.model, h, old)


def test_ar_loss_gradients():
    cfg, model, tokens, targets, mem, c_mem = tiny_setup()
    g = torch.Generator().manual_seed(11)
    h = [torch.randn(3, 2, cfg.d_model, generator=g) for _ in range(cfg.n_layers)]
    old = [torch.randn(4, 2, cfg.d_model, generator=g) for _ in range(cfg.n_layers)]
    wrapper = _ARLoss(model)
    conv_names = [n for n, _ in wrapper.named_parameters() if ".compress.conv." in n]
    conv = tuple(dict(wrapper.named_parameters())[n].detach().clone().requires_grad_(True) for n in conv_names)
    assert len(conv_names) == 2 * cfg.n_layers

    def f(*ps):
        return functional_call(wrapper, dict(zip(conv_names, ps)), (h, old))

    assert torch.autograd.gradcheck(f, conv, eps=1e-6, atol=1e-8, rtol=1e-5)

    # (c) zero gradient everywhere else.
    loss = C.attention_reconstruction_loss(model, h, old)
    assert loss.item() > 0
    named = list(model.named_parameters())
    grads = torch.autograd.grad(loss, [p for _, p in named], allow_unused=True)
    for (n, _), gr in zip(named, grads):
        if ".compress.conv." in n:
            assert gr is not None and gr.abs().sum() > 0, n
        else:
            assert gr is None or torch.count_nonzero(gr) == 0, n
    # Pooling compression has no parameters: the loss is a constant.
    _, pooled, *_ = tiny_setup("mean")
    assert not C.attention_reconstruction_loss(pooled, h, old).requires_grad
    print("(b) gradcheck of the AR loss w.r.t. compress.conv: ok")
    print("(c) the AR loss reaches compress.conv.* only")


# ---- (d) safetensors -------------------------------------------------------------------------------


def test_safetensors_round_trip():
    g = torch.Generator().manual_seed(5)
    tensors = {
        "f64": torch.randn(3, 4, generator=g, dtype=torch.float64),
        "f32": torch.randn(5, generator=g).float(),
        "f16": torch.randn(2, 3, generator=g).half(),
        "bf16": torch.randn(7, generator=g).bfloat16(),
        "i64": torch.tensor([[-(2**62), 3], [5, 2**40]], dtype=torch.int64),
        "i32": torch.arange(-3, 9, dtype=torch.int32).view(3, 4),
        "i16": torch.tensor([-7, 300], dtype=torch.int16),
        "i8": torch.tensor([-128, 127], dtype=torch.int8),
        "u8": torch.tensor([0, 255], dtype=torch.uint8),
        "bool": torch.tensor([True, False, True]),
        "scalar": torch.tensor(2.5, dtype=torch.float64),
        "empty": torch.zeros(0, 3, dtype=torch.float64),
        "strided": torch.randn(4, 6, generator=g, dtype=torch.float64).t(),
    }
    meta = {"b": "two", "a": "one"}
    with tempfile.TemporaryDirectory() as d:
        p1, p2 = os.path.join(d, "x.safetensors"), os.path.join(d, "y.safetensors")
        st.save(p1, tensors, meta)
        st.save(p2, dict(reversed(list(tensors.items()))), dict(reversed(list(meta.items()))))
        with open(p1, "rb") as f1, open(p2, "rb") as f2:
            raw = f1.read()
            assert raw == f2.read(), "save must not depend on dict order"
        n = int.from_bytes(raw[:8], "little")
        assert n % 8 == 0 and raw[8 + n - 1 : 8 + n] in (b" ", b"}")
        back, meta_back = st.load(p1)
    assert meta_back == meta
    assert set(back) == set(tensors)
    for k, v in tensors.items():
        assert back[k].dtype == v.dtype and back[k].shape == v.shape, k
        assert torch.equal(back[k], v), k
    print("(d) safetensors round trip: ok")


# ---- model structure and memory ----------------------------------------------------------------------


def expected_names(n_layers, conv=True):
    names = ["src_embed.weight", "transformer.norm.weight", "transformer.norm.bias", "generator.weight",
             "generator.bias"]
    for l in range(n_layers):
        p = f"transformer.layers.{l}."
        if conv:
            names += [p + "compress.conv.weight", p + "compress.conv.bias"]
        names += [p + "self_attn." + s for s in ("query.linear.weight", "key.linear.weight", "value.linear.weight",
                                                  "value.linear.bias", "output.weight", "output.bias",
                                                  "key_pos_embeddings", "key_pos_bias", "query_pos_bias")]
        names += [p + "feed_forward." + s for s in ("layer1.weight", "layer1.bias", "layer2.weight", "layer2.bias")]
        names += [p + s for s in ("norm_self_attn.weight", "norm_self_attn.bias", "norm_ff.weight", "norm_ff.bias")]
    return names


def test_state_dict_names():
    for compression in ("conv", "max", "mean"):
        cfg = C.ModelConfig(vocab=7, d_model=6, heads=3, d_ff=5, n_layers=2, compression_rate=3,
                            compression=compression, n_pos=4)
        sd = C.AutoregressiveModel(cfg).state_dict()
        assert sorted(sd) == sorted(expected_names(2, compression == "conv")), compression
        assert sd["transformer.layers.1.self_attn.key_pos_embeddings"].shape == (8, 3, 2)
        assert sd["transformer.layers.1.self_attn.key_pos_bias"].shape == (8, 3)
        if compression == "conv":
            assert sd["transformer.layers.0.compress.conv.weight"].shape == (6, 6, 3)
    print("state_dict names: ok")


def test_memory_rules():
    cfg = C.ModelConfig(vocab=5, d_model=4, heads=2, d_ff=6, n_layers=1, compression_rate=3, n_pos=64)
    model = C.AutoregressiveModel(cfg)
    C.random_init(model, 2)
    seg = lambda k: [torch.full((2, 1, 4), float(k)) + torch.arange(2.0)[:, None, None] / 10]  # noqa: E731

    # Compressive: mem_len 4, c 3, c_mem_len 2; two new slots per segment.
    mem = C.Memory(1, mem_len=4, c_mem_len=2, compression_rate=3)
    assert mem.merge(seg(0), model) is None and mem.mem[0].shape[0] == 2
    assert mem.merge(seg(1), model) is None and mem.mem[0].shape[0] == 4
    old = mem.merge(seg(2), model)  # 6 slots: excess 2 -> compress the oldest 3
    assert old[0].shape[0] == 3 and mem.mem[0].shape[0] == 3 and mem.c_mem[0].shape[0] == 1
    assert torch.equal(mem.mem[0][0], seg(1)[0][1])
    with torch.no_grad():
        assert torch.allclose(mem.c_mem[0], model.transformer.layers[0].compress(old[0]))
    old = mem.merge(seg(3), model)  # 5 slots: excess 1 -> compress 3
    assert old[0].shape[0] == 3 and mem.mem[0].shape[0] == 2 and mem.c_mem[0].shape[0] == 2
    newest = mem.c_mem[0][1].clone()
    mem.merge(seg(4), model)  # 4 slots: nothing compressed
    mem.merge(seg(5), model)  # 6 slots: compress 3; c_mem keeps its newest 2
    assert mem.c_mem[0].shape[0] == 2 and torch.equal(mem.c_mem[0][0], newest)

    # Transformer-XL: the newest mem_len slots, nothing compressed, nothing kept beyond mem_len.
    xl = C.Memory(1, mem_len=3, c_mem_len=0, compression_rate=3)
    for k in range(4):
        assert xl.merge(seg(k), model) is None
    assert xl.mem[0].shape[0] == 3 and xl.c_mem[0] is None
    assert torch.equal(xl.mem[0][0], seg(2)[0][1]) and torch.equal(xl.mem[0][2], seg(3)[0][1])
    zero = C.Memory(1, mem_len=0, c_mem_len=0, compression_rate=3)
    zero.merge(seg(0), model)
    assert zero.mem[0].shape[0] == 0

    try:
        C.Memory(1, mem_len=1, c_mem_len=2, compression_rate=3)
        raise AssertionError("mem_len < c − 1 must be rejected")
    except ValueError:
        pass
    # K > P is an error.
    small = C.AutoregressiveModel(C.ModelConfig(vocab=5, d_model=4, heads=2, d_ff=6, n_layers=1,
                                                compression_rate=2, n_pos=4))
    small(torch.zeros(4, 1, dtype=torch.long))
    try:
        small(torch.zeros(3, 1, dtype=torch.long), [torch.zeros(2, 1, 4)], [None])
        raise AssertionError("K > P must be rejected")
    except ValueError:
        pass
    print("memory merge rules: ok")


def test_segment_consistency():
    """A segment split in two with memory gives the same logits as the whole (memory = all of it)."""
    cfg = C.ModelConfig(vocab=6, d_model=8, heads=2, d_ff=10, n_layers=2, compression_rate=2, n_pos=16)
    model = C.AutoregressiveModel(cfg)
    C.random_init(model, 4)
    tokens = torch.randint(0, cfg.vocab, (6, 2), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        whole, _ = model(tokens)
        mem = C.Memory(cfg.n_layers, mem_len=8, c_mem_len=0, compression_rate=2)
        first, new = model(tokens[:4])
        mem.merge(new, model)
        second, _ = model(tokens[4:], mem.mem, mem.c_mem)
    assert torch.allclose(torch.cat((first, second)), whole, atol=1e-12)
    print("segment split with memory == whole sequence: ok")


def test_eval_cli():
    tools = os.path.dirname(HERE)
    with tempfile.TemporaryDirectory() as d:
        ckpt, toks, out = (os.path.join(d, n) for n in ("w.safetensors", "t.safetensors", "o.safetensors"))
        subprocess.run([sys.executable, os.path.join(tools, "make_random_checkpoint.py"), "--vocab", "9",
                        "--d-model", "8", "--heads", "2", "--d-ff", "12", "--n-layers", "2",
                        "--compression-rate", "2", "--n-pos", "32", "--batch", "3", "--n-tokens", "14",
                        "--seed", "5", "--checkpoint", ckpt, "--tokens", toks], check=True)
        subprocess.run([sys.executable, os.path.join(tools, "reference_eval.py"), "--model", "compressive",
                        "--checkpoint", ckpt, "--tokens", toks, "--out", out, "--seq-len", "4", "--mem-len", "4",
                        "--c-mem-len", "2", "--n-pos", "32"], check=True)
        res, _ = st.load(out)
        sd, meta = st.load(ckpt)
        tokens = st.load(toks)[0]["tokens"]
    assert res["logits"].shape == (3, 3, 4, 9) and res["logits"].dtype == torch.float32
    assert res["ce_loss"].shape == (3,) and res["ar_loss"].shape == (3,)
    assert res["ar_loss"][0] == 0 and res["ar_loss"][1] > 0 and res["ar_loss"][2] > 0
    # Recompute segment 0 directly.
    cfg = C.config_from_state_dict(sd, 32)
    model = C.load_model(sd, cfg)
    with torch.no_grad():
        logits, _ = model(tokens[:, :4].t())
    assert torch.allclose(res["logits"][0].double(), logits.transpose(0, 1), atol=1e-5)
    print("reference_eval CLI: ok")


def test_feedback_eval_cli():
    tools = os.path.dirname(HERE)
    with tempfile.TemporaryDirectory() as d:
        ckpt, toks, out = (os.path.join(d, n) for n in ("w.safetensors", "t.safetensors", "o.safetensors"))
        subprocess.run([sys.executable, os.path.join(tools, "make_random_checkpoint.py"), "--model", "feedback-kv",
                        "--vocab", "9", "--d-model", "8", "--heads", "2", "--d-ff", "12", "--n-layers", "2",
                        "--n-pos", "5", "--batch", "3", "--n-tokens", "14", "--seed", "6", "--checkpoint", ckpt,
                        "--tokens", toks], check=True)
        subprocess.run([sys.executable, os.path.join(HERE, "feedback.py"), "--model", "feedback-kv",
                        "--checkpoint", ckpt, "--tokens", toks, "--out", out, "--seq-len", "6", "--mem-len", "0"],
                       check=True, stdout=subprocess.DEVNULL)
        wrong = subprocess.run([sys.executable, os.path.join(HERE, "feedback.py"), "--model", "feedback",
                                "--checkpoint", ckpt, "--tokens", toks, "--out", out, "--seq-len", "6"],
                               capture_output=True, text=True)
        res, _ = st.load(out)
        sd, _ = st.load(ckpt)
        tokens = st.load(toks)[0]["tokens"]
    assert wrong.returncode == 1 and "not a feedback (per-layer attn.key) model" in wrong.stderr
    assert res["logits"].shape == (2, 3, 6, 9) and res["logits"].dtype == torch.float32
    assert res["ce_loss"].shape == (2,) and torch.equal(res["ar_loss"], torch.zeros(2))
    # Segment 1 from an empty memory, recomputed directly.
    model = FB.load_model(sd, FB.config_from_state_dict(sd, kv_shared=True))
    with torch.no_grad():
        logits = model(tokens[:, 6:12].t())
    assert torch.allclose(res["logits"][1].double(), logits.transpose(0, 1), atol=1e-5)
    print("feedback.py CLI: ok")


if __name__ == "__main__":
    test_positional_term()
    test_gradcheck_forward()
    test_ar_loss_gradients()
    test_safetensors_round_trip()
    test_state_dict_names()
    test_memory_rules()
    test_segment_consistency()
    test_eval_cli()
    test_feedback_eval_cli()
    print("all reference checks passed")
