// Where a training step's threads wait, loop by loop: steady-state training steps of configuration
// A, B or C (model_shapes.hpp) with every loop of the held team timed by its source line
// (include/mnemo/kernels/cpu/region_profile.hpp; this program is built with -DMNEMO_PROFILE_REGIONS).
//
//   OMP_NUM_THREADS=2 build/benchmarks/region_profile A 200    configuration, timed steps
//
// The memory is filled and ten steps run untimed first (the buffers grow there). Prints the median
// step, then the table: per site the loops, their time, thread 0's wait, the other threads' wait
// and the serial code before them, as % of the held time.
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include <mnemo/mnemo.hpp>

#include "model_shapes.hpp"
#include "model_steps.hpp"

namespace {

using mnemo_bench::shape;

template <class Cfg>
int run(const shape& s, int steps) {
    mnemo::compressive_transformer<float, Cfg> model({.vocab = s.vocab, .n_layers = s.n_layers, .d_ff = s.d_ff});
    model.reset_parameters(1);
    auto mem = model.make_memory(s.mem, s.c_mem);
    mem.reset(s.batch, s.seq);
    mnemo_bench::fill_memory(model, mem, s);
    auto& ps = model.parameters();
    mnemo::adamw<float> opt(ps.size(), {.lr = 2.5e-4});
    const auto tokens = mnemo_bench::tokens_for(s, 1), targets = mnemo_bench::tokens_for(s, 2);
    std::vector<double> ms;
    constexpr int warm_up = 10;
    for (int i = 0; i < warm_up + steps; ++i) {
        if (i == warm_up) mnemo::region_profile::start();
        const auto a = std::chrono::steady_clock::now();
        ps.zero_grad();
        model.train_segment(tokens, targets, s.batch, mem);
        mnemo::clip_grad_norm(ps, 1.0);
        opt.step(ps);
        if (i >= warm_up) ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - a).count());
    }
    mnemo::region_profile::stop();
    std::sort(ms.begin(), ms.end());
    std::printf("%d steps on %d threads, median %.3f ms a step\n", steps, omp_get_max_threads(), ms[ms.size() / 2]);
    mnemo::region_profile::report(stdout);
    return 0;
}

}  // namespace

int main(int argc, char** argv) {
    const std::string cfg = argc > 1 ? argv[1] : "A";
    const int steps = argc > 2 ? std::atoi(argv[2]) : 100;
    if (argc > 3 || steps < 1 || (cfg != "A" && cfg != "B" && cfg != "C")) {
        std::fprintf(stderr, "usage: region_profile [A|B|C] [timed steps >= 1]\n");
        return 2;
    }
    if (cfg == "A") return run<mnemo::config<128, 4, 2>>(mnemo_bench::A, steps);
    if (cfg == "B") return run<mnemo::config<256, 8, 4>>(mnemo_bench::B, steps);
    return run<mnemo::config<512, 8, 4>>(mnemo_bench::C, steps);
}
