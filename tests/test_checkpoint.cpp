// The two-file checkpoint (mnemo/train/checkpoint.hpp): each instant a save can be interrupted at is
// recreated on disk and recovered; pairs that were not saved together are rejected; a file-size limit
// during a save is an error that leaves the previous pair intact.
#include <sys/resource.h>
#include <unistd.h>

#include <csignal>
#include <filesystem>
#include <string>
#include <vector>

#include <doctest/doctest.h>

#include <mnemo/train/checkpoint.hpp>

#include "testing.hpp"

namespace fs = std::filesystem;

namespace {

struct scratch_dir : mnemo::testing::temp_dir {
    scratch_dir() : mnemo::testing::temp_dir("checkpoint") {}
};

std::vector<float> values_of(int step, std::size_t n = 64) {
    std::vector<float> v(n);
    for (std::size_t i = 0; i < n; ++i) v[i] = float(step) * 1000.0f + float(i);
    return v;
}

/// A checkpoint of step `step` written whole through checkpoint_writer.
void save(const std::string& path, int step) {
    const std::vector<float> w = values_of(step), m = values_of(-step);
    mnemo::checkpoint_writer cw(path);
    cw.model().add("w", {std::int64_t(w.size())}, w.data()).set_metadata("step", std::to_string(step));
    cw.state().add("m", {std::int64_t(m.size())}, m.data()).set_metadata("step", std::to_string(step));
    cw.commit();
}

/// One file of a checkpoint of step `step`, written on its own (what a killed save leaves).
void write_model(const std::string& file, int step) {
    const std::vector<float> w = values_of(step);
    mnemo::safetensors_writer(file).add("w", {std::int64_t(w.size())}, w.data()).set_metadata("step", std::to_string(step)).commit();
}
void write_state(const std::string& file, int step, const std::string& model_file) {
    const std::vector<float> m = values_of(-step);
    mnemo::safetensors_writer(file)
        .add("m", {std::int64_t(m.size())}, m.data())
        .set_metadata("step", std::to_string(step))
        .set_metadata("model_fnv1a64", mnemo::file_fnv1a64(model_file))
        .commit();
}

/// What a save of `step` killed after its commit point leaves: both pending files.
void write_pending_pair(const std::string& path, int step) {
    const std::string model_pending = path + ".pending";
    write_model(model_pending, step);
    write_state(mnemo::checkpoint_state_path(path) + ".pending", step, model_pending);
}

/// The pair on disk: both files read, checked as a pair, and at `step`.
void check_pair_at(const std::string& path, int step) {
    const auto model = mnemo::read_safetensors(path);
    const auto state = mnemo::read_safetensors(mnemo::checkpoint_state_path(path));
    CHECK_NOTHROW(mnemo::check_checkpoint_pair(model, state));
    CHECK(model.metadata().at("step") == std::to_string(step));
    CHECK(model.to_vector<float>("w") == values_of(step));
    CHECK(state.to_vector<float>("m") == values_of(-step));
    for (const char* leftover : {".pending", ".state.safetensors.pending"}) CHECK_FALSE(fs::exists(path + leftover));
}

std::string message_of(auto&& f) {
    try {
        f();
    } catch (const mnemo::error& e) {
        return e.what();
    }
    return "";
}

}  // namespace

TEST_CASE("checkpoint: a save writes both files and leaves nothing pending") {
    scratch_dir d;
    const std::string path = d.file("ck.safetensors");
    save(path, 1);
    check_pair_at(path, 1);
    save(path, 2);
    check_pair_at(path, 2);
    CHECK(mnemo::recover_checkpoint(path) == mnemo::checkpoint_recovery::none);
    check_pair_at(path, 2);
}

