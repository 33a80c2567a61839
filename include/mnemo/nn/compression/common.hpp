#pragma once
// What every compression function shares: the shape rules and messages (detail::compression_shape)
// and compression_needs_usage<C>. The functions themselves: conv.hpp, pooling.hpp (max, mean),
// dilated_conv.hpp, most_used.hpp, and none.hpp (a model that never compresses); nn/compression.hpp
// includes them all. Each has the same interface (template <class T, std::size_t D, std::size_t Rate,
// class Backend>, constructor from a parameter_set and a name, reset_parameters, compressed_rows,
// forward, backward), so any drops into compressive_transformer<T, Config, X>.
#include <cstdint>
#include <string>
#include <string_view>
#include <type_traits>

#include "../module.hpp"

namespace mnemo {

namespace detail {

/// The shape rules every compression function shares. `who` names the module in messages, e.g.
/// "conv_compression 'transformer.layers.0.compress'"; `rate` is the compression rate c.
struct compression_shape {
    static std::string who(const char* kind, const std::string& name) { return std::string(kind) + " '" + name + "'"; }

    /// Memory rows → compressed rows, after checking batch > 0 and rows a multiple of rate·batch.
    static index_t compressed_rows(std::string_view who, index_t mem_rows, index_t batch, index_t rate) {
        MNEMO_CHECK(batch > 0, who, ": batch must be positive, got ", batch);
        const index_t window = rate * batch;
        MNEMO_CHECK(mem_rows >= 0 && mem_rows % window == 0, who, ": memory has ", mem_rows,
                    " rows, not a multiple of compression rate ", rate, " x batch ", batch, " = ", window);
        return mem_rows / rate;
    }

    /// mem [n·rate·batch, d] and out [n·batch, d]; returns n·batch.
    template <class M, class O>
    static index_t check_forward(const std::string& who, const M& mem, index_t batch, const O& out,
                                 const char* out_name, index_t d, index_t rate) {
        check_cols(mem, d, who.c_str(), "mem");
        check_cols(out, d, who.c_str(), out_name);
        const index_t rows = compressed_rows(who, mem.rows(), batch, rate);
        MNEMO_CHECK(out.rows() == rows, who, ": ", out_name, " has ", out.rows(), " rows, expected memory rows ",
                    mem.rows(), " / compression rate ", rate, " = ", rows);
        return rows;
    }

    /// As check_forward for (mem, d_out), and d_mem [n·rate·batch, d] when it has data; returns n·batch.
    template <class M, class DO, class DM>
    static index_t check_backward(const std::string& who, const M& mem, index_t batch, const DO& d_out,
                                  const DM& d_mem, index_t d, index_t rate) {
        const index_t rows = check_forward(who, mem, batch, d_out, "d_out", d, rate);
        if (d_mem.data()) {
            check_cols(d_mem, d, who.c_str(), "d_mem");
            MNEMO_CHECK(d_mem.rows() == mem.rows(), who, ": d_mem has ", d_mem.rows(), " rows but mem has ",
                        mem.rows());
        }
        return rows;
    }

    /// Backward reads what the last forward kept: it must have been over memory of this shape.
    static void check_saved(const std::string& who, index_t mem_rows, index_t batch, index_t saved_rows,
                            index_t saved_batch) {
        if (mem_rows == saved_rows && batch == saved_batch) return;
        if (saved_rows < 0) detail::fail(who, ": backward called before forward");
        detail::fail(who, ": backward over ", mem_rows, " memory rows with batch ", batch,
                     " but the last forward saw ", saved_rows, " rows with batch ", saved_batch);
    }

    /// The extents a compression function is built with: D and Rate where static (checked), else given.
    template <std::size_t D, std::size_t Rate>
    static void check_extents(const std::string& who, index_t d, index_t rate) {
        check_extent<D>(d, who.c_str(), "d_model");
        check_extent<Rate>(rate, who.c_str(), "compression rate");
    }
};

template <class C>
constexpr bool compression_needs_usage_impl() {
    if constexpr (requires { C::needs_usage; }) return static_cast<bool>(C::needs_usage);
    else return false;
}
}  // namespace detail

/// True for a compression function that must be given the memory's usage (set_usage) before each
/// forward: one that declares `static constexpr bool needs_usage = true`. False for every other one
/// (the others declare nothing).
template <class C>
inline constexpr bool compression_needs_usage = detail::compression_needs_usage_impl<std::remove_cvref_t<C>>();

}  // namespace mnemo
