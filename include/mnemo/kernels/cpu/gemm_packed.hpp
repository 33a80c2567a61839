#pragma once
// Single-precision GEMM for AVX-512, packed and cache-blocked in the GotoBLAS/BLIS way. gemm.hpp sends
// it the large float products of its three forms (row-major, C = beta·C + alpha·op(A)·op(B)) on
// AVX-512 builds; use_packed() there says which, and records what was measured.
//
// Micro-kernel: a 14×32 tile of C in 28 zmm accumulators (xsimd::batch<float, avx512f>); each step
// over k loads two vectors of packed B and broadcasts 14 floats of packed A into 28 FMAs (2 more
// registers for B, 1 for the broadcast). On its own it runs at the FMA peak, from L1 or L2.
// Blocking, for Zen 5 (48 KiB L1d and 1 MiB L2 per core, shared L3):
//   kc = 512   depth of a K block (k cut into equal blocks of at most 512). C is read and written
//              once per block, so deep blocks save C traffic: against kc = 256 (with mc = 504), the
//              one-thread median went from 0.87 to 0.90 of peak, 1024×2048×512 from 0.81 to 0.86;
//              the 64 KiB B micro-panel streams from L2 as fast as from L1.
//   mc = 252   rows of A per block at most: 252 × 512 floats (516 KiB) stay in L2 while the B panels
//              pass. A thread's rows are cut into equal blocks of whole tiles (512 rows: 182, 182,
//              148), never a full block and a sliver: every block streams all of B's panels, so a
//              block of 8 rows cost about as much as one of 252. 2 threads, the 51 products of B and
//              C, medians of 2 interleaved runs: median 0.754 → 0.795 of peak, tn 0.72 → 0.82.
//   nc = 2048  columns of B per block.
// Packing: rows of A [M, K] are copied with a row stride of kc + 16 floats (a panel's 14 rows would
// otherwise share a few L1 sets); for gemm_tn A [K, M] is copied as it lies, 14 columns a row, and
// the kernel reads it with the other stride: nothing is transposed. B [K, N] is copied into 32-column
// panels 16 rows at a time; B [N, K] (gemm_nt) goes through 16×16 register transposes. The source is
// prefetched ahead (a row of A is too short a run for the hardware prefetcher).
//
// Threads: each owns a block of C's rows at tile boundaries. Every element of C sums over k in the
// same order whatever the split (K blocks depend on k alone, each row of a tile is its own FMA chain,
// partial tiles run the full-tile arithmetic), so results are bitwise the same on any thread count.
// Packed B is shared up to 16 MiB: threads claim 128-column packing tasks with an atomic, each packs
// those nobody has started, and waits only for a task the other thread is in the middle of, for a
// bounded while: if that thread lost its core, it packs a copy itself. No barrier, so a busy core
// costs no more than in a plain fork/join. Larger B: each thread packs the blocks it needs. Buffers
// are per thread and grow once: a steady-state GEMM allocates nothing.
//
// Measured (bench_kernels, the 17 large products of configurations B and C, fraction of the FP32
// peak, medians over the shapes): 2 threads 0.87 nn / 0.88 nt / 0.855 tn against Eigen's 0.81 /
// 0.76 / 0.75; 1 thread 0.90 / 0.90 / 0.88 against 0.84 / 0.83 / 0.80 (gemm.hpp has the details).
#ifdef __AVX512F__
#include <immintrin.h>
#include <omp.h>

#include <Eigen/Core>
#include <algorithm>
#include <atomic>
#include <memory>
#include <vector>
#include <xsimd/xsimd.hpp>

#include "../../core/shape.hpp"

