#pragma once
// Single-precision GEMM, packed and cache-blocked in the GotoBLAS/BLIS way, for AVX-512 and for AVX2 +
// FMA. gemm.hpp sends it the large float products of its three forms (row-major, C = beta·C +
// alpha·op(A)·op(B)); use_packed() there says which, and records what was measured. One template,
// gemm_packed_t<Isa>, holds the algorithm; the instruction set (packed_isa_avx512, packed_isa_avx2)
// gives the vector type, the tile and the register transpose; the cache blocking is a runtime trait
// chosen by the CPU's microarchitecture (packed_tuning, cpu_model.hpp), each value with a note of
// where it was measured. gemm_packed is the kernel of the build's widest instruction set.
//
// Micro-kernels: AVX-512, a 14×32 tile of C in 28 zmm accumulators; each step over k loads two
// vectors of packed B and broadcasts 14 floats of packed A into 28 FMAs. AVX2, a 6×16 tile in 12 ymm
// accumulators (2 loads of B, 6 broadcasts, 12 FMAs a step). Both run at the FMA peak from L1 or L2.
// A short last row tile runs with its rows rounded up to even (4 rows of a 256-row product: a 4×32
// tile, not 14×32).
// Blocking, for Zen 5 (AVX-512; 48 KiB L1d and 1 MiB L2 per core, shared L3):
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
// Blocking, for Zen 2 (AVX2; 32 KiB L1d, 512 KiB L2 per core, 16 MiB L3 per 4-core CCX), the 17
// large products of B and C, nn, whole-set GFLOP/s (one thread / two; peak 107 / 213):
//   kc = 512   256: 91-92 / 173; 384: 93; 512: 95-96 / 182-186; 768 and 1024 (mc 48): 94.
//   mc = 72    (kc 512) 48: 95; 72: 94 / 185; 96: 95-96 / 182; 144: 94; 256 with mc 288: 90.
//   nc = 4096  2048: 185 / 4096: 182-186 at mc 96, within the noise; BLIS uses 4080 here.
//   Prefetching each tile's rows of C before its k loop changed nothing (92.2 against 91.3).
// Packing: rows of A [M, K] are copied with a row stride of kc_cap + lanes floats (a panel's rows
// would otherwise share a few L1 sets); for gemm_tn A [K, M] is copied as it lies, mr columns a row
// padded to a whole vector, and the kernel reads it with the other stride: nothing is transposed.
// B [K, N] is copied into nr-column panels 16 rows at a time; B [N, K] (gemm_nt) goes through
// lanes × lanes register transposes. The source is prefetched ahead (a row of A is too short a run
// for the hardware prefetcher).
//
// Threads: each owns a block of C's rows at tile boundaries. Every element of C sums over k in the
// same order whatever the split (K blocks depend on k and the blocking alone, each row of a tile is
// its own FMA chain, partial tiles run the same per-element arithmetic), so results are bitwise the
// same on any thread count (with a given blocking: two CPU models with different kc round
// differently).
// Packed B is shared up to 16 MiB in products of 2^24 multiply-adds or more (shared_min_work):
// threads claim 4-panel packing tasks with an atomic, each packs those nobody has started, and waits
// only for a task the other thread is in the middle of, for a bounded while: if that thread lost its
// core, it packs a copy itself. No barrier, so a busy core costs no more than in a plain fork/join.
// Larger B, or smaller products: each thread packs the blocks it needs. Buffers are per thread and
// grow once: a steady-state GEMM allocates nothing.
//
// Measured (bench_kernels, the 17 large products of configurations B and C, fraction of the FP32
// peak, min / median / max over the shapes; gemm.hpp has the AVX-512 details):
//   Zen 5, AVX-512, medians: 2 threads 0.87 nn / 0.88 nt / 0.855 tn against Eigen's 0.81 / 0.76 /
//   0.75; 1 thread 0.90 / 0.90 / 0.88 against 0.84 / 0.83 / 0.80.
//   Zen 2, AVX2 (one run, both paths): 2 threads nn 0.79 / 0.84 / 0.86 against Eigen's 0.69 / 0.77 /
//   0.81, nt 0.79 / 0.82 / 0.86 against 0.72 / 0.79 / 0.82, tn 0.70 / 0.80 / 0.86 against 0.64 /
//   0.72 / 0.77; 1 thread nn 0.77 / 0.85 / 0.88 against 0.77 / 0.80 / 0.85, nt 0.83 / 0.86 / 0.89
//   against 0.75 / 0.81 / 0.86, tn 0.80 / 0.85 / 0.88 against 0.65 / 0.74 / 0.81. Packed ahead on
//   98 of the 102 rows.
#include "causal_keys.hpp"
#include "cpu_model.hpp"

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#define MNEMO_PACKED_GEMM 1
#include "simd.hpp"  // first: the intrinsics' headers (<immintrin.h>) are read in its diagnostic region

#include <omp.h>

