#pragma once
// The one place mnemo touches xsimd. Debian 12 ships xsimd 8.1: its horizontal sum is `hadd` (9.0
// renamed it reduce_add), it has no reduce_max, and its free load_unaligned<Arch> breaks for a
// non-default Arch, so loads and stores go through the batch type's members.
//
// xsimd 8.1's `haddp` (W batches to one batch of their W sums) is wrong on AVX-512: for
// batch<float, avx512bw> it returns the sums in lanes 0,1,4,5,2,3,6,7,8,9,12,13,10,11,14,15. mnemo
// does not use it; transpose_add below does that job. tests/test_simd.cpp checks every xsimd
// operation mnemo relies on against a scalar reference, on each instruction set the suite builds.
#include <bit>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <utility>

// The instruction sets' intrinsics and xsimd are first read here, inside a diagnostic region (gemm.hpp
// and gemm_packed.hpp include this header before Eigen for that reason). g++ 12 reports the AVX-512
// intrinsics' deliberately undefined source registers (`_mm512_undefined_ps()`, `__Y = __Y`) as
// used uninitialized wherever Eigen's or xsimd's kernels call them (GCC bug 105593): hundreds of
// false reports in a -O1 build, a few at -O3, all located in the intrinsics' headers. A diagnostic
// pragma applies by the location of the reported line, so with those headers read inside the region
// the false reports are gone and warnings located in mnemo's or a user's code are untouched. (A
// program that includes <immintrin.h>, Eigen or xsimd before mnemo keeps them.)
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif
#include <xsimd/xsimd.hpp>
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif

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

/// Whether stream_store writes around the caches for T (float on x86 with AVX or AVX-512).
template <class T>
inline constexpr bool streams =
#if defined(__AVX__) && (defined(__x86_64__) || defined(__i386__))
    std::is_same_v<T, float> && (width<T> == 8 || width<T> == 16);
#else
    false;
#endif
/// b to p with a non-temporal store where streams<T> (p aligned to the batch's size): the line goes
/// to memory without first being read into the caches. Elsewhere an ordinary store. Call
/// stream_fence() before another thread reads what was stored.
template <class T>
inline void stream_store(T* p, const batch<T>& b) {
#if defined(__AVX__) && (defined(__x86_64__) || defined(__i386__))
    if constexpr (streams<T>) {
#if defined(__AVX512F__)
        if constexpr (width<T> == 16) return _mm512_stream_ps(p, b);
#endif
        if constexpr (width<T> == 8) return _mm256_stream_ps(p, b);
    }
#endif
    b.store_unaligned(p);
}
/// Orders this thread's stream_store stores before what follows (non-temporal stores are not
/// ordered by x86's usual rules).
inline void stream_fence() {
#if defined(__AVX__) && (defined(__x86_64__) || defined(__i386__))
    _mm_sfence();
#endif
}

/// Asks for the cache lines of [p, p + n) into L1, for reading: for rows whose lines the hardware
/// prefetchers do not follow (short rows far apart).
template <class T>
inline void prefetch_lines(const T* p, index_t n) {
    for (index_t i = 0; i < n; i += index_t(64 / sizeof(T))) __builtin_prefetch(p + i, 0, 3);
}

/// Asks for every cache line [p, p + n) touches (n ≥ 1) into L1, with intent to write (prefetchw
/// where the target has PRFCHW, a read prefetch otherwise): a tile's rows of its output, asked for
/// before its product loop so that its stores at the end find them.
template <class T>
inline void prefetch_for_write(const T* p, index_t n) {
    const std::uintptr_t first = reinterpret_cast<std::uintptr_t>(p) & ~std::uintptr_t(63);
    const std::uintptr_t last = reinterpret_cast<std::uintptr_t>(p + n - 1) & ~std::uintptr_t(63);
    for (std::uintptr_t line = first; line <= last; line += 64)
        __builtin_prefetch(reinterpret_cast<const void*>(line), 1, 3);
}

