#pragma once
// A trainer checkpoint: two safetensors files committed as one.
//
//   PATH                     the model (what mnemo_eval and PyTorch read)
//   PATH.state.safetensors   what resuming needs besides the model (optimizer moments, positions, memory)
//
// Each file alone is written atomically (safetensors_writer: temporary file, fsync, rename), but two
// renames are not one, so a crash between them would leave a model of step N+1 beside a state of step N.
// checkpoint_writer::commit() therefore goes through pending files:
//
//   1. PATH.pending                      the new model, complete and durable
//   2. PATH.state.safetensors.pending    the new state; the moment this file exists the save has happened
//   3. rename PATH.pending -> PATH, then PATH.state.safetensors.pending -> PATH.state.safetensors
//
// recover_checkpoint(PATH), run before a checkpoint is read (and at the start of every save), finishes
// or discards whatever a killed process left:
//
//   state pending, model pending   -> both renames (the save had happened)
//   state pending, no model pending -> the state's rename (the model's was done)
//   model pending alone            -> removed: the save had not happened, the old pair is intact
//   stale PATH*.tmp.<pid> files of processes no longer running -> removed
//
// So after a crash at any instant the pair on disk is either the previous checkpoint or the new one.
// The state file records a 64-bit FNV-1a hash of its model file's bytes (metadata "model_fnv1a64");
// check_checkpoint_pair() rejects a model and a state that were not saved together. POSIX only.
#include <signal.h>

#include <algorithm>
#include <cerrno>
#include <cinttypes>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <span>
#include <string>
#include <system_error>
#include <type_traits>
#include <vector>

#include "../core/buffer.hpp"
#include "../core/error.hpp"
#include "../io/safetensors.hpp"

namespace mnemo {

inline constexpr const char* checkpoint_state_suffix = ".state.safetensors";
inline constexpr const char* checkpoint_pending_suffix = ".pending";

/// The state file that goes with the model file at `path`.
inline std::string checkpoint_state_path(const std::string& path) { return path + checkpoint_state_suffix; }

/// 64-bit FNV-1a of a file's bytes, as 16 lower-case hex digits (Python: a loop over the bytes with
/// h = ((h ^ b) * 0x100000001b3) mod 2^64 from 0xcbf29ce484222325).
inline std::string file_fnv1a64(const std::string& path) {
    std::FILE* f = std::fopen(path.c_str(), "rb");
    if (!f) {
        const int e = errno;
        detail::fail("checkpoint: cannot open '", path, "' to hash it: ", detail::errno_text(e));
    }
    std::uint64_t h = 0xcbf29ce484222325ull;
    std::vector<unsigned char> buf(1 << 16);
    std::size_t n = 0;
    while ((n = std::fread(buf.data(), 1, buf.size(), f)) > 0)
        for (std::size_t i = 0; i < n; ++i) h = (h ^ buf[i]) * 0x100000001b3ull;
    const bool bad = std::ferror(f) != 0;
    std::fclose(f);
    if (bad) detail::fail("checkpoint: read error while hashing '", path, "'");
    char hex[17];
    std::snprintf(hex, sizeof hex, "%016" PRIx64, h);
    return hex;
}

namespace detail {

inline bool file_exists(const std::string& p) {
    std::error_code ec;
    return std::filesystem::exists(std::filesystem::symlink_status(p, ec));
}

inline void rename_or_fail(const std::string& from, const std::string& to) {
    if (std::rename(from.c_str(), to.c_str()) != 0) {
        const int e = errno;
        fail("checkpoint: cannot rename '", from, "' to '", to, "': ", errno_text(e));
    }
}

inline void remove_or_fail(const std::string& p) {
    if (std::remove(p.c_str()) != 0 && errno != ENOENT) {
        const int e = errno;
        fail("checkpoint: cannot remove '", p, "': ", errno_text(e));
    }
}

/// Removes "<name>.tmp.<pid>" files beside `file` whose process is gone (a save killed mid-write).
inline void remove_stale_temporaries(const std::string& file) {
    namespace fs = std::filesystem;
    const fs::path p(file);
    const fs::path dir = p.has_parent_path() ? p.parent_path() : fs::path(".");
    const std::string prefix = p.filename().string() + ".tmp.";
    std::error_code ec;
    for (const auto& entry : fs::directory_iterator(dir, ec)) {
        const std::string name = entry.path().filename().string();
        if (name.size() <= prefix.size() || name.compare(0, prefix.size(), prefix) != 0) continue;
        const std::string digits = name.substr(prefix.size());
        if (digits.size() > 9 || digits.find_first_not_of("0123456789") != std::string::npos) continue;
        const long pid = std::stol(digits);
        if (pid > 0 && ::kill(pid_t(pid), 0) != 0 && errno == ESRCH) remove_or_fail(entry.path().string());
    }
}

}  // namespace detail

/// What recover_checkpoint found and did.
enum class checkpoint_recovery { none, rolled_forward, discarded };

/// Completes or discards a save that was interrupted (see the top of this file). Returns what it did.
inline checkpoint_recovery recover_checkpoint(const std::string& path) {
    const std::string state = checkpoint_state_path(path);
    const std::string model_pending = path + checkpoint_pending_suffix;
    const std::string state_pending = state + checkpoint_pending_suffix;
    for (const std::string& f : {path, state, model_pending, state_pending}) detail::remove_stale_temporaries(f);
    checkpoint_recovery r = checkpoint_recovery::none;
    if (detail::file_exists(state_pending)) {
        if (detail::file_exists(model_pending)) detail::rename_or_fail(model_pending, path);
        detail::rename_or_fail(state_pending, state);
        r = checkpoint_recovery::rolled_forward;
    } else if (detail::file_exists(model_pending)) {
        detail::remove_or_fail(model_pending);
        r = checkpoint_recovery::discarded;
    }
    if (r != checkpoint_recovery::none) detail::sync_directory_of(path);
    return r;
}

/// Collects the two files of a checkpoint and writes them as one with commit().
class checkpoint_writer {
public:
    explicit checkpoint_writer(std::string path)
        : path_(std::move(path)), model_(path_ + checkpoint_pending_suffix),
          state_(checkpoint_state_path(path_) + checkpoint_pending_suffix) {}

