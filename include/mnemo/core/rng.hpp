#pragma once
// Counter-based random numbers (Philox4x32-10, Salmon et al., SC'11): the i-th number of stream
// (seed, offset) is a pure function of (seed, offset + i), so dropout can re-derive its mask in
// backward instead of storing it, any thread can draw any element, and a checkpoint of the RNG is
// just (seed, offset).
#include <array>
#include <cmath>
#include <cstdint>

namespace mnemo {

struct philox4x32 {
    using counter = std::array<std::uint32_t, 4>;
    using key = std::array<std::uint32_t, 2>;

    static constexpr counter round(counter c, key k) {
        constexpr std::uint64_t m0 = 0xD2511F53u, m1 = 0xCD9E8D57u;
        const std::uint64_t p0 = m0 * c[0], p1 = m1 * c[2];
        return {static_cast<std::uint32_t>(p1 >> 32) ^ c[1] ^ k[0], static_cast<std::uint32_t>(p1),
                static_cast<std::uint32_t>(p0 >> 32) ^ c[3] ^ k[1], static_cast<std::uint32_t>(p0)};
    }
    /// Ten rounds of Philox4x32 on counter c with key k.
    static constexpr counter generate(counter c, key k) {
        for (int r = 0; r < 10; ++r) {
            c = round(c, k);
            if (r < 9) { k[0] += 0x9E3779B9u; k[1] += 0xBB67AE85u; }
        }
        return c;
    }
};

/// The 32-bit random word number `index` of stream `seed`.
constexpr std::uint32_t random_u32(std::uint64_t seed, std::uint64_t index) {
    const philox4x32::counter c{static_cast<std::uint32_t>(index >> 2), static_cast<std::uint32_t>(index >> 34), 0u, 0u};
    const philox4x32::key k{static_cast<std::uint32_t>(seed), static_cast<std::uint32_t>(seed >> 32)};
    return philox4x32::generate(c, k)[index & 3u];
}

/// Uniform in [0, 1) with 24 random bits (exactly representable in float).
constexpr float random_uniform(std::uint64_t seed, std::uint64_t index) {
    return static_cast<float>(random_u32(seed, index) >> 8) * (1.0f / 16777216.0f);
}

/// A sequential stream over the counter-based generator: (seed, offset) is its whole state.
class rng {
public:
    explicit rng(std::uint64_t seed = 0, std::uint64_t offset = 0) : seed_(seed), offset_(offset) {}
    std::uint32_t next_u32() { return random_u32(seed_, offset_++); }
    /// Uniform in [0, 1).
    double uniform() {
        const std::uint64_t hi = next_u32() >> 5, lo = next_u32() >> 6;  // 53 bits
        return static_cast<double>((hi << 26) | lo) * (1.0 / 9007199254740992.0);
    }
    double uniform(double a, double b) { return a + (b - a) * uniform(); }
    /// Standard normal (Box–Muller).
    double normal() {
        double u1 = uniform();
        while (u1 <= 0.0) u1 = uniform();
        const double u2 = uniform();
        return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
    }
    std::uint64_t seed() const { return seed_; }
    std::uint64_t offset() const { return offset_; }
    void set_state(std::uint64_t seed, std::uint64_t offset) { seed_ = seed; offset_ = offset; }

private:
    std::uint64_t seed_;
    std::uint64_t offset_;
};

}  // namespace mnemo
