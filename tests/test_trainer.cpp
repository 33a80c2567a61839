// The trainer library (mnemo/trainer/): segment streams, the training loop, its checkpoints (a save and
// a restore continue bit for bit), fit()'s hooks, the NaN stop, sampling's use of the RNG, and the
// metrics log's resume rule.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include <mnemo/mnemo.hpp>

#include "testing.hpp"

namespace {

using mnemo::index_t;
using mnemo::token_t;

using compressive_t = mnemo::compressive_transformer<float, mnemo::config<16, 2, 2>, mnemo::conv_compression>;
using feedback_t = mnemo::feedback_transformer<float, mnemo::config<16, 2>>;

std::string tiny_text() {
    std::string t;
    for (int i = 0; i < 40; ++i) t += "line " + std::to_string(i) + ": the quick brown fox jumps over a lazy dog.\n";
    return t;
}

const mnemo::trainer_options tiny_options{.batch = 3, .seq_len = 4, .mem_len = 4, .c_mem_len = 4,
                                          .optimizer = mnemo::optimizer_kind::adamw, .lr = 3e-3,
                                          .warmup = 2, .steps = 40, .seed = 7};

template <class Model>
auto model_options(index_t vocab) {
    if constexpr (std::is_same_v<Model, compressive_t>)
        return mnemo::compressive_options{.vocab = vocab, .n_layers = 2, .d_ff = 16, .n_pos = 16};
    else
        return mnemo::feedback_options{.vocab = vocab, .n_layers = 2, .d_ff = 16, .n_pos = 16};
}

template <class Model>
mnemo::trainer_options options_for() {
    mnemo::trainer_options o = tiny_options;
    if constexpr (std::is_same_v<Model, feedback_t>) o.mem_len = o.c_mem_len = 0;
    return o;
}

template <class Model>
mnemo::trainer<Model> make_trainer(Model& model, const mnemo::text_corpus& data) {
    const auto o = options_for<Model>();
    return mnemo::trainer<Model>(model, o, data.vocab, mnemo::segment_streams(data.train, o.batch, o.seq_len, "training"),
                                 mnemo::segment_streams(data.valid, o.batch, o.seq_len, "validation"));
}

std::vector<float> values_of(const mnemo::parameter_set<float>& ps) {
    return std::vector<float>(ps.values(), ps.values() + ps.size());
}

}  // namespace

TEST_CASE("segment_streams: sequence-major segments, positions, wrap-around") {
    std::vector<token_t> text(50);
    for (std::size_t i = 0; i < text.size(); ++i) text[i] = token_t(i);
    mnemo::segment_streams s(text, 2, 4, "test");  // streams [0, 25) and [25, 50)
    CHECK(s.segments_per_pass() == 6);
    std::vector<token_t> in, tgt;
    CHECK_FALSE(s.next(in, tgt));
    CHECK(in == std::vector<token_t>{0, 25, 1, 26, 2, 27, 3, 28});
    CHECK(tgt == std::vector<token_t>{1, 26, 2, 27, 3, 28, 4, 29});
    CHECK(s.offsets() == std::vector<std::int64_t>{4, 29});
    for (int i = 1; i < 6; ++i) CHECK_FALSE(s.next(in, tgt));
    CHECK(s.next(in, tgt));  // the seventh segment starts a new pass
    CHECK(in[0] == 0);
    const std::vector<std::int64_t> other{8, 30};
    CHECK_THROWS_WITH_AS(s.set_offsets(other), doctest::Contains("do not match these streams"), mnemo::error);
    CHECK_THROWS_WITH_AS(mnemo::segment_streams(std::span<const token_t>(text.data(), 9), 2, 4, "validation (10%)"),
                         doctest::Contains("the text is too short: its validation (10%) part has 9 characters"),
                         mnemo::error);
}

