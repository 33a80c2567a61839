#!/usr/bin/env bash
# Draws the training and validation curves of one or several runs from the JSON-lines files that
# `train --metrics FILE` writes (include/mnemo/trainer/metrics.hpp): one curve per run and kind
# (train, valid) against the step, into a PNG, and with --dumb into the terminal as well.
#   tools/plot.sh [--out PNG] [--dumb] [--y KEY] [--title TEXT] METRICS...
#     --out PNG    the image (default: the first METRICS file with .png instead of its extension)
#     --dumb       also draw the curves as text in the terminal
#     --y KEY      what to plot: bits_per_char (default), loss, ar, lr, grad_norm, tokens_per_s, accuracy
#     --title TEXT the plot's title (default: the files' names)
# Needs gnuplot (Debian: gnuplot-nox; tools/install-deps.sh installs it).
set -euo pipefail
out="" dumb=0 key=bits_per_char title="" files=()
while [ $# -gt 0 ]; do
    case $1 in
        --out) out=$2; shift 2 ;;
        --dumb) dumb=1; shift ;;
        --y) key=$2; shift 2 ;;
        --title) title=$2; shift 2 ;;
        -h|--help) sed -n '2,11p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        -*) echo "plot.sh: unknown option '$1' (see tools/plot.sh --help)" >&2; exit 2 ;;
        *) files+=("$1"); shift ;;
    esac
done
if [ ${#files[@]} -eq 0 ]; then echo "plot.sh: no metrics file given (see tools/plot.sh --help)" >&2; exit 2; fi
case $key in
    bits_per_char|loss|ar|lr|grad_norm|tokens_per_s|accuracy|elapsed_s|tokens) ;;
    *) echo "plot.sh: unknown --y '$key' (expected bits_per_char, loss, ar, lr, grad_norm, tokens_per_s, accuracy)" >&2
       exit 2 ;;
esac
command -v gnuplot >/dev/null || { echo "plot.sh: gnuplot not found (apt-get install gnuplot-nox)" >&2; exit 1; }
for f in "${files[@]}"; do
    [ -r "$f" ] || { echo "plot.sh: cannot read '$f'" >&2; exit 1; }
done
[ -n "$out" ] || out="${files[0]%.*}.png"
[ -n "$title" ] || title="${files[*]}"

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# One data file per (file, run, kind): "step value" lines, in the order written.
plots=()
n=0
for f in "${files[@]}"; do
    n=$((n + 1))
    awk -v key="$key" -v dir="$tmp" -v n="$n" '
        function field(line, name,    at, rest, end) {
            at = index(line, "\"" name "\":")
            if (at == 0) return ""
            rest = substr(line, at + length(name) + 3)
            if (substr(rest, 1, 1) == "\"") { rest = substr(rest, 2); end = index(rest, "\"") }
            else { end = match(rest, /[,}]/) }
            return end ? substr(rest, 1, end - 1) : rest
        }
        {
            run = field($0, "run"); kind = field($0, "kind"); step = field($0, "step"); y = field($0, key)
            if (step == "" || y == "" || y == "null") next
            name = dir "/" n "\t" run "\t" kind
            gsub(/[^A-Za-z0-9_.\t\/-]/, "_", name)
            print step, y >> name
            seen[name] = 1
        }
        END { for (s in seen) print s }' "$f" | sort >"$tmp/list.$n"
    while IFS= read -r d; do plots+=("$d"); done <"$tmp/list.$n"
done
if [ ${#plots[@]} -eq 0 ]; then
    echo "plot.sh: no '$key' values in ${files[*]}" >&2
    exit 1
fi

script=$tmp/plot.gp
plot_cmd() {
    local sep="plot" d label file run kind
    for d in "${plots[@]}"; do
        IFS=$'\t' read -r file run kind <<<"${d#"$tmp"/}"
        label="$run $kind"
        [ ${#files[@]} -gt 1 ] && label="$(basename "${files[$((file - 1))]}") $label"
        if [ "$kind" = valid ]; then style="with linespoints pt 7 ps 0.6"; else style="with lines"; fi
        printf '%s "%s" using 1:2 %s title "%s"' "$sep" "$d" "$style" "${label//\"/}"
        sep=","
    done
    echo
}
{
    echo "set title \"${title//\"/}\" noenhanced"
    echo "set xlabel \"step\""
    echo "set ylabel \"$key\" noenhanced"
    echo "set key top right noenhanced"
    echo "set grid"
    echo "set terminal pngcairo size 1000,600"
    echo "set output \"$out\""
    plot_cmd
    echo "unset output"
    if [ $dumb -eq 1 ]; then
        echo "set terminal dumb size 110,32"
        echo "set output"
        plot_cmd
    fi
} >"$script"
gnuplot "$script"
echo "plot.sh: wrote $out"