#include <Eigen/Core>
#include <algorithm>
#include <atomic>
#include <memory>
#include <vector>

#include "../../core/shape.hpp"
#include "parallel.hpp"

namespace mnemo::cpu_kernels {

// The two instruction sets the kernel is written for: vector type, tile shape, partial loads and
// stores, and the lanes × lanes register transpose gemm_nt's packing uses.
#ifdef __AVX512F__
/// AVX-512: a 14×32 tile in 28 zmm accumulators.
struct packed_isa_avx512 {
    using batch = xsimd::batch<float, xsimd::avx512f>;
    using reg = __m512;
    static constexpr const char* name = "avx512";
    static constexpr index_t lanes = 16, mr = 14, nv = 2;
    /// The tile's k loop as it is: unrolled 4 times on a Granite Rapids VM, the 51 products of B and
    /// C moved within the noise (1 thread 157-170 against 162-167 GFLOP/s; not measured on Zen 4/5).
    static constexpr bool unroll_k = false;
    /// The deepest K block any tuning trait of this kernel uses (the row stride of packed A is
    /// kc_cap + lanes whatever the trait: a compile-time stride keeps the tile's addressing simple).
    static constexpr index_t kc_cap = 512;
    /// gemm_direct's tile prefetches B's row this many steps ahead (0: none). Granite Rapids VM, one
    /// thread, the absorbed attention's [32, 136]·[136, 128] product of A for 32 batch elements in
    /// turn (ẑ from L3): 91-93 → 101-104 GFLOP/s with 16 (8: 100-104, 24: 98-102, 32: 100-102); with
    /// the operands hot in L1, 133-140 either way.
    static constexpr index_t direct_prefetch = 16;
    /// Fewest rows of C a product needs to go to this kernel (gemm::use_packed): with 14-row tiles
    /// Eigen was up to 1.7× faster on 3 to 64 rows (Zen 5; gemm.hpp's head).
    static constexpr index_t min_rows = 96;

    static __mmask16 mask(index_t n) { return n >= lanes ? __mmask16(0xffff) : n <= 0 ? __mmask16(0) : __mmask16((1u << n) - 1u); }
    static reg zero() { return _mm512_setzero_ps(); }
    static void store(float* p, reg v) { _mm512_store_ps(p, v); }
    static void storeu(float* p, reg v) { _mm512_storeu_ps(p, v); }
    /// Lanes [0, n) from p, zero past them (n may be ≤ 0 or ≥ lanes); nothing past p + n is read.
    static reg load_partial(const float* p, index_t n) { return _mm512_maskz_loadu_ps(mask(n), p); }
    static void store_partial(float* p, index_t n, reg v) { _mm512_mask_storeu_ps(p, mask(n), v); }

    /// In-register transpose of 16 rows of 16 floats: four rounds of swapping the off-diagonal blocks
    /// of 8, 4, 2 and 1 (two-source permutes only: g++ 12 warns about the unpack and shuffle
    /// intrinsics' internal _mm512_undefined_ps() wherever those are inlined into user code).
    static void transpose(reg r[16]) {
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
};
#endif

/// AVX2 + FMA: a 6×16 tile in 12 ymm accumulators (two FMA pipes of 5 cycles' latency need 10 or
/// more chains); each step over k loads two vectors of B and broadcasts 6 floats of A: 8 loads for
/// 12 FMAs, within the two load ports.
struct packed_isa_avx2 {
    using batch = xsimd::batch<float, xsimd::avx2>;
    using reg = __m256;
    static constexpr const char* name = "avx2";
    static constexpr index_t lanes = 8, mr = 6, nv = 2;
    /// The tile's k loop unrolled 4 times (the same FMAs in the same order). On a 2-core Zen 3 VM,
    /// the 51 products of B and C as one set (default blocking, 7 interleaved pairs of runs, fraction
    /// of the peak): 2 threads 0.59-0.66 → 0.68-0.72, 1 thread 0.61-0.79 → 0.68-0.80; the Zen 2
    /// measurements in the file's head were taken before it.
    static constexpr bool unroll_k = true;
    static constexpr index_t kc_cap = 512;
    /// gemm_direct's B prefetch (see packed_isa_avx512): not measured on an AVX2 machine, so none.
    static constexpr index_t direct_prefetch = 0;
    /// Fewest rows of C for this kernel (see packed_isa_avx512). 2-core Zen 3 VM, 2 threads, operands
    /// hot, best of 9 interleaved: nn/nt/tn with 40-80 rows ran 1.08-2.05× Eigen's speed over 28
    /// shapes (n 32-2048, k 32-1024; 64×512×512 1.45×, 64×2048×512 1.45×, 40×2048×512 2.05×); 32
    /// rows 1.26-1.47× in one run and 0.89-0.90× in two others (nt 32×512×512).
    static constexpr index_t min_rows = 40;

