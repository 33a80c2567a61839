#pragma once
// The one place mnemo touches xsimd. Debian 12 ships xsimd 8.1: its horizontal sum is `hadd` (9.0
// renamed it reduce_add), it has no reduce_max, and its free load_unaligned<Arch> breaks for a
// non-default Arch, so loads and stores go through the batch type's members.
#include <type_traits>

#include <xsimd/xsimd.hpp>

#include "../../core/shape.hpp"

namespace mnemo::simd {

using arch = xsimd::default_arch;
template <class T>
using batch = xsimd::batch<T, arch>;
template <class T>
inline constexpr index_t width = static_cast<index_t>(batch<T>::size);

template <class T>
inline batch<T> load(const T* p) { return batch<T>::load_unaligned(p); }
template <class T>
inline void store(T* p, const batch<T>& b) { b.store_unaligned(p); }
template <class T>
inline batch<T> splat(T v) { return batch<T>(v); }
/// xsimd's hadd, except for 8 doubles: there g++ 12 warns, wherever it is inlined into user code,
/// about the undefined vector inside _mm512_extractf64x4_pd; the lanes are summed here in hadd's
/// own order instead (hi + lo halves, then (0 + 2) + (1 + 3)), so the result is the same.
template <class T>
inline T reduce_add(const batch<T>& b) {
    if constexpr (std::is_same_v<T, double> && batch<T>::size == 8) {
        alignas(64) double l[8];
        b.store_aligned(l);
        return ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]));
    } else {
        return xsimd::hadd(b);
    }
}
template <class T>
inline T reduce_max(const batch<T>& b) {
    alignas(64) T lanes[batch<T>::size];
    b.store_aligned(lanes);
    T m = lanes[0];
    for (std::size_t i = 1; i < batch<T>::size; ++i) m = lanes[i] > m ? lanes[i] : m;
    return m;
}
/// Number of leading elements of an n-element row that full batches cover.
template <class T>
inline index_t full_batches(index_t n) { return n - n % width<T>; }

}  // namespace mnemo::simd