    const std::string& path() const { return path_; }
    safetensors_writer& model() { return model_; }
    safetensors_writer& state() { return state_; }

    /// Writes PATH and PATH.state.safetensors so that a crash at any instant leaves the previous pair or
    /// this one (see the top of this file). Throws mnemo::error (the previous pair intact) on failure.
    void commit() {
        recover_checkpoint(path_);  // a pending pair of an earlier, killed save must not mix with this one
        try {
            model_.commit();
            state_.set_metadata("model_fnv1a64", file_fnv1a64(model_.path()));
            state_.commit();
        } catch (...) {
            std::remove(model_.path().c_str());  // the save had not happened: nothing pending stays
            throw;
        }
        detail::rename_or_fail(model_.path(), path_);
        detail::rename_or_fail(state_.path(), checkpoint_state_path(path_));
        detail::sync_directory_of(path_);
    }

private:
    std::string path_;
    safetensors_writer model_, state_;
};

/// Rejects a model file and a state file that were not saved together (their step, and the model's
/// hash recorded in the state). Files from before the hash was recorded are checked by step alone.
inline void check_checkpoint_pair(const safetensors_file& model, const safetensors_file& state) {
    const auto& m = model.metadata();
    const auto& s = state.metadata();
    const auto get = [](const safetensors_metadata& md, const char* key) {
        const auto it = md.find(key);
        return it == md.end() ? std::string("?") : it->second;
    };
    if (get(m, "step") != get(s, "step"))
        detail::fail("checkpoint: '", model.path(), "' is at step ", get(m, "step"), " but '", state.path(),
                     "' at step ", get(s, "step"), ": they were not saved together");
    const auto it = s.find("model_fnv1a64");
    if (it != s.end()) {
        const std::string h = file_fnv1a64(model.path());
        if (h != it->second)
            detail::fail("checkpoint: '", state.path(), "' was saved with a model file of hash ", it->second, ", but '",
                         model.path(), "' hashes to ", h, ": the two files do not belong together");
    }
}

// ---------------------------------------------------------------------------------------------
// Reading a trainer state file. Every value is checked before use; errors name the file and tensor.
// ---------------------------------------------------------------------------------------------

/// A non-negative count held in a tensor of one integer element (trainer.step, trainer.sample_rng).
inline std::int64_t read_state_count(const safetensors_file& f, const std::string& name) {
    const std::vector<std::int64_t> v = f.to_vector<std::int64_t>(name);
    if (v.size() != 1 || v[0] < 0)
        detail::fail("checkpoint: '", f.path(), "': tensor '", name, "' must hold one non-negative integer, it holds ",
                     v.size() == 1 ? std::to_string(v[0]) : std::to_string(v.size()) + " elements");
    return v[0];
}

/// A byte vocabulary stored as integers (trainer.vocab): distinct values in [0, 255], increasing, at
/// least one.
inline std::vector<std::uint8_t> read_state_bytes(const safetensors_file& f, const std::string& name) {
    const std::vector<std::int64_t> v = f.to_vector<std::int64_t>(name);
    if (v.empty()) detail::fail("checkpoint: '", f.path(), "': tensor '", name, "' is empty (no vocabulary)");
    std::vector<std::uint8_t> b;
    for (std::size_t i = 0; i < v.size(); ++i) {
        if (v[i] < 0 || v[i] > 255 || (i > 0 && v[i] <= v[i - 1]))
            detail::fail("checkpoint: '", f.path(), "': tensor '", name, "' must list distinct bytes in increasing "
                         "order, but element ", i, " is ", v[i]);
        b.push_back(std::uint8_t(v[i]));
    }
    return b;
}

/// Restores a compressive / XL memory from memory.<layer>.mem and .c_mem ([slots, batch, d_model]) and,
/// for a memory that tracks usage (most-used compression: it has usage_data), memory.<layer>.usage
/// ([mem slots, batch]), for the memory layers `layers` (model layer indices, in the memory's slot
/// order). Slot counts come from the shapes; they must agree over the layers and fit the memory
/// (resize() checks mem_len and c_mem_len). `memory` must be reset, for `count` streams: the file's
/// streams [first, first + count) (a data-parallel rank's share; count -1: all of them).
template <class Memory>
void read_state_memory(const safetensors_file& f, std::span<const index_t> layers, index_t batch, index_t d_model,
                       Memory& memory, index_t first = 0, index_t count = -1) {
    if (layers.empty()) return;
    if (count < 0) count = batch - first;
    MNEMO_CHECK(first >= 0 && count >= 1 && first + count <= batch, "checkpoint: streams [", first, ", ", first + count,
                ") are not a slice of the ", batch, " saved ones");
    const auto slots = [&](const std::string& name) {
        const auto& t = f.at(name);
        if (t.shape.size() != 3 || t.shape[1] != batch || t.shape[2] != d_model)
            detail::fail("checkpoint: '", f.path(), "': tensor '", name, "' has shape ", shape_string(t.shape),
                         ", expected [slots, ", batch, ", ", d_model, "]");
        return index_t(t.shape[0]);
    };
    // Rows [first, first + count) of each of the tensor's `rows` [batch, width] blocks, into dst (the
    // memory's backend), over the host path.
    using T = typename Memory::value_type;
    std::vector<T> all, mine;
    const auto read_slice = [&](const std::string& name, index_t rows, index_t width, T* dst) {
        all = f.to_vector<T>(name);
        const T* host = all.data();
        if (first != 0 || count != batch) {
            mine.resize(std::size_t(rows * count * width));
            for (index_t r = 0; r < rows; ++r)
                std::copy_n(all.data() + (r * batch + first) * width, count * width, mine.data() + r * count * width);
            host = mine.data();
        }
        if (rows > 0)
            device_memory<typename Memory::backend_type>::upload(dst, host, sizeof(T) * std::size_t(rows * count * width));
    };
    const std::string head = "memory." + std::to_string(layers[0]);
    const index_t mem_slots = slots(head + ".mem"), c_mem_slots = slots(head + ".c_mem");
    memory.resize(mem_slots, c_mem_slots);
    for (std::size_t slot = 0; slot < layers.size(); ++slot) {
        const std::string p = "memory." + std::to_string(layers[slot]);
        if (slots(p + ".mem") != mem_slots || slots(p + ".c_mem") != c_mem_slots)
            detail::fail("checkpoint: '", f.path(), "': layer ", layers[slot],
                         "'s memory holds a different number of slots than layer ", layers[0], "'s");
        read_slice(p + ".mem", mem_slots, d_model, memory.mem_data(index_t(slot)));
        read_slice(p + ".c_mem", c_mem_slots, d_model, memory.c_mem_data(index_t(slot)));
        if constexpr (requires { memory.usage_data(index_t(0)); }) {
            const auto& t = f.at(p + ".usage");
            if (t.shape != std::vector<std::int64_t>{mem_slots, batch})
                detail::fail("checkpoint: '", f.path(), "': tensor '", p, ".usage' has shape ", shape_string(t.shape),
                             ", expected [", mem_slots, ", ", batch, "]");
            read_slice(p + ".usage", mem_slots, 1, memory.usage_data(index_t(slot)));
        }
    }
}

}  // namespace mnemo
