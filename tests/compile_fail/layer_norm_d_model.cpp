// A layer norm over d_model 128 must refuse a view of 64 features:
// expect_extent<128, 64, mnemo::axis::d_model>.
#include <vector>

#include <mnemo/mnemo.hpp>

int main() {
    mnemo::parameter_set<float> ps;
    mnemo::layer_norm<float, 128> ln(ps, "norm");
    ps.allocate();
    std::vector<float> x(3 * 128), y(3 * 128);
#ifdef MNEMO_EXPECT_COMPILE_ERROR
    ln.forward(mnemo::view<const float, 64>(x.data(), 3), mnemo::view<float, 128>(y.data(), 3));
#else
    ln.forward(mnemo::view<const float, 128>(x.data(), 3), mnemo::view<float, 128>(y.data(), 3));
#endif
    return 0;
}