namespace mnemo::cpu_kernels {

struct gemm_packed {
    using batch = xsimd::batch<float, xsimd::avx512f>;
    static constexpr index_t lanes = 16;
    static constexpr index_t mr = 14;         // rows of a tile
    static constexpr index_t nv = 2;          // vectors across a tile
    static constexpr index_t nr = nv * lanes; // columns of a tile
    static constexpr index_t kc_max = 512;
    static constexpr index_t a_ld = kc_max + lanes;  // row stride of packed A (nn, nt)
    static constexpr index_t mc_max = 252;
    static constexpr index_t nc_max = 2048;
    /// Columns of B one shared packing task covers, and the largest packed B (floats) a team shares.
    static constexpr index_t task_cols = 4 * nr;
    static constexpr index_t shared_b_max = index_t(1) << 22;
    /// Products of at most this many rows split C's columns over the threads (whole 32-column
    /// panels; each thread packs all of A and only its own columns of B, so nothing is shared or
    /// waited for) instead of its rows: with 512 rows or fewer a thread's share of rows re-streams
    /// all of B for very few tiles. The 51 products of B and C on 2 threads (2 interleaved runs):
    /// 256 rows 0.64 → 0.71-0.81 of peak, 512 rows 0.74 → 0.81, 1024 rows median 0.80 → 0.82; from
    /// 2048 rows the row split is ahead (0.86 against 0.82). Every element still sums over k in the
    /// same order: the bits do not change.
    static constexpr index_t col_split_rows = 1024;
    /// ... and at least this many multiply-adds: configuration A's products (256 rows, 2^22-2^23)
    /// were 1% slower in its training step split by columns.
    static constexpr double col_split_min_work = double(1 << 24);
    /// How far ahead (floats) copy_block prefetches its source.
    static constexpr index_t prefetch_distance = 2048;

    enum class form { nn, nt, tn };

    /// Depth of a K block: k cut into equal blocks of at most kc_max, rounded up to 16. It depends on
    /// k alone, so every element of C sums over k in the same order whatever rows a thread has.
    static index_t k_block(index_t k) {
        const index_t blocks = (k + kc_max - 1) / kc_max;
        return std::min(kc_max, ((k + blocks - 1) / blocks + lanes - 1) / lanes * lanes);
    }

    static __mmask16 mask(index_t n) { return n >= lanes ? __mmask16(0xffff) : __mmask16((1u << n) - 1u); }

    static void prefetch(const float* p) { _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T0); }

    /// In-register transpose of 16 rows of 16 floats: four rounds of swapping the off-diagonal blocks
    /// of 8, 4, 2 and 1 (two-source permutes only: g++ 12 warns about the unpack and shuffle
    /// intrinsics' internal _mm512_undefined_ps() wherever those are inlined into user code).
    static void transpose16(__m512 r[16]) {
#pragma GCC unroll 4
        for (int bs = 8; bs >= 1; bs /= 2) {
            alignas(64) int lo[16], hi[16];
#pragma GCC unroll 16
            for (int c = 0; c < 16; ++c) {
                lo[c] = (c & bs) ? 16 + c - bs : c;
                hi[c] = (c & bs) ? 16 + c : c + bs;
            }
            const __m512i vlo = _mm512_load_si512(lo), vhi = _mm512_load_si512(hi);
#pragma GCC unroll 16
            for (int i = 0; i < 16; ++i) {
                if (i & bs) continue;
                const __m512 a = r[i], b = r[i + bs];
                r[i] = _mm512_permutex2var_ps(a, vlo, b);
                r[i + bs] = _mm512_permutex2var_ps(a, vhi, b);
            }
        }
    }

    /// A block of gemm_nn / gemm_nt: dst[r·a_ld + c] = src[r·ld + c] for r < rows, c < cols, zero up
    /// to rows_pad and cols_pad (a multiple of 16). Rows up to prefetch_rows are prefetched a few KiB
    /// ahead: one row is too short a run for the hardware prefetcher.
    static void copy_block(const float* src, index_t ld, index_t rows, index_t rows_pad, index_t cols, index_t cols_pad,
                           float* dst, index_t prefetch_rows) {
        const index_t ahead = std::clamp<index_t>(prefetch_distance / cols, 1, 64);
        for (index_t r = 0; r < rows_pad; ++r) {
            if (r + ahead < prefetch_rows)
                for (index_t c = 0; c < cols; c += lanes) prefetch(src + (r + ahead) * ld + c);
            for (index_t c = 0; c < cols_pad; c += lanes)
                _mm512_store_ps(dst + r * a_ld + c, r < rows ? _mm512_maskz_loadu_ps(mask(std::max<index_t>(0, cols - c)), src + r * ld + c)
                                                             : _mm512_setzero_ps());
        }
    }

