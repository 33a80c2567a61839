#!/usr/bin/env bash
# Throughput of data-parallel training on this machine: configurations A and B (README, Performance)
# trained by build/examples/train as 1 process × 2 threads and as 2 MPI ranks × 1 thread each, and the
# gradient bytes each rank exchanges per step (docs/distributed.md has the results).
#   tools/data_parallel_bench.sh TEXT [TRAIN]      TEXT: a text file of a few hundred KB or more
# Each figure is the steady state: the mean ms/step of the last progress line, after the memories
# are full. Runs alternate (1×2, 2×1, 1×2, 2×1) so that a drift of the machine's speed shows.
set -euo pipefail
text=${1:?usage: tools/data_parallel_bench.sh TEXT [TRAIN]}
train=${2:-build/examples/train}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
mpi=(mpirun --oversubscribe --bind-to none -np 2)
A=(--d-model 128 --heads 4 --rate 2 --d-ff 256 --layers 6 --seq-len 8 --mem-len 8 --c-mem-len 128 --batch 32
   --steps 100 --log-every 20)
B=(--d-model 256 --heads 8 --rate 4 --d-ff 1024 --layers 6 --seq-len 128 --mem-len 128 --c-mem-len 128 --n-pos 512
   --batch 8 --steps 16 --log-every 8)
common=(--data "$text" --eval-every 0 --sample-len 0 --warmup 10)

last_line() { grep '^step' | tail -1; }
ms() { sed -E 's/.* ([0-9.]+) ms\/step.*/\1/'; }
for config in A B; do
    declare -n args=$config
    for round in 1 2; do
        one=$("$train" "${common[@]}" "${args[@]}" --threads 2)
        two=$("${mpi[@]}" "$train" "${common[@]}" "${args[@]}" --threads 1)
        exchange=$(last_line <<<"$two" | sed -E 's/.*exchange ([0-9.]+ MB\/step in [0-9.]+ ms).*/\1/')
        echo "$config round $round: 1 rank x 2 threads $(last_line <<<"$one" | ms) ms/step;" \
             "2 ranks x 1 thread $(last_line <<<"$two" | ms) ms/step, exchange $exchange per rank"
    done
    params=$(grep -o '[0-9]* parameters' <<<"$one" | grep -o '[0-9]*')
    echo "$config: $params parameters: $(( params * 4 / 1000 )) kB per step if the whole gradient were sent"
done
