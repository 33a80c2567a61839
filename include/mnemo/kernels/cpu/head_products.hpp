#pragma once
// The products of one attention head whose shared or output side is the head width d_k, known at
// compile time: A's attention over its 8 segment keys is an 8×8×32 product per (batch element, head),
// thousands of them per step, where a general GEMM's call, blocking and packing cost several times
// the 2K multiply-adds; B's is 128×384×32, where Eigen's GEBP ran at 0.4-0.5 of peak. Here a tile of
// the output stays in registers; no GEMM packing, only the operand read more than once is copied to
// the stack (a depth block of its rows at a time).
//
//   head_nt: S[M,N]  = X[M,Dk]·Y[N,Dk]ᵀ            (scores q·kᵀ; d attention weights dO·vᵀ)
//   head_nn: O[M,Dk] (=, +=) A[M,N]·Y[N,Dk]          (context a·v; d(q+u) = dS·k)
//   head_tn: O[N,Dk] (=, +=) A[M,N]ᵀ·X[M,Dk]         (dv = aᵀ·dO; dk = dSᵀ·q)
//
// nn and tn are one register-tiled product (rows_product): R rows × up to 4 vectors of O per tile
// (AVX2, d_k 32: 3 × 4 in 12 ymm; AVX-512: 12 × 2), each element one FMA chain over the depth in
// order. nt has two kernels: for a few keys, one horizontal sum per score (head_nt: X's row in
// registers); for many, the scores as vectors along the keys (head_nt_wide: Yᵀ copied a block at a
// time, and X's rows when they lie apart, R rows × 2 vectors per tile, AVX2 6 × 16), one FMA chain
// over d per score.
//
// Attention's products take a causal band (causal_keys: query row i sees keys up to offset + i): the
// tiles then skip what a tile's rows cannot see, about a sixth of B's per-head work (memory 256,
// segment 128), and give the same bits as without it; so does the general route's packed GEMM
// (gemm_*_banded), by its own tiles (C's products, d_k 64, take that route).
//
// Every pointer is a row-major block with its own row stride (a head's columns inside [rows, D]
// buffers). The kernels need d_k to be a whole number of SIMD vectors, at most 8 (`fits`). What
// callers use are the dispatchers head_gemm_nt / _nn / _tn, which take these kernels where they were
// measured to win and the general GEMMs (gemm.hpp) elsewhere (see nt_route / rows_route).
//
// Runtime d_k (a runtime-shape model, config<dynamic, dynamic, dynamic>): every product and
// dispatcher has an overload taking d_k as its first (runtime) argument. It takes the same route for
// the same shape and computes the same sums in the same order (the kernels are one implementation,
// instantiated with Dk = 0 for a runtime width); the operand rows cached in registers become rows of
// at most 8 vectors held in arrays of 8. The vector arithmetic is explicit, so the results are bitwise
// the compile-time ones, except where a plain loop is left to the compiler: heads_dot_rows' scalar
// tail (d_k not a whole number of vectors), which g++'s FMA contraction (-ffp-contract=fast, its
// default) may fuse differently when the trip count is a constant.
#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "../../core/shape.hpp"
#include "causal_keys.hpp"
#include "gemm.hpp"
#include "simd.hpp"

namespace mnemo::cpu_kernels {

struct head_products {
    /// The few-key nt kernel copies Y's rows (at most 16) to a stack block of this many; nn and tn
    /// take the tiles up to this many keys (or rows and keys) whatever the work.
    static constexpr index_t max_reread_rows = 64;

    template <class T, index_t Dk>
    static constexpr bool fits = Dk % simd::width<T> == 0 && Dk / simd::width<T> <= 8;
    /// fits for a runtime d_k.
    template <class T>
    static constexpr bool fits_runtime(index_t dk) {
        return dk > 0 && dk % simd::width<T> == 0 && dk / simd::width<T> <= 8;
    }

    using causal_keys = cpu_kernels::causal_keys;

    /// The routes (the same for a compile-time and a runtime d_k), measured on one thread against the
    /// general GEMM (Zen 2, AVX2, operands 2048 floats apart; docs/performance.md): under
    /// tiles_max_work multiply-adds (where the general path is Eigen's) the register tiles were
    /// 1.3-4× as fast on nn and tn at every shape tried (8×16 to 256×152, d_k 32 and 64; earlier, on
    /// AVX-512, nn 2-4× up to 64 keys and tn up to 64×64, the limits kept below) and 1.2-1.5× on nt
    /// from 16 rows on (with fewer, copying Yᵀ costs what the tiles save: Eigen 1.1× ahead at 8×144);
    /// from there on, the packed GEMM is 1.05-1.2× ahead. The few-key nt kernel: 2-3× at up
    /// to 8 keys, and at 16 keys over 16 rows.
    enum class route { reduce, tiles, general };
    static constexpr route nt_route(index_t m, index_t n, index_t dk) {
        if (n <= 8 || (n <= 16 && m <= 16)) return route::reduce;
        if (m >= 16 && small(m, n, dk)) return route::tiles;
        return route::general;
    }
    template <class T>
    static constexpr bool rows_route(index_t m, index_t n, index_t dk, bool nn, T beta) {
        if (beta != T(0) && beta != T(1)) return false;
        return (nn ? n <= max_reread_rows : m <= max_reread_rows && n <= max_reread_rows) || small(m, n, dk);
    }
    /// Products under this many multiply-adds take the tiles: where the general GEMM's packed path
    /// begins (gemm::packed_min_work, on builds that have it).
    static constexpr double tiles_max_work = double(1 << 21);
    static constexpr bool small(index_t m, index_t n, index_t dk) {
        return double(m) * double(n) * double(dk) < tiles_max_work;
    }

    /// Whether rows_product writes O [rows, Dk] (row stride ldo) around the caches: when it is
    /// written once, in one depth block, is at least stream_min_bytes, and its rows lie apart
    /// (ldo > Dk) on whole vectors. Such an O is a head's slice of a [rows, B·D] or wider buffer, as
    /// the attention's dK and dV (128-byte rows 16 KB apart in configuration B's [K·B, 2D] d keys
    /// and values): each ordinary store first read its line from L3 or DRAM. B's two tn products
    /// 37-39 → 25-28 µs (dK) and 57-60 → 45-50 µs (dV) a head, one thread, in a scratch loop over
    /// its backward's buffers; B's step 1-2% faster at the median in 5 of 5 runs of 29 steps with
    /// and 29 without, alternated step by step in one process (Granite Rapids VM,
    /// docs/performance.md). What reads such an O (a GEMM over the whole buffer) comes after every
    /// head, when it would have left L2 anyway. Only B's shapes qualify among A, B and C (C's d_k
    /// of 64 takes its 256 queries in four depth blocks).
    template <class T>
    static bool stream_output(index_t rows, index_t dk, const T* o, index_t ldo) {
        constexpr index_t W = simd::width<T>;
        return simd::streams<T> && ldo > dk && double(rows) * double(dk) * sizeof(T) >= stream_min_bytes &&
               reinterpret_cast<std::uintptr_t>(o) % (W * sizeof(T)) == 0 && ldo % W == 0 && dk % W == 0;
    }
    /// 32 KiB: B's dK and dV (384 keys × 32) stream; the reconstruction loss's (32 keys), the
    /// context of its target attention (128 queries × 32) and a generated token's rows do not
    /// (read again at once).
    static constexpr double stream_min_bytes = 32 * 1024;

