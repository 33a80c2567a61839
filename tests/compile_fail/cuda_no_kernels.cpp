// Using a backend without kernels is a compile error that says so: a linear layer on mnemo::cuda
// (declared, but its kernels are not part of this build) cannot run forward.
#include <vector>

#include <mnemo/mnemo.hpp>

#ifdef MNEMO_EXPECT_COMPILE_ERROR
using backend = mnemo::cuda;
#else
using backend = mnemo::cpu;
#endif

int main() {
    mnemo::parameter_set<float> ps;
    mnemo::linear<float, 8, 4, backend> lin(ps, "lin");
    ps.allocate();
    std::vector<float> x(8), y(4);
    lin.forward(mnemo::view<const float, 8, backend>(x.data(), 1), mnemo::view<float, 4, backend>(y.data(), 1));
    return 0;
}
