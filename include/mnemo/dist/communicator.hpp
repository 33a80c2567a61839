#pragma once
// The communicator seam of data-parallel training: what the trainer needs from the processes that train
// one model together (rank, size, a sum that every rank gets bitwise the same, broadcast, gather,
// barrier, and an agreement on errors), and the gradient reduction built on it.
//
//   mnemo::single_process       one process, no MPI: every collective is the identity (the default)
//   mnemo::mpi_communicator     MPI (mnemo/dist/mpi.hpp; the program links MPI)
//
// An implementation over NCCL for device buffers (the CUDA backend) implements the same interface; the
// trainer calls nothing else.
//
// Determinism. sum() returns bitwise the same values on every rank, and the same values from run to run
// for a given number of ranks: MPI's all-reduce promises neither (its algorithm may add in a different
// order on different ranks), so the MPI implementation reduces each chunk on one rank
// (reduce-scatter) and copies the result to all (all-gather).
//
// Errors. A collective that one rank skips because it threw leaves the others waiting forever. Code that
// can fail on some ranks only (reading a file) runs under agree(): every rank reports whether it
// failed, and all of them learn the first failing rank and its message, so all of them throw the same
// error (collective_error) and leave together; only rank 0 needs to print it. With one process,
// agree() only runs the work.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <functional>
#include <limits>
#include <new>
#include <span>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "../core/buffer.hpp"
#include "../core/error.hpp"
#include "../core/parameters.hpp"
#include "../core/shape.hpp"
#include "../kernels/cpu/ops.hpp"

namespace mnemo {

/// An error raised alike on every rank (after agree(), or from values every rank shares): rank 0 prints
/// it, the others leave quietly.
class collective_error : public error {
public:
    using error::error;
};

/// What data-parallel training asks of the processes (see the header comment).
class communicator {
public:
    virtual ~communicator() = default;
    virtual int rank() const = 0;
    virtual int size() const = 0;
    /// In place: x ← Σ over ranks of x, bitwise the same on every rank and from run to run.
    virtual void sum(float* x, std::size_t n) = 0;
    virtual void sum(double* x, std::size_t n) = 0;
    virtual void sum(std::int64_t* x, std::size_t n) = 0;
    /// In place: x ← the element-wise minimum over ranks.
    virtual void min(std::int64_t* x, std::size_t n) = 0;
    /// Rank `root`'s bytes to every rank.
    virtual void broadcast(void* data, std::size_t bytes, int root) = 0;
    /// Every rank's `bytes` bytes, in rank order, into `out` (size()·bytes) on `root`; `out` is ignored
    /// elsewhere.
    virtual void gather(const void* in, std::size_t bytes, void* out, int root) = 0;
    virtual void barrier() = 0;
    /// A name for messages ("1 process", "MPI, 4 ranks").
    virtual std::string description() const = 0;

    /// Bytes this rank's sum() calls of floats have handed to the network since the last reset (the
    /// payload; the MPI implementation's algorithm sends 2·(size−1)/size of it).
    std::uint64_t float_sum_bytes() const { return float_sum_bytes_; }
    void reset_traffic() { float_sum_bytes_ = 0; }

    /// Broadcasts a string (its length, then its bytes) from `root`.
    std::string broadcast(std::string s, int root) {
        std::int64_t n = std::int64_t(s.size());
        broadcast(&n, sizeof n, root);
        s.resize(std::size_t(n));
        if (n > 0) broadcast(s.data(), std::size_t(n), root);
        return s;
    }

