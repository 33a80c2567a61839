// A linear layer from 64 features must refuse a view of 32 features at compile time, with an error
// that names both extents: expect_extent<64, 32, mnemo::axis::in_features>.
#include <vector>

#include <mnemo/mnemo.hpp>

int main() {
    mnemo::parameter_set<float> ps;
    mnemo::linear<float, 64, 16> lin(ps, "lin");
    ps.allocate();
    std::vector<float> y(2 * 16);
#ifdef MNEMO_EXPECT_COMPILE_ERROR
    std::vector<float> x(2 * 32);
    lin.forward(mnemo::view<const float, 32>(x.data(), 2), mnemo::view<float, 16>(y.data(), 2));
#else
    std::vector<float> x(2 * 64);
    lin.forward(mnemo::view<const float, 64>(x.data(), 2), mnemo::view<float, 16>(y.data(), 2));
#endif
    return 0;
}