    /// S[M,N] = X[M,Dk]·Y[N,Dk]ᵀ
    template <index_t Dk, class T>
    static void head_gemm_nt(index_t m, index_t n, const T* x, index_t ldx, const T* y, index_t ldy, T* s, index_t lds,
                             causal_keys band = {}) {
        if constexpr (fits<T, Dk>) {
            const route r = nt_route(m, n, Dk);
            if (r == route::reduce) return head_nt<Dk>(m, n, x, ldx, y, ldy, s, lds);
            if (r == route::tiles) return head_nt_wide_impl<Dk>(Dk, m, n, x, ldx, y, ldy, s, lds, band);
        }
        gemm::gemm_nt_banded(m, n, Dk, x, ldx, y, ldy, s, lds, T(0), T(1), band);
    }
    /// O[M,Dk] = beta·O + A[M,N]·Y[N,Dk]
    template <index_t Dk, class T>
    static void head_gemm_nn(index_t m, index_t n, const T* a, index_t lda, const T* y, index_t ldy, T* o, index_t ldo,
                             T beta = T(0), causal_keys band = {}) {
        if constexpr (fits<T, Dk>)
            if (rows_route(m, n, Dk, true, beta))
                return rows_product<Dk>(Dk, m, n, a, lda, 1, y, ldy, o, ldo, beta != T(0), band, true);
        gemm::gemm_nn_banded(m, Dk, n, a, lda, y, ldy, o, ldo, beta, T(1), band);
    }
    /// O[N,Dk] = beta·O + A[M,N]ᵀ·X[M,Dk]
    template <index_t Dk, class T>
    static void head_gemm_tn(index_t m, index_t n, const T* a, index_t lda, const T* x, index_t ldx, T* o, index_t ldo,
                             T beta = T(0), causal_keys band = {}) {
        if constexpr (fits<T, Dk>)
            if (rows_route(m, n, Dk, false, beta))
                return rows_product<Dk>(Dk, n, m, a, 1, lda, x, ldx, o, ldo, beta != T(0), band, false);
        gemm::gemm_tn_banded(n, Dk, m, a, lda, x, ldx, o, ldo, beta, T(1), band);
    }

    /// The three dispatchers with a runtime d_k (the same routes, bitwise the same results).
    template <class T>
    static void head_gemm_nt(index_t dk, index_t m, index_t n, const T* x, index_t ldx, const T* y, index_t ldy, T* s,
                             index_t lds, causal_keys band = {}) {
        if (fits_runtime<T>(dk)) {
            const route r = nt_route(m, n, dk);
            if (r == route::reduce) return head_nt_impl<0>(dk, m, n, x, ldx, y, ldy, s, lds);
            if (r == route::tiles) return head_nt_wide_impl<0>(dk, m, n, x, ldx, y, ldy, s, lds, band);
        }
        gemm::gemm_nt_banded(m, n, dk, x, ldx, y, ldy, s, lds, T(0), T(1), band);
    }
    template <class T>
    static void head_gemm_nn(index_t dk, index_t m, index_t n, const T* a, index_t lda, const T* y, index_t ldy, T* o,
                             index_t ldo, T beta = T(0), causal_keys band = {}) {
        if (fits_runtime<T>(dk) && rows_route(m, n, dk, true, beta))
            return rows_product<0>(dk, m, n, a, lda, 1, y, ldy, o, ldo, beta != T(0), band, true);
        gemm::gemm_nn_banded(m, dk, n, a, lda, y, ldy, o, ldo, beta, T(1), band);
    }
    template <class T>
    static void head_gemm_tn(index_t dk, index_t m, index_t n, const T* a, index_t lda, const T* x, index_t ldx, T* o,
                             index_t ldo, T beta = T(0), causal_keys band = {}) {
        if (fits_runtime<T>(dk) && rows_route(m, n, dk, false, beta))
            return rows_product<0>(dk, n, m, a, 1, lda, x, ldx, o, ldo, beta != T(0), band, false);
        gemm::gemm_tn_banded(n, dk, m, a, lda, x, ldx, o, ldo, beta, T(1), band);
    }

    /// S[i, j] = Σ_d X[i, d]·Y[j, d]
    template <index_t Dk, class T>
    static void head_nt(index_t m, index_t n, const T* x, index_t ldx, const T* y_in, index_t ldy_in, T* s, index_t lds) {
        head_nt_impl<Dk>(Dk, m, n, x, ldx, y_in, ldy_in, s, lds);
    }
    /// The same with a runtime d_k (fits_runtime).
    template <class T>
    static void head_nt(index_t dk, index_t m, index_t n, const T* x, index_t ldx, const T* y_in, index_t ldy_in, T* s,
                        index_t lds) {
        head_nt_impl<0>(dk, m, n, x, ldx, y_in, ldy_in, s, lds);
    }

private:
    // The kernels, for a compile-time d_k (Dk > 0; dk == Dk) or a runtime one (Dk == 0, d_k = dk): one
    // source, so the two compute the same sums in the same order. V: the vectors of a row (a constant
    // when Dk is); VMax: the size of the arrays that hold a row's vectors.
    template <index_t Dk, class T>
    static constexpr index_t max_vectors = Dk > 0 ? Dk / simd::width<T> : 8;