    /// Runs `work` on every rank; if it threw on some, every rank throws collective_error with the
    /// message of the first failing rank, "rank R: " in front. With one rank, work's own exception
    /// passes through unchanged.
    void agree(const std::function<void()>& work) {
        if (size() == 1) {
            work();
            return;
        }
        std::string message;
        try {
            work();
        } catch (const std::bad_alloc&) {
            message = "out of memory (the model, the batch or the memory lengths are too large for this machine)";
        } catch (const std::length_error&) {
            message = "out of memory (the model, the batch or the memory lengths are too large for this machine)";
        } catch (const std::exception& e) {
            message = e.what();
            if (message.empty()) message = "an error without a message";
        }
        std::int64_t first = message.empty() ? std::numeric_limits<std::int64_t>::max() : std::int64_t(rank());
        min(&first, 1);
        if (first == std::numeric_limits<std::int64_t>::max()) return;
        message = broadcast(message, int(first));
        const std::string prefix = "mnemo: ";
        const std::string body = message.starts_with(prefix) ? message.substr(prefix.size()) : message;
        throw collective_error(prefix + "rank " + std::to_string(first) + ": " + body);
    }

protected:
    std::uint64_t float_sum_bytes_ = 0;
};

/// One process: every collective is the identity.
class single_process final : public communicator {
public:
    int rank() const override { return 0; }
    int size() const override { return 1; }
    void sum(float*, std::size_t n) override { float_sum_bytes_ += n * sizeof(float); }
    void sum(double*, std::size_t) override {}
    void sum(std::int64_t*, std::size_t) override {}
    void min(std::int64_t*, std::size_t) override {}
    void broadcast(void*, std::size_t, int) override {}
    void gather(const void* in, std::size_t bytes, void* out, int) override {
        if (bytes > 0) std::memcpy(out, in, bytes);
    }
    void barrier() override {}
    std::string description() const override { return "1 process"; }
};

/// Whether this process was started by an MPI launcher (mpirun, mpiexec, srun with PMI/PMIx): a
/// program built without MPI says so rather than train alone in every process.
inline bool launched_by_mpi() {
    for (const char* v : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS"})
        if (std::getenv(v)) return true;
    return false;
}

/// The process-wide single_process (the trainer's default).
inline communicator& local_communicator() {
    static single_process c;
    return c;
}

/// Averages a parameter_set's gradient over the ranks, sending only what may be non-zero.
///
/// The row-sparse tensors (the positional tables: most of the parameters, of which a step writes only
/// its window's rows) are live only over their touched rows. The ranks first agree on the hull of every
/// such tensor's touched rows (one small all-reduce), record it in the set (so the live ranges are the
/// same on every rank), pack the live ranges into one buffer, sum it (communicator::sum) and unpack it
/// divided by the rank count. Every rank ends with bitwise the same gradient. The buffers grow on the
/// first call and are reused.
class gradient_averager {
public:
    /// Whether reduce() sends the live ranges only (the default) or the whole buffer (for measuring).
    explicit gradient_averager(bool live_only = true) : live_only_(live_only) {}

    template <class T>
    void reduce(communicator& comm, parameter_set<T>& ps) {
        static_assert(std::is_same_v<T, float>, "gradient_averager: float parameters");
        const int n = comm.size();
        if (n == 1) {
            last_bytes_ = 0;
            return;
        }
        if (!live_only_) ps.touch_all_grads();
        const auto& entries = ps.entries();
        // The hull of each row-sparse tensor's touched rows over the ranks: min of lo and of −hi.
        rows_.clear();
        for (std::size_t i = 0; i < entries.size(); ++i) {
            if (entries[i].sparsity != grad_sparsity::rows) continue;
            const auto [lo, hi] = ps.touched_grad_rows(index_t(i));
            constexpr std::int64_t none = std::numeric_limits<std::int64_t>::max();
            rows_.push_back(lo < hi ? lo : none);
            rows_.push_back(lo < hi ? -std::int64_t(hi) : none);
        }
        if (!rows_.empty()) comm.min(rows_.data(), rows_.size());
        for (std::size_t i = 0, k = 0; i < entries.size(); ++i) {
            if (entries[i].sparsity != grad_sparsity::rows) continue;
            const std::int64_t lo = rows_[k++], neg_hi = rows_[k++];
            if (lo != std::numeric_limits<std::int64_t>::max()) ps.touch_grad_rows(index_t(i), index_t(lo), index_t(-neg_hi));
        }
        const std::span<const flat_range> live = ps.grad_live_ranges();
        std::size_t total = 0;
        for (const flat_range& r : live) total += std::size_t(r.end - r.begin);
        if (staging_.size() < total) staging_.resize(total);
        T* g = ps.grads_preserving_zeros();  // writes stay inside the live ranges
        std::size_t at = 0;
        for (const flat_range& r : live) {
            const index_t len = r.end - r.begin;
            ops<cpu>::copy(1, len, g + r.begin, len, staging_.data() + at, len);
            at += std::size_t(len);
        }
        comm.sum(staging_.data(), total);
        const T scale = T(1) / T(n);  // exact for 2, 4, 8, ... ranks
        at = 0;
        for (const flat_range& r : live) {
            const index_t len = r.end - r.begin;
            ops<cpu>::scale(1, len, staging_.data() + at, len, scale, g + r.begin, len);
            at += std::size_t(len);
        }
        last_bytes_ = total * sizeof(T);
    }

    /// The bytes the last reduce() summed (per rank; 0 with one rank).
    std::uint64_t last_bytes() const { return last_bytes_; }

private:
    bool live_only_;
    std::vector<std::int64_t> rows_;
    aligned_vector<float> staging_;
    std::uint64_t last_bytes_ = 0;
};

}  // namespace mnemo
