"""An independent PyTorch reference for mnemo's Compressive Transformer and Transformer-XL.

Written from the math in docs/reference.md (§1-11), not translated from labml;
the parameter names match labml's state_dict so checkpoints are interchangeable:

    src_embed.weight                                            [vocab, D]
    transformer.layers.{l}.compress.conv.weight / .bias         [D, D, c] / [D]   (conv compression only)
    transformer.layers.{l}.self_attn.query.linear.weight        [D, D]     (no bias)
    transformer.layers.{l}.self_attn.key.linear.weight          [D, D]     (no bias)
    transformer.layers.{l}.self_attn.value.linear.weight / .bias
    transformer.layers.{l}.self_attn.output.weight / .bias
    transformer.layers.{l}.self_attn.key_pos_embeddings         R [2P, heads, d_k]
    transformer.layers.{l}.self_attn.key_pos_bias               S [2P, heads]
    transformer.layers.{l}.self_attn.query_pos_bias             u [heads, d_k]
    transformer.layers.{l}.feed_forward.layer1.weight / .bias   [d_ff, D] / [d_ff]
    transformer.layers.{l}.feed_forward.layer2.weight / .bias   [D, d_ff] / [D]
    transformer.layers.{l}.norm_self_attn.weight / .bias, .norm_ff.weight / .bias
    transformer.norm.weight / .bias
    generator.weight / .bias                                    [vocab, D] / [vocab]

Tensors are sequence-major, [seq, batch, d_model]. Everything works in any floating dtype and on
any device; the golden data uses float64.

Relative attention (per head, d_k = D / heads, L_mem = compressed + ordinary memory slots, K = L_mem + Q):

    score[i, j] = ((q_i + u)·k_j + q_i·R[P − δ] + S[P − δ]) / sqrt(d_k),   δ = (L_mem + i) − j,

masked to −inf where j > L_mem + i, softmax over j. The positional term is computed by direct
indexing (a gather of the table row P − δ for every (i, j)), not with Transformer-XL's shift trick;
tools/reference/test_reference.py checks the two agree.

Training order per segment (docs/reference.md §8, §10): forward with the carried memory -> merge the
new memory without gradient (compressing with the current weights) -> CE + attention-reconstruction
loss -> backward -> clip -> optimizer step.
"""
import math
from dataclasses import dataclass
from typing import List, Optional

import torch
import torch.nn.functional as F
from torch import nn

LAYER_NORM_EPS = 1e-5


@dataclass(frozen=True)
class ModelConfig:
    """Sizes of an AutoregressiveModel. `compression` is "conv", "max" or "mean"."""

    vocab: int
    d_model: int
    heads: int
    d_ff: int
    n_layers: int
    compression_rate: int
    compression: str = "conv"
    n_pos: int = 4096  # P: the positional tables have 2P rows

    def __post_init__(self):
        if self.d_model % self.heads != 0:
            raise ValueError(f"d_model {self.d_model} is not a multiple of heads {self.heads}")
        if self.compression not in ("conv", "max", "mean"):
            raise ValueError(f"unknown compression {self.compression!r} (conv, max or mean)")
        if self.compression_rate < 1:
            raise ValueError("compression_rate must be at least 1")


# ---------------------------------------------------------------------------------------------------
# Compression functions f_c: [n·c, B, D] -> [n, B, D]
# ---------------------------------------------------------------------------------------------------


class ConvCompression(nn.Module):
    """cm[s] = b + Σ_t W[:, :, t] · m[s·c + t]: a Conv1d with kernel = stride = c over the sequence."""

    def __init__(self, rate: int, d_model: int):
        super().__init__()
        self.rate = rate
        self.conv = nn.Conv1d(d_model, d_model, kernel_size=rate, stride=rate)

    def forward(self, mem: torch.Tensor) -> torch.Tensor:
        # [S, B, D] -> [B, D, S] -> conv -> [B, D, S/c] -> [S/c, B, D]
        return self.conv(mem.permute(1, 2, 0)).permute(2, 0, 1)


class PoolCompression(nn.Module):
    """Max or mean pooling over each group of c consecutive slots; no parameters."""

    def __init__(self, rate: int, mode: str):
        super().__init__()
        self.rate = rate
        self.mode = mode

    def forward(self, mem: torch.Tensor) -> torch.Tensor:
        x = mem.permute(1, 2, 0)
        pool = F.max_pool1d if self.mode == "max" else F.avg_pool1d
        return pool(x, kernel_size=self.rate, stride=self.rate).permute(2, 0, 1)