    static __m256i mask(index_t n) {
        return _mm256_cmpgt_epi32(_mm256_set1_epi32(int(std::clamp<index_t>(n, 0, lanes))), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    }
    static reg zero() { return _mm256_setzero_ps(); }
    static void store(float* p, reg v) { _mm256_store_ps(p, v); }
    static void storeu(float* p, reg v) { _mm256_storeu_ps(p, v); }
    static reg load_partial(const float* p, index_t n) { return n >= lanes ? _mm256_loadu_ps(p) : _mm256_maskload_ps(p, mask(n)); }
    static void store_partial(float* p, index_t n, reg v) {
        if (n >= lanes) _mm256_storeu_ps(p, v);
        else _mm256_maskstore_ps(p, mask(n), v);
    }

    /// In-register transpose of 8 rows of 8 floats: pairs interleaved, then quads, then the 128-bit
    /// halves exchanged.
    static void transpose(reg r[8]) {
        const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
        const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
        const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
        const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
        const __m256 s0 = _mm256_shuffle_ps(t0, t2, _MM_SHUFFLE(1, 0, 1, 0)), s1 = _mm256_shuffle_ps(t0, t2, _MM_SHUFFLE(3, 2, 3, 2));
        const __m256 s2 = _mm256_shuffle_ps(t1, t3, _MM_SHUFFLE(1, 0, 1, 0)), s3 = _mm256_shuffle_ps(t1, t3, _MM_SHUFFLE(3, 2, 3, 2));
        const __m256 s4 = _mm256_shuffle_ps(t4, t6, _MM_SHUFFLE(1, 0, 1, 0)), s5 = _mm256_shuffle_ps(t4, t6, _MM_SHUFFLE(3, 2, 3, 2));
        const __m256 s6 = _mm256_shuffle_ps(t5, t7, _MM_SHUFFLE(1, 0, 1, 0)), s7 = _mm256_shuffle_ps(t5, t7, _MM_SHUFFLE(3, 2, 3, 2));
        r[0] = _mm256_permute2f128_ps(s0, s4, 0x20), r[1] = _mm256_permute2f128_ps(s1, s5, 0x20);
        r[2] = _mm256_permute2f128_ps(s2, s6, 0x20), r[3] = _mm256_permute2f128_ps(s3, s7, 0x20);
        r[4] = _mm256_permute2f128_ps(s0, s4, 0x31), r[5] = _mm256_permute2f128_ps(s1, s5, 0x31);
        r[6] = _mm256_permute2f128_ps(s2, s6, 0x31), r[7] = _mm256_permute2f128_ps(s3, s7, 0x31);
    }
};

/// Cache blocking of the packed kernel, one set per microarchitecture it was measured on
/// (packed_tuning below). kc is a multiple of the ISA's lanes and at most its kc_cap, mc a multiple
/// of its mr, nc a multiple of 4·nr (a packing task).
struct packed_blocking {
    const char* measured_on;  // the microarchitecture the values come from
    index_t kc;               // depth of a K block at most
    index_t mc;               // rows of A per block at most (packed A stays in L2)
    index_t nc;               // columns of B per block at most
    /// Products of at most this many rows split C's columns over the threads (whole nr-column
    /// panels; each thread packs all of A and only its own columns of B, so nothing is shared or
    /// waited for) instead of its rows; 0: always its rows. With few rows a thread's share of them
    /// re-streams all of B for very few tiles. Every element still sums over k in the same order:
    /// the bits do not change.
    index_t col_split_rows;
};

/// The blocking of the packed kernel for instruction set Isa on CPU model `m`. Results depend on kc
/// (the K blocks each element sums in), so they differ between tunings, never between thread counts.
template <class Isa>
struct packed_tuning;

#ifdef __AVX512F__
template <>
struct packed_tuning<packed_isa_avx512> {
    // Zen 5 (48 KiB L1d, 1 MiB L2 a core): measured, see the file's head (2 threads, the 51 products
    // of B and C: median 0.87 nn / 0.88 nt / 0.855 tn of peak). Column split up to 1024 rows, the 51
    // products on 2 threads (2 interleaved runs): 256 rows 0.64 → 0.71-0.81 of peak, 512 rows 0.74 →
    // 0.81, 1024 rows median 0.80 → 0.82; from 2048 rows the row split is ahead (0.86 against 0.82).
    // Again on a Zen 5 VM (family 1Ah model 02h, peak 224 / 449 GFLOP/s) on 2026-12-02,
    // BM_packed_blocking, medians of 5 interleaved runs, 2 / 1 threads: this setting 0.765 / 0.804,
    // nc 4096 0.776 / 0.808, mc 126 0.765 / 0.802, mc 504 0.760 / 0.801, no column split 0.755 /
    // 0.800, kc 384 (mc 378) 0.748 / 0.791, kc 256 (mc 504) 0.728 / 0.763: kept.
    static constexpr packed_blocking zen5{"zen5", 512, 252, 2048, 1024};
    // Zen 4 (32 KiB L1d, 1 MiB L2): Zen 5's values, measured on a 2-core Zen 4 VM (EPYC family 19h
    // model 11h, peak 229-235 GFLOP/s on 2 threads) on 2026-12-07, BM_packed_blocking, medians of 5
    // interleaved runs, two sweeps, 2 / 1 threads: this setting 0.849, 0.818 / 0.880, 0.861; mc 126
    // 0.835, 0.814 / 0.843, 0.829; mc 504 0.834, 0.845 / 0.870, 0.842; nc 4096 0.842, 0.806 / 0.870,
    // 0.894; no column split 0.833, 0.820 / 0.878, 0.862; kc 384 (mc 378) 0.831, 0.827 / 0.827,
    // 0.856; kc 256 (mc 504) 0.768, 0.810 / 0.828, 0.833: no other setting ahead in both sweeps, kept.
    static constexpr packed_blocking zen4{"zen4 (zen5's values, measured)", 512, 252, 2048, 1024};
    // Sapphire/Emerald Rapids (48 KiB L1d, 2 MiB L2): Zen 5's values, measured on a 2-core Emerald
    // Rapids VM (peak 175 / 345 GFLOP/s on 1 / 2 threads), the 51 products, medians of 4-5
    // interleaved runs: 1 thread mc 126 / 252 / 504 (kc 512) 143 / 148 / 146 GFLOP/s, kc 384 (mc
    // 378) 144; 2 threads mc 252 / 378 / 504 / 700 263 / 255 / 277 / 264, nc 4096 283 (mc 252) and
    // 246 (mc 504), kc 256 252: the 2-MiB L2's larger blocks gain nothing the noise (212-296 for one
    // setting) would show.
    static constexpr packed_blocking xeon_spr{"xeon-spr (zen5's values, measured)", 512, 252, 2048, 1024};
    // Granite Rapids (48 KiB L1d, 2 MiB L2): Zen 5's values, measured on a 2-core VM (CPUID model
    // A7h with AMX, 480 MiB L3; peak 240 / 469-483 GFLOP/s) with BM_packed_blocking, the 51 products,
    // medians of 5 interleaved runs: every setting 0.63-0.66 of the peak on 2 threads and 0.65-0.68
    // on 1 (mc 126 / 504, nc 4096, kc 256 / 384, no column split); mc 504 against 252 in 8 more pairs
    // 321 against 315 GFLOP/s on 2 threads, 161 against 159 on 1: within the noise. The tile alone,
    // operands in L1, reaches 0.77-0.87 there: the gap is packing (9% of a 2048×512×2048 product) and
    // B's panels from L3, not the blocking. Again 2026-12-05 (same VM kind, peak 420-432 on 2
    // threads), 4 interleaved rounds of 3 on 2 threads: mc 252 0.654-0.674, mc 504 0.662-0.669, mc
    // 126 0.644-0.662; kc 256 / 384, nc 4096 and no column split 0.647-0.667 in one sweep: kept.
    // kc 1024 (a scratch build with kc_cap 1024), the 51 products on one thread, mean GFLOP/s of 2
    // interleaved rounds: mc 252 156.0 / 155.3, mc 126 155.4 / 154.2, this setting 154.2 / 156.0.
    static constexpr packed_blocking xeon_gnr{"xeon-gnr (zen5's values, measured)", 512, 252, 2048, 1024};
    static constexpr packed_blocking for_model(cpu_model m) {
        return m == cpu_model::zen4 ? zen4 : m == cpu_model::xeon_spr ? xeon_spr : m == cpu_model::xeon_gnr ? xeon_gnr : zen5;
    }
};
#endif

template <>
struct packed_tuning<packed_isa_avx2> {
    // Zen 2 (32 KiB L1d, 512 KiB L2 a core, 16 MiB L3 a CCX): measured, see the file's head. Column
    // split up to 0, 1024 or 2048 rows: the 51 products on 2 threads within 1% of each other in
    // total (2 interleaved runs); the slowest shape of a form at 136-170 GFLOP/s with none against
    // 155-169 with 1024 (the low ones gone): kept.
    static constexpr packed_blocking zen2{"zen2", 512, 72, 4096, 1024};
    // Zen 3 (32 KiB L1d, 512 KiB L2 a core, 32 MiB L3): Zen 2's values, measured on a 2-core Zen 3
    // VM (EPYC family 19h model 01h, peak 96 / 188 GFLOP/s) with bench_kernels' packed_blocking
    // sweep, the 51 products as one set, fraction of the peak, medians of 5 interleaved runs with
    // the k loop unrolled: 2 threads, kc 512 with mc 48 / 72 / 96 / 144 / 252 0.65 / 0.67 / 0.68 /
    // 0.66 / 0.67, no column split 0.66, kc 384 (mc 96) 0.59, kc 256 (mc 144) 0.58; 1 thread every
    // kc-512 setting 0.69-0.73, kc 256-384 0.62-0.64, nc 2048 0.68 (and 0.42 on 2 threads in a noisy
    // moment). Two sweeps before the unroll gave the same picture, about 0.08 lower. Again on
    // 2026-12-03 (same VM kind, peak 103 / 206 GFLOP/s), one sweep: 2 threads mc 48 / 72 / 96 /
    // 144 / 252 0.86 / 0.86 / 0.85 / 0.86 / 0.73, nc 2048 0.82, no column split 0.83, kc 384 0.80,
    // kc 256 0.78; 1 thread 0.85-0.885 at kc 512, kc 256 0.81: kept.
    static constexpr packed_blocking zen3{"zen3 (zen2's values, measured)", 512, 72, 4096, 1024};
    // Zen 1 and others with AVX2 only: Zen 2's values, not measured on them (Zen 1 has the same L1d
    // and L2; its 256-bit FMAs are split in two, which halves the peak, not the blocking).
    static constexpr packed_blocking other{"zen2's values", 512, 72, 4096, 1024};
    static constexpr packed_blocking for_model(cpu_model m) {
        return m == cpu_model::zen2 ? zen2 : m == cpu_model::zen3 ? zen3 : other;
    }
};

template <class Isa>
struct gemm_packed_t {
    using isa = Isa;
    using batch = typename Isa::batch;
    using reg = typename Isa::reg;
    static constexpr index_t lanes = Isa::lanes;
    static constexpr index_t mr = Isa::mr;               // rows of a tile
    static constexpr index_t nv = Isa::nv;               // vectors across a tile
    static constexpr index_t nr = nv * lanes;            // columns of a tile
    static constexpr index_t a_ld = Isa::kc_cap + lanes; // row stride of packed A (nn, nt)
    static constexpr index_t tn_panel = Isa::kc_cap * lanes; // panel stride of packed A (tn)
    /// Columns of B one shared packing task covers, and the largest packed B (floats) a team shares.
    static constexpr index_t task_cols = 4 * nr;
    static constexpr index_t shared_b_max = index_t(1) << 22;
    /// The column split (packed_blocking::col_split_rows) also needs at least this many
    /// multiply-adds: configuration A's products (256 rows, 2^22-2^23) were 1% slower in its
    /// training step split by columns (Zen 5).
    static constexpr double col_split_min_work = double(1 << 24);
    /// Products of fewer multiply-adds split by rows pack B privately: each thread packs every panel
    /// itself, nothing claimed or waited for. On the 2-core Zen 5 VM the two vCPUs do not share an
    /// L3 (a 12 MiB buffer one thread had read came to the other at 16-28 GB/s, against 60-76 GB/s
    /// for the first thread reading it again), so half of a shared packed B reached each thread from
    /// the other's cache. Configuration A's step (its products 2^22-2^23 multiply-adds), one process
    /// alternating the two rules, medians of 20 rounds of 20 steps, three runs: 19.8 / 19.0 / 22.2 →
    /// 18.9 / 18.4 / 21.5 ms; B's step (12 rounds of 3) 213.0 → 212.1 ms. Sharing no product at
    /// all (the same way, another hour): B 188.4 → 187.2 ms, C's step (8 rounds) 641.7 → 643.4.
    static constexpr double shared_min_work = double(1 << 24);
    /// How far ahead (floats) copy_block prefetches its source.
    static constexpr index_t prefetch_distance = 2048;

