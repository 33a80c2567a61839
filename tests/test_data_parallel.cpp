// Data-parallel training under MPI (mnemo/dist/, trainer<Model> with a communicator), run by ctest as
// `mpiexec -n N test_data_parallel` for N = 1, 2 and 4. doctest has no MPI runner here, so this is its
// own small main: every rank runs every check, counts its failures (printing each with its rank), and
// the counts are summed so that every rank exits with the same status.
//
// The checks, for a Compressive Transformer with most-used compression (its memory carries usage rows,
// so every part of the state travels), batch 8, 20 steps:
//   1. The communicator: sums are bitwise the same on every rank; agree() gives every rank the first
//      failing rank's message (with one rank, the work's own exception).
//   2. N ranks train like one process with the whole batch: losses and parameters after 20 steps within
//      float tolerance (rank 0 trains the one-process run itself and prints the worst differences);
//      with N = 1, bitwise.
//   3. Every rank holds bitwise the same parameters, and a second run is bitwise the first.
//   4. A checkpoint saved at step 10 (rank 0 writes it, with every stream's memory) resumes on N ranks
//      bitwise, and in one process (another rank count) within tolerance; a one-process checkpoint
//      resumes on N ranks.
//   5. A save that fails on rank 0 (no such directory) throws collective_error on every rank, and the
//      validation figures are the same on every rank.
#include <omp.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include <mnemo/dist/mpi.hpp>
#include <mnemo/mnemo.hpp>

