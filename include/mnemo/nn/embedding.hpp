#pragma once
// Token embedding, as torch.nn.Embedding: y[i, :] = W[token_i, :]   W [vocab, D] (`<name>.weight`)
// No scaling and no absolute positions (the models add relative positions inside attention).
// Backward: W[token_i, :] += dy[i, :] (repeated tokens add up).
#include <cstdint>
#include <span>
#include <string>

#include "../core/rng.hpp"
#include "module.hpp"

namespace mnemo {

using token_t = std::int32_t;

template <class T, std::size_t D, class Backend = cpu>
class embedding {
    using K = ops<Backend>;
    static_assert(D != dynamic, "mnemo: embedding needs a static d_model");

public:
    static constexpr std::size_t features = D;

    embedding(parameter_set<T>& ps, const std::string& name, index_t vocab) : name_(name), vocab_(vocab) {
        MNEMO_CHECK(vocab > 0, "embedding '", name, "': vocabulary size must be positive, got ", vocab);
        weight_ = ps.declare(name + ".weight", {vocab, static_cast<index_t>(D)});
    }

    /// PyTorch's default: W ~ N(0, 1).
    void reset_parameters(rng& r) const {
        for (index_t i = 0; i < weight_.size(); ++i) weight_.value()[i] = static_cast<T>(r.normal());
    }

    /// y[rows, D] = W[tokens]. A token outside [0, vocab) is an error naming it and its position.
    template <view_of<T> Y>
    void forward(std::span<const token_t> tokens, const Y& y) const {
        static_assert(check_view<D, Y, axis::d_model, Backend>());
        MNEMO_CHECK(static_cast<index_t>(tokens.size()) == y.rows(), "embedding '", name_, "': ", tokens.size(),
                    " tokens but the output has ", y.rows(), " rows");
        for (std::size_t i = 0; i < tokens.size(); ++i)
            MNEMO_CHECK(tokens[i] >= 0 && tokens[i] < vocab_, "embedding '", name_, "': token ", tokens[i],
                        " at position ", i, " is outside the vocabulary [0, ", vocab_, ")");
        K::gather_rows(y.rows(), static_cast<index_t>(D), tokens.data(), weight_.value(), static_cast<index_t>(D),
                       y.data(), y.ld());
    }

    /// W[tokens[i]] += dy[i] (tokens were validated by forward).
    template <view_of<T> DY>
    void backward(std::span<const token_t> tokens, const DY& dy) const {
        static_assert(check_view<D, DY, axis::d_model, Backend>());
        MNEMO_CHECK(static_cast<index_t>(tokens.size()) == dy.rows(), "embedding '", name_, "': ", tokens.size(),
                    " tokens but dy has ", dy.rows(), " rows");
        K::scatter_add_rows(dy.rows(), static_cast<index_t>(D), tokens.data(), dy.data(), dy.ld(), weight_.grad(),
                            static_cast<index_t>(D));
    }

    index_t vocab() const { return vocab_; }
    const param<T>& weight() const { return weight_; }

private:
    std::string name_;
    index_t vocab_;
    param<T> weight_;  // [vocab, D]
};

}  // namespace mnemo