    enum class form { nn, nt, tn };

    /// The blocking this machine gets (packed_tuning, by CPUID), chosen once per process.
    static const packed_blocking& tuning() {
        static const packed_blocking b = packed_tuning<Isa>::for_model(this_cpu_model());
        return b;
    }

    /// Depth of a K block: k cut into equal blocks of at most kc_max, rounded up to the lanes. It
    /// depends on k and the blocking alone, so every element of C sums over k in the same order
    /// whatever rows or columns a thread has.
    static index_t k_block(index_t k, index_t kc_max) {
        const index_t blocks = (k + kc_max - 1) / kc_max;
        return std::min(kc_max, ((k + blocks - 1) / blocks + lanes - 1) / lanes * lanes);
    }

    static void prefetch(const float* p) { _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T0); }

    /// A block of gemm_nn / gemm_nt: dst[r·a_ld + c] = src[r·ld + c] for r < rows, c < cols, zero up
    /// to rows_pad and cols_pad (a multiple of the lanes). Rows up to prefetch_rows are prefetched a
    /// few KiB ahead: one row is too short a run for the hardware prefetcher.
    static void copy_block(const float* src, index_t ld, index_t rows, index_t rows_pad, index_t cols, index_t cols_pad,
                           float* dst, index_t prefetch_rows) {
        const index_t ahead = std::clamp<index_t>(prefetch_distance / cols, 1, 64);
        for (index_t r = 0; r < rows_pad; ++r) {
            if (r + ahead < prefetch_rows)
                for (index_t c = 0; c < cols; c += 16) prefetch(src + (r + ahead) * ld + c);
            for (index_t c = 0; c < cols_pad; c += lanes)
                Isa::store(dst + r * a_ld + c, r < rows ? Isa::load_partial(src + r * ld + c, cols - c) : Isa::zero());
        }
    }