namespace {

using mnemo::index_t;
using model_t = mnemo::compressive_transformer<float, mnemo::config<16, 2, 2>, mnemo::most_used_compression>;

int failures = 0;
int my_rank = 0;

#define EXPECT(cond, ...)                                                    \
    do {                                                                     \
        if (!(cond)) {                                                       \
            ++failures;                                                      \
            std::fprintf(stderr, "rank %d: FAILED %s: ", my_rank, #cond);   \
            std::fprintf(stderr, __VA_ARGS__);                               \
            std::fprintf(stderr, "\n");                                      \
        }                                                                    \
    } while (0)

constexpr index_t batch = 8;
constexpr std::int64_t steps = 20;
const mnemo::recall_task task;

mnemo::trainer_options options() {
    return {.batch = batch, .seq_len = 8, .mem_len = 8, .c_mem_len = 8, .lr = 3e-3, .warmup = 2, .steps = steps};
}

/// A model, its trainer over `comm` (this rank's streams), and what the run saw.
struct run {
    model_t model{mnemo::compressive_options{.vocab = task.vocab.size(), .n_layers = 2, .d_ff = 32, .n_pos = 32}};
    mnemo::trainer<model_t> t;
    std::vector<double> ce;  // per step

    explicit run(mnemo::communicator& comm) : t(make(comm)) {}

    mnemo::trainer<model_t> make(mnemo::communicator& comm) {
        model.reset_parameters(5);
        const mnemo::stream_slice slice = mnemo::stream_slice_of(batch, comm);
        return mnemo::trainer<model_t>(model, options(), task.vocab, mnemo::segment_streams(task, 11, batch, 8, slice),
                                       mnemo::segment_streams(task, 12, batch, 8, slice), comm);
    }
    void steps_until(std::int64_t step) {
        while (t.step_count() < step) ce.push_back(t.step().ce);
    }
    std::vector<float> values() {
        const auto& ps = model.parameters();
        return {ps.values(), ps.values() + ps.size()};
    }
};

std::uint64_t hash_of(const std::vector<float>& v) {
    std::uint64_t h = 1469598103934665603ull;
    for (float x : v) {
        std::uint32_t u;
        std::memcpy(&u, &x, 4);
        h = (h ^ u) * 1099511628211ull;
    }
    return h;
}

/// max |a − b| / max(1, max |b|), over parameters.
double relative_difference(const std::vector<float>& a, const std::vector<float>& b) {
    double worst = 0, scale = 1;
    for (float x : b) scale = std::max(scale, double(std::fabs(x)));
    for (std::size_t i = 0; i < a.size(); ++i) worst = std::max(worst, std::fabs(double(a[i]) - double(b[i])));
    return worst / scale;
}

/// Whether every rank holds the same value (the hash of a vector, a count).
bool same_on_every_rank(mnemo::communicator& comm, std::uint64_t h) {
    std::uint64_t first = h;
    comm.broadcast(&first, sizeof first, 0);
    std::int64_t differ = first != h;
    comm.sum(&differ, 1);
    return differ == 0;
}

}  // namespace

int main(int argc, char** argv) {
    mnemo::mpi_session mpi(argc, argv);
    mnemo::communicator& comm = mpi.communicator();
    my_rank = comm.rank();
    const int n = comm.size();
    omp_set_num_threads(1);
    if (!mpi.active())
        std::printf("test_data_parallel: not started by mpiexec: checking one process against itself\n");
    try {
        // A directory every rank sees (one machine): rank 0 makes it and names it.
        std::string dir;
        if (my_rank == 0) {
            char tmpl[] = "/tmp/mnemo_data_parallel_XXXXXX";
            if (!::mkdtemp(tmpl)) {
                std::perror("mkdtemp");
                mpi.abort(1);
            }
            dir = tmpl;
        }
        dir = comm.broadcast(dir, 0);

        // 1. The communicator.
        {
            std::vector<float> x(1001);  // not a multiple of the rank count
            mnemo::rng r(std::uint64_t(100 + my_rank));
            for (float& v : x) v = float(r.next_u32() % 1000000) * 1e-3f - 500.0f;
            comm.sum(x.data(), x.size());
            EXPECT(same_on_every_rank(comm, hash_of(x)), "the sum of floats differs between ranks");
            std::string message;
            try {
                comm.agree([&] {
                    if (my_rank == n - 1) mnemo::detail::fail("the last rank failed");
                });
            } catch (const mnemo::collective_error& e) {
                message = e.what();
            } catch (const mnemo::error& e) {  // one rank: the work's own exception
                message = n == 1 ? "mnemo: rank 0: " + std::string(e.what()).substr(7) : "not collective";
            }
            const std::string expected = "mnemo: rank " + std::to_string(n - 1) + ": the last rank failed";
            EXPECT(message == expected, "agree() gave '%s', expected '%s'", message.c_str(), expected.c_str());
        }

        // 2, 3. N ranks against one process; every rank the same; run to run the same.
        run a(comm);
        a.steps_until(10);
        a.t.save(dir + "/step10.safetensors", {});
        a.steps_until(steps);
        const std::vector<float> a_values = a.values();
        EXPECT(same_on_every_rank(comm, hash_of(a_values)), "the ranks' parameters differ after %d steps", int(steps));
        {
            run again(comm);
            again.steps_until(steps);
            EXPECT(again.values() == a_values && again.ce == a.ce, "a second run of %d ranks differs from the first", n);
        }
        double worst_loss = 0, worst_param = 0;
        if (my_rank == 0) {
            run one(mnemo::local_communicator());
            one.steps_until(10);
            one.t.save(dir + "/one10.safetensors", {});
            one.steps_until(steps);
            for (std::size_t i = 0; i < a.ce.size(); ++i)
                worst_loss = std::max(worst_loss, std::fabs(a.ce[i] - one.ce[i]) / std::fabs(one.ce[i]));
            worst_param = relative_difference(a_values, one.values());
            if (n == 1) {
                EXPECT(a.ce == one.ce && a_values == one.values(), "one rank differs from one process");
            } else {
                EXPECT(worst_loss < 1e-5, "losses differ from one process's by %.3g (relative)", worst_loss);
                EXPECT(worst_param < 1e-4, "parameters differ from one process's by %.3g (relative)", worst_param);
            }
            // The N-rank checkpoint in one process (another rank count): tolerance.
            run resumed(mnemo::local_communicator());
            resumed.t.restore(mnemo::read_trainer_checkpoint(dir + "/step10.safetensors"));
            resumed.steps_until(steps);
            const double d = relative_difference(resumed.values(), a_values);
            EXPECT(n == 1 ? d == 0 : d < 1e-4, "the %d-rank checkpoint resumed in one process ends %.3g away", n, d);
            std::printf("test_data_parallel: %d rank%s against one process after %d steps: worst loss difference "
                        "%.3g, worst parameter difference %.3g (relative)\n",
                        n, n == 1 ? "" : "s", int(steps), worst_loss, worst_param);
        }
        comm.barrier();

        // 4. Resume on N ranks: bitwise; a one-process checkpoint on N ranks: tolerance.
        {
            run resumed(comm);
            resumed.t.restore(mnemo::read_trainer_checkpoint(dir + "/step10.safetensors", {}, comm));
            resumed.steps_until(steps);
            EXPECT(resumed.values() == a_values, "resuming the step-10 checkpoint on %d ranks is not bitwise", n);
            EXPECT(std::vector<double>(a.ce.begin() + 10, a.ce.end()) == resumed.ce,
                   "the resumed losses are not the uninterrupted run's");
        }
        {
            run from_one(comm);
            from_one.t.restore(mnemo::read_trainer_checkpoint(dir + "/one10.safetensors", {}, comm));
            from_one.steps_until(steps);
            const double d = relative_difference(from_one.values(), a_values);
            EXPECT(d < 1e-4, "a one-process checkpoint resumed on %d ranks ends %.3g away", n, d);
            EXPECT(same_on_every_rank(comm, hash_of(from_one.values())), "the resumed ranks' parameters differ");
        }

        // 5. A failed save reaches every rank; validation is the same everywhere.
        {
            bool thrown = false;
            try {
                a.t.save(dir + "/no/such/dir/x.safetensors", {});
            } catch (const mnemo::collective_error&) {
                thrown = true;
            } catch (const mnemo::error&) {
                thrown = n == 1;  // one rank: the writer's own error
            }
            EXPECT(thrown, "a save into a missing directory did not throw collective_error here");
            const mnemo::validation_result v = a.t.validate(4);
            std::uint64_t h = 0;
            std::memcpy(&h, &v.ce, sizeof h);
            EXPECT(same_on_every_rank(comm, h ^ std::uint64_t(v.correct) ^ (std::uint64_t(v.answers) << 32)),
                   "the validation figures differ between ranks");
            EXPECT(v.segments == 4, "validation read %lld segments", (long long)v.segments);
        }
        comm.barrier();
        if (my_rank == 0) std::filesystem::remove_all(dir);
    } catch (const std::exception& e) {
        std::fprintf(stderr, "rank %d: unexpected exception: %s\n", my_rank, e.what());
        mpi.abort(1);
    }
    std::int64_t total = failures;
    comm.sum(&total, 1);
    if (my_rank == 0) {
        if (total == 0) std::printf("test_data_parallel: %d rank%s: every check passed\n", n, n == 1 ? "" : "s");
        else std::printf("test_data_parallel: %d rank%s: %lld check(s) failed\n", n, n == 1 ? "" : "s", (long long)total);
    }
    return total == 0 ? 0 : 1;
}
