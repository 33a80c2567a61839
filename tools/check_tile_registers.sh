#!/usr/bin/env bash
# Checks that the register-tiled product kernels keep their accumulators in registers: in an
# optimised x86-64 binary, the FMAs inside gemm_packed_t's and gemm_direct_t's tiles and
# head_products' kernels may read a spilled constant from the stack, never a tile's accumulators.
# When g++ cannot give a tile's accumulators registers (a loop over them left rolled indexes them
# with a variable), it keeps them all on the stack, and every FMA of the product loop becomes a
# load, an FMA and a store: the results stay the same, the speed halves, and no other test notices
# (head_nt_wide's scores went that way once, 5-10% of configuration B's training step).
#   tools/check_tile_registers.sh [--objdump PATH] BINARY...
# Exits 1 naming each function whose FMAs read more than two different stack slots, or when a
# binary has no tile kernel at all (the check would pass without looking at anything).
set -euo pipefail
objdump=objdump
if [ "${1:-}" = --objdump ]; then objdump=$2; shift 2; fi
if [ $# -eq 0 ]; then
    echo "usage: tools/check_tile_registers.sh [--objdump PATH] BINARY..." >&2
    exit 2
fi
# Stack slots a kernel's FMAs may read: a spilled constant or two. A tile of one row (two
# accumulators) could spill and pass; the tiles that carry the products hold 8 to 28.
max_slots=2
status=0
for bin in "$@"; do
    if [ ! -f "$bin" ]; then
        echo "check_tile_registers: $bin: no such file" >&2
        exit 2
    fi
    # One line per tile kernel: "<stack slots its FMAs read> <FMAs with a stack operand> <FMAs>
    # <demangled name>". Spilled accumulators are many slots, one an FMA; a constant spilled for
    # the update of C after the k loop (beta, seen in a test build) is one slot read by every row.
    report=$("$objdump" -d -C --no-show-raw-insn "$bin" | awk '
        function flush() { if (name != "" && fmas > 0) print slots, spilled, fmas, name }
        /^[0-9a-f]+ <.*>:$/ {
            flush()
            name = ""; fmas = 0; spilled = 0; slots = 0; frame = 0; delete seen
            if ($0 ~ /gemm_packed_t<[^>]*>::tile<|gemm_direct_t<[^>]*>::tile<|cpu_kernels::head_products::/) {
                name = $0
                sub(/^[0-9a-f]+ </, "", name)
                sub(/>:$/, "", name)
            }
            next
        }
        # %rbp addresses the stack only in a function that made it its frame pointer; elsewhere
        # it may hold any pointer (a packed panel).
        name != "" && /\tmov +%rsp,%rbp$/ { frame = 1 }
        name != "" && /\tv(fmadd|fmsub|fnmadd|fnmsub)[0-9]+[ps][sd]/ {
            fmas++
            if (match($0, /-?(0x[0-9a-f]+)?\(%rsp\)/) || (frame && match($0, /-?(0x[0-9a-f]+)?\(%rbp\)/))) {
                spilled++
                slot = substr($0, RSTART, RLENGTH)
                if (!(slot in seen)) { seen[slot] = 1; slots++ }
            }
        }
        END { flush() }')
    if [ -z "$report" ]; then
        echo "check_tile_registers: $bin: no tile kernel with FMAs found (stripped, or not an optimised x86-64 build?)" >&2
        status=1
        continue
    fi
    kernels=$(wc -l <<<"$report")
    total=$(awk '{ n += $3 } END { print n }' <<<"$report")
    bad=$(awk -v max="$max_slots" '$1 > max' <<<"$report")
    if [ -n "$bad" ]; then
        while read -r slots spilled fmas name; do
            echo "check_tile_registers: $(basename "$bin"): ${name:0:160}: $spilled of $fmas FMAs read $slots different stack slots (accumulators spilled)" >&2
        done <<<"$bad"
        status=1
    else
        echo "check_tile_registers: $(basename "$bin"): $kernels tile kernels, $total FMAs, none with accumulators on the stack"
    fi
done
exit $status
