#!/usr/bin/env bash
# Checks mnemo_eval against its PyTorch twins on random checkpoints: tools/reference_eval.py for the
# Compressive Transformer and Transformer-XL, tools/reference/feedback.py for the Feedback Transformers.
#
#   tools/check_eval_parity.sh            (after building: cmake --build build --target mnemo_eval)
#   MNEMO_EVAL=path/to/mnemo_eval PYTHON=/usr/bin/python3 tools/check_eval_parity.sh
#
# For each configuration below: tools/make_random_checkpoint.py writes random weights and tokens,
# both programs evaluate them with the same flags, and a comparer reports the worst absolute and
# relative error of logits, ce_loss and ar_loss. mnemo runs in float32 and the reference in float64,
# so the tolerances are float32-sized: |mnemo − ref| <= atol + rtol·|ref| with
#   logits   atol 1e-4  rtol 1e-4    (values of a few units; float32 rounding over a few layers and
#                                     segments of carried, compressed memory, or the feedback recurrence
#                                     over a segment's steps)
#   ce_loss  atol 1e-5  rtol 1e-5    (a mean over many positions: its rounding errors average out)
#   ar_loss  atol 1e-5  rtol 1e-4    (a mean of squared differences, relative error of its terms)
# Needs a python with torch (Debian's python3-torch).
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
eval_bin=${MNEMO_EVAL:-$root/build/examples/mnemo_eval}
python=${PYTHON:-/usr/bin/python3}
[[ -x $eval_bin ]] || { echo "check_eval_parity: no mnemo_eval at $eval_bin (build it, or set MNEMO_EVAL)" >&2; exit 2; }
"$python" -c 'import torch' 2>/dev/null || { echo "check_eval_parity: $python has no torch" >&2; exit 2; }

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# Prints the worst errors of each output tensor; exits 1 when one is out of tolerance.
compare() {
    "$python" - "$1" "$2" <<'EOF'
import os, sys
sys.path.insert(0, os.path.join(os.environ["MNEMO_ROOT"], "tools", "reference"))
import safetensors_io as st

tolerance = {"logits": (1e-4, 1e-4), "ce_loss": (1e-5, 1e-5), "ar_loss": (1e-5, 1e-4)}
got, _ = st.load(sys.argv[1])
want, _ = st.load(sys.argv[2])
ok = set(got) == set(want)
if not ok:
    print(f"    tensors differ: mnemo {sorted(got)}, reference {sorted(want)}")
parts = []
for name, (atol, rtol) in tolerance.items():
    if name not in got or name not in want:
        continue
    a, b = got[name].double(), want[name].double()
    if a.shape != b.shape:
        print(f"    {name}: shape {tuple(a.shape)} vs reference {tuple(b.shape)}")
        ok = False
        continue
    diff = (a - b).abs()
    # Relative error only where the reference is not near zero (elsewhere atol decides).
    big = b.abs() > 1e-3
    rel = (diff[big] / b.abs()[big]).max().item() if big.any() else 0.0
    excess = diff - (atol + rtol * b.abs())
    worst = int(excess.flatten().argmax())
    bad = int((excess > 0).sum()) + int(diff.isnan().sum())
    parts.append(f"{name} max abs {diff.max().item():.2e} rel {rel:.2e}")
    if bad:
        ok = False
        print(f"    {name}: {bad} of {a.numel()} elements out of tolerance (atol {atol}, rtol {rtol}); worst at flat "
              f"index {worst}: mnemo {a.flatten()[worst].item():.8g}, reference {b.flatten()[worst].item():.8g}")
print("    " + "; ".join(parts))
sys.exit(0 if ok else 1)
EOF
}

failures=0
n_cases=0
# check NAME "make_random_checkpoint flags" "eval flags"
check() {
    local name=$1 make_flags=$2 eval_flags=$3
    n_cases=$((n_cases + 1))
    local dir=$work/$name
    mkdir -p "$dir"
    # shellcheck disable=SC2086  # the flag strings are meant to split
    "$python" "$root/tools/make_random_checkpoint.py" $make_flags --checkpoint "$dir/w.safetensors" \
        --tokens "$dir/t.safetensors"
    local common="--checkpoint $dir/w.safetensors --tokens $dir/t.safetensors $eval_flags"
    local reference=$root/tools/reference_eval.py
    [[ $eval_flags == *"--model feedback"* ]] && reference=$root/tools/reference/feedback.py
    # shellcheck disable=SC2086
    if ! "$eval_bin" $common --out "$dir/mnemo.safetensors" >"$dir/mnemo.log" 2>&1; then
        echo "FAIL $name: mnemo_eval failed:"; sed 's/^/    /' "$dir/mnemo.log"; failures=$((failures + 1)); return
    fi
    # shellcheck disable=SC2086
    if ! "$python" "$reference" $common --out "$dir/ref.safetensors" >"$dir/ref.log" 2>&1; then
        echo "FAIL $name: $(basename "$reference") failed:"; sed 's/^/    /' "$dir/ref.log"; failures=$((failures + 1)); return
    fi
    if out=$(MNEMO_ROOT=$root compare "$dir/mnemo.safetensors" "$dir/ref.safetensors"); then
        echo "ok   $name ($eval_flags)"
        echo "$out"
    else
        echo "FAIL $name ($eval_flags)"
        echo "$out"
        failures=$((failures + 1))
    fi
}

# The reference experiment's size: 8 segments, the compressed memory (8 slots) truncated from the 3rd on.
check conv_128_4_2 "--vocab 65 --d-model 128 --heads 4 --d-ff 256 --n-layers 2 --compression-rate 2 --n-pos 64 --batch 2 --n-tokens 129 --seed 1 --std 0.1" \
    "--model compressive --seq-len 16 --mem-len 16 --c-mem-len 8"
