// libFuzzer harness: a trainer state file (PATH.state.safetensors) read the way `train --resume` reads
// it, into the run tools/fuzz.sh writes its seed checkpoints with: a Compressive Transformer of
// d_model 16, 2 heads, rate 2, most-used compression (so the memory carries usage rows), 1 layer with
// memory, n_pos 12, d_ff 16, vocabulary 3, batch 2, mem_len 4, c_mem_len 4 (a state file of 11 KB; one
// layer rather than two halves the header JSON, which is most of the time per input).
// Everything that resuming reads is checked (mnemo/train/checkpoint.hpp) before use: the counters, the
// vocabulary, the optimizer moments, the memory. A mnemo::error is the expected answer to bad input;
// anything else (a crash, a sanitizer report, another exception, a leak) is a finding.
#include <cstddef>
#include <cstdint>
#include <vector>

#include <mnemo/mnemo.hpp>

namespace {

constexpr mnemo::index_t batch = 2, d_model = 16;
using model_t = mnemo::compressive_transformer<float, mnemo::config<16, 2, 2>, mnemo::most_used_compression>;

model_t& model() {
    static model_t* m = new model_t(mnemo::compressive_options{
        .vocab = 3, .n_layers = 1, .d_ff = 16, .n_pos = 12});
    return *m;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
    model_t& net = model();
    auto& ps = net.parameters();
    try {
        const mnemo::safetensors_file f = mnemo::parse_safetensors(data, size, "fuzz.state.safetensors");
        const auto& meta = f.metadata();
        if (const auto it = meta.find("format"); it == meta.end() || it->second != "mnemo-train-1")
            mnemo::detail::fail("not a train state file");
        (void)mnemo::read_state_count(f, "trainer.step");
        (void)mnemo::read_state_count(f, "trainer.sample_rng");
        (void)f.to_vector<std::int64_t>("trainer.data_position");
        (void)mnemo::read_state_bytes(f, "trainer.vocab");
        std::vector<float> m(std::size_t(ps.size())), v(std::size_t(ps.size()));
        mnemo::read_parameter_buffer(f, ps, m.data(), "optimizer.exp_avg.");
        mnemo::read_parameter_buffer(f, ps, v.data(), "optimizer.exp_avg_sq.");
        auto memory = net.make_memory(4, 4);
        memory.reset(batch, 4);
        std::vector<mnemo::index_t> layers;
        for (mnemo::index_t slot = 0; slot < net.n_memory_layers(); ++slot) layers.push_back(net.memory_layer(slot));
        mnemo::read_state_memory(f, layers, batch, d_model, memory);
    } catch (const mnemo::error&) {
    }
    return 0;
}
