#pragma once
// The language-modelling loss both models train on: mean softmax cross-entropy of logits [rows, vocab]
// (backend memory) against targets (host memory, one per row; a negative target is an ignored row, as
// PyTorch's ignore_index), fused with its gradient d loss / d logits = (softmax − onehot) / counted.
// The targets are checked on the host (check_targets) and uploaded for the kernel. operator() returns
// the loss over the host path (one double); queue() leaves its sum in backend memory for the caller to
// read later (a model reads every loss of a segment in one transfer).
#include <span>

#include "../core/buffer.hpp"
#include "../nn/embedding.hpp"
#include "../nn/module.hpp"

namespace mnemo {

template <class T, class Backend = cpu>
class cross_entropy_loss {
    using kernels = checked_ops<Backend>;

public:
    /// The mean over the counted rows (0 when none is counted); d_logits [rows, vocab] gets the gradient
    /// of that mean. queue() and mean() with one read on the host.
    double operator()(index_t rows, index_t vocab, const T* logits, std::span<const token_t> targets, T* d_logits) {
        const index_t counted = queue(rows, vocab, logits, targets, d_logits, sum_.ensure(1));
        double sum = 0;  // the host path: the loss is returned now
        device_memory<Backend>::download(&sum, sum_.data(), sizeof(double));
        return mean(sum, counted);
    }

    /// The same, leaving the loss in backend memory: `sum` (one double of Backend's memory) gets the
    /// sum of the counted rows' losses; returns the number of counted rows (known on the host, from
    /// the targets). The loss is mean(sum, counted) once the caller reads the sum.
    index_t queue(index_t rows, index_t vocab, const T* logits, std::span<const token_t> targets, T* d_logits,
                  double* sum) {
        check_targets(targets, vocab);
        index_t counted = 0;
        for (token_t t : targets) counted += t >= 0;
        const T scale = counted > 0 ? T(1) / T(counted) : T(0);
        T* losses = rows_.ensure(rows);
        kernels::cross_entropy_fused(rows, vocab, logits, vocab, targets_.upload(targets), losses, scale, d_logits, vocab);
        kernels::sum_as_double(rows, losses, sum);
        return counted;
    }

    /// The loss from queue()'s sum (read on the host) and count.
    static double mean(double sum, index_t counted) { return counted > 0 ? sum / double(counted) : 0.0; }

private:
    buffer<token_t, Backend> targets_;
    buffer<T, Backend> rows_;       // the per-row losses
    buffer<double, Backend> sum_;  // their sum (operator())
};

}  // namespace mnemo