    template <index_t Dk, class T>
    static void head_nt_impl(index_t dk, index_t m, index_t n, const T* x, index_t ldx, const T* y_in, index_t ldy_in,
                             T* s, index_t lds) {
        using B = simd::batch<T>;
        constexpr index_t W = simd::width<T>, VMax = max_vectors<Dk, T>;
        const index_t V = (Dk > 0 ? Dk : dk) / W;
        alignas(64) T pack[max_reread_rows * VMax * W];
        const T* y = packed<Dk>(Dk > 0 ? Dk : dk, n, y_in, ldy_in, pack);
        const index_t ldy = Dk > 0 ? Dk : dk;
        for (index_t i = 0; i < m; ++i) {
            B xi[VMax];
            for (index_t v = 0; v < V; ++v) xi[v] = simd::load(x + i * ldx + v * W);
            T* si = s + i * lds;
            index_t j = 0;
            for (; j + 4 <= n; j += 4) {
                B a0 = xi[0] * simd::load(y + (j + 0) * ldy), a1 = xi[0] * simd::load(y + (j + 1) * ldy);
                B a2 = xi[0] * simd::load(y + (j + 2) * ldy), a3 = xi[0] * simd::load(y + (j + 3) * ldy);
                for (index_t v = 1; v < V; ++v) {
                    a0 = simd::fma(xi[v], simd::load(y + (j + 0) * ldy + v * W), a0);
                    a1 = simd::fma(xi[v], simd::load(y + (j + 1) * ldy + v * W), a1);
                    a2 = simd::fma(xi[v], simd::load(y + (j + 2) * ldy + v * W), a2);
                    a3 = simd::fma(xi[v], simd::load(y + (j + 3) * ldy + v * W), a3);
                }
                si[j] = simd::reduce_add(a0);
                si[j + 1] = simd::reduce_add(a1);
                si[j + 2] = simd::reduce_add(a2);
                si[j + 3] = simd::reduce_add(a3);
            }
            for (; j < n; ++j) {
                B a = xi[0] * simd::load(y + j * ldy);
                for (index_t v = 1; v < V; ++v) a = simd::fma(xi[v], simd::load(y + j * ldy + v * W), a);
                si[j] = simd::reduce_add(a);
            }
        }
    }

    // nn and tn are one product over register tiles: O[r, :] (= or +=) Σ_p c(r, p)·Y[p, :] for rows
    // r < rows, depth p < depth, with coefficients c(r, p) = a[r·rs + p·ps] (nn: A's row r, rs = lda,
    // ps = 1; tn: A's column r, rs = 1, ps = lda). A tile holds R rows × VC vectors of O in
    // registers; every element is one FMA chain over p in order, from 0 or from O (across depth
    // blocks through O's memory, which keeps the value), so the tile shapes, the blocks and the route
    // (compile-time or runtime d_k) leave the bits alone. Y's rows are copied a depth block at a time
    // (Y_BLOCK floats, L1) to the stack when there is more than one row tile to share them: a head's
    // rows lie batch·D or 2·batch·D floats apart, and a few of them fill one L1 set.

    /// Accumulator registers a tile may use: 12 of AVX2's 16, 24 of AVX-512's 32 (the rest hold the
    /// loaded row and the broadcasts).
    template <class T>
    static constexpr index_t tile_registers = sizeof(simd::batch<T>) >= 64 ? 24 : 12;
    /// Vectors of O per tile row (a row wider than that is split into column chunks).
    static constexpr index_t max_tile_vectors = 4;
    /// The stack block Y's rows (nn, tn) or Yᵀ's columns (nt) are copied to: 16 KiB of float.
    static constexpr index_t y_block = 4096;

    template <index_t R, index_t VC, class T>
    [[gnu::always_inline]] static inline void rows_tile(index_t depth, const T* a, index_t rs, index_t ps, const T* y,
                                                        index_t ldy, T* o, index_t ldo, bool load_o, bool stream_o) {
        using B = simd::batch<T>;
        constexpr index_t W = simd::width<T>;
        B c[R][VC];
        if (!load_o && !stream_o)  // O's lines, with intent to write, while the depth loop runs
            for (index_t r = 0; r < R; ++r) simd::prefetch_for_write(o + r * ldo, VC * W);
        for (index_t r = 0; r < R; ++r)
            for (index_t v = 0; v < VC; ++v) c[r][v] = load_o ? simd::load(o + r * ldo + v * W) : simd::splat<T>(0);
        for (index_t p = 0; p < depth; ++p) {
            B yv[VC];
            for (index_t v = 0; v < VC; ++v) yv[v] = simd::load(y + p * ldy + v * W);
            for (index_t r = 0; r < R; ++r) {
                const B s = simd::splat(a[r * rs + p * ps]);
                for (index_t v = 0; v < VC; ++v) c[r][v] = simd::fma(s, yv[v], c[r][v]);
            }
        }
        if constexpr (simd::streams<T>) {
            if (stream_o) {
                for (index_t r = 0; r < R; ++r)
                    for (index_t v = 0; v < VC; ++v) simd::stream_store(o + r * ldo + v * W, c[r][v]);
                return;
            }
        }
        for (index_t r = 0; r < R; ++r)
            for (index_t v = 0; v < VC; ++v) simd::store(o + r * ldo + v * W, c[r][v]);
    }

    /// Every row tile of one column chunk of VC vectors over the depth block [p0, p0 + depth), each
    /// tile over the part of it where its rows' coefficients can be nonzero (band; queries: the rows
    /// are query rows and the depth keys, as nn's; else the rows are keys and the depth queries).
    template <index_t VC, class T>
    static void rows_chunk(index_t rows, index_t p0, index_t depth, const T* a, index_t rs, index_t ps, const T* y,
                           index_t ldy, T* o, index_t ldo, bool load_o, causal_keys band, bool queries,
                           bool stream_o) {
        constexpr index_t R = std::min<index_t>(12, tile_registers<T> / VC);
        auto tile = [&]<index_t Rt>(index_t r) {
            const index_t begin = queries ? 0 : std::clamp<index_t>(band.first_query(r) - p0, 0, depth);
            const index_t end = queries ? std::clamp<index_t>(band.end(r + Rt) - p0, 0, depth) : depth;
            if (end <= begin && load_o) return;  // nothing to add (without load_o the tile still writes zeros)
            rows_tile<Rt, VC>(std::max<index_t>(0, end - begin), a + r * rs + begin * ps, rs, ps, y + begin * ldy, ldy,
                              o + r * ldo, ldo, load_o, stream_o);
        };
        index_t r = 0;
        for (; r + R <= rows; r += R) tile.template operator()<R>(r);
        if (r < rows) with_rows<R - 1>(rows - r, [&]<index_t Rt>() { tile.template operator()<Rt>(r); });
    }

    /// f.template operator()<rows>() for a runtime 1 ≤ rows ≤ Max: the remainder of a tile loop as one tile.
    template <index_t Max, class F>
    [[gnu::always_inline]] static inline void with_rows(index_t rows, F&& f) {
        if constexpr (Max > 1)
            if (rows < Max) return with_rows<Max - 1>(rows, f);
        f.template operator()<Max>();
    }

