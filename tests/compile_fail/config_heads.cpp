// d_model must split evenly into heads: config<100, 3> is refused with expect_divisible<100, 3>.
#include <mnemo/mnemo.hpp>

#ifdef MNEMO_EXPECT_COMPILE_ERROR
using cfg = mnemo::config<100, 3, 2>;
#else
using cfg = mnemo::config<96, 3, 2>;
#endif

int main() { return cfg::d_head == 32 ? 0 : 1; }