    /// A block of gemm_tn, [kb, mb] of A [K, M] (stride ld), as panels of mr columns, panel q at
    /// dst + q·mr·a_ld holding dst[p·mr + i] = src[p·ld + q·mr + i], zero past mb. 16 rows at a time
    /// across the panels, the next 16 prefetched; each row of a panel is stored as a whole vector
    /// whose last lanes the next row overwrites (masked on the panel's last row).
    static void pack_a_cols(const float* src, index_t ld, index_t kb, index_t mb, float* dst) {
        for (index_t p0 = 0; p0 < kb; p0 += lanes) {
            const index_t p1 = std::min(kb, p0 + lanes);
            for (index_t i = 0; i < mb; i += mr) {
                const __mmask16 load = mask(mb - i);
                float* d = dst + i * a_ld;
                for (index_t p = p1; p < std::min(kb, p1 + lanes); ++p) prefetch(src + p * ld + i);
                for (index_t p = p0; p < p1; ++p) {
                    const __m512 x = _mm512_maskz_loadu_ps(load, src + p * ld + i);
                    if (p + 1 < kb) _mm512_storeu_ps(d + p * mr, x);
                    else _mm512_mask_storeu_ps(d + p * mr, mask(mr), x);
                }
            }
        }
    }

    /// Columns [0, w) of a B block [kb, ·] of B [K, N] (stride ld, nn and tn) as panels of nr
    /// columns, panel q at dst + q·nr·kb holding dst[p·nr + j] = src[p·ld + q·nr + j], zero past w.
    /// 16 rows at a time across the panels, the next 16 prefetched: the source is read in long runs
    /// and each panel gets 2 KiB at once (row by row, the panels' lines, kb·nr floats apart, would
    /// fight over a few cache sets).
    static void pack_b_rows(const float* src, index_t ld, index_t kb, index_t w, float* dst) {
        for (index_t p0 = 0; p0 < kb; p0 += lanes) {
            const index_t p1 = std::min(kb, p0 + lanes);
            for (index_t j = 0; j < w; j += nr) {
                const __mmask16 m0 = mask(w - j), m1 = mask(std::max<index_t>(0, w - j - lanes));
                for (index_t p = p1; p < std::min(kb, p1 + lanes); ++p) prefetch(src + p * ld + j), prefetch(src + p * ld + j + lanes);
                for (index_t p = p0; p < p1; ++p) {
                    float* d = dst + j * kb + p * nr;
                    _mm512_store_ps(d, _mm512_maskz_loadu_ps(m0, src + p * ld + j));
                    _mm512_store_ps(d + lanes, _mm512_maskz_loadu_ps(m1, src + p * ld + j + lanes));
                }
            }
        }
    }

    /// One panel of B [N, K] (gemm_nt): dst[p·nr + j] = src[j·ld + p] for j < rows (≤ nr), p < kb,
    /// zero for rows ≤ j < nr; 16×16 blocks transposed in registers, the next 16 rows (up to
    /// prefetch_rows) prefetched meanwhile.
    static void pack_b_transposed(const float* src, index_t ld, index_t rows, index_t kb, float* dst, index_t prefetch_rows) {
        for (index_t r0 = 0; r0 < nr; r0 += lanes)
            for (index_t c0 = 0; c0 < kb; c0 += lanes) {
                const __mmask16 load = mask(kb - c0);
                __m512 x[16];
                for (index_t j = 0; j < lanes; ++j) {
                    if (r0 + lanes + j < prefetch_rows) prefetch(src + (r0 + lanes + j) * ld + c0);
                    x[j] = r0 + j < rows ? _mm512_maskz_loadu_ps(load, src + (r0 + j) * ld + c0) : _mm512_setzero_ps();
                }
                transpose16(x);
                for (index_t d = 0; d < std::min(lanes, kb - c0); ++d) _mm512_store_ps(dst + (c0 + d) * nr + r0, x[d]);
            }
    }

