#pragma once
// Extents: static where the model's config fixes them (d_model, heads, d_head, d_ff), dynamic
// (runtime) for batch, sequence, memory lengths and vocabulary. A static mismatch is a compile error
// routed through a class template, so every compiler prints both numbers and the axis, e.g.
//   in instantiation of 'struct mnemo::expect_extent<64, 32, mnemo::axis::in_features>'
#include <cstddef>
#include <cstdint>
#include <limits>

namespace mnemo {

using index_t = std::ptrdiff_t;

/// The sentinel for an extent known only at run time (as Eigen::Dynamic).
inline constexpr std::size_t dynamic = std::numeric_limits<std::size_t>::max();

/// Axis names: they appear in compile errors to say which extent disagreed.
namespace axis {
struct features {};
struct in_features {};
struct out_features {};
struct d_model {};
}  // namespace axis

/// expect_extent<Expected, Got, Axis>: compiles only when the two extents agree (or one is dynamic;
/// that case is checked at run time instead).
template <std::size_t Expected, std::size_t Got, class Axis>
struct expect_extent {
    static constexpr bool agree = Expected == Got || Expected == dynamic || Got == dynamic;
    static_assert(agree,
                  "mnemo: extent mismatch: a view with Got features was passed where Expected features "
                  "are required (the numbers are the arguments of expect_extent<Expected, Got, Axis>)");
    static constexpr bool value = true;  // the static_assert above is the one report
};

/// expect_divisible<DModel, Heads>: d_model must split evenly into heads.
template <std::size_t DModel, std::size_t Heads>
struct expect_divisible {
    static constexpr bool divisible = Heads >= 1 && DModel % (Heads >= 1 ? Heads : 1) == 0;
    static_assert(divisible,
                  "mnemo: d_model must be divisible by heads, and heads at least 1 (the numbers are the "
                  "arguments of expect_divisible<DModel, Heads>)");
    static constexpr bool value = true;
};

/// expect_compression_rate<Rate>: the compression rate c must be at least 1.
template <std::size_t Rate>
struct expect_compression_rate {
    static constexpr bool rate_at_least_one = Rate >= 1;
    static_assert(rate_at_least_one,
                  "mnemo: the compression rate must be at least 1 (the number is the argument of "
                  "expect_compression_rate<Rate>)");
    static constexpr bool value = true;
};

/// An extent held at compile time when static, at run time when dynamic. Empty when static.
/// Converts to index_t implicitly, so a module can keep one as a member (`[[no_unique_address]]
/// extent_holder<D> d_;`) and compute with it as with a constant: for a static extent the value is a
/// compile-time constant and the code is the same as with `static constexpr index_t d_ = D`. A static
/// holder ignores the value it is constructed from (callers check it first, see check_extent).
template <std::size_t Extent>
struct extent_holder {
    static constexpr bool is_dynamic = false;
    constexpr extent_holder() = default;
    constexpr explicit extent_holder(index_t) {}
    static constexpr index_t get() { return static_cast<index_t>(Extent); }
    constexpr operator index_t() const { return get(); }  // NOLINT(google-explicit-constructor)
};
template <>
struct extent_holder<dynamic> {
    static constexpr bool is_dynamic = true;
    index_t n = 0;
    constexpr extent_holder() = default;
    constexpr explicit extent_holder(index_t v) : n(v) {}
    constexpr index_t get() const { return n; }
    constexpr operator index_t() const { return n; }  // NOLINT(google-explicit-constructor)
};

/// The extents a model's kernels may take as compile-time constants, passed as one template argument
/// (`K::template relative_attention_forward<static_extents{D, H, Dk}>(…)`): a static config's values,
/// `dynamic` for a runtime shape. Constant extents give the kernels' loops the same code (and, for the
/// vectorised reductions over a head's features, the same summation order) as before they moved.
struct static_extents {
    std::size_t d_model = dynamic;
    std::size_t heads = dynamic;
    std::size_t d_head = dynamic;
};

/// A run [begin, end) of a flat buffer (a parameter_set's), in elements.
struct flat_range {
    index_t begin = 0;
    index_t end = 0;
    friend bool operator==(const flat_range&, const flat_range&) = default;
};

}  // namespace mnemo
