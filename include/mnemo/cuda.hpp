#pragma once
// mnemo's CUDA backend: everything of mnemo.hpp, plus the mnemo::cuda tag's kernels and memory.
// Link the compiled target mnemo::cuda (CMake: target_link_libraries(app PRIVATE mnemo::cuda)); then
// compressive_transformer<float, Cfg, Compression, mnemo::cuda> and the other models run on the GPU.
// cuda_runtime::available() says whether this process can use one.
#include "mnemo.hpp"
#include "kernels/cuda/ops.hpp"
#include "kernels/cuda/runtime.hpp"
