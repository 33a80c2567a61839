#!/usr/bin/env bash
# Regenerates the golden data of the mnemo_eval tests (tests/CMakeLists.txt, "eval_golden.*" and
# "eval_error.*") with the PyTorch reference, so those tests need no Python:
#   <case>_checkpoint.safetensors  random weights (tools/make_random_checkpoint.py)
#   <case>_tokens.safetensors      random tokens
#   <case>_expected.safetensors    tools/reference_eval.py's output (tools/reference/feedback.py's for
#                                  the feedback cases; computed in float64, stored F32)
# plus small broken inputs for the error-message tests. Run from anywhere: tests/golden/eval/regenerate.sh
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
tools=$(cd "$here/../../../tools" && pwd)
python=${PYTHON:-/usr/bin/python3}
cd "$here"

# Compressive Transformer, d_model 16, 2 heads, conv rate 2, n_pos 16: 5 segments of 4 over a batch of
# 2; memory 4, compressed memory 3, so compression starts in segment 1 and the compressed memory is
# truncated from segment 2 on (4 slots made, 3 kept).
"$python" "$tools/make_random_checkpoint.py" --vocab 11 --d-model 16 --heads 2 --d-ff 24 --n-layers 2 \
    --compression-rate 2 --n-pos 16 --batch 2 --n-tokens 22 --seed 11 \
    --checkpoint compressive_checkpoint.safetensors --tokens compressive_tokens.safetensors
"$python" "$tools/reference_eval.py" --model compressive --checkpoint compressive_checkpoint.safetensors \
    --tokens compressive_tokens.safetensors --out compressive_expected.safetensors --seq-len 4 --mem-len 4 --c-mem-len 3

# Transformer-XL (a checkpoint without compress.* tensors), I32 tokens: 4 segments of 5, memory 7.
"$python" "$tools/make_random_checkpoint.py" --vocab 11 --d-model 16 --heads 2 --d-ff 24 --n-layers 2 \
    --compression-rate 2 --compression max --n-pos 16 --batch 3 --n-tokens 21 --seed 12 --token-dtype i32 \
    --checkpoint xl_checkpoint.safetensors --tokens xl_tokens.safetensors
"$python" "$tools/reference_eval.py" --model xl --checkpoint xl_checkpoint.safetensors \
    --tokens xl_tokens.safetensors --out xl_expected.safetensors --seq-len 5 --mem-len 7 --c-mem-len 0

# Feedback Transformer (per-layer keys/values), d_model 16, 2 heads, 2 layers, n_pos 8: 3 segments of 6
# over a batch of 2, each from an empty memory; one token left over after the last segment.
"$python" "$tools/make_random_checkpoint.py" --model feedback --vocab 11 --d-model 16 --heads 2 --d-ff 24 \
    --n-layers 2 --n-pos 8 --batch 2 --n-tokens 20 --seed 14 \
    --checkpoint feedback_checkpoint.safetensors --tokens feedback_tokens.safetensors
"$python" "$tools/reference/feedback.py" --model feedback --checkpoint feedback_checkpoint.safetensors \
    --tokens feedback_tokens.safetensors --out feedback_expected.safetensors --seq-len 6

# Feedback Transformer with shared keys/values, I32 tokens, batch 3: 3 segments of 9 = n_pos + 1 tokens,
# so the last step reads every row of the positional tables but row P.
"$python" "$tools/make_random_checkpoint.py" --model feedback-kv --vocab 11 --d-model 16 --heads 2 --d-ff 24 \
    --n-layers 2 --n-pos 8 --batch 3 --n-tokens 28 --seed 15 --token-dtype i32 \
    --checkpoint feedback_kv_checkpoint.safetensors --tokens feedback_kv_tokens.safetensors
"$python" "$tools/reference/feedback.py" --model feedback-kv --checkpoint feedback_kv_checkpoint.safetensors \
    --tokens feedback_kv_tokens.safetensors --out feedback_kv_expected.safetensors --seq-len 9

# Broken inputs, each with one fault.
"$python" - "$tools/reference" <<'PY'
import sys
import torch
sys.path.insert(0, sys.argv[1])
import safetensors_io as st

sd, meta = st.load("compressive_checkpoint.safetensors")
# A configuration that is not compiled in: d_model 8 (1 layer, 2 heads, rate 2, vocab 5, n_pos 4).
g = torch.Generator().manual_seed(13)
def rnd(*shape):
    return torch.randn(shape, generator=g)
small = {"src_embed.weight": rnd(5, 8), "generator.weight": rnd(5, 8), "generator.bias": rnd(5),
         "transformer.norm.weight": rnd(8), "transformer.norm.bias": rnd(8)}
p = "transformer.layers.0."
small.update({p + "compress.conv.weight": rnd(8, 8, 2), p + "compress.conv.bias": rnd(8),
              p + "self_attn.query.linear.weight": rnd(8, 8), p + "self_attn.key.linear.weight": rnd(8, 8),
              p + "self_attn.value.linear.weight": rnd(8, 8), p + "self_attn.value.linear.bias": rnd(8),
              p + "self_attn.output.weight": rnd(8, 8), p + "self_attn.output.bias": rnd(8),
              p + "self_attn.key_pos_embeddings": rnd(8, 2, 4), p + "self_attn.key_pos_bias": rnd(8, 2),
              p + "self_attn.query_pos_bias": rnd(2, 4),
              p + "feed_forward.layer1.weight": rnd(12, 8), p + "feed_forward.layer1.bias": rnd(12),
              p + "feed_forward.layer2.weight": rnd(8, 12), p + "feed_forward.layer2.bias": rnd(8),
              p + "norm_self_attn.weight": rnd(8), p + "norm_self_attn.bias": rnd(8),
              p + "norm_ff.weight": rnd(8), p + "norm_ff.bias": rnd(8)})
st.save("unsupported_checkpoint.safetensors", small)
# A missing tensor.
st.save("missing_tensor_checkpoint.safetensors",
        {k: v for k, v in sd.items() if k != "transformer.layers.1.norm_ff.bias"}, meta)
# A tensor of the wrong shape.
st.save("wrong_shape_checkpoint.safetensors",
        {k: (torch.zeros(12) if k == "generator.bias" else v) for k, v in sd.items()}, meta)
# A tensor no model declares (as from a file saved with optimizer state), in a Transformer-XL checkpoint.
xl, xl_meta = st.load("xl_checkpoint.safetensors")
st.save("unexpected_tensor_checkpoint.safetensors", {**xl, "optimizer.step": torch.tensor([3.0])}, xl_meta)
# A feedback checkpoint with a tensor its model lacks (the feedback models read no compress.* weights).
fb, fb_meta = st.load("feedback_checkpoint.safetensors")
st.save("feedback_extra_checkpoint.safetensors",
        {**fb, "transformer.layers.0.compress.conv.weight": torch.zeros(16, 16, 2)}, fb_meta)
# A token outside the vocabulary (11).
tok, _ = st.load("compressive_tokens.safetensors")
bad = tok["tokens"].clone()
bad[1, 5] = 11
st.save("bad_tokens.safetensors", {"tokens": bad})
PY
ls -l "$here"