    /// A read prefetch into L2 (prefetcht1), as volatile asm on x86: an optimising g++ 12 deleted
    /// prefetch_coefficients' loops, which do nothing but prefetch, when they were written with
    /// __builtin_prefetch or _mm_prefetch (the binary had none of their instructions).
    static void prefetch_l2(const void* p) {
#if defined(__x86_64__) || defined(__i386__)
        asm volatile("prefetcht1 %0" : : "m"(*static_cast<const char*>(p)));
#else
        __builtin_prefetch(p, 0, 2);
#endif
    }

    /// The coefficients a depth block's tiles will read (those the band lets them see), asked into L2
    /// in memory order before the first tile. A tile reads them as 12 short runs (nn: 12 rows apart)
    /// or one short run per depth step (tn: 12 floats of every row), patterns the hardware
    /// prefetchers follow poorly, and inside a training step they often come from L3 or DRAM: the
    /// attention probabilities the backward reads were written by the forward long before.
    /// Configuration B's 128×384×32 tn (dV = Aᵀ·dO, dK = dSᵀ·q) took 78 µs a product inside the step
    /// (nn 29 µs, either 19-20 µs with hot operands); with the sweep 45-48 µs, B's per-head products
    /// 168-170 → 143-148 ms of thread time a step, and the step about 4% faster, ahead in 13 of 13
    /// interleaved rounds (Granite Rapids VM, docs/performance.md). Rows with stride 1 in neither
    /// direction (no caller has them) are left to the hardware. Not inlined: the prefetch's asm
    /// inside rows_product's body made g++ keep the tiles' accumulators on the stack (3× slower).
    template <class T>
    [[gnu::noinline]] static void prefetch_coefficients(index_t rows, index_t p0, index_t depth, const T* a, index_t rs,
                                                        index_t ps, causal_keys band, bool queries) {
        constexpr index_t line = index_t(64 / sizeof(T));
        auto run = [](const T* q, index_t n) {
            if (n <= 0) return;
            for (index_t i = 0; i < n; i += line) prefetch_l2(q + i);
            prefetch_l2(q + n - 1);  // the last line, when q is not line-aligned
        };
        if (ps == 1) {  // nn: row r's coefficients over the block's depth (keys when queries)
            for (index_t r = 0; r < rows; ++r)
                run(a + r * rs, queries ? std::clamp<index_t>(band.end(r + 1) - p0, 0, depth) : depth);
        } else if (rs == 1) {  // tn: depth step p's coefficients over the rows (keys when !queries)
            for (index_t p = 0; p < depth; ++p)
                run(a + p * ps, queries ? rows : std::min(rows, band.end(p0 + p + 1)));
        }
    }

    template <index_t Dk_, class T>
    static void rows_product(index_t dk, index_t rows, index_t depth, const T* a, index_t rs, index_t ps, const T* y_in,
                             index_t ldy_in, T* o, index_t ldo, bool accumulate, causal_keys band = {},
                             bool queries = true) {
        constexpr index_t W = simd::width<T>;
        const index_t Dk = Dk_ > 0 ? Dk_ : dk, V = Dk / W;
        const index_t block = std::max<index_t>(1, y_block / Dk);
        const bool copy = rows > 2;
        alignas(64) T pack[y_block];
        index_t p0 = 0;
        do {  // at least once: depth 0 still writes O = 0 when not accumulating
            if (p0 > 0 && queries && p0 >= band.end(rows)) break;  // no row sees these keys, nor the rest
            const index_t pb = std::min(block, depth - p0);
            const T* y = copy ? packed<Dk_>(Dk, pb, y_in + p0 * ldy_in, ldy_in, pack) : y_in + p0 * ldy_in;
            const index_t ldy = copy ? Dk : ldy_in;
            const bool load_o = accumulate || p0 > 0;
            const T* ab = a + p0 * ps;
            prefetch_coefficients(rows, p0, pb, ab, rs, ps, band, queries);
            const bool stream_o = !load_o && depth <= block && stream_output<T>(rows, Dk, o, ldo);
            for (index_t v0 = 0; v0 < V; v0 += max_tile_vectors) {
                const index_t vc = std::min(max_tile_vectors, V - v0);
                const T* yc = y + v0 * W;
                T* oc = o + v0 * W;
                if (vc == 4) rows_chunk<4>(rows, p0, pb, ab, rs, ps, yc, ldy, oc, ldo, load_o, band, queries, stream_o);
                else if (vc == 3) rows_chunk<3>(rows, p0, pb, ab, rs, ps, yc, ldy, oc, ldo, load_o, band, queries, stream_o);
                else if (vc == 2) rows_chunk<2>(rows, p0, pb, ab, rs, ps, yc, ldy, oc, ldo, load_o, band, queries, stream_o);
                else rows_chunk<1>(rows, p0, pb, ab, rs, ps, yc, ldy, oc, ldo, load_o, band, queries, stream_o);
            }
            if (stream_o) simd::stream_fence();
            p0 += block;
        } while (p0 < depth);
    }

    // nt over many keys: S[i, j] = Σ_d X[i, d]·Y[j, d] with the scores as vectors along j. Yᵀ is
    // copied a block of columns at a time to the stack ([Dk, nb], zero past n), and a tile holds
    // R rows × 2 vectors of S, one FMA chain over d per score.
    template <index_t R, class T>
    [[gnu::always_inline]] static inline void nt_tile(index_t dk, const T* x, index_t ldx, const T* yt, index_t ldyt,
                                                      T* s, index_t lds, index_t cols) {
        using B = simd::batch<T>;
        constexpr index_t W = simd::width<T>;
        B c[R][2];
        // S's lines asked for with intent to write while the d loop runs (and O's in rows_tile where
        // it is written once): Zen 5, steps alternated in one process, both together, configuration
        // A's training step 0.4-1.0% faster in 4 runs of 400 steps, B's -0.8 to +1.1% in 4 runs of
        // 60 steps.
        for (index_t r = 0; r < R; ++r) simd::prefetch_for_write(s + r * lds, cols);
        for (index_t r = 0; r < R; ++r) c[r][0] = c[r][1] = simd::splat<T>(0);
        for (index_t d = 0; d < dk; ++d) {
            const B y0 = simd::load(yt + d * ldyt), y1 = simd::load(yt + d * ldyt + W);
            for (index_t r = 0; r < R; ++r) {
                const B xs = simd::splat(x[r * ldx + d]);
                c[r][0] = simd::fma(xs, y0, c[r][0]);
                c[r][1] = simd::fma(xs, y1, c[r][1]);
            }
        }
        if (cols == 2 * W) {
            for (index_t r = 0; r < R; ++r) {
                simd::store(s + r * lds, c[r][0]);
                simd::store(s + r * lds + W, c[r][1]);
            }
        } else {
            alignas(64) T tmp[2 * W];
            // Unrolled by force: a loop over r left rolled (its body has a loop of runtime length)
            // indexes c with a variable, and g++ 12 then keeps all 2·R accumulators on the stack,
            // in the d loop too: every FMA a load and a store (B's score products 2× slower, its
            // training step 4-12%; tools/check_tile_registers.sh catches it).
#pragma GCC unroll 16
            for (index_t r = 0; r < R; ++r) {
                simd::store(tmp, c[r][0]);
                simd::store(tmp + W, c[r][1]);
                for (index_t j = 0; j < cols; ++j) s[r * lds + j] = tmp[j];
            }
        }
    }

