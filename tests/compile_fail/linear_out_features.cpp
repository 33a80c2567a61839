// A linear layer to 16 features must refuse an output view of 8 features:
// expect_extent<16, 8, mnemo::axis::out_features>.
#include <vector>

#include <mnemo/mnemo.hpp>

int main() {
    mnemo::parameter_set<float> ps;
    mnemo::linear<float, 64, 16> lin(ps, "lin");
    ps.allocate();
    std::vector<float> x(2 * 64), y(2 * 16);
#ifdef MNEMO_EXPECT_COMPILE_ERROR
    lin.forward(mnemo::view<const float, 64>(x.data(), 2), mnemo::view<float, 8>(y.data(), 2));
#else
    lin.forward(mnemo::view<const float, 64>(x.data(), 2), mnemo::view<float, 16>(y.data(), 2));
#endif
    return 0;
}
