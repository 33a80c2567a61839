// The CUDA tests' main: runs doctest when this process can use a GPU; otherwise says why and exits 77,
// which ctest reports as Skipped (SKIP_RETURN_CODE). MNEMO_REQUIRE_GPU=1 makes a missing GPU a failure.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>

#include <mnemo/kernels/cuda/runtime.hpp>

int main(int argc, char** argv) {
    const char* require = std::getenv("MNEMO_REQUIRE_GPU");
    const bool required = require && std::strcmp(require, "0") != 0 && *require;
    if (!mnemo::cuda_runtime::available()) {
        std::fprintf(stderr, "%s: %s: %s\n", argv[0], required ? "FAILED (MNEMO_REQUIRE_GPU is set)" : "skipped",
                     mnemo::cuda_runtime::describe().c_str());
        return required ? 1 : 77;
    }
    std::fprintf(stderr, "%s: on %s\n", argv[0], mnemo::cuda_runtime::describe().c_str());
    doctest::Context context(argc, argv);
    return context.run();
}