    template <index_t Dk_, class T>
    static void head_nt_wide_impl(index_t dk, index_t m, index_t n, const T* x, index_t ldx, const T* y, index_t ldy, T* s,
                                  index_t lds, causal_keys band = {}) {
        constexpr index_t W = simd::width<T>, NR = 2 * W;
        constexpr index_t R = std::min<index_t>(12, tile_registers<T> / 2);
        const index_t Dk = Dk_ > 0 ? Dk_ : dk;
        const index_t nb = std::max<index_t>(NR, y_block / Dk / NR * NR);  // Yᵀ's columns per block
        alignas(64) T pack[y_block];  // nb·Dk ≤ y_block: fits keeps Dk ≤ 8 vectors ≤ y_block / NR
        // X's rows, a block of xb at a time, copied to the stack when they lie apart (a head's rows in
        // [rows, B·D] buffers are 8 KB apart in configuration B: a tile's 12 rows share one L1 set
        // with the Yᵀ block's lines). One block (m ≤ xb) is copied once, for the first Yᵀ block.
        const index_t xb = y_block / Dk;
        const bool copy_x = ldx > Dk && m > R;
        alignas(64) T xpack[y_block];
        for (index_t j0 = 0; j0 < n && j0 < band.end(m); j0 += nb) {  // keys some row sees
            const index_t cols = std::min(nb, n - j0), ldyt = (cols + NR - 1) / NR * NR;
            // The columns a tile of rows [i, i + Rt) computes: those its last row sees, whole vectors.
            auto seen = [&](index_t i, index_t rt) { return std::min(cols, band.end(i + rt) - j0); };
            pack_transposed<Dk_>(Dk, cols, ldyt, y + j0 * ldy, ldy, pack);
            for (index_t i0 = 0; i0 < m; i0 += xb) {
                const index_t i1 = std::min(m, i0 + xb);
                if (seen(i0, i1 - i0) <= 0) continue;  // no row of the block sees these keys
                const T* xr = x + i0 * ldx;
                index_t ldxr = ldx;
                if (copy_x) {
                    if (j0 == 0 || m > xb) packed<Dk_>(Dk, i1 - i0, x + i0 * ldx, ldx, xpack);
                    xr = xpack;
                    ldxr = Dk;
                }
                index_t i = i0;
                for (; i + R <= i1; i += R)
                    for (index_t j = 0; j < seen(i, R); j += NR)
                        nt_tile<R>(Dk, xr + (i - i0) * ldxr, ldxr, pack + j, ldyt, s + i * lds + j0 + j, lds,
                                   std::min(NR, cols - j));
                if (i < i1)
                    with_rows<R - 1>(i1 - i, [&]<index_t Rt>() {
                        for (index_t j = 0; j < seen(i, Rt); j += NR)
                            nt_tile<Rt>(Dk, xr + (i - i0) * ldxr, ldxr, pack + j, ldyt, s + i * lds + j0 + j, lds,
                                        std::min(NR, cols - j));
                    });
            }
        }
    }

    /// Yᵀ's block for head_nt_wide: pack[d·ldyt + j] = y[j·ldy + d] for j < cols, zero for
    /// cols ≤ j < ldyt (a multiple of the SIMD width), d < Dk. For float on the packed GEMM's
    /// instruction sets, W × W blocks go through its register transpose (the scalar copy was about a
    /// sixth of B's score products, one head hot); otherwise element by element. A copy: the bits
    /// are the same either way.
    template <index_t Dk_, class T>
    static void pack_transposed(index_t dk, index_t cols, index_t ldyt, const T* y, index_t ldy, T* pack) {
        const index_t Dk = Dk_ > 0 ? Dk_ : dk;
#ifdef MNEMO_PACKED_GEMM
        using isa = gemm_packed::isa;
        if constexpr (std::is_same_v<T, float> && isa::lanes == simd::width<T>) {
            constexpr index_t L = isa::lanes;
            for (index_t j = 0; j < ldyt; j += L) {
                for (index_t t = 0; t < L; ++t) simd::prefetch_lines(y + (j + t + prefetch_ahead) * ldy, Dk);
                for (index_t d0 = 0; d0 < Dk; d0 += L) {
                    typename isa::reg x[L];
                    for (index_t t = 0; t < L; ++t)
                        x[t] = j + t < cols ? isa::load_partial(y + (j + t) * ldy + d0, L) : isa::zero();
                    isa::transpose(x);
                    for (index_t t = 0; t < L; ++t) isa::storeu(pack + (d0 + t) * ldyt + j, x[t]);
                }
            }
            return;
        }
#endif
        for (index_t j = 0; j < cols; ++j) {
            simd::prefetch_lines(y + (j + prefetch_ahead) * ldy, Dk);
            for (index_t d = 0; d < Dk; ++d) pack[d * ldyt + j] = y[j * ldy + d];
        }
        for (index_t j = cols; j < ldyt; ++j)
            for (index_t d = 0; d < Dk; ++d) pack[d * ldyt + j] = T(0);
    }

public:
    // One query row over many rows, every head in one pass (one generated token: the per-head
    // products read each cached key row once per head, d_k floats at a time, rows 2·D floats apart;
    // these read each row once, whole). Any d_k: whole SIMD vectors, then a scalar tail. Each output
    // is computed the same way whatever range of rows or heads a call is given, so splitting a product
    // over threads leaves its bits alone.