    /// C ← alpha·acc + prev for one vector of C, prev = beta·C (load_c) or 0: the one formula of full
    /// and partial tiles (multiplications by 1 are skipped, which changes no bit).
    struct update {
        batch va, vb;
        bool unit_alpha, unit_beta, load_c;
        update(float alpha, float beta, bool load)
            : va(alpha), vb(beta), unit_alpha(alpha == 1.0f), unit_beta(beta == 1.0f), load_c(load) {}
        batch operator()(const batch& acc, const batch& c) const {
            if (!load_c) return unit_alpha ? acc : va * acc;
            return xsimd::fma(va, acc, unit_beta ? c : vb * c);
        }
    };

    /// The micro-kernel: acc[i][j] = Σ_{p<kb} a[i·IS + p·PS] · b[p·nr + j] for a tile of mr × nr,
    /// then C updated. Full tiles store straight to C; partial ones (rows < mr or cols < nr: packed
    /// with zeros) go through a copy of the accumulators and masked loads and stores. Out of line, so
    /// that the 28 accumulators have the registers to themselves.
    template <index_t IS, index_t PS>
    [[gnu::noinline]] static void tile(index_t kb, const float* a, const float* b, float* c, index_t ldc, index_t rows,
                                       index_t cols, const update& up) {
        batch acc[mr][nv];
#pragma GCC unroll 16
        for (index_t i = 0; i < mr; ++i)
#pragma GCC unroll 2
            for (index_t v = 0; v < nv; ++v) acc[i][v] = batch(0.0f);
        for (index_t p = 0; p < kb; ++p) {
            batch bv[nv];
#pragma GCC unroll 2
            for (index_t v = 0; v < nv; ++v) bv[v] = batch::load_aligned(b + p * nr + v * lanes);
#pragma GCC unroll 16
            for (index_t i = 0; i < mr; ++i) {
                const batch ai(a[i * IS + p * PS]);
#pragma GCC unroll 2
                for (index_t v = 0; v < nv; ++v) acc[i][v] = xsimd::fma(ai, bv[v], acc[i][v]);
            }
        }
        if (rows == mr && cols == nr) {
#pragma GCC unroll 16
            for (index_t i = 0; i < mr; ++i)
#pragma GCC unroll 2
                for (index_t v = 0; v < nv; ++v) {
                    float* cp = c + i * ldc + v * lanes;
                    up(acc[i][v], up.load_c ? batch::load_unaligned(cp) : batch(0.0f)).store_unaligned(cp);
                }
            return;
        }
        alignas(64) float t[mr * nr];
#pragma GCC unroll 16
        for (index_t i = 0; i < mr; ++i)
#pragma GCC unroll 2
            for (index_t v = 0; v < nv; ++v) acc[i][v].store_aligned(t + i * nr + v * lanes);
        for (index_t i = 0; i < rows; ++i)
            for (index_t v = 0; v * lanes < cols; ++v) {
                float* cp = c + i * ldc + v * lanes;
                const __mmask16 mk = mask(cols - v * lanes);
                const batch prev = up.load_c ? batch(_mm512_maskz_loadu_ps(mk, cp)) : batch(0.0f);
                _mm512_mask_storeu_ps(cp, mk, up(batch::load_aligned(t + i * nr + v * lanes), prev));
            }
    }