    /// A block of gemm_tn, [kb, mb] of A [K, M] (stride ld), as panels of mr columns, panel q at
    /// dst + q·tn_panel holding dst[p·lanes + i] = src[p·ld + q·mr + i] for i < mr (zero past mb;
    /// lanes mr..lanes-1 of each row are padding the tile never reads). 16 rows at a time across the
    /// panels, the next 16 prefetched. Each row of a panel is one aligned vector store: with rows mr
    /// floats apart (56 bytes on AVX-512) most stores crossed a cache line, and this copy was 2.7% of
    /// configuration B's training step (perf, Zen 5).
    static void pack_a_cols(const float* src, index_t ld, index_t kb, index_t mb, float* dst) {
        static_assert(lanes >= mr);
        for (index_t p0 = 0; p0 < kb; p0 += 16) {
            const index_t p1 = std::min(kb, p0 + 16);
            for (index_t i = 0; i < mb; i += mr) {
                float* d = dst + (i / mr) * tn_panel;
                for (index_t p = p1; p < std::min(kb, p1 + 16); ++p) prefetch(src + p * ld + i);
                for (index_t p = p0; p < p1; ++p)
                    Isa::store(d + p * lanes, Isa::load_partial(src + p * ld + i, std::min(mr, mb - i)));
            }
        }
    }

