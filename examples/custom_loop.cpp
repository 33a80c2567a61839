// custom_loop: a training loop of your own over mnemo's trainer library, in a few lines. It trains a
// small Compressive Transformer on a text file (or on a text it makes up), validates, saves a
// checkpoint that `train --resume` and mnemo_eval read, and samples.
//   custom_loop [FILE|-] [STEPS]        (-: the made-up text; STEPS default 300)
#include <cstdio>
#include <cstdlib>
#include <string>

#include <mnemo/mnemo.hpp>

int main(int argc, char** argv) try {
    // The data: a file, split 90/10, or a made-up text with some structure to learn.
    mnemo::text_corpus data;
    if (argc > 1 && std::string(argv[1]) != "-") {
        data = mnemo::read_text_corpus(argv[1]);
    } else {
        std::string text;
        for (int i = 0; i < 400; ++i) text += "the " + std::string(i % 3 ? "cat" : "dog") + " sat on mat " + char('a' + i % 7) + ".\n";
        data = mnemo::split_text(text, "made-up text");
    }
    const long steps = argc > 2 ? std::atol(argv[2]) : 300;

    // The model: shapes in the type (d_model 64, 4 heads, compression rate 2), the rest at run time.
    using model_t = mnemo::compressive_transformer<float, mnemo::config<64, 4, 2>, mnemo::conv_compression>;
    model_t model({.vocab = data.vocab.size(), .n_layers = 2, .d_ff = 128, .n_pos = 64});
    model.reset_parameters(/*seed=*/1);

    // The trainer: streams of the data, the memory, the optimizer and its schedule.
    const mnemo::trainer_options o{.batch = 16, .seq_len = 16, .mem_len = 16, .c_mem_len = 16,
                                   .optimizer = mnemo::optimizer_kind::adamw, .lr = 1e-3,
                                   .warmup = 30, .steps = steps};
    mnemo::trainer trainer(model, o, data.vocab,
                           mnemo::segment_streams(data.train, o.batch, o.seq_len, "training"),
                           mnemo::segment_streams(data.valid, o.batch, o.seq_len, "validation"));

    // The loop: one segment per step; print every 50 steps, validate every 100.
    for (long s = 0; s < steps; ++s) {
        const mnemo::step_result r = trainer.step();
        if (r.step % 50 == 0)
            std::printf("step %4lld  loss %.3f bits/char  |grad| %.2f  lr %.2e\n", (long long)r.step,
                        r.ce / 0.6931471805599453, r.grad_norm, r.lr);
        if (r.step % 100 == 0) {
            const mnemo::validation_result v = trainer.validate(/*max_segments=*/0);
            std::printf("valid      loss %.3f bits/char\n", v.ce / 0.6931471805599453);
        }
    }

    // A checkpoint pair (model + trainer state) and a sample.
    trainer.save("custom_loop.safetensors", {{"model", "compressive"}});
    const auto prompt = data.vocab.encode("the ", "the prompt");
    std::printf("sample: the %s\n", trainer.sample_text(prompt, 60, {.temperature = 0.8, .top_p = 0.95}).c_str());
    return 0;
} catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
}
