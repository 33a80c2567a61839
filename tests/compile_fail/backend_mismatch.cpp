// A view of one backend passed to a module of another does not compile: expect_backend<mnemo::cpu, mnemo::cuda>.
#include <vector>

#include <mnemo/mnemo.hpp>

#ifdef MNEMO_EXPECT_COMPILE_ERROR
using input_backend = mnemo::cuda;
#else
using input_backend = mnemo::cpu;
#endif

int main() {
    mnemo::parameter_set<float> ps;
    mnemo::linear<float, 8, 4> lin(ps, "lin");
    ps.allocate();
    std::vector<float> x(8), y(4);
    lin.forward(mnemo::view<const float, 8, input_backend>(x.data(), 1), mnemo::view<float, 4>(y.data(), 1));
    return 0;
}