TEST_CASE("segment_streams: the recall task scores answers whose key is in the stream") {
    const mnemo::recall_task task;
    mnemo::segment_streams s(task, 5, 4, 8);
    std::vector<token_t> in, tgt;
    std::int64_t answers = 0;
    for (int i = 0; i < 64; ++i) {  // 512 positions per stream: about 15 episodes each
        s.next(in, tgt);
        for (index_t r = 0; r < index_t(tgt.size()); ++r)
            if (s.scored_answer(r)) {
                ++answers;
                CHECK(task.keys.find(task.vocab.byte(tgt[std::size_t(r)])) != std::string_view::npos);
                CHECK(task.vocab.byte(in[std::size_t(r)]) == task.query);
            }
    }
    CHECK(answers >= 4 * 14);
    CHECK(answers <= 4 * 16);
}

TEST_CASE_TEMPLATE("trainer: k steps, save, restore, k steps equal 2k steps bitwise", Model, compressive_t, feedback_t) {
    const mnemo::text_corpus data = mnemo::split_text(tiny_text(), "tiny");
    mnemo::testing::temp_dir dir("trainer");
    const std::string path = dir.file("ck.safetensors");

    Model straight_model(model_options<Model>(data.vocab.size()));
    straight_model.reset_parameters(3);
    auto straight = make_trainer(straight_model, data);
    for (int i = 0; i < 16; ++i) straight.step();

    Model first_model(model_options<Model>(data.vocab.size()));
    first_model.reset_parameters(3);
    auto first = make_trainer(first_model, data);
    for (int i = 0; i < 8; ++i) first.step();
    first.save(path, {{"note", "test"}});
    CHECK(first.last_saved_step() == 8);

    Model second_model(model_options<Model>(data.vocab.size()));
    second_model.reset_parameters(3);
    second_model.reset_parameters(99);  // the checkpoint must replace every value
    auto second = make_trainer(second_model, data);
    second.restore(mnemo::read_trainer_checkpoint(path), path);
    CHECK(second.step_count() == 8);
    for (int i = 0; i < 8; ++i) second.step();
    CHECK(values_of(second_model.parameters()) == values_of(straight_model.parameters()));
    const auto v1 = straight.validate(2), v2 = second.validate(2);
    CHECK(v1.ce == v2.ce);
    CHECK(v1.ce > 0);
}

TEST_CASE("trainer: fit reports, validates and saves on its schedule") {
    const mnemo::text_corpus data = mnemo::split_text(tiny_text(), "tiny");
    mnemo::testing::temp_dir dir("trainer_fit");
    compressive_t model(model_options<compressive_t>(data.vocab.size()));
    model.reset_parameters(3);
    auto t = make_trainer(model, data);
    std::vector<std::int64_t> logged, validated, saved;
    mnemo::fit_hooks hooks;
    hooks.on_log = [&](const mnemo::fit_progress& p) {
        logged.push_back(p.step);
        CHECK(std::isfinite(p.ce));
        CHECK(p.tokens_per_second > 0);
    };
    hooks.on_validation = [&](std::int64_t step, const mnemo::validation_result& v, double) {
        validated.push_back(step);
        CHECK(v.segments == 2);
    };
    hooks.on_save = [&](std::int64_t step, const std::string&) { saved.push_back(step); };
    const std::int64_t taken = t.fit({.until = 10, .log_every = 4, .eval_every = 5, .eval_segments = 2,
                                      .save_every = 3, .checkpoint = dir.file("ck.safetensors")},
                                     hooks);
    CHECK(taken == 10);
    CHECK(logged == std::vector<std::int64_t>{4, 8, 10});
    CHECK(validated == std::vector<std::int64_t>{5});  // not at the last step: the caller's
    CHECK(saved == std::vector<std::int64_t>{3, 6, 9});
    const auto f = mnemo::read_trainer_checkpoint(dir.file("ck.safetensors"));
    CHECK(mnemo::read_state_count(f.state, "trainer.step") == 9);
    CHECK(f.model.metadata().at("step") == "9");
}