    using buffer = std::vector<float, Eigen::aligned_allocator<float>>;
    /// This thread's buffer `which` (0: packed A, 1: its own packed B, 2: packed B it shares with
    /// its team), at least `size` floats; grown once, kept.
    static float* thread_buffer(int which, index_t size) {
        thread_local buffer bufs[3];
        buffer& b = bufs[which];
        if (b.size() < std::size_t(size)) b.resize(std::size_t(size));
        return b.data();
    }

    /// `count` packing-task states (0 free, 1 being packed, 2 packed), all set to 0; this thread's,
    /// grown once, kept.
    static std::atomic<int>* task_states(index_t count) {
        thread_local std::unique_ptr<std::atomic<int>[]> states;
        thread_local index_t capacity = 0;
        if (count > capacity) {
            states.reset(new std::atomic<int>[std::size_t(count)]);
            capacity = count;
        }
        for (index_t i = 0; i < count; ++i) states[i].store(0, std::memory_order_relaxed);
        return states.get();
    }

    /// Waits a bounded while (2000 pauses, about 50 µs here: a few times what packing a task takes)
    /// for a task another thread is packing; false if it is still not done (that thread lost its
    /// core), and the caller packs a copy of its own instead.
    static bool packed(const std::atomic<int>& state) {
        for (int spin = 0; spin < 2000; ++spin) {
            if (state.load(std::memory_order_acquire) == 2) return true;
            _mm_pause();
        }
        return state.load(std::memory_order_acquire) == 2;
    }