# ---------------------------------------------------------------------------------------------------
# Relative multi-head attention
# ---------------------------------------------------------------------------------------------------


class HeadProjection(nn.Module):
    """A linear projection whose output is split into heads: [S, B, D] -> [S, B, heads, d_k]."""

    def __init__(self, d_model: int, heads: int, bias: bool):
        super().__init__()
        self.heads = heads
        self.d_k = d_model // heads
        self.linear = nn.Linear(d_model, d_model, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x).view(*x.shape[:-1], self.heads, self.d_k)


def relative_position_scores(q: torch.Tensor, R: torch.Tensor, S: torch.Tensor, mem_len: int, P: int):
    """The positional part q_i·R[P − δ] + S[P − δ] of the scores, unscaled, as [B, heads, Q, K].

    q: [Q, B, heads, d_k]; R: [2P, heads, d_k]; S: [2P, heads]; mem_len = L_mem; K = L_mem + Q.
    δ = L_mem + i − j runs over [−(Q − 1), K − 1], so only table rows r ∈ [P − K + 1, P + Q − 1]
    are touched. We form q_i·R[r] + S[r] for those rows and then pick, for every (i, j), the row
    r = P − δ by an explicit gather: index r − (P − K + 1) = (Q − 1) − i + j.
    Rows above P (δ < 0) are only picked at future positions, which the caller masks.
    """
    Q = q.shape[0]
    K = mem_len + Q
    lo = P - K + 1
    R_rows = R[lo : P + Q]  # [K + Q − 1, heads, d_k]
    S_rows = S[lo : P + Q]  # [K + Q − 1, heads]
    by_row = torch.einsum("ibhd,rhd->bhir", q, R_rows) + S_rows.t()[None, :, None, :]  # [B, H, Q, K+Q−1]
    i = torch.arange(Q, device=q.device)[:, None]
    j = torch.arange(K, device=q.device)[None, :]
    index = (Q - 1) - i + j  # [Q, K], values in [0, K + Q − 2]
    B, H = by_row.shape[0], by_row.shape[1]
    return torch.gather(by_row, 3, index.expand(B, H, Q, K))


class RelativeMultiHeadAttention(nn.Module):
    """Transformer-XL relative attention; query/key without bias, value/output with bias."""

    def __init__(self, heads: int, d_model: int, n_pos: int):
        super().__init__()
        self.heads = heads
        self.d_k = d_model // heads
        self.P = n_pos
        self.scale = 1.0 / math.sqrt(self.d_k)
        self.query = HeadProjection(d_model, heads, bias=False)
        self.key = HeadProjection(d_model, heads, bias=False)
        self.value = HeadProjection(d_model, heads, bias=True)
        self.output = nn.Linear(d_model, d_model)
        self.key_pos_embeddings = nn.Parameter(torch.zeros(2 * n_pos, heads, self.d_k))
        self.key_pos_bias = nn.Parameter(torch.zeros(2 * n_pos, heads))
        self.query_pos_bias = nn.Parameter(torch.zeros(heads, self.d_k))

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """query [Q, B, D] (the segment); key = value [K, B, D] (memory then segment) -> [Q, B, D]."""
        Q, B, D = query.shape
        K = key.shape[0]
        mem_len = K - Q
        if K > self.P:
            raise ValueError(f"{K} keys exceed the {self.P} relative positions (n_pos)")
        q = self.query(query)  # [Q, B, H, d_k]
        k = self.key(key)  # [K, B, H, d_k]
        v = self.value(value)  # [K, B, H, d_k]
        content = torch.einsum("ibhd,jbhd->bhij", q + self.query_pos_bias, k)
        position = relative_position_scores(q, self.key_pos_embeddings, self.key_pos_bias, mem_len, self.P)
        scores = (content + position) * self.scale  # [B, H, Q, K]
        scores = scores.masked_fill(future_mask(Q, mem_len, query.device), float("-inf"))
        attn = torch.softmax(scores, dim=-1)
        out = torch.einsum("bhij,jbhd->ibhd", attn, v).reshape(Q, B, D)
        return self.output(out)


def future_mask(Q: int, mem_len: int, device=None) -> torch.Tensor:
    """[Q, L_mem + Q] bool, True where key j is in the future of query i (j > L_mem + i)."""
    i = torch.arange(Q, device=device)[:, None]
    j = torch.arange(mem_len + Q, device=device)[None, :]
    return j > mem_len + i


