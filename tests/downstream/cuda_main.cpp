// Builds against an installed mnemo with its CUDA backend (mnemo::cuda) and runs the GPU's one
// question that needs no GPU: whether there is one. With a GPU, one small upload and download too.
#include <cstdio>
#include <vector>

#include <mnemo/cuda.hpp>

int main() {
    if (!mnemo::cuda_runtime::available()) {
        std::printf("downstream: mnemo::cuda links (no GPU: %s)\n", mnemo::cuda_runtime::describe().c_str());
        return 0;
    }
    mnemo::buffer<float, mnemo::cuda> b;
    const std::vector<float> x = {1.0f, 2.0f, 3.0f};
    b.upload(x);
    std::vector<float> y(3);
    mnemo::device_memory<mnemo::cuda>::download(y.data(), b.data(), sizeof(float) * 3);
    if (y != x) {
        std::printf("downstream: the GPU round trip changed the values\n");
        return 1;
    }
    std::printf("downstream: mnemo::cuda links and runs (%s)\n", mnemo::cuda_runtime::describe().c_str());
    return 0;
}