    /// s[h·lds + r] = Σ_{d<Dk} x[h·Dk + d]·y[r·ldy + h·Dk + d], for rows r in [r0, r1) and heads h < heads.
    /// The (row, head) pairs go W (the SIMD width) at a time: their W partial sums reduce together
    /// (simd::transpose_add, the same tree for every lane, so a pair's bits do not depend on r0).
    template <index_t Dk, class T>
    static void heads_dot_rows(index_t heads, index_t r0, index_t r1, const T* x, const T* y, index_t ldy, T* s,
                               index_t lds) {
        heads_dot_rows_impl<Dk>(Dk, heads, r0, r1, x, y, ldy, s, lds);
    }
    /// The same with a runtime d_k (any): bitwise the compile-time one's results.
    template <class T>
    static void heads_dot_rows(index_t dk, index_t heads, index_t r0, index_t r1, const T* x, const T* y, index_t ldy,
                               T* s, index_t lds) {
        heads_dot_rows_impl<0>(dk, heads, r0, r1, x, y, ldy, s, lds);
    }

    /// o[h·Dk + d] = Σ_{r<n} a[h·lda + r]·y[r·ldy + h·Dk + d], for heads h in [h0, h1) (o's other heads
    /// are not touched); with `accumulate`, o += the sum. The rows are summed in order, one fused
    /// multiply-add each, four at a time into registers: rows [0, n) in one call give the bits of rows
    /// [0, m) and then [m, n) accumulated.
    template <index_t Dk, class T>
    static void heads_weighted_rows(index_t h0, index_t h1, index_t n, const T* a, index_t lda, const T* y, index_t ldy,
                                    T* o, bool accumulate = false) {
        heads_weighted_rows_impl<Dk>(Dk, h0, h1, n, a, lda, y, ldy, o, accumulate);
    }
    /// The same with a runtime d_k (any): bitwise the compile-time one's results.
    template <class T>
    static void heads_weighted_rows(index_t dk, index_t h0, index_t h1, index_t n, const T* a, index_t lda, const T* y,
                                    index_t ldy, T* o, bool accumulate = false) {
        heads_weighted_rows_impl<0>(dk, h0, h1, n, a, lda, y, ldy, o, accumulate);
    }

    /// One key row's scores, every head, plus those of a second row: s[h] = Σ_{d<Dk} x[h·Dk + d]·
    /// k[h·Dk + d] + Σ_d y[h·Dk + d]·r[h·Dk + d] (the second sum when r is not null) for h < heads,
    /// one chain of FMAs a head (k's vectors, then r's) and heads_dot_rows' reduction tree. s is
    /// written in whole vectors (heads rounded up to the SIMD width; the lanes past heads hold
    /// nothing of use): a caller loads it back as vectors, which a CPU forwards from such stores.
    template <index_t Dk, class T>
    static void heads_row_dots(index_t heads, const T* x, const T* k, const T* y, const T* r, T* s) {
        heads_row_dots_impl<Dk>(Dk, heads, x, k, y, r, s);
    }
    template <class T>
    static void heads_row_dots(index_t dk, index_t heads, const T* x, const T* k, const T* y, const T* r, T* s) {
        heads_row_dots_impl<0>(dk, heads, x, k, y, r, s);
    }

    /// An online softmax's step over one value row, every head: o[h·Dk + d] = o[h·Dk + d]·c[h] +
    /// e[h]·v[h·Dk + d] for h < heads (a head with c[h] = 1 is not multiplied, which leaves its bits
    /// alone).
    template <index_t Dk, class T>
    static void heads_rescale_add(index_t heads, const T* c, const T* e, const T* v, T* o) {
        heads_rescale_add_impl<Dk>(Dk, heads, c, e, v, o);
    }
    template <class T>
    static void heads_rescale_add(index_t dk, index_t heads, const T* c, const T* e, const T* v, T* o) {
        heads_rescale_add_impl<0>(dk, heads, c, e, v, o);
    }

private:
    template <index_t Dk_, class T>
    static void heads_row_dots_impl(index_t dk, index_t heads, const T* x, const T* k, const T* y, const T* r, T* s) {
        using B = simd::batch<T>;
        constexpr index_t W = simd::width<T>;
        const index_t Dk = Dk_ > 0 ? Dk_ : dk, V = Dk / W;
        // With d_k and the heads count compile-time constants (a count that divides W or that W
        // divides, d_k whole vectors) the groups' loops unroll and their sums stay in registers.
        if constexpr (Dk_ > 0 && Dk_ % W == 0) {
            if (row_dots_fixed<Dk_, 1, 2, 4, 8, 16, 32>(heads, x, k, y, r, s)) return;
        }
        for (index_t h0 = 0; h0 < heads; h0 += W) {
            const index_t n = std::min(W, heads - h0);
            B acc[W];
            for (index_t i = 0; i < W; ++i) {
                if (i >= n || V == 0) {
                    acc[i] = simd::splat(T(0));
                    continue;
                }
                const index_t off = (h0 + i) * Dk;
                B a = simd::load(x + off) * simd::load(k + off);
                for (index_t v = 1; v < V; ++v) a = simd::fma(simd::load(x + off + v * W), simd::load(k + off + v * W), a);
                if (r)
                    for (index_t v = 0; v < V; ++v) a = simd::fma(simd::load(y + off + v * W), simd::load(r + off + v * W), a);
                acc[i] = a;
            }
            simd::store(s + h0, simd::transpose_add(acc));
        }
        if (V * W == Dk) return;
        for (index_t h = 0; h < heads; ++h) {  // the scalar tails (d_k not a whole number of vectors)
            const index_t off = h * Dk;
            T t = s[h];
            for (index_t d = V * W; d < Dk; ++d) t += x[off + d] * k[off + d];
            if (r)
                for (index_t d = V * W; d < Dk; ++d) t += y[off + d] * r[off + d];
            s[h] = t;
        }
    }
    /// heads_row_dots for the first of Hc, More... that equals heads; false if none does (or it
    /// neither divides W nor is a multiple of it).
    template <index_t Dk_, index_t Hc, index_t... More, class T>
    static bool row_dots_fixed(index_t heads, const T* x, const T* k, const T* y, const T* r, T* s) {
        constexpr index_t W = simd::width<T>;
        if constexpr (W % Hc == 0 || Hc % W == 0) {
            if (heads == Hc) {
                if (r) row_dots_groups<Dk_, Hc, true>(x, k, y, r, s);
                else row_dots_groups<Dk_, Hc, false>(x, k, y, r, s);
                return true;
            }
        }
        if constexpr (sizeof...(More) > 0) return row_dots_fixed<Dk_, More...>(heads, x, k, y, r, s);
        else return false;
    }
    template <index_t Dk_, index_t Hc, bool WithR, class T>
    static void row_dots_groups(const T* x, const T* k, const T* y, const T* r, T* s) {
        using B = simd::batch<T>;
        constexpr index_t W = simd::width<T>, CV = Dk_ / W, n = Hc < W ? Hc : W;
        for (index_t h0 = 0; h0 < Hc; h0 += W) {
            B acc[W];
#pragma GCC unroll 32
            for (index_t i = 0; i < W; ++i) {
                if (i >= n) {
                    acc[i] = simd::splat(T(0));
                    continue;
                }
                const index_t off = (h0 + i) * Dk_;
                B a = simd::load(x + off) * simd::load(k + off);
#pragma GCC unroll 16
                for (index_t v = 1; v < CV; ++v) a = simd::fma(simd::load(x + off + v * W), simd::load(k + off + v * W), a);
                if constexpr (WithR) {
#pragma GCC unroll 16
                    for (index_t v = 0; v < CV; ++v) a = simd::fma(simd::load(y + off + v * W), simd::load(r + off + v * W), a);
                }
                acc[i] = a;
            }
            simd::store(s + h0, simd::transpose_add(acc));
        }
    }