TEST_CASE("trainer: a NaN stops the step before the optimizer, naming the step and the last checkpoint") {
    const mnemo::text_corpus data = mnemo::split_text(tiny_text(), "tiny");
    mnemo::testing::temp_dir dir("trainer_nan");
    compressive_t model(model_options<compressive_t>(data.vocab.size()));
    model.reset_parameters(3);
    auto t = make_trainer(model, data);
    t.step();
    t.save(dir.file("ck.safetensors"), {});
    auto& ps = model.parameters();
    std::fill(ps.values(), ps.values() + ps.size(), std::nanf(""));
    const std::vector<float> before = values_of(ps);
    CHECK_THROWS_WITH_AS(t.step(), doctest::Contains("step 2: the"), mnemo::error);
    CHECK_THROWS_WITH_AS(t.step(), doctest::Contains("ck.safetensors' at step 1, is kept"), mnemo::error);
    const std::vector<float> after = values_of(ps);
    CHECK(std::memcmp(before.data(), after.data(), before.size() * sizeof(float)) == 0);  // no optimizer step
}

TEST_CASE("trainer: sampling draws one uniform per token, greedy none") {
    const mnemo::text_corpus data = mnemo::split_text(tiny_text(), "tiny");
    compressive_t model(model_options<compressive_t>(data.vocab.size()));
    model.reset_parameters(3);
    auto t = make_trainer(model, data);
    const auto prompt = data.vocab.encode("line 1", "prompt");
    const std::uint64_t o0 = t.sample_rng().offset();
    const std::string g1 = t.sample_text(prompt, 12, {.greedy = true});
    CHECK(t.sample_rng().offset() == o0);
    CHECK(t.sample_text(prompt, 12, {.greedy = true}) == g1);
    CHECK(g1.size() == 12);
    (void)t.sample(prompt, 9, {.temperature = 0.7, .top_k = 4, .top_p = 0.9});
    mnemo::rng one(1);
    (void)one.uniform();
    CHECK(t.sample_rng().offset() == o0 + 9 * one.offset());
    CHECK_THROWS_WITH_AS(t.sample(prompt, 3, {.top_p = 1.5}), doctest::Contains("top_p must be in (0, 1]"), mnemo::error);
}

TEST_CASE("metrics_log: fresh runs truncate; a resumed run keeps the steps up to its checkpoint") {
    mnemo::testing::temp_dir dir("metrics");
    const std::string path = dir.file("m.jsonl");
    const auto read_all = [&] {
        std::ifstream in(path);
        std::vector<std::int64_t> steps;
        std::string line;
        while (std::getline(in, line)) steps.push_back(mnemo::metrics_log::step_of(line));
        return steps;
    };
    {
        mnemo::metrics_log m(path);
        for (int s = 10; s <= 40; s += 10) m.train("run", s, s * 8, 1.0, 0.1, 1e-3, 0.5, 100, 1);
        m.valid("run", 40, 320, 1.0, 0.1, -1, 4, 2);
    }
    CHECK(read_all() == std::vector<std::int64_t>{10, 20, 30, 40, 40});
    {
        mnemo::metrics_log m(path, 20);  // resumed from a checkpoint of step 20
        m.train("run", 30, 240, 1.0, 0.1, 1e-3, 0.5, 100, 1);
    }
    CHECK(read_all() == std::vector<std::int64_t>{10, 20, 30});
    { mnemo::metrics_log m(path); }
    CHECK(read_all().empty());
    std::ifstream in(path);
    CHECK(in.good());
    mnemo::metrics_log none;
    CHECK_FALSE(bool(none));
    none.train("x", 1, 1, 1, 1, 1, 1, 1, 1);  // writes nothing, no error
    {
        mnemo::metrics_log m(path);
        m.valid("a\"b", 1, 8, std::nan(""), 0, 0.5, 1, 0);
    }
    std::ifstream in2(path);
    std::string line;
    std::getline(in2, line);
    CHECK(line == "{\"run\":\"a\\\"b\",\"kind\":\"valid\",\"step\":1,\"tokens\":8,\"loss\":null,\"bits_per_char\":null,"
                  "\"ar\":0,\"accuracy\":0.5,\"segments\":1,\"elapsed_s\":0}");
}