    /// Columns [0, w) of a B block [kb, ·] of B [K, N] (stride ld, nn and tn) as panels of nr
    /// columns, panel q at dst + q·nr·kb holding dst[p·nr + j] = src[p·ld + q·nr + j], zero past w.
    /// 16 rows at a time across the panels, the next 16 prefetched: the source is read in long runs
    /// and each panel gets 16 rows at once (row by row, the panels' lines, kb·nr floats apart, would
    /// fight over a few cache sets).
    static void pack_b_rows(const float* src, index_t ld, index_t kb, index_t w, float* dst) {
        for (index_t p0 = 0; p0 < kb; p0 += 16) {
            const index_t p1 = std::min(kb, p0 + 16);
            for (index_t j = 0; j < w; j += nr) {
                for (index_t p = p1; p < std::min(kb, p1 + 16); ++p)
                    for (index_t v = 0; v < nr; v += 16) prefetch(src + p * ld + j + v);
                for (index_t p = p0; p < p1; ++p) {
                    float* d = dst + j * kb + p * nr;
#pragma GCC unroll 4
                    for (index_t v = 0; v < nv; ++v) Isa::store(d + v * lanes, Isa::load_partial(src + p * ld + j + v * lanes, w - j - v * lanes));
                }
            }
        }
    }

    /// One panel of B [N, K] (gemm_nt): dst[p·nr + j] = src[j·ld + p] for j < rows (≤ nr), p < kb,
    /// zero for rows ≤ j < nr; lanes × lanes blocks transposed in registers, the next rows (up to
    /// prefetch_rows) prefetched meanwhile.
    static void pack_b_transposed(const float* src, index_t ld, index_t rows, index_t kb, float* dst, index_t prefetch_rows) {
        for (index_t r0 = 0; r0 < nr; r0 += lanes)
            for (index_t c0 = 0; c0 < kb; c0 += lanes) {
                reg x[lanes];
                for (index_t j = 0; j < lanes; ++j) {
                    if (r0 + lanes + j < prefetch_rows) prefetch(src + (r0 + lanes + j) * ld + c0);
                    x[j] = r0 + j < rows ? Isa::load_partial(src + (r0 + j) * ld + c0, kb - c0) : Isa::zero();
                }
                Isa::transpose(x);
                for (index_t d = 0; d < std::min(lanes, kb - c0); ++d) Isa::store(dst + (c0 + d) * nr + r0, x[d]);
            }
    }

    /// C ← alpha·acc + prev for one vector of C, prev = beta·C (load_c) or 0: the one formula of full
    /// and partial tiles (multiplications by 1 are skipped, which changes no bit). The last K block
    /// of a product with a bias then adds the bias's vector to that, the same sum as adding it after
    /// the product (elementwise::add_bias_rows).
    struct update {
        batch va, vb;
        bool unit_alpha, unit_beta, load_c;
        update(float alpha, float beta, bool load)
            : va(alpha), vb(beta), unit_alpha(alpha == 1.0f), unit_beta(beta == 1.0f), load_c(load) {}
        batch operator()(const batch& acc, const batch& c) const {
            if (!load_c) return unit_alpha ? acc : va * acc;
            return simd::fma(va, acc, unit_beta ? c : vb * c);
        }
    };

