#pragma once
// Token embedding, as torch.nn.Embedding: y[i, :] = W[token_i, :]   W [vocab, D] (`<name>.weight`)
// No scaling and no absolute positions (the models add relative positions inside attention).
// Backward: W[token_i, :] += dy[i, :] (repeated tokens add up).
#include <cstdint>
#include <span>
#include <string>

#include "../core/buffer.hpp"
#include "../core/config.hpp"
#include "../core/rng.hpp"
#include "module.hpp"

namespace mnemo {

using token_t = std::int32_t;

/// D may be `dynamic` (a runtime-shape model): it is then given at construction.
template <class T, std::size_t D, class Backend = cpu>
class embedding {
    using kernels = checked_ops<Backend>;
    [[no_unique_address]] extent_holder<D> d_;

public:
    static constexpr std::size_t features = D;

    embedding(parameter_set<T, Backend>& ps, const std::string& name, index_t vocab) requires(D != dynamic)
        : embedding(ps, name, vocab, static_cast<index_t>(D)) {}
    /// Runtime extent (must equal D when that is static).
    embedding(parameter_set<T, Backend>& ps, const std::string& name, index_t vocab, index_t d)
        : d_(d), name_(name), vocab_(vocab) {
        check_extent<D>(d, ("embedding '" + name + "'").c_str(), "d_model");
        MNEMO_CHECK(vocab > 0, "embedding '", name, "': vocabulary size must be positive, got ", vocab);
        weight_ = ps.declare(name + ".weight", {vocab, d_});
    }

    /// PyTorch's default: W ~ N(0, 1).
    void reset_parameters(rng& r) const {
        weight_.generate([&] { return r.normal(); });
    }

    /// y[rows, D] = W[tokens]. A token outside [0, vocab) is an error naming it and its position.
    template <view_of<T> Y>
    void forward(std::span<const token_t> tokens, const Y& y) const {
        static_assert(check_view<D, Y, axis::d_model, Backend>());
        if constexpr (Y::features == dynamic) check_cols(y, d_, "embedding", "y");
        MNEMO_CHECK(static_cast<index_t>(tokens.size()) == y.rows(), "embedding '", name_, "': ", tokens.size(),
                    " tokens but the output has ", y.rows(), " rows");
        for (std::size_t i = 0; i < tokens.size(); ++i)
            MNEMO_CHECK(tokens[i] >= 0 && tokens[i] < vocab_, "embedding '", name_, "': token ", tokens[i],
                        " at position ", i, " is outside the vocabulary [0, ", vocab_, ")");
        kernels::gather_rows(y.rows(), d_, ids_.upload(tokens), weight_.value(), d_, y.data(), y.ld());
    }

    /// W[tokens[i]] += dy[i] (tokens were validated by forward).
    template <view_of<T> DY>
    void backward(std::span<const token_t> tokens, const DY& dy) const {
        static_assert(check_view<D, DY, axis::d_model, Backend>());
        MNEMO_CHECK(static_cast<index_t>(tokens.size()) == dy.rows(), "embedding '", name_, "': ", tokens.size(),
                    " tokens but dy has ", dy.rows(), " rows");
        kernels::scatter_add_rows(dy.rows(), d_, ids_.upload(tokens), dy.data(), dy.ld(), weight_.grad(), d_);
    }

    index_t vocab() const { return vocab_; }
    const param<T, Backend>& weight() const { return weight_; }

private:
    std::string name_;
    index_t vocab_;
    param<T, Backend> weight_;  // [vocab, D]
    mutable buffer<token_t, Backend> ids_;  // the tokens, uploaded for the kernels
};

}  // namespace mnemo