    template <index_t Dk_, class T>
    static void heads_rescale_add_impl(index_t dk, index_t heads, const T* c, const T* e, const T* v, T* o) {
        using B = simd::batch<T>;
        constexpr index_t W = simd::width<T>;
        const index_t Dk = Dk_ > 0 ? Dk_ : dk, V = Dk / W;
        for (index_t h = 0; h < heads; ++h) {
            const T* vh = v + h * Dk;
            T* oh = o + h * Dk;
            const B ve = simd::splat(e[h]);
            if (c[h] == T(1)) {
                for (index_t i = 0; i < V; ++i) simd::store(oh + i * W, simd::fma(ve, simd::load(vh + i * W), simd::load(oh + i * W)));
                for (index_t d = V * W; d < Dk; ++d) oh[d] = std::fma(e[h], vh[d], oh[d]);
            } else {
                const B vc = simd::splat(c[h]);
                for (index_t i = 0; i < V; ++i)
                    simd::store(oh + i * W, simd::fma(ve, simd::load(vh + i * W), simd::load(oh + i * W) * vc));
                for (index_t d = V * W; d < Dk; ++d) oh[d] = std::fma(e[h], vh[d], oh[d] * c[h]);
            }
        }
    }

    // heads_dot_rows reads y front to back: the (row, head) pairs in memory order, W (the SIMD width)
    // at a time, a row's heads one after another and then the next row's, one stream when ldy =
    // heads·d_k, the keys of a [keys | values] cache row otherwise. The older order, head by head over
    // a block of W rows, made W short streams of d_k floats that the prefetchers followed poorly. A
    // scratch program over configuration C's, B's and A's one-token scores and weighted values (24, 6
    // and 6 layers of rows: from DRAM, L3 and L2), one thread, 2-core Zen 4 VM, medians of 21
    // interleaved rounds: C 11.3 → 14.7 GB/s, B 61 → 74, A 65 → 80 (a plain sum of C's bytes 24.6).
    // That needs the pattern of offsets at compile time: with the heads a runtime count, stepping
    // (row, head) pair by pair made B and A 20% slower than the old order. So the heads counts that
    // divide W, or that W divides, take loops of whole groups with the pattern unrolled; any other
    // count, and the pairs left after the whole groups, step pair by pair. Every pair's sum is the
    // same chain of FMAs and the same reduction tree on each route: the bits do not depend on it.
    // The cached token in the models, one process alternating the two orders (medians of the
    // per-round ratios, 12-16 rounds): C 0.90 of the old time on one thread, 0.96-0.98 on two; B
    // 0.965, A 0.99 on two. Software prefetch a few rows ahead (2, 4 or 8) was slower on Zen 4, in
    // this order and the old; on a Zen 3 VM (AVX2) the old order gained 5-8% from a prefetch of the
    // next W rows, and this order is not measured there.

    /// The scores of one group of n ≤ W pairs: acc[i] = Σ_v x_i·y_i over the whole vectors of d_k,
    /// for the pairs' x and y row starts given by at(i, xi, yi), called for i = 0, ..., n − 1 in
    /// order; their sums (transpose_add) into sums, zero past n.
    template <index_t Dk_, class T, class At>
    static void group_sums(index_t V, index_t n, At at, T* sums) {
        using B = simd::batch<T>;
        constexpr index_t W = simd::width<T>;
        const index_t CV = Dk_ > 0 ? Dk_ / W : V;
        B acc[W];
        for (index_t i = 0; i < W; ++i) {
            if (i >= n) {
                acc[i] = simd::splat(T(0));
                continue;
            }
            const T *xi, *yi;
            at(i, xi, yi);
            B a = simd::load(xi) * simd::load(yi);
            for (index_t v = 1; v < CV; ++v) a = simd::fma(simd::load(xi + v * W), simd::load(yi + v * W), a);
            acc[i] = a;
        }
        simd::transpose_add(acc).store_aligned(sums);
    }

    /// Whole groups of W / Hc rows of Hc heads (Hc divides W) from row r0 on; returns the rows done.
    template <index_t Dk_, index_t Hc, class T>
    static index_t dot_row_groups(index_t Dk, index_t r0, index_t r1, const T* x, const T* y, index_t ldy, T* s,
                                  index_t lds) {
        constexpr index_t W = simd::width<T>, R = W / Hc;
        const index_t rows = (r1 - r0) / R * R;
        alignas(64) T sums[W];
        for (index_t r = r0; r < r0 + rows; r += R) {
            const T* yr = y + r * ldy;
            group_sums<Dk_>(Dk / W, W, [&](index_t i, const T*& xi, const T*& yi) {
                xi = x + i % Hc * Dk;
                yi = yr + i / Hc * ldy + i % Hc * Dk;
            }, sums);
            for (index_t i = 0; i < W; ++i) s[i % Hc * lds + r + i / Hc] = sums[i];
        }
        return rows;
    }

    /// dot_row_groups for the first of Hc, More... that equals heads and is below W; 0 rows if none.
    template <index_t Dk_, index_t Hc, index_t... More, class T>
    static index_t dot_row_groups_for(index_t heads, index_t Dk, index_t r0, index_t r1, const T* x, const T* y,
                                      index_t ldy, T* s, index_t lds) {
        if constexpr (Hc < simd::width<T>) {
            if (heads == Hc) return dot_row_groups<Dk_, Hc>(Dk, r0, r1, x, y, ldy, s, lds);
            if constexpr (sizeof...(More) > 0) return dot_row_groups_for<Dk_, More...>(heads, Dk, r0, r1, x, y, ldy, s, lds);
        }
        return 0;
    }