    /// The micro-kernel: acc[i][j] = Σ_{p<kb} a[i·IS + p·PS] · b[p·nr + j] for a tile of MR × nr
    /// (MR ≤ mr rows of a panel packed for mr), then C updated. Full tiles store straight to C;
    /// partial ones (rows < MR or cols < nr: packed with zeros) go through a copy of the accumulators
    /// and partial loads and stores. Out of line, so that the accumulators have the registers to
    /// themselves. tile_rows picks MR; each element's sum is the same FMA chain over k whatever MR.
    /// bias (null: none): the tile's columns of a row vector added to every row after the update.
    template <index_t IS, index_t PS, index_t MR = mr>
    [[gnu::noinline]] static void tile(index_t kb, const float* a, const float* b, float* c, index_t ldc, index_t rows,
                                       index_t cols, const update& up, const float* bias) {
        static_assert(MR >= 1 && MR <= mr);
        batch acc[MR][nv];
#pragma GCC unroll 16
        for (index_t i = 0; i < MR; ++i)
#pragma GCC unroll 2
            for (index_t v = 0; v < nv; ++v) acc[i][v] = batch(0.0f);
        // C's lines for the update, asked for with intent to write while the k loop runs. Zen 5,
        // steps alternated in one process: configuration B's training step 1.7-2.7% and C's
        // 1.4-3.2% faster than without (A's 0.1-0.8%), and 0.5-2.8% faster than the same prefetch
        // for reading (which is what g++ emits for a target without PRFCHW, such as
        // -march=x86-64-v3).
#pragma GCC unroll 16
        for (index_t i = 0; i < MR; ++i)
            if (i < rows) simd::prefetch_for_write(c + i * ldc, cols);
        // One step over k: nv vectors of B, MR broadcasts of A, MR·nv FMAs.
        const auto step = [&](index_t p) [[gnu::always_inline]] {
            batch bv[nv];
#pragma GCC unroll 2
            for (index_t v = 0; v < nv; ++v) bv[v] = batch::load_aligned(b + p * nr + v * lanes);
#pragma GCC unroll 16
            for (index_t i = 0; i < MR; ++i) {
                const batch ai(a[i * IS + p * PS]);
#pragma GCC unroll 2
                for (index_t v = 0; v < nv; ++v) acc[i][v] = simd::fma(ai, bv[v], acc[i][v]);
            }
        };
        if constexpr (Isa::unroll_k) {
#pragma GCC unroll 4
            for (index_t p = 0; p < kb; ++p) step(p);
        } else {
            for (index_t p = 0; p < kb; ++p) step(p);
        }
        if (rows == MR && cols == nr) {
            if (bias) {
                batch bv[nv];
#pragma GCC unroll 2
                for (index_t v = 0; v < nv; ++v) bv[v] = batch::load_unaligned(bias + v * lanes);
#pragma GCC unroll 16
                for (index_t i = 0; i < MR; ++i)
#pragma GCC unroll 2
                    for (index_t v = 0; v < nv; ++v) {
                        float* cp = c + i * ldc + v * lanes;
                        (up(acc[i][v], up.load_c ? batch::load_unaligned(cp) : batch(0.0f)) + bv[v]).store_unaligned(cp);
                    }
                return;
            }
#pragma GCC unroll 16
            for (index_t i = 0; i < MR; ++i)
#pragma GCC unroll 2
                for (index_t v = 0; v < nv; ++v) {
                    float* cp = c + i * ldc + v * lanes;
                    up(acc[i][v], up.load_c ? batch::load_unaligned(cp) : batch(0.0f)).store_unaligned(cp);
                }
            return;
        }
        alignas(64) float t[MR * nr];
#pragma GCC unroll 16
        for (index_t i = 0; i < MR; ++i)
#pragma GCC unroll 2
            for (index_t v = 0; v < nv; ++v) acc[i][v].store_aligned(t + i * nr + v * lanes);
        for (index_t i = 0; i < rows; ++i)
            for (index_t v = 0; v * lanes < cols; ++v) {
                float* cp = c + i * ldc + v * lanes;
                const index_t w = cols - v * lanes;
                const batch prev = up.load_c ? batch(Isa::load_partial(cp, w)) : batch(0.0f);
                batch r = up(batch::load_aligned(t + i * nr + v * lanes), prev);
                if (bias) r = r + batch(Isa::load_partial(bias + v * lanes, w));
                Isa::store_partial(cp, w, r);
            }
    }

