#!/usr/bin/env bash
# Bitwise before/after check of two builds of examples/train: the same short runs with each, then the
# checkpoints (parameters, optimizer state, memory) compared byte for byte and the printed losses
# and samples compared line for line (timings and paths left out). For a change that must not move a
# bit (a refactor, a kernel moved): every run must say "identical".
#
#   tools/compare_builds.sh OLD_TRAIN NEW_TRAIN [DATA]
#     OLD_TRAIN, NEW_TRAIN  two builds of examples/train (e.g. a worktree of the previous commit's)
#     DATA                  a text file (default: a made-up one written here)
#
# Runs: the compressive model with each compression function, Transformer-XL, post-LN + GRU gates +
# auto-encoding, and both Feedback Transformers, a few optimizer steps each at a small size (d_model 64,
# 4 heads, rate 2: a shape compiled into train), with a sample generated from the trained model at the
# end (the generation cache); the runs named *-runtime again through the runtime-shape model
# (MNEMO_FORCE_DYNAMIC=1).
set -euo pipefail
old=${1:?usage: tools/compare_builds.sh OLD_TRAIN NEW_TRAIN [DATA]}
new=${2:?usage: tools/compare_builds.sh OLD_TRAIN NEW_TRAIN [DATA]}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
data=${3:-}
if [ -z "$data" ]; then
    data=$work/text.txt
    for i in $(seq 1 300); do echo "line $i: the quick brown fox $((i % 7)) jumps over the lazy dog $((i % 3))."; done >"$data"
fi
common=(--data "$data" --d-model 64 --heads 4 --d-ff 96 --layers 2 --n-pos 64 --batch 4 --steps 6 --warmup 2
        --optimizer adamw --lr 1e-3
        --eval-every 3 --eval-segments 2 --sample-len 40 --log-every 1 --seed 3)
runs=(
    "compressive-conv|--model compressive --compression conv --seq-len 8 --mem-len 8 --c-mem-len 8"
    "compressive-max|--model compressive --compression max --seq-len 8 --mem-len 8 --c-mem-len 8"
    "compressive-mean|--model compressive --compression mean --seq-len 8 --mem-len 8 --c-mem-len 8"
    "compressive-dilated|--model compressive --compression dilated --seq-len 8 --mem-len 8 --c-mem-len 8"
    "compressive-most-used|--model compressive --compression most-used --seq-len 8 --mem-len 8 --c-mem-len 8"
    "compressive-variants|--model compressive --norm post --residual gru --reconstruction autoencoding --memory-layers 1 --seq-len 8 --mem-len 8 --c-mem-len 8"
    "xl-clamp|--model xl --seq-len 8 --mem-len 8 --clamp-len 5"
    "compressive-conv-runtime|--model compressive --compression conv --seq-len 8 --mem-len 8 --c-mem-len 8"
    "feedback-runtime|--model feedback --seq-len 12"
    "feedback|--model feedback --seq-len 12"
    "feedback-kv|--model feedback-kv --seq-len 12"
)
status=0
for entry in "${runs[@]}"; do
    name=${entry%%|*}
    read -r -a flags <<<"${entry#*|}"
    for side in old new; do
        bin=$old
        [ "$side" = new ] && bin=$new
        mkdir -p "$work/$side"
        dyn=0
        [[ $name == *-runtime ]] && dyn=1
        MNEMO_FORCE_DYNAMIC=$dyn "$bin" "${common[@]}" "${flags[@]}" --checkpoint "$work/$side/$name.safetensors" --threads 2 \
            >"$work/$side/$name.log" 2>&1 || { echo "$name: $side run failed:"; tail -5 "$work/$side/$name.log"; status=1; continue 2; }
        # Keep what the numbers say, not how long they took or where files went.
        sed -E 's/[0-9.]+ ?(ms|s|tok\/s|k tok\/s|MB\/s)\b/T/g; s#'"$work"'/(old|new)#DIR#g' "$work/$side/$name.log" |
            grep -vE 'elapsed|time|took|speed|per second|tokens/s|ms/step' >"$work/$side/$name.out" || true
    done
    if cmp -s "$work/old/$name.safetensors" "$work/new/$name.safetensors" &&
       cmp -s "$work/old/$name.safetensors.state.safetensors" "$work/new/$name.safetensors.state.safetensors" &&
       cmp -s "$work/old/$name.out" "$work/new/$name.out"; then
        echo "$name: identical (checkpoint, trainer state, losses and sample)"
    else
        echo "$name: DIFFERENT"
        cmp "$work/old/$name.safetensors" "$work/new/$name.safetensors" || true
        diff "$work/old/$name.out" "$work/new/$name.out" | head -10 || true
        status=1
    fi
done
exit $status