TEST_CASE("checkpoint: every instant a save can be killed at leaves the previous pair or the new one") {
    scratch_dir d;
    const std::string path = d.file("ck.safetensors"), model_pending = path + ".pending";

    SUBCASE("killed while writing the new model: the old pair stays") {
        save(path, 1);
        write_model(model_pending, 2);
        CHECK(mnemo::recover_checkpoint(path) == mnemo::checkpoint_recovery::discarded);
        check_pair_at(path, 1);
    }
    SUBCASE("killed after both pending files: the save is completed") {
        save(path, 1);
        write_pending_pair(path, 2);
        CHECK(mnemo::recover_checkpoint(path) == mnemo::checkpoint_recovery::rolled_forward);
        check_pair_at(path, 2);
    }
    SUBCASE("killed between the two renames: the state's rename is completed") {
        save(path, 1);
        write_pending_pair(path, 2);
        fs::rename(model_pending, path);
        CHECK(mnemo::recover_checkpoint(path) == mnemo::checkpoint_recovery::rolled_forward);
        check_pair_at(path, 2);
    }
    SUBCASE("the first save killed before its commit point: no checkpoint, nothing left") {
        write_model(model_pending, 1);
        CHECK(mnemo::recover_checkpoint(path) == mnemo::checkpoint_recovery::discarded);
        CHECK_FALSE(fs::exists(path));
        CHECK_FALSE(fs::exists(model_pending));
    }
    SUBCASE("a save after a killed one does not mix the two") {
        save(path, 1);
        write_pending_pair(path, 2);
        save(path, 3);  // recovers the pending pair of step 2 first, then writes step 3
        check_pair_at(path, 3);
    }
}

TEST_CASE("checkpoint: temporary files of killed writers are removed, those of live ones kept") {
    scratch_dir d;
    const std::string path = d.file("ck.safetensors");
    save(path, 1);
    // pid 2^22 + 1 is above Linux's largest pid (pid_max is at most 2^22).
    const std::string dead = path + ".pending.tmp.4194305", live = path + ".pending.tmp." + std::to_string(::getpid());
    write_model(dead, 5);
    write_model(live, 5);
    CHECK(mnemo::recover_checkpoint(path) == mnemo::checkpoint_recovery::none);
    CHECK_FALSE(fs::exists(dead));
    CHECK(fs::exists(live));
    check_pair_at(path, 1);
}

TEST_CASE("checkpoint: a model and a state that were not saved together are rejected") {
    scratch_dir d;
    const std::string a = d.file("a.safetensors"), b = d.file("b.safetensors");
    save(a, 4);
    // b: the same step, other values: the step agrees, the model's hash does not.
    {
        std::vector<float> w = values_of(4);
        w[7] += 1.0f;
        const std::vector<float> m = values_of(-4);
        mnemo::checkpoint_writer cw(b);
        cw.model().add("w", {std::int64_t(w.size())}, w.data()).set_metadata("step", "4");
        cw.state().add("m", {std::int64_t(m.size())}, m.data()).set_metadata("step", "4");
        cw.commit();
    }
    const auto model_a = mnemo::read_safetensors(a);
    const auto state_b = mnemo::read_safetensors(mnemo::checkpoint_state_path(b));
    CHECK(message_of([&] { mnemo::check_checkpoint_pair(model_a, state_b); }).find("do not belong together") !=
          std::string::npos);
    save(b, 5);
    const auto state_b5 = mnemo::read_safetensors(mnemo::checkpoint_state_path(b));
    const std::string msg = message_of([&] { mnemo::check_checkpoint_pair(model_a, state_b5); });
    INFO(msg);
    CHECK(msg.find("is at step 4") != std::string::npos);
    CHECK(msg.find("at step 5") != std::string::npos);
}

TEST_CASE("checkpoint: a file-size limit during a save is an error naming the file; the old pair stays") {
    scratch_dir d;
    const std::string path = d.file("ck.safetensors");
    save(path, 1);
    rlimit old{};
    REQUIRE(::getrlimit(RLIMIT_FSIZE, &old) == 0);
    const auto old_handler = std::signal(SIGXFSZ, SIG_IGN);  // else the kernel kills us (SIGXFSZ)
    rlimit small = old;
    small.rlim_cur = 4096;
    REQUIRE(::setrlimit(RLIMIT_FSIZE, &small) == 0);
    std::string msg;
    {
        const std::vector<float> big(4096, 1.0f);  // 16 KiB: past the limit
        mnemo::checkpoint_writer cw(path);
        cw.model().add("w", {std::int64_t(big.size())}, big.data()).set_metadata("step", "2");
        cw.state().add("m", {std::int64_t(big.size())}, big.data()).set_metadata("step", "2");
        msg = message_of([&] { cw.commit(); });
    }
    ::setrlimit(RLIMIT_FSIZE, &old);
    std::signal(SIGXFSZ, old_handler);
    INFO(msg);
    CHECK(msg.find("ck.safetensors") != std::string::npos);
    CHECK(msg.find("File too large") != std::string::npos);
    check_pair_at(path, 1);
    for (const auto& e : fs::directory_iterator(d.path)) {
        INFO(e.path().string());
        CHECK(e.path().filename().string().find(".tmp.") == std::string::npos);
    }
}
