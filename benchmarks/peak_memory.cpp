// Peak resident memory of a training step and of generation for configurations A, B and C of
// bench_models, each in a fresh process (the kernel's high-water mark, VmHWM, only grows):
//
//   for c in A B C; do for m in train generate; do build/benchmarks/peak_memory $c $m; done; done
//
// It runs the steady state of bench_models (memory and compressed memory full, 3 steps or 64
// tokens) and prints the high-water mark before the model was built and after. The training figure
// includes AdamW's two moment buffers; generation has no optimizer (values and gradient buffers only).
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include <mnemo/mnemo.hpp>

namespace {

using mnemo::index_t;
using mnemo::token_t;

struct shape {
    index_t vocab, n_layers, d_ff, seq, mem, c_mem, batch;
};

double vm_hwm_mib() {
    std::ifstream f("/proc/self/status");
    std::string line;
    while (std::getline(f, line))
        if (line.rfind("VmHWM:", 0) == 0) return std::stod(line.substr(6)) / 1024.0;  // kB
    return -1;
}

std::vector<token_t> tokens_for(const shape& s, index_t batch, std::uint64_t seed) {
    mnemo::rng r(seed);
    std::vector<token_t> t(std::size_t(s.seq * batch));
    for (auto& x : t) x = token_t(r.next_u32() % std::uint32_t(s.vocab));
    return t;
}

template <class Cfg>
int run(const shape& s, bool train, const char* name) {
    const double before = vm_hwm_mib();
    mnemo::compressive_transformer<float, Cfg> model({.vocab = s.vocab, .n_layers = s.n_layers, .d_ff = s.d_ff});
    model.reset_parameters(1);
    if (!train) model.set_grad_enabled(false);  // inference, as bench_models' generation rows
    const index_t batch = train ? s.batch : 1;
    auto mem = model.make_memory(s.mem, s.c_mem);
    mem.reset(batch, s.seq);
    const index_t fill = (s.mem + s.c_mem * index_t(Cfg::compression_rate)) / s.seq + 2;
    auto& ps = model.parameters();
    for (index_t i = 0; i < fill; ++i) {
        auto t = tokens_for(s, batch, 1000 + std::uint64_t(i));
        model.forward(t, batch, mem);
        model.update_memory(mem);
    }
    if (train) {
        mnemo::adamw<float> opt(ps.size(), {.lr = 2.5e-4});
        const auto x = tokens_for(s, batch, 1), y = tokens_for(s, batch, 2);
        for (int i = 0; i < 3; ++i) {
            ps.zero_grad();
            model.train_segment(x, y, batch, mem);
            mnemo::clip_grad_norm(ps, 1.0);
            opt.step(ps);
        }
    } else {
        model.cache_memory_projections(true);
        std::vector<token_t> tok = {1};
        for (int i = 0; i < 64; ++i) {
            auto logits = model.forward(tok, 1, mem);
            model.update_memory(mem);
            tok[0] = token_t(std::max_element(logits.row(0), logits.row(0) + logits.cols()) - logits.row(0));
        }
    }
    const double after = vm_hwm_mib();
    std::printf("%s %-8s peak RSS %.1f MiB (process before the model: %.1f MiB; parameters %.1f M)\n", name,
                train ? "train" : "generate", after, before, double(ps.count()) / 1e6);
    return 0;
}

}  // namespace

int main(int argc, char** argv) {
    if (argc != 3 || (std::strcmp(argv[2], "train") != 0 && std::strcmp(argv[2], "generate") != 0)) {
        std::fprintf(stderr, "usage: peak_memory A|B|C train|generate\n");
        return 2;
    }
    const bool train = std::strcmp(argv[2], "train") == 0;
    const std::string c = argv[1];
    if (c == "A") return run<mnemo::config<128, 4, 2>>({65, 6, 256, 8, 8, 128, 32}, train, "A");
    if (c == "B") return run<mnemo::config<256, 8, 4>>({65, 6, 1024, 128, 128, 128, 8}, train, "B");
    if (c == "C") return run<mnemo::config<512, 8, 4>>({256, 6, 2048, 256, 256, 256, 4}, train, "C");
    std::fprintf(stderr, "peak_memory: unknown configuration '%s' (A, B or C)\n", c.c_str());
    return 2;
}
