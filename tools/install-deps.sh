#!/usr/bin/env bash
# Installs what mnemo needs to build, test and benchmark, from Debian 12's packages.
# Idempotent: only packages that are missing are installed; apt-get update runs only then.
#   tools/install-deps.sh            build + test + benchmark dependencies
#   tools/install-deps.sh --python   also python3-torch, for the reference scripts under tools/, and
#                                    libopenblas0-openmp (OpenBLAS's OpenMP build, which
#                                    benchmarks/compare_pytorch.py puts under torch)
#   tools/install-deps.sh --blas     also libopenblas-openmp-dev, for cmake -DMNEMO_BLAS=ON (OpenBLAS's
#                                    OpenMP build with its headers; never the pthread build)
# The two flags may be given together.
set -euo pipefail

# libcli11-dev: the programs' command lines; gnuplot-nox: tools/plot.sh; clang-14 + libclang-rt-14-dev:
# libFuzzer (tools/fuzz.sh); libomp-14-dev: LLVM's OpenMP with Archer (tools/tsan.sh); libopenmpi-dev +
# openmpi-bin: data-parallel training (mpirun -np N train) and its tests.
packages=(build-essential cmake libeigen3-dev libxsimd-dev xtl-dev doctest-dev libbenchmark-dev libcli11-dev
          gnuplot-nox clang-14 libclang-rt-14-dev libomp-14-dev libopenmpi-dev openmpi-bin)
for arg in "$@"; do
  case "$arg" in
    --python) packages+=(python3-torch python3-numpy libopenblas0-openmp) ;;
    --blas) packages+=(libopenblas-openmp-dev) ;;
    *) echo "install-deps: unknown option '$arg' (expected --python and/or --blas)" >&2; exit 2 ;;
  esac
done

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if [[ ${#missing[@]} -eq 0 ]]; then
  echo "install-deps: all dependencies present"
  exit 0
fi

echo "install-deps: installing ${missing[*]}"
sudo=""
if [[ $(id -u) -ne 0 ]]; then sudo="sudo"; fi
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -qq
$sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
