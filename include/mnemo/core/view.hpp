#pragma once
// view<T, Features, Backend>: a non-owning row-major 2-D view [rows, Features] over memory the caller
// owns. Rows are dynamic (batch × sequence, sequence-major as in the reference's [seq, batch, d]
// layout: row = s * batch + b); the feature extent is static when the config fixes it, or `dynamic`.
// `ld` is the distance between rows in elements (ld >= cols), so a view can address a column block.
#include <cassert>
#include <type_traits>

#include "backend.hpp"
#include "error.hpp"
#include "shape.hpp"

namespace mnemo {

template <class T, std::size_t Features = dynamic, class Backend = cpu>
class view {
    static_assert(backend<Backend>, "mnemo: view's third argument must be a backend tag (mnemo::cpu, mnemo::cuda)");

public:
    using element_type = T;
    using value_type = std::remove_const_t<T>;
    using backend_type = Backend;
    static constexpr std::size_t features = Features;

    constexpr view() = default;

    /// A contiguous view of `rows` rows of the static feature extent.
    constexpr view(T* data, index_t rows) requires(Features != dynamic)
        : data_(data), rows_(rows), ld_(static_cast<index_t>(Features)) {}

    /// A contiguous view of `rows` rows of `cols` features, held as the module holds them: static
    /// (the same view as the two-argument constructor's) or runtime (config<dynamic, dynamic, dynamic>).
    constexpr view(T* data, index_t rows, extent_holder<Features> cols)
        : data_(data), rows_(rows), cols_(cols), ld_(cols.get()) {}

    /// A view with explicit columns (must equal Features when static) and row stride.
    constexpr view(T* data, index_t rows, index_t cols, index_t ld = -1)
        : data_(data), rows_(rows), cols_(cols), ld_(ld < 0 ? cols : ld) {
        if constexpr (Features != dynamic) {
            MNEMO_CHECK(cols == static_cast<index_t>(Features), "view: ", cols,
                        " columns given for a view of static extent ", Features);
        }
        MNEMO_CHECK(rows >= 0 && cols >= 0 && ld_ >= cols, "view: bad shape rows=", rows, " cols=", cols,
                    " ld=", ld_);
    }

    /// Mutable -> const, static -> dynamic features: both implicit, never the other way.
    template <class U, std::size_t F2>
        requires std::is_convertible_v<U (*)[], T (*)[]> && (Features == dynamic || F2 == Features) &&
                 (!(std::is_same_v<U, T> && F2 == Features))
    constexpr view(const view<U, F2, Backend>& o)  // NOLINT(google-explicit-constructor)
        : data_(o.data()), rows_(o.rows()), cols_(o.cols()), ld_(o.ld()) {}

    constexpr T* data() const { return data_; }
    constexpr index_t rows() const { return rows_; }
    constexpr index_t cols() const { return cols_.get(); }
    constexpr index_t ld() const { return ld_; }
    constexpr index_t size() const { return rows_ * cols(); }
    constexpr bool contiguous() const { return ld_ == cols(); }

    constexpr T* row(index_t r) const {
        assert(r >= 0 && r < rows_);
        return data_ + r * ld_;
    }
    constexpr T& operator()(index_t r, index_t c) const {
        assert(r >= 0 && r < rows_ && c >= 0 && c < cols());
        return data_[r * ld_ + c];
    }

    /// Rows [first, first + count).
    constexpr view row_range(index_t first, index_t count) const {
        assert(first >= 0 && count >= 0 && first + count <= rows_);
        view v = *this;
        v.data_ = data_ + first * ld_;
        v.rows_ = count;
        return v;
    }

    /// Columns [first, first + Count): a static block of a wider view.
    template <std::size_t Count>
    constexpr view<T, Count, Backend> col_block(index_t first) const {
        assert(first >= 0 && first + static_cast<index_t>(Count) <= cols());
        return view<T, Count, Backend>(data_ + first, rows_, static_cast<index_t>(Count), ld_);
    }

private:
    T* data_ = nullptr;
    index_t rows_ = 0;
    [[no_unique_address]] extent_holder<Features> cols_{};
    index_t ld_ = Features == dynamic ? 0 : static_cast<index_t>(Features);
};

template <class T, std::size_t F, class B = cpu>
using const_view = view<const T, F, B>;

}  // namespace mnemo
