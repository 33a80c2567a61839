#pragma once
// What every module shares: the `view_of` concept for its arguments, the compile-time checks on
// them, and the backward contract.
//
// Backward contract (as llm.c): parameter gradients are ACCUMULATED (+=) into the parameter_set's
// gradient buffer, so several uses of one parameter and several micro-batches add up; activation
// gradients are ASSIGNED (=) unless the call says `accumulate`. An empty view (null data) for an
// activation gradient means "not needed" and skips that work.
#include <span>
#include <type_traits>

#include "../core/backend.hpp"
#include "../core/error.hpp"
#include "../core/parameters.hpp"
#include "../core/shape.hpp"
#include "../core/view.hpp"
#include "../kernels/cpu/ops.hpp"  // the CPU kernels; other backends add their ops<> specialisation
#include "../kernels/kernel_table.hpp"

namespace mnemo {

namespace detail {
template <class V>
struct is_view : std::false_type {};
template <class T, std::size_t F, class B>
struct is_view<view<T, F, B>> : std::true_type {};
}  // namespace detail

/// V is a mnemo::view whose elements are T (const or not).
template <class V, class T>
concept view_of = detail::is_view<std::remove_cvref_t<V>>::value &&
                  std::is_same_v<typename std::remove_cvref_t<V>::value_type, T>;

/// Compile-time check that a view argument has the features and the backend a module needs.
/// Instantiates expect_extent / expect_backend, whose names carry both extents into the error.
template <std::size_t Expected, class V, class Axis, class Backend>
constexpr bool check_view() {
    using v = std::remove_cvref_t<V>;
    static_assert(expect_extent<Expected, v::features, Axis>::value);
    static_assert(expect_backend<Backend, typename v::backend_type>::value);
    return true;
}

/// Runtime half of the shape check: dynamic extents, and row counts that must agree.
template <class V>
inline void check_cols(const V& v, index_t expected, const char* module, const char* what) {
    MNEMO_CHECK(v.cols() == expected, module, ": ", what, " has ", v.cols(), " features, expected ", expected);
}
/// Host input check of cross-entropy targets (host memory, before they are uploaded for the kernels):
/// throws mnemo::error naming the first target outside [−∞, vocab) (negative targets are ignored rows).
template <class I>
inline void check_targets(std::span<const I> targets, index_t vocab) {
    for (std::size_t i = 0; i < targets.size(); ++i)
        MNEMO_CHECK(targets[i] < static_cast<I>(vocab), "cross_entropy: target ", static_cast<long long>(targets[i]),
                    " at row ", i, " is outside the vocabulary of ", vocab);
}
template <class A, class B>
inline void check_rows(const A& a, const B& b, const char* module, const char* what_a, const char* what_b) {
    MNEMO_CHECK(a.rows() == b.rows(), module, ": ", what_a, " has ", a.rows(), " rows but ", what_b, " has ", b.rows());
}

}  // namespace mnemo
