#pragma once
// mpi_communicator: the communicator (mnemo/dist/communicator.hpp) over MPI. Not part of mnemo.hpp:
// include it where the program links MPI (CMake: find_package(MPI), MPI::MPI_CXX).
//
//   mnemo::mpi_session mpi(argc, argv);   // MPI_Init_thread (funneled) when launched by mpirun, else nothing
//   mnemo::communicator& comm = mpi.communicator();   // MPI_COMM_WORLD, or the single process
//
// A program started without mpirun stays a single process and never initialises MPI (Open MPI's
// singleton start-up costs time and prints warnings on machines without a network). Only the thread that
// created the session calls MPI (MPI_THREAD_FUNNELED); OpenMP's threads never do.
//
// sum() of floats is a reduce-scatter followed by an all-gather over a buffer padded to a multiple of
// the rank count: each chunk is added on one rank in MPI's fixed order and copied to the others, so
// every rank holds bitwise the same sum (an all-reduce promises that only as advice), and its traffic
// is the bandwidth-optimal 2·(size−1)/size of the payload per rank. Small sums of doubles and integers
// are a reduce to rank 0 and a broadcast, for the same reason.
#include <mpi.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <optional>
#include <string>

#include "../core/buffer.hpp"
#include "../core/error.hpp"
#include "communicator.hpp"

namespace mnemo {

namespace detail {
inline void mpi_check(int rc, const char* what) {
    if (rc == MPI_SUCCESS) return;
    char text[MPI_MAX_ERROR_STRING];
    int len = 0;
    MPI_Error_string(rc, text, &len);
    fail("MPI: ", what, " failed: ", std::string(text, std::size_t(len)));
}
}  // namespace detail

/// The communicator over MPI_COMM_WORLD (see the header comment).
class mpi_communicator final : public communicator {
public:
    mpi_communicator() {
        MPI_Comm_rank(MPI_COMM_WORLD, &rank_);
        MPI_Comm_size(MPI_COMM_WORLD, &size_);
        // Errors come back as codes (detail::mpi_check turns them into mnemo::error), not as an abort.
        MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
    }
    int rank() const override { return rank_; }
    int size() const override { return size_; }

    void sum(float* x, std::size_t n) override {
        float_sum_bytes_ += n * sizeof(float);
        if (size_ == 1 || n == 0) return;
        const std::size_t chunk = (n + std::size_t(size_) - 1) / std::size_t(size_);
        MNEMO_CHECK(chunk <= std::size_t(INT32_MAX), "MPI: a sum of ", n, " floats is too large for one call");
        padded_.resize(chunk * std::size_t(size_));
        std::copy(x, x + n, padded_.begin());
        std::fill(padded_.begin() + std::ptrdiff_t(n), padded_.end(), 0.0f);
        mine_.resize(chunk);
        detail::mpi_check(MPI_Reduce_scatter_block(padded_.data(), mine_.data(), int(chunk), MPI_FLOAT, MPI_SUM,
                                                   MPI_COMM_WORLD),
                          "the gradient reduce-scatter");
        detail::mpi_check(MPI_Allgather(mine_.data(), int(chunk), MPI_FLOAT, padded_.data(), int(chunk), MPI_FLOAT,
                                        MPI_COMM_WORLD),
                          "the gradient all-gather");
        std::copy(padded_.begin(), padded_.begin() + std::ptrdiff_t(n), x);
    }
    void sum(double* x, std::size_t n) override { reduce_then_broadcast(x, n, MPI_DOUBLE, MPI_SUM); }
    void sum(std::int64_t* x, std::size_t n) override { reduce_then_broadcast(x, n, MPI_INT64_T, MPI_SUM); }
    void min(std::int64_t* x, std::size_t n) override { reduce_then_broadcast(x, n, MPI_INT64_T, MPI_MIN); }

    void broadcast(void* data, std::size_t bytes, int root) override {
        auto* p = static_cast<char*>(data);
        for (std::size_t at = 0; at < bytes;) {  // in pieces that an int counts
            const std::size_t n = std::min<std::size_t>(bytes - at, std::size_t(1) << 30);
            detail::mpi_check(MPI_Bcast(p + at, int(n), MPI_BYTE, root, MPI_COMM_WORLD), "a broadcast");
            at += n;
        }
    }
    void gather(const void* in, std::size_t bytes, void* out, int root) override {
        MNEMO_CHECK(bytes <= std::size_t(INT32_MAX), "MPI: a gather of ", bytes, " bytes per rank is too large");
        detail::mpi_check(MPI_Gather(in, int(bytes), MPI_BYTE, out, int(bytes), MPI_BYTE, root, MPI_COMM_WORLD),
                          "a gather");
    }
    void barrier() override { detail::mpi_check(MPI_Barrier(MPI_COMM_WORLD), "a barrier"); }
    std::string description() const override {
        return "MPI, " + std::to_string(size_) + (size_ == 1 ? " rank" : " ranks");
    }

private:
    template <class T>
    void reduce_then_broadcast(T* x, std::size_t n, MPI_Datatype type, MPI_Op op) {
        if (size_ == 1 || n == 0) return;
        MNEMO_CHECK(n <= std::size_t(INT32_MAX), "MPI: a reduction of ", n, " values is too large for one call");
        // In place on rank 0 (no buffer to allocate in a training step), then from rank 0 to all.
        detail::mpi_check(MPI_Reduce(rank_ == 0 ? MPI_IN_PLACE : x, x, int(n), type, op, 0, MPI_COMM_WORLD),
                          "a reduction");
        detail::mpi_check(MPI_Bcast(x, int(n), type, 0, MPI_COMM_WORLD), "a broadcast");
    }

    int rank_ = 0, size_ = 1;
    aligned_vector<float> padded_, mine_;
};

/// MPI's lifetime for a program: initialises MPI when the process was launched by mpirun (see the
/// header comment) and finalises it on destruction.
class mpi_session {
public:
    mpi_session(int& argc, char**& argv) {
        if (!launched_by_mpi()) return;
        int provided = 0;
        detail::mpi_check(MPI_Init_thread(&argc, &argv, MPI_THREAD_FUNNELED, &provided), "MPI_Init_thread");
        initialised_ = true;
        world_.emplace();
    }
    ~mpi_session() {
        world_.reset();
        if (initialised_) MPI_Finalize();
    }
    mpi_session(const mpi_session&) = delete;
    mpi_session& operator=(const mpi_session&) = delete;

    bool active() const { return initialised_; }
    mnemo::communicator& communicator() {
        if (world_) return *world_;
        return local_communicator();
    }
    /// Ends every rank of the job at once (for an error raised on one rank only, outside agree()).
    [[noreturn]] void abort(int code) {
        if (initialised_) MPI_Abort(MPI_COMM_WORLD, code);
        std::exit(code);
    }

private:
    bool initialised_ = false;
    std::optional<mpi_communicator> world_;
};

}  // namespace mnemo
