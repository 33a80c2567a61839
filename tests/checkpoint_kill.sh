#!/usr/bin/env bash
# Kills examples/train with SIGKILL at random moments of a run that saves after every step (so most
# kills land inside a save), then checks that the checkpoint left on disk resumes to the same final
# files, byte for byte, as a run that was never killed.
#   tests/checkpoint_kill.sh TRAIN WORK_DIR [KILLS]     (ctest runs a handful; tools/kill_test.sh 100+)
set -euo pipefail
train=$1 work=$2 kills=${3:-5}
rm -rf "$work"
mkdir -p "$work"
cd "$work"

for i in $(seq 1 10); do echo "line $i: the quick brown fox jumps over a lazy dog."; done >tiny.txt
model=(--data tiny.txt --d-model 16 --heads 2 --rate 2 --d-ff 32 --layers 2 --n-pos 16384 --seq-len 4 --mem-len 4
       --c-mem-len 6 --batch 4 --warmup 10 --steps 40)
quiet=(--eval-every 0 --sample-len 0 --log-every 1000 --threads 2)

"$train" "${model[@]}" "${quiet[@]}" --checkpoint ref.safetensors >/dev/null
# How long a run that saves after every step takes: the window the kills are drawn from.
t0=$(date +%s%N)
"$train" "${model[@]}" "${quiet[@]}" --save-every 1 --checkpoint timing.safetensors >/dev/null
span_us=$((($(date +%s%N) - t0) / 1000))

inside_save=0 before_first_save=0 resumed=0 rolled_forward=0 discarded=0 finished=0
for ((k = 1; k <= kills; ++k)); do
    rm -f ck.safetensors* out.safetensors*
    "$train" "${model[@]}" "${quiet[@]}" --save-every 1 --checkpoint ck.safetensors >run.log 2>&1 &
    pid=$!
    delay_us=$(((RANDOM * 32768 + RANDOM) % span_us))
    sleep "$(printf '%d.%06d' $((delay_us / 1000000)) $((delay_us % 1000000)))"
    kill -9 "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
    if grep -q '^saved .*end of training' run.log; then finished=$((finished + 1)); fi
    # Inside a save: a pending or temporary file was on disk when the kill came.
    if compgen -G 'ck.safetensors*.pending' >/dev/null || compgen -G 'ck.safetensors*.tmp.*' >/dev/null; then
        inside_save=$((inside_save + 1))
    fi
    if [ ! -e ck.safetensors ] && [ ! -e ck.safetensors.state.safetensors.pending ]; then
        before_first_save=$((before_first_save + 1))  # killed before the first save had happened
        rm -f ck.safetensors*
        continue
    fi
    if ! "$train" --resume ck.safetensors "${quiet[@]}" --checkpoint out.safetensors >resume.log 2>&1; then
        echo "checkpoint_kill: kill $k (after ${delay_us} us): resuming failed:" >&2
        cat resume.log >&2
        ls -l >&2
        exit 1
    fi
    grep -q 'completed the save' resume.log && rolled_forward=$((rolled_forward + 1))
    grep -q 'removed the unfinished save' resume.log && discarded=$((discarded + 1))
    for f in out.safetensors out.safetensors.state.safetensors; do
        if ! cmp -s "$f" "ref${f#out}"; then
            echo "checkpoint_kill: kill $k (after ${delay_us} us): $f differs from the uninterrupted run's" >&2
            cat resume.log >&2
            exit 1
        fi
    done
    resumed=$((resumed + 1))
done
echo "checkpoint_kill: $kills kills over a ${span_us} us run, $inside_save inside a save: $resumed resumed bitwise" \
     "($rolled_forward completing an interrupted save, $discarded discarding an unfinished one)," \
     "$before_first_save before the first save, $finished after the run had finished"