    template <index_t Dk_, class T>
    static void heads_dot_rows_impl(index_t dk, index_t heads, index_t r0, index_t r1, const T* x, const T* y,
                                    index_t ldy, T* s, index_t lds) {
        constexpr index_t W = simd::width<T>;
        const index_t Dk = Dk_ > 0 ? Dk_ : dk, V = Dk / W;
        index_t done = 0;  // pairs
        if (V > 0 && heads % W == 0) {  // W heads of one row a group
            alignas(64) T sums[W];
            for (index_t r = r0; r < r1; ++r)
                for (index_t h0 = 0; h0 < heads; h0 += W) {
                    const T* xh = x + h0 * Dk;
                    const T* yh = y + r * ldy + h0 * Dk;
                    group_sums<Dk_>(V, W, [&](index_t i, const T*& xi, const T*& yi) {
                        xi = xh + i * Dk;
                        yi = yh + i * Dk;
                    }, sums);
                    for (index_t i = 0; i < W; ++i) s[(h0 + i) * lds + r] = sums[i];
                }
            done = (r1 - r0) * heads;
        } else if (V > 0) {
            done = heads * dot_row_groups_for<Dk_, 1, 2, 4, 8>(heads, Dk, r0, r1, x, y, ldy, s, lds);
        }
        // The rest pair by pair, still W at a time (any heads count; the rows after whole groups).
        const index_t pairs = (r1 - r0) * heads;
        for (index_t p0 = done; p0 < pairs; p0 += W) {
            const index_t n = std::min(W, pairs - p0);
            alignas(64) T sums[W] = {};
            index_t r = r0 + p0 / heads, h = p0 % heads;
            if (V > 0)
                group_sums<Dk_>(V, n, [&](index_t, const T*& xi, const T*& yi) {
                    xi = x + h * Dk;
                    yi = y + r * ldy + h * Dk;
                    if (++h == heads) h = 0, ++r;
                }, sums);
            r = r0 + p0 / heads, h = p0 % heads;
            for (index_t i = 0; i < n; ++i) {
                s[h * lds + r] = sums[i];
                if (++h == heads) h = 0, ++r;
            }
        }
        if (V * W == Dk) return;
        // Every pair's scalar tail (d_k not a whole number of vectors), added to its sum.
        for (index_t p = 0, r = r0, h = 0; p < pairs; ++p) {
            const T* xh = x + h * Dk;
            const T* yi = y + r * ldy + h * Dk;
            T t = s[h * lds + r];
            for (index_t d = V * W; d < Dk; ++d) t += xh[d] * yi[d];
            s[h * lds + r] = t;
            if (++h == heads) h = 0, ++r;
        }
    }

    template <index_t Dk_, class T>
    static void heads_weighted_rows_impl(index_t dk, index_t h0, index_t h1, index_t n, const T* a, index_t lda,
                                         const T* y, index_t ldy, T* o, bool accumulate) {
        using B = simd::batch<T>;
        constexpr index_t W = simd::width<T>;
        const index_t Dk = Dk_ > 0 ? Dk_ : dk, V = Dk / W;
        if (!accumulate) std::fill(o + h0 * Dk, o + h1 * Dk, T(0));
        // o += rows [r, r + R) of every head, in order
        auto add_rows = [&]<index_t R>(index_t r) {
            for (index_t h = h0; h < h1; ++h) {
                const T* ah = a + h * lda + r;
                const T* yh = y + r * ldy + h * Dk;
                T* oh = o + h * Dk;
                for (index_t v = 0; v < V; ++v) {
                    B c = simd::load(oh + v * W);
                    for (index_t i = 0; i < R; ++i) c = simd::fma(simd::splat(ah[i]), simd::load(yh + i * ldy + v * W), c);
                    simd::store(oh + v * W, c);
                }
                for (index_t d = V * W; d < Dk; ++d)
                    for (index_t i = 0; i < R; ++i) oh[d] += ah[i] * yh[i * ldy + d];
            }
        };
        index_t r = 0;
        for (; r + 4 <= n; r += 4) add_rows.template operator()<4>(r);
        for (; r < n; ++r) add_rows.template operator()<1>(r);
    }

    // The rows of an operand read more than once, copied to contiguous stack memory: a head's rows
    // lie batch·D floats apart (A: 16 or 32 KiB), so more than a few of them share one L1 set.
    // (dk == Dk when Dk > 0.)
    template <index_t Dk, class T>
    static const T* packed(index_t dk, index_t rows, const T* p, index_t ld, T* pack) {
        constexpr index_t W = simd::width<T>;
        const index_t row = Dk > 0 ? Dk : dk, V = row / W;
        for (index_t r = 0; r < rows; ++r) {
            simd::prefetch_lines(p + (r + prefetch_ahead) * ld, row);
            for (index_t v = 0; v < V; ++v) simd::store(pack + r * row + v * W, simd::load(p + r * ld + v * W));
        }
        return pack;
    }

    // Copies read a head's rows far apart (a new page each, for the keys and values): the loads of one
    // row wait on memory, and the out-of-order window holds one or two rows' worth of them. Asking for
    // the row prefetch_ahead rows on (past the end: a prefetch never faults) overlaps the misses; the
    // pack of the keys was a third of the scores' time in configuration B's forward without it.
    static constexpr index_t prefetch_ahead = 8;
};

/// The per-head products for the extents E: with d_head a compile-time width (E.d_head) for a static
/// config, with the runtime width dk of a runtime-shape model otherwise (the same routes and sums).
/// Each takes dk first and passes the rest on to head_products.
template <static_extents E>
struct heads_for {
#define MNEMO_HEADS_FOR(name, kernel)                                                              \
    template <class... A>                                                                        \
    static void name(index_t dk, A... a) {                                                       \
        if constexpr (E.d_head != dynamic) head_products::template kernel<index_t(E.d_head)>(a...); \
        else head_products::kernel(dk, a...);                                                    \
    }
    MNEMO_HEADS_FOR(gemm_nt, head_gemm_nt)
    MNEMO_HEADS_FOR(gemm_nn, head_gemm_nn)
    MNEMO_HEADS_FOR(gemm_tn, head_gemm_tn)
    MNEMO_HEADS_FOR(dot_rows, heads_dot_rows)
    MNEMO_HEADS_FOR(weighted_rows, heads_weighted_rows)
    MNEMO_HEADS_FOR(row_dots, heads_row_dots)
    MNEMO_HEADS_FOR(rescale_add, heads_rescale_add)
#undef MNEMO_HEADS_FOR
};

}  // namespace mnemo::cpu_kernels
