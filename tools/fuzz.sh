#!/usr/bin/env bash
# Fuzzes mnemo's readers of untrusted files with libFuzzer (clang, ASan + UBSan, leaks checked):
#   fuzz_safetensors     the safetensors reader (header JSON, offsets, dtypes, shapes, conversions)
#   fuzz_trainer_state   a trainer state file read as `train --resume` reads it
#   fuzz_text_data       the data reader (vocabulary, split, encoding) and --prompt
#
#   tools/fuzz.sh [--seconds N | --runs N] [--build DIR] [--train PATH] [HARNESS...]
#     --seconds N   each harness runs N seconds (tools/test.sh: 20)
#     --runs N      each harness runs N inputs (the README's figure: 10000000)
#     --train PATH  examples/train, to write the seed checkpoints (default: build/examples/train)
#     HARNESS...    only these harnesses (default: all three, one after the other); two invocations with
#                   the same --build DIR and different harnesses can run side by side, one per core
#
# Seeds: the checkpoints under tests/golden, and checkpoints and state files that `train` writes here
# for the run fuzz_trainer_state expects. Findings (crash-*, leak-*, timeout-*, oom-*) land in
# DIR/findings/<harness>/ and fail the script; copy each to fuzz/regressions/<harness>/, where the
# ctest fuzz_replay.* tests run it through the same harness on every build.
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=60 runs="" build=build-fuzz train=build/examples/train selected=()
while [ $# -gt 0 ]; do
    case $1 in
        --seconds) seconds=$2; shift 2 ;;
        --runs) runs=$2; shift 2 ;;
        --build) build=$2; shift 2 ;;
        --train) train=$2; shift 2 ;;
        fuzz_safetensors|fuzz_trainer_state|fuzz_text_data) selected+=("$1"); shift ;;
        *) echo "fuzz.sh: unknown option or harness '$1' (see the top of tools/fuzz.sh)" >&2; exit 2 ;;
    esac
done
cxx=$(command -v clang++-14 || command -v clang++ || true)
if [ -z "$cxx" ]; then echo "fuzz.sh: clang++ not found (tools/install-deps.sh installs clang)" >&2; exit 1; fi
harnesses=(fuzz_safetensors fuzz_trainer_state fuzz_text_data)
[ ${#selected[@]} -gt 0 ] && harnesses=("${selected[@]}")
mkdir -p "$build"

# Build (only what changed).
for h in "${harnesses[@]}"; do
    if [ ! -x "$build/$h" ] || [ -n "$(find include fuzz/$h.cpp -newer "$build/$h" -print -quit)" ]; then
        echo "fuzz.sh: building $h"
        # -fopenmp: mnemo is built with OpenMP wherever it is used (LLVM's libomp here, libomp-14-dev).
        "$cxx" -std=c++20 -O2 -g -fopenmp -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=all \
            -Iinclude -isystem /usr/include/eigen3 "fuzz/$h.cpp" -o "$build/$h"
    fi
done

# Seeds, for the selected harnesses only (so that side-by-side invocations leave each other's alone).
seeds=$build/seeds
selected_harness() { [[ " ${harnesses[*]} " == *" $1 "* ]]; }
for h in "${harnesses[@]}"; do rm -rf "${seeds:?}/$h"; mkdir -p "$seeds/$h"; done
if selected_harness fuzz_safetensors; then cp tests/golden/eval/*.safetensors "$seeds/fuzz_safetensors/"; fi
if selected_harness fuzz_text_data; then
    printf 'abcdefghij\n%.0s' $(seq 1 40) >"$seeds/fuzz_text_data/letters.txt"
    printf 'line 1: the quick brown fox jumps over a lazy dog.\nline 2: \xc3\xa9t\xc3\xa9\n' >"$seeds/fuzz_text_data/utf8.txt"
fi
if ! selected_harness fuzz_safetensors && ! selected_harness fuzz_trainer_state; then
    :
elif [ -x "$train" ]; then
    work=$build/seed_run.$$
    rm -rf "$work"
    mkdir -p "$work"
    # The run fuzz_trainer_state reads into (see the top of fuzz/fuzz_trainer_state.cpp): vocabulary 3.
    printf 'ab\nba\n%.0s' $(seq 1 40) >"$work/ab.txt"
    run=(--data "$work/ab.txt" --d-model 16 --heads 2 --rate 2 --compression most-used --layers 1 --n-pos 12
         --d-ff 16 --seq-len 4 --mem-len 4 --c-mem-len 4 --batch 2 --warmup 2 --eval-every 0 --sample-len 0
         --log-every 1000 --threads 1)
    for steps in 1 5; do
        "$train" "${run[@]}" --steps $steps --checkpoint "$work/ck$steps.safetensors" >/dev/null
        if selected_harness fuzz_trainer_state; then
            cp "$work/ck$steps.safetensors.state.safetensors" "$seeds/fuzz_trainer_state/state$steps.safetensors"
        fi
        if selected_harness fuzz_safetensors; then
            cp "$work/ck$steps.safetensors" "$seeds/fuzz_safetensors/model$steps.safetensors"
        fi
    done
    rm -rf "$work"
else
    echo "fuzz.sh: no $train: the trainer-state harness starts from fuzz/regressions alone (build first)" >&2
fi
for h in "${harnesses[@]}"; do
    if [ -d "fuzz/regressions/$h" ]; then cp fuzz/regressions/$h/* "$seeds/$h/" 2>/dev/null || true; fi
done

# Run. Corpora grow in DIR/corpus/<harness> across runs.
status=0
for h in "${harnesses[@]}"; do
    corpus=$build/corpus/$h findings=$build/findings/$h
    mkdir -p "$corpus" "$findings"
    limit=(-max_total_time="$seconds")
    [ -n "$runs" ] && limit=(-runs="$runs")
    log=$build/$h.log
    echo "fuzz.sh: $h (${runs:-$seconds s}${runs:+ runs})"
    set +e
    ASAN_OPTIONS=detect_leaks=1 "$build/$h" "$corpus" "$seeds/$h" "${limit[@]}" -timeout=10 -rss_limit_mb=2048 \
        -max_len=32768 -print_final_stats=1 -artifact_prefix="$findings/" >"$log" 2>&1
    rc=$?
    set -e
    execs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$log" | grep -o '[0-9]*$' || echo "?")
    secs=$(grep -o 'stat::average_exec_per_sec: *[0-9]*' "$log" | grep -o '[0-9]*$' || echo "?")
    found=$(find "$findings" -type f | wc -l)
    if [ "$rc" -ne 0 ] || [ "$found" -ne 0 ]; then
        echo "fuzz.sh: $h FAILED (exit $rc, $found finding(s) in $findings); the end of $log:" >&2
        tail -40 "$log" >&2
        status=1
    else
        echo "fuzz.sh: $h: $execs executions ($secs/s), no crash, leak or timeout; corpus $(ls "$corpus" | wc -l) inputs"
    fi
done
exit $status
