#!/usr/bin/env bash
# Bundles the header-only dependencies (Eigen, xsimd, xtl, doctest, CLI11: headers and CMake package
# files) into gpu-deps/ (ignored by git), for a GPU machine whose image has nvcc and CMake but none of
# Debian's development packages. Run here, then carry gpu-deps to that machine; tools/gpu_check.sh
# builds against it (CMAKE_PREFIX_PATH). The package files locate their headers relative to
# themselves, except doctest's (a fixed /usr), which is rewritten. Ninja goes in too (gpu-deps/bin, used
# when the machine has none): it builds the CUDA targets side by side where Make builds them one by one.
set -euo pipefail
cd "$(dirname "$0")/.."
out=gpu-deps
rm -rf "$out"
mkdir -p "$out/include"
for d in eigen3 xsimd xtl doctest CLI; do cp -r "/usr/include/$d" "$out/include/"; done
copy_dir() { mkdir -p "$out/$2"; cp -r "$1/." "$out/$2/"; }
copy_dir /usr/share/eigen3/cmake share/eigen3/cmake
copy_dir /usr/share/cmake/xtl share/cmake/xtl
copy_dir /usr/lib/x86_64-linux-gnu/cmake/xsimd lib/x86_64-linux-gnu/cmake/xsimd
copy_dir /usr/share/cmake/CLI11 share/cmake/CLI11
copy_dir /usr/lib/cmake/doctest lib/cmake/doctest
sed -i 's|set(_IMPORT_PREFIX "/usr")|get_filename_component(_IMPORT_PREFIX "${CMAKE_CURRENT_LIST_DIR}/../../.." ABSOLUTE)|' \
    "$out/lib/cmake/doctest/doctestTargets.cmake"
if command -v ninja >/dev/null; then mkdir -p "$out/bin" && cp "$(command -v ninja)" "$out/bin/"; fi
du -sh "$out"