# ---------------------------------------------------------------------------------------------------
# Layers and model
# ---------------------------------------------------------------------------------------------------


class FeedForward(nn.Module):
    """Linear(D, d_ff) -> ReLU -> Linear(d_ff, D), both with bias."""

    def __init__(self, d_model: int, d_ff: int):
        super().__init__()
        self.layer1 = nn.Linear(d_model, d_ff)
        self.layer2 = nn.Linear(d_ff, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer2(F.relu(self.layer1(x)))


class CompressiveTransformerLayer(nn.Module):
    """Pre-LN layer: x += attn(LN(x), LN([c_mem, mem, x])); x += ff(LN(x))."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        if cfg.compression == "conv":
            self.compress = ConvCompression(cfg.compression_rate, cfg.d_model)
        else:
            self.compress = PoolCompression(cfg.compression_rate, cfg.compression)
        self.self_attn = RelativeMultiHeadAttention(cfg.heads, cfg.d_model, cfg.n_pos)
        self.feed_forward = FeedForward(cfg.d_model, cfg.d_ff)
        self.norm_self_attn = nn.LayerNorm(cfg.d_model, eps=LAYER_NORM_EPS)
        self.norm_ff = nn.LayerNorm(cfg.d_model, eps=LAYER_NORM_EPS)

    def forward(self, x: torch.Tensor, mem: Optional[torch.Tensor], c_mem: Optional[torch.Tensor]):
        # Keys/values: [c_mem, mem, x] (oldest first), all through this layer's attention LayerNorm
        # with its current parameters. LayerNorm acts row by row, so normalising the concatenation
        # equals normalising each part; the queries are the segment's rows of the same result.
        parts = [t for t in (c_mem, mem) if t is not None and t.shape[0] > 0]
        mem_len = sum(t.shape[0] for t in parts)
        m_z = self.norm_self_attn(torch.cat(parts + [x], dim=0))
        z = m_z[mem_len:]
        x = x + self.self_attn(z, m_z, m_z)
        return x + self.feed_forward(self.norm_ff(x))


class CompressiveTransformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.layers = nn.ModuleList([CompressiveTransformerLayer(cfg) for _ in range(cfg.n_layers)])
        self.norm = nn.LayerNorm(cfg.d_model, eps=LAYER_NORM_EPS)

    def forward(self, x, mem: List[Optional[torch.Tensor]], c_mem: List[Optional[torch.Tensor]]):
        """Returns (LN(output), new_mem) where new_mem[l] is layer l's input, detached."""
        new_mem = []
        for l, layer in enumerate(self.layers):
            new_mem.append(x.detach())
            x = layer(x, mem[l] if mem else None, c_mem[l] if c_mem else None)
        return self.norm(x), new_mem


class AutoregressiveModel(nn.Module):
    """Embedding (no scaling, no absolute positions) -> CompressiveTransformer -> Linear to logits."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.src_embed = nn.Embedding(cfg.vocab, cfg.d_model)
        self.transformer = CompressiveTransformer(cfg)
        self.generator = nn.Linear(cfg.d_model, cfg.vocab)

    def forward(self, tokens: torch.Tensor, mem=None, c_mem=None):
        """tokens [Q, B] -> (logits [Q, B, vocab], new_mem: list of [Q, B, D] per layer)."""
        h, new_mem = self.transformer(self.src_embed(tokens), mem or [], c_mem or [])
        return self.generator(h), new_mem


# ---------------------------------------------------------------------------------------------------
# Memory and the attention-reconstruction loss
# ---------------------------------------------------------------------------------------------------


class Memory:
    """Per-layer memory and compressed memory carried across segments.

    c_mem_len == 0 is Transformer-XL: the memory keeps its newest mem_len slots and nothing is
    compressed (unlike labml's training code, which keeps every slot then because m[-0:] is all of m).
    """

    def __init__(self, n_layers: int, mem_len: int, c_mem_len: int, compression_rate: int):
        if mem_len < 0 or c_mem_len < 0:
            raise ValueError("mem_len and c_mem_len must be non-negative")
        if c_mem_len > 0 and mem_len < compression_rate - 1:
            # With fewer slots the oldest ceil(excess / c)·c could exceed what is there.
            raise ValueError(f"mem_len {mem_len} < compression_rate − 1 = {compression_rate - 1}")
        self.n_layers = n_layers
        self.mem_len = mem_len
        self.c_mem_len = c_mem_len
        self.rate = compression_rate
        self.mem: List[Optional[torch.Tensor]] = [None] * n_layers
        self.c_mem: List[Optional[torch.Tensor]] = [None] * n_layers

    @property
    def compressive(self) -> bool:
        return self.c_mem_len > 0

    def merge(self, new_mem: List[torch.Tensor], model: AutoregressiveModel) -> Optional[List[torch.Tensor]]:
        """Appends this segment's layer inputs, compresses the overflow with the current weights.

        Runs without gradient. Returns the slots compressed away (one [n·c, B, D] per layer) or
        None when nothing was compressed this time.
        """
        to_compress = []
        with torch.no_grad():
            for l in range(self.n_layers):
                m = new_mem[l].detach() if self.mem[l] is None else torch.cat((self.mem[l], new_mem[l].detach()))
                if not self.compressive:
                    self.mem[l] = m[max(0, m.shape[0] - self.mem_len) :]
                    continue
                excess = m.shape[0] - self.mem_len
                if excess <= 0:
                    self.mem[l] = m
                    continue
                n_old = -(-excess // self.rate) * self.rate  # ceil(excess / c) · c
                old, self.mem[l] = m[:n_old], m[n_old:]
                cm = model.transformer.layers[l].compress(old)
                if self.c_mem[l] is not None:
                    cm = torch.cat((self.c_mem[l], cm))
                self.c_mem[l] = cm[max(0, cm.shape[0] - self.c_mem_len) :]
                to_compress.append(old)
        return to_compress if to_compress else None


def _detached_attention(sa: RelativeMultiHeadAttention, h: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
    """softmax_j((q_i·k_j)·scale) v_j with detached projection weights: [Q, B, heads, d_k].

    No positional terms, no mask, no output projection (docs/reference.md §10).
    """

    def project(p: HeadProjection, x):
        b = p.linear.bias.detach() if p.linear.bias is not None else None
        return F.linear(x, p.linear.weight.detach(), b).view(*x.shape[:-1], p.heads, p.d_k)

    q, k, v = project(sa.query, h), project(sa.key, kv), project(sa.value, kv)
    a = torch.softmax(torch.einsum("ibhd,jbhd->bhij", q, k) * sa.scale, dim=-1)
    return torch.einsum("bhij,jbhd->ibhd", a, v)


def attention_reconstruction_loss(model: AutoregressiveModel, h: List[torch.Tensor], old: List[torch.Tensor]):
    """Σ_l MSE(attn(h_l, LN(f_c(m_l))), attn(h_l, LN(m_l))); only f_c's parameters get gradient.

    h[l]: this segment's input of layer l; old[l]: the slots layer l compressed away this step.
    """
    total = None
    for layer, h_l, m_l in zip(model.transformer.layers, h, old):
        h_l, m_l = h_l.detach(), m_l.detach()
        cm_l = layer.compress(m_l)
        ln = layer.norm_self_attn
        w, b = ln.weight.detach(), ln.bias.detach()
        h_n, m_n, cm_n = (F.layer_norm(t, ln.normalized_shape, w, b, ln.eps) for t in (h_l, m_l, cm_l))
        with_compressed = _detached_attention(layer.self_attn, h_n, cm_n)
        with_original = _detached_attention(layer.self_attn, h_n, m_n)
        loss = F.mse_loss(with_compressed, with_original)
        total = loss if total is None else total + loss
    return total


# ---------------------------------------------------------------------------------------------------
# One segment of training or evaluation
# ---------------------------------------------------------------------------------------------------


def _mem_lists(memory: Memory):
    return list(memory.mem), list(memory.c_mem)


def train_step(model: AutoregressiveModel, optimizer, memory: Memory, tokens, targets, clip: float):
    """One segment: forward, merge memory, CE + AR, backward, clip, optimizer step.

    Every parameter takes part in every step: one that the loss does not reach gets an exactly zero
    gradient (not None), so AdamW's decoupled weight decay still applies to it. Returns a dict with
    logits [Q, B, V], ce_loss, ar_loss (0-d tensors), grad_norm (before clipping) and grads
    (name -> gradient of the total loss before clipping).
    """
    mem, c_mem = _mem_lists(memory)
    logits, new_mem = model(tokens, mem, c_mem)
    old = memory.merge(new_mem, model)
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
    ar = attention_reconstruction_loss(model, new_mem, old) if old is not None else torch.zeros_like(ce)
    optimizer.zero_grad(set_to_none=True)
    (ce + ar).backward()
    named = list(model.named_parameters())
    for _, p in named:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    grads = {n: p.grad.detach().clone() for n, p in named}
    norm = torch.nn.utils.clip_grad_norm_([p for _, p in named], clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return {"logits": logits.detach(), "ce_loss": ce.detach(), "ar_loss": ar.detach(),
            "grad_norm": norm.detach(), "grads": grads}


@torch.no_grad()
def eval_segment(model: AutoregressiveModel, memory: Memory, tokens, targets):
    """Forward with the carried memory, then merge; returns (logits, ce_loss, ar_loss)."""
    mem, c_mem = _mem_lists(memory)
    logits, new_mem = model(tokens, mem, c_mem)
    old = memory.merge(new_mem, model)
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
    ar = attention_reconstruction_loss(model, new_mem, old) if old is not None else torch.zeros_like(ce)
    return logits, ce, ar


# ---------------------------------------------------------------------------------------------------
# Checkpoints
# ---------------------------------------------------------------------------------------------------


def config_from_state_dict(sd, n_pos: int, compression: str = "conv", compression_rate: Optional[int] = None):
    """Reads vocab, d_model, d_ff, n_layers, heads (and c from the conv weight) from tensor shapes.

    The compression rate comes from `transformer.layers.0.compress.conv.weight` when present,
    otherwise from `compression_rate`. Raises ValueError for inconsistent shapes.
    """
    vocab, d_model = sd["src_embed.weight"].shape
    n_layers = 0
    while f"transformer.layers.{n_layers}.norm_ff.weight" in sd:
        n_layers += 1
    if n_layers == 0:
        raise ValueError("the checkpoint has no transformer layers")
    d_ff = sd["transformer.layers.0.feed_forward.layer1.weight"].shape[0]
    rows, heads = sd["transformer.layers.0.self_attn.key_pos_bias"].shape
    if rows != 2 * n_pos:
        raise ValueError(f"the positional tables have {rows} rows, but n_pos {n_pos} needs {2 * n_pos}")
    conv = sd.get("transformer.layers.0.compress.conv.weight")
    if conv is not None:
        rate = conv.shape[2]
        if compression_rate is not None and compression_rate != rate:
            raise ValueError(f"compression rate {compression_rate} disagrees with the conv kernel {rate}")
    elif compression == "conv":
        raise ValueError("conv compression needs transformer.layers.{l}.compress.conv.* in the checkpoint")
    else:
        rate = compression_rate
        if rate is None:
            raise ValueError(f"{compression} pooling: the compression rate is not in the checkpoint")
    return ModelConfig(vocab=int(vocab), d_model=int(d_model), heads=int(heads), d_ff=int(d_ff),
                       n_layers=n_layers, compression_rate=int(rate), compression=compression, n_pos=n_pos)


def load_model(sd, cfg: ModelConfig, dtype=torch.float64) -> AutoregressiveModel:
    """Builds the model and loads `sd` strictly (every tensor used, none missing, shapes equal).

    Conv compression weights in a checkpoint used with max/mean pooling are ignored, since a
    Transformer-XL or pooling run never reads them.
    """
    model = AutoregressiveModel(cfg).to(dtype)
    own = model.state_dict()
    extra = [k for k in sd if k not in own and not (cfg.compression != "conv" and ".compress.conv." in k)]
    missing = [k for k in own if k not in sd]
    if extra or missing:
        raise ValueError(f"checkpoint mismatch: unexpected {extra}, missing {missing}")
    for k, v in own.items():
        if tuple(sd[k].shape) != tuple(v.shape):
            raise ValueError(f"{k}: shape {tuple(sd[k].shape)} in the checkpoint, {tuple(v.shape)} expected")
    model.load_state_dict({k: sd[k].to(dtype) for k in own})
    return model


def random_init(model: nn.Module, seed: int, std: float = 0.3, bias_std: float = 0.1):
    """Seeded random values for every parameter, for tests (reference training inits R, S, u to 0).

    LayerNorm weights 1 + N(0, 0.1²), LayerNorm and linear/conv biases N(0, bias_std²), everything
    else (embedding, projections, conv, R, S, u) N(0, std²). Draws follow named_parameters() order.
    """
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g, dtype=torch.float64).to(p.dtype)
            owner, leaf = name.split(".")[-2], name.split(".")[-1]
            if owner.startswith("norm") and leaf == "weight":
                p.copy_(1.0 + 0.1 * noise)
            elif leaf == "bias":
                p.copy_(bias_std * noise)
            else:
                p.copy_(std * noise)