    /// C [m, n] = beta·C + alpha·op(A)·op(B) (the forms of gemm.hpp: nn A [m, k] · B [k, n], nt A
    /// [m, k] · B [n, k]ᵀ, tn A [k, m]ᵀ · B [k, n]; row strides lda, ldb, ldc) on up to `threads`
    /// threads. beta = 0 overwrites C whatever it holds.
    template <form F>
    static void run(index_t m, index_t n, index_t k, const float* a, index_t lda, const float* b, index_t ldb, float* c,
                    index_t ldc, float beta, float alpha, int threads) {
        if (m <= 0 || n <= 0) return;
        if (k <= 0) {
            for (index_t i = 0; i < m; ++i)
                for (index_t j = 0; j < n; ++j) c[i * ldc + j] = beta == 0.0f ? 0.0f : beta * c[i * ldc + j];
            return;
        }
        // Packed A: row i of a panel at a[i·a_ld] (nn, nt), or column p at a[p·mr] (tn).
        constexpr index_t a_stride_i = F == form::tn ? 1 : a_ld, a_stride_p = F == form::tn ? mr : 1;
        const index_t kc = k_block(k), nc = std::min(nc_max, (n + nr - 1) / nr * nr);
        const index_t tiles = (m + mr - 1) / mr;
        threads = int(std::min<index_t>(threads, tiles));
        const index_t blocks = (k + kc - 1) / kc * ((n + nc - 1) / nc), tasks = (nc + task_cols - 1) / task_cols;
        // Up to col_split_rows rows, the threads take C's columns instead (see there).
        const bool by_cols = threads > 1 && m <= col_split_rows && n >= 2 * nr * threads &&
                             double(m) * double(n) * double(k) >= col_split_min_work;
        const bool shared = threads > 1 && !by_cols && blocks * kc * nc <= shared_b_max;
        float* shared_b = shared ? thread_buffer(2, blocks * kc * nc) : nullptr;
        std::atomic<int>* states = shared ? task_states(blocks * tasks) : nullptr;

        // Packs columns [j0, j1) of the B block (jc, pc) into dst, panel by panel.
        auto pack_b = [&](index_t jc, index_t pc, index_t j0, index_t j1, float* dst) {
            const index_t kb = std::min(kc, k - pc);
            if constexpr (F == form::nt) {
                for (index_t j = j0; j < j1; j += nr)
                    pack_b_transposed(b + (jc + j) * ldb + pc, ldb, std::min(nr, j1 - j), kb, dst + (j - j0) * kb, j1 - j);
            } else {
                pack_b_rows(b + pc * ldb + jc + j0, ldb, kb, j1 - j0, dst);
            }
        };

        auto body = [&](int t, int team) {
            index_t r0 = std::min(m, tiles * t / team * mr), r1 = std::min(m, tiles * (t + 1) / team * mr);
            index_t c0 = 0, c1 = n;
            if (by_cols) {
                const index_t panels = (n + nr - 1) / nr;
                r0 = 0, r1 = m;
                c0 = std::min(n, panels * t / team * nr), c1 = std::min(n, panels * (t + 1) / team * nr);
            }
            // The thread's rows in equal blocks of at most mc_max (whole tiles): a short last block
            // would stream all of B from L3 for a tile or two (512 rows: 182+182+148, not 252+252+8).
            const index_t row_blocks = std::max<index_t>(1, (r1 - r0 + mc_max - 1) / mc_max);
            const index_t mc = std::min(mc_max, ((r1 - r0 + row_blocks - 1) / row_blocks + mr - 1) / mr * mr);
            float* ap = thread_buffer(0, std::max(mc, mr) * a_ld);
            float* own_b = thread_buffer(1, kc * (shared ? task_cols : nc));
            index_t block = 0;
            for (index_t jc = c0; jc < c1; jc += nc) {
                const index_t nb = std::min(nc, c1 - jc), block_tasks = (nb + task_cols - 1) / task_cols;
                for (index_t pc = 0; pc < k; pc += kc, ++block) {
                    const index_t kb = std::min(kc, k - pc), kb_pad = (kb + lanes - 1) / lanes * lanes;
                    float* bp = own_b;
                    std::atomic<int>* st = nullptr;
                    if (shared) {  // claim and pack the tasks nobody has started, from this thread's share on
                        bp = shared_b + block * kc * nc;
                        st = states + block * tasks;
                        for (index_t u = 0; u < block_tasks; ++u) {
                            const index_t q = (u + block_tasks * t / team) % block_tasks;
                            int free = 0;
                            if (st[q].load(std::memory_order_relaxed) == 0 &&
                                st[q].compare_exchange_strong(free, 1, std::memory_order_acquire)) {
                                pack_b(jc, pc, q * task_cols, std::min(nb, (q + 1) * task_cols), bp + q * task_cols * kb);
                                st[q].store(2, std::memory_order_release);
                            }
                        }
                    } else {
                        pack_b(jc, pc, 0, nb, bp);
                    }
                    const update up(alpha, pc == 0 ? beta : 1.0f, pc > 0 || beta != 0.0f);
                    for (index_t ic = r0; ic < r1; ic += mc) {
                        const index_t mb = std::min(mc, r1 - ic);
                        if constexpr (F == form::tn) pack_a_cols(a + pc * lda + ic, lda, kb, mb, ap);
                        else copy_block(a + ic * lda + pc, lda, mb, (mb + mr - 1) / mr * mr, kb, kb_pad, ap, r1 - ic);
                        for (index_t j0 = 0; j0 < nb; j0 += task_cols) {
                            const index_t j1 = std::min(nb, j0 + task_cols);
                            const float* panels = bp + j0 * kb;
                            if (shared && !packed(st[j0 / task_cols])) {
                                pack_b(jc, pc, j0, j1, own_b);
                                panels = own_b;
                            }
                            for (index_t jr = j0; jr < j1; jr += nr)
                                for (index_t ir = 0; ir < mb; ir += mr)
                                    tile<a_stride_i, a_stride_p>(kb, ap + ir * a_ld, panels + (jr - j0) * kb,
                                                                 c + (ic + ir) * ldc + jc + jr, ldc, std::min(mr, mb - ir),
                                                                 std::min(nr, nb - jr), up);
                        }
                    }
                }
            }
        };
        if (threads <= 1) {
            body(0, 1);
            return;
        }
#pragma omp parallel num_threads(threads)
        body(omp_get_thread_num(), omp_get_num_threads());
    }
};

}  // namespace mnemo::cpu_kernels
#endif