# Tiny: memory shorter than a segment, compressed memory truncated, batch 3.
check conv_16_2_2 "--vocab 11 --d-model 16 --heads 2 --d-ff 24 --n-layers 2 --compression-rate 2 --n-pos 16 --batch 3 --n-tokens 41 --seed 2" \
    "--model compressive --seq-len 5 --mem-len 3 --c-mem-len 4"
# Rate 3 with a segment length that is not a multiple of it; F64 weights and I32 tokens are converted on load.
check conv_12_3_3 "--vocab 7 --d-model 12 --heads 3 --d-ff 20 --n-layers 3 --compression-rate 3 --n-pos 32 --batch 2 --n-tokens 36 --seed 3 --dtype f64 --token-dtype i32" \
    "--model compressive --seq-len 7 --mem-len 5 --c-mem-len 3"
# Rate 4, 8 heads; leftover tokens after the last whole segment are ignored.
check conv_256_8_4 "--vocab 40 --d-model 256 --heads 8 --d-ff 512 --n-layers 2 --compression-rate 4 --n-pos 64 --batch 2 --n-tokens 50 --seed 4 --std 0.06" \
    "--model compressive --seq-len 8 --mem-len 8 --c-mem-len 6"
# --c-mem-len 0 with a conv checkpoint: Transformer-XL, the conv weights go unread.
check conv_c_mem_0 "--vocab 11 --d-model 16 --heads 2 --d-ff 24 --n-layers 2 --compression-rate 2 --n-pos 16 --batch 2 --n-tokens 33 --seed 5" \
    "--model compressive --seq-len 4 --mem-len 6 --c-mem-len 0"
# Transformer-XL from a checkpoint without compress.* tensors (pooling checkpoints have none).
check xl_16_2 "--vocab 11 --d-model 16 --heads 2 --d-ff 24 --n-layers 2 --compression-rate 2 --compression max --n-pos 16 --batch 2 --n-tokens 41 --seed 6" \
    "--model xl --seq-len 5 --mem-len 7 --c-mem-len 0"
# Transformer-XL without memory (every segment on its own).
check xl_64_4_no_memory "--vocab 30 --d-model 64 --heads 4 --d-ff 96 --n-layers 2 --compression-rate 2 --compression mean --n-pos 32 --batch 4 --n-tokens 31 --seed 7 --std 0.15" \
    "--model xl --seq-len 6 --mem-len 0 --c-mem-len 0"
# Max pooling (rate from the checkpoint's metadata), truncation of the compressed memory.
check max_16_2_2 "--vocab 11 --d-model 16 --heads 2 --d-ff 24 --n-layers 2 --compression-rate 2 --compression max --n-pos 16 --batch 2 --n-tokens 41 --seed 8" \
    "--model compressive --compression max --seq-len 4 --mem-len 3 --c-mem-len 3"
# Mean pooling on a larger model.
check mean_64_4_2 "--vocab 30 --d-model 64 --heads 4 --d-ff 96 --n-layers 3 --compression-rate 2 --compression mean --n-pos 32 --batch 2 --n-tokens 61 --seed 9 --std 0.15" \
    "--model compressive --compression mean --seq-len 6 --mem-len 6 --c-mem-len 5"
# Max pooling of a conv checkpoint: the conv weights are ignored, the rate comes from their kernel.
check max_of_conv_12_3_3 "--vocab 7 --d-model 12 --heads 3 --d-ff 20 --n-layers 2 --compression-rate 3 --n-pos 16 --batch 1 --n-tokens 25 --seed 10" \
    "--model compressive --compression max --seq-len 4 --mem-len 2 --c-mem-len 3"

# Feedback Transformers: every segment from an empty memory.
# Tiny, plain variant: segments of n_pos + 1 = 8 tokens (every table row but row P is read), batch 3.
check feedback_16_2 "--model feedback --vocab 11 --d-model 16 --heads 2 --d-ff 24 --n-layers 2 --n-pos 7 --batch 3 --n-tokens 41 --seed 21" \
    "--model feedback --seq-len 8"
# Shared keys/values, 3 layers; the memory flags given as 0 (accepted by both); leftover tokens ignored.
check feedback_kv_64_4 "--model feedback-kv --vocab 30 --d-model 64 --heads 4 --d-ff 96 --n-layers 3 --n-pos 32 --batch 2 --n-tokens 40 --seed 22 --std 0.15" \
    "--model feedback-kv --seq-len 12 --mem-len 0 --c-mem-len 0"
# The reference experiment's text size (vocabulary 65, d_model 128), longer segments.
check feedback_128_4 "--model feedback --vocab 65 --d-model 128 --heads 4 --d-ff 256 --n-layers 2 --n-pos 64 --batch 2 --n-tokens 97 --seed 23 --std 0.1" \
    "--model feedback --seq-len 32"
# The reference feedback experiment's width: d_model 512, 8 heads, d_ff 2048 (2 layers here).
check feedback_kv_512_8 "--model feedback-kv --vocab 65 --d-model 512 --heads 8 --d-ff 2048 --n-layers 2 --n-pos 32 --batch 2 --n-tokens 33 --seed 24 --std 0.04" \
    "--model feedback-kv --seq-len 16"
# 3 heads of 4, F64 weights and I32 tokens (converted on load).
check feedback_12_3 "--model feedback --vocab 7 --d-model 12 --heads 3 --d-ff 20 --n-layers 3 --n-pos 16 --batch 2 --n-tokens 36 --seed 25 --dtype f64 --token-dtype i32" \
    "--model feedback --seq-len 7"

echo "check_eval_parity: $((n_cases - failures)) of $n_cases configurations agree"
[[ $failures -eq 0 ]]
