// The compression rate must be at least 1: config<128, 4, 0> is refused with expect_compression_rate<0>.
#include <mnemo/mnemo.hpp>

#ifdef MNEMO_EXPECT_COMPILE_ERROR
using cfg = mnemo::config<128, 4, 0>;
#else
using cfg = mnemo::config<128, 4, 1>;
#endif

int main() { return cfg::compression_rate == 1 ? 0 : 1; }