    /// tile<IS, PS, MR> for a tile of `rows` rows: MR = mr for a full one, else the least of mr − 2,
    /// mr − 4, … that holds them (both ISAs' mr are even: a 1-row tile runs as 2, whose extra FMA
    /// chains cost no extra loads of B).
    template <index_t IS, index_t PS, index_t MR = mr>
    static void tile_rows(index_t kb, const float* a, const float* b, float* c, index_t ldc, index_t rows, index_t cols,
                          const update& up, const float* bias) {
        if constexpr (MR > 2)
            if (rows <= MR - 2) return tile_rows<IS, PS, MR - 2>(kb, a, b, c, ldc, rows, cols, up, bias);
        tile<IS, PS, MR>(kb, a, b, c, ldc, rows, cols, up, bias);
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
    /// threads, blocked by `bl` (this machine's tuning() unless given). beta = 0 overwrites C
    /// whatever it holds. `band` (an attention head's causal band, C's rows the queries): tiles skip
    /// what no row of theirs sees. nt (scores, C [queries, keys]): tiles of keys beyond every row's
    /// band are left unwritten. nn (context, k the keys): op(A)[i, p] is zero for p ≥ band.end(i + 1),
    /// so a tile's k loop stops at its last row's end. tn (C [keys, ·], k the queries): op(A)[j, p]
    /// is zero for p < band.first_query(j), so a tile's k loop starts at its first row's. Only exact
    /// zeros are skipped: the sums are those of the whole product but the sign of a zero.
    /// `bias` (null: none; a band is then not used): bias[j] added to C's column j after the product, as the
    /// tiles of the last K block store C (a linear layer's y = x·Wᵀ + b in one pass over y).
    template <form F>
    static void run(index_t m, index_t n, index_t k, const float* a, index_t lda, const float* b, index_t ldb, float* c,
                    index_t ldc, float beta, float alpha, int threads, const packed_blocking& bl = tuning(),
                    causal_keys band = {}, const float* bias = nullptr) {
        if (m <= 0 || n <= 0) return;
        if (k <= 0) {
            for (index_t i = 0; i < m; ++i)
                for (index_t j = 0; j < n; ++j) {
                    const float prev = beta == 0.0f ? 0.0f : beta * c[i * ldc + j];
                    c[i * ldc + j] = bias ? prev + bias[j] : prev;
                }
            return;
        }
        // Packed A: row i of a panel at a[i·a_ld] (nn, nt), or column p at a[p·lanes] (tn); panels
        // mr·a_ld (nn, nt) or tn_panel (tn) floats apart.
        constexpr index_t a_stride_i = F == form::tn ? 1 : a_ld, a_stride_p = F == form::tn ? lanes : 1;
        constexpr index_t a_panel = F == form::tn ? tn_panel : mr * a_ld;
        const index_t kc_max = std::min(bl.kc, Isa::kc_cap), mc_max = bl.mc, nc_max = bl.nc;
        const index_t kc = k_block(k, kc_max), nc = std::min(nc_max, (n + nr - 1) / nr * nr);
        const index_t tiles = (m + mr - 1) / mr;
        threads = int(std::min<index_t>(threads, tiles));
        const index_t blocks = (k + kc - 1) / kc * ((n + nc - 1) / nc), tasks = (nc + task_cols - 1) / task_cols;
        const double work = double(m) * double(n) * double(k);
        // Up to bl.col_split_rows rows, the threads take C's columns instead (see packed_blocking).
        const bool by_cols =
            threads > 1 && m <= bl.col_split_rows && n >= 2 * nr * threads && work >= col_split_min_work;
        const bool shared = threads > 1 && !by_cols && work >= shared_min_work && blocks * kc * nc <= shared_b_max;
        const bool banded = !band.none() && !bias;  // with a bias every tile is computed and stored
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
            float* ap = thread_buffer(0, std::max<index_t>(1, (mc + mr - 1) / mr) * a_panel);
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
                    const float* block_bias = pc + kb >= k ? bias : nullptr;  // after the last K block
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
                                for (index_t ir = 0; ir < mb; ir += mr) {
                                    const index_t rows = std::min(mr, mb - ir);
                                    index_t skip = 0, depth = kb;  // the tile's part of this K block
                                    if (banded) {
                                        const index_t i0 = ic + ir, i1 = i0 + rows;
                                        if constexpr (F == form::nt) {
                                            if (jc + jr >= band.end(i1)) continue;  // no row sees these keys
                                        } else if constexpr (F == form::nn) {
                                            depth = std::clamp<index_t>(band.end(i1) - pc, 0, kb);
                                        } else {
                                            skip = std::clamp<index_t>(band.first_query(i0) - pc, 0, kb);
                                            depth = kb - skip;
                                        }
                                        if (depth == 0 && up.load_c) continue;  // adds nothing to C
                                    }
                                    tile_rows<a_stride_i, a_stride_p>(depth, ap + ir / mr * a_panel + skip * a_stride_p,
                                                                      panels + (jr - j0) * kb + skip * nr,
                                                                      c + (ic + ir) * ldc + jc + jr, ldc, rows,
                                                                      std::min(nr, nb - jr), up,
                                                                      block_bias ? block_bias + jc + jr : nullptr);
                                }
                        }
                    }
                }
            }
        };
        if (threads <= 1) {
            body(0, 1);
            return;
        }
        parallel_team(threads, [&](index_t t, index_t nt) { body(int(t), int(nt)); });
    }
};

#ifdef __AVX512F__
using gemm_packed = gemm_packed_t<packed_isa_avx512>;
#else
using gemm_packed = gemm_packed_t<packed_isa_avx2>;
#endif

}  // namespace mnemo::cpu_kernels
#endif