/// x·y + z (fma) and x·y − z (fms) with one rounding, for a batch of any x86 instruction set. xsimd
/// 8.1 has fused kernels for fma3<sse4_2> and fma3<avx> only: on AVX-512 (and for an explicit avx2
/// arch) it computes x·y + z with two roundings, which g++ contracts into one FMA only from -O2 (a
/// -O1 build then rounds differently from a -O3 one). These call the FMA instructions themselves;
/// one macro writes both, `insn` naming the instruction (fmadd, fmsub).
#if defined(__AVX512F__)
#define MNEMO_SIMD_FUSED_512(insn)                                                                              \
    if constexpr (sizeof(B) == 64 && f32) return B(_mm512_##insn##_ps(x, y, z));                               \
    if constexpr (sizeof(B) == 64 && f64) return B(_mm512_##insn##_pd(x, y, z));
#else
#define MNEMO_SIMD_FUSED_512(insn)
#endif
#if defined(__FMA__)
#define MNEMO_SIMD_FUSED_256(insn)                                                                              \
    if constexpr (sizeof(B) == 32 && f32) return B(_mm256_##insn##_ps(x, y, z));                               \
    if constexpr (sizeof(B) == 32 && f64) return B(_mm256_##insn##_pd(x, y, z));                               \
    if constexpr (sizeof(B) == 16 && f32) return B(_mm_##insn##_ps(x, y, z));                                  \
    if constexpr (sizeof(B) == 16 && f64) return B(_mm_##insn##_pd(x, y, z));
#else
#define MNEMO_SIMD_FUSED_256(insn)
#endif
#define MNEMO_SIMD_FUSED(name, insn)                                                                           \
    template <class T, class A>                                                                                \
    inline xsimd::batch<T, A> name(const xsimd::batch<T, A>& x, const xsimd::batch<T, A>& y,                   \
                                   const xsimd::batch<T, A>& z) {                                              \
        using B [[maybe_unused]] = xsimd::batch<T, A>;                                                         \
        [[maybe_unused]] constexpr bool f32 = std::is_same_v<T, float>, f64 = std::is_same_v<T, double>;      \
        MNEMO_SIMD_FUSED_512(insn)                                                                             \
        MNEMO_SIMD_FUSED_256(insn)                                                                             \
        return xsimd::name(x, y, z);                                                                           \
    }
MNEMO_SIMD_FUSED(fma, fmadd)
MNEMO_SIMD_FUSED(fms, fmsub)
#undef MNEMO_SIMD_FUSED
#undef MNEMO_SIMD_FUSED_256
#undef MNEMO_SIMD_FUSED_512
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
/// erfc lane by lane: xsimd's for float, libm's for double. xsimd 8.1's double erfc is a float-grade
/// fit: against erfcl it is off by up to 1.8e4 ulp (relative) for arguments in [2.2, 7] and by up to
/// 2.8e7 ulp in (7, 26.5] (measured on AVX2 and AVX-512 alike), which put double GELU 9 eps from the
/// exact value near x = −3.1. Its float erfc is within 9 ulp on [-3, 3] (test_simd's bound), 25 ulp
/// below 8 and 40 at 9, where erfc is under 1e-36 and GELU's output is x times that.
template <class T>
inline batch<T> erfc(const batch<T>& z) {
    if constexpr (std::is_same_v<T, float>) {
        return xsimd::erfc(z);
    } else {
        alignas(64) T lanes[batch<T>::size];
        z.store_aligned(lanes);
        for (auto& v : lanes) v = std::erfc(v);
        return batch<T>::load_aligned(lanes);
    }
}
namespace detail {

/// The compiler's own vector of W lanes of T (GCC's and Clang's vector extension). transpose_add is
/// written once over these and the compiler lowers its shuffles to the target's instructions, so the
/// lane logic is the same source on every instruction set, and tests can run it at any width on any
/// host (a 16-lane vector on an AVX2 machine becomes pairs of 8-lane instructions).
template <class T, int W>
struct vector_of;
#define MNEMO_SIMD_VECTOR_OF(T, W) \
    template <>                    \
    struct vector_of<T, W> {       \
        typedef T type __attribute__((vector_size(W * sizeof(T)))); \
    };
MNEMO_SIMD_VECTOR_OF(float, 2)
MNEMO_SIMD_VECTOR_OF(float, 4)
MNEMO_SIMD_VECTOR_OF(float, 8)
MNEMO_SIMD_VECTOR_OF(float, 16)
MNEMO_SIMD_VECTOR_OF(double, 2)
MNEMO_SIMD_VECTOR_OF(double, 4)
MNEMO_SIMD_VECTOR_OF(double, 8)
#undef MNEMO_SIMD_VECTOR_OF
template <class T, int W>
using vector = typename vector_of<T, W>::type;

/// Lane i of one half of the pair (a, b) in fold<Blk> below, as an index into a's lanes [0, W) and
/// b's [W, 2W): in each block of Blk lanes, the first Blk/2 take a's block, the others b's; `upper`
/// takes the upper half of that block instead of the lower.
template <int Blk, int W>
constexpr int fold_lane(int i, bool upper) {
    const int block = i / Blk * Blk, offset = i % Blk;
    const int from = offset < Blk / 2 ? block + offset : W + block + offset - Blk / 2;
    return from + (upper ? Blk / 2 : 0);
}
/// In each block of Blk lanes: the lower half holds a's two half-blocks added, the upper b's.
template <int Blk, class V, int... I>
inline V fold(const V& a, const V& b, std::integer_sequence<int, I...>) {
    constexpr int W = sizeof...(I);
    return __builtin_shufflevector(a, b, fold_lane<Blk, W>(I, false)...) +
           __builtin_shufflevector(a, b, fold_lane<Blk, W>(I, true)...);
}

/// One round: fold v[k] with v[k + Blk/2] for k < Blk/2, then the next round on the Blk/2 results.
template <int Blk, class V, int W>
inline void fold_rounds(V* v) {
    for (int k = 0; k < Blk / 2; ++k) v[k] = fold<Blk>(v[k], v[k + Blk / 2], std::make_integer_sequence<int, W>{});
    if constexpr (Blk > 2) fold_rounds<Blk / 2, V, W>(v);
}

/// v[0] := (lane i = Σ lanes of v[i]) for i < W, overwriting v. Rounds Blk = W, W/2, ..., 2: every
/// vector's lanes are summed by the same halving tree, ((l[0] + l[W/2]) + (l[W/4] + l[3W/4])) + ...,
/// the one halving_sum spells out in scalar code.
template <class T, int W>
inline vector<T, W> transpose_add(vector<T, W>* v) {
    if constexpr (W > 1) fold_rounds<W, vector<T, W>, W>(v);
    return v[0];
}

}  // namespace detail

/// The sum of W lanes in transpose_add's order: fold the upper half onto the lower until one is left.
template <class T, int W>
inline T halving_sum(const T* lanes) {
    T l[W];
    for (int i = 0; i < W; ++i) l[i] = lanes[i];
    for (int n = W / 2; n >= 1; n /= 2)
        for (int i = 0; i < n; ++i) l[i] = l[i] + l[i + n];
    return l[0];
}

/// Lane i of the result = the sum of the lanes of v[i], for the width<T> batches v (the job of
/// xsimd's haddp, which is wrong on AVX-512). Every lane is summed in the same order (halving_sum's),
/// so a value's bits do not depend on which lane it was computed in.
template <class T>
inline batch<T> transpose_add(const batch<T> (&v)[batch<T>::size]) {
    constexpr int W = int(batch<T>::size);
    using reg = typename batch<T>::register_type;
    using V = detail::vector<T, W>;
    static_assert(sizeof(V) == sizeof(reg));
    V u[W];
    for (int i = 0; i < W; ++i) u[i] = std::bit_cast<V>(static_cast<reg>(v[i]));
    return batch<T>(std::bit_cast<reg>(detail::transpose_add<T, W>(u)));
}

/// Number of leading elements of an n-element row that full batches cover.
template <class T>
inline index_t full_batches(index_t n) { return n - n % width<T>; }

}  // namespace mnemo::simd
