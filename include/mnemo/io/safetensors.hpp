#pragma once
// Checkpoints in the safetensors format (Hugging Face), readable by PyTorch, JAX and candle:
//
//   [8 bytes]  N, little-endian u64: the length of the header
//   [N bytes]  JSON header, padded with spaces:
//              {"__metadata__": {"k": "v", ...},                       (optional, strings only)
//               "name": {"dtype": "F32", "shape": [4, 3], "data_offsets": [begin, end]}, ...}
//   [rest]     the data section; offsets are relative to its start, tensors are row-major and
//              little-endian, and together they must cover the data section exactly.
//
// Reading treats the file as hostile: every number in the header is checked before it is used
// (the header length against a 100 MB limit and the file, each range against the data section,
// each range length against dtype and shape, the ranges against each other), and every error is
// a mnemo::error naming the file, the tensor and the problem. Nothing is read out of bounds.
//
// Writing is atomic: the file is written to "<path>.tmp.<pid>" in the same directory, flushed and
// fsync'ed, renamed over the target, and the directory is fsync'ed, so a crash or a full disk
// leaves either the previous checkpoint or the new one, never a torn file. POSIX only.
//
// save_parameters / load_parameters connect a parameter_set (names are PyTorch state_dict names)
// to a file; safetensors_writer adds arbitrary extra tensors (optimizer moments, step counters).
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <limits>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <system_error>
#include <type_traits>
#include <utility>
#include <vector>

#include "../core/error.hpp"
#include "json.hpp"
#include "../core/parameters.hpp"
#include "../core/shape.hpp"

namespace mnemo {

// ---------------------------------------------------------------------------------------------
// Element types
// ---------------------------------------------------------------------------------------------

/// The element types of the safetensors format (spelled as in the file: "F32", "BF16", "BOOL"...).
enum class dtype : std::uint8_t {
    boolean, u8, i8, f8_e5m2, f8_e4m3, i16, u16, f16, bf16, i32, u32, f32, i64, u64, f64
};

inline constexpr dtype all_dtypes[] = {dtype::boolean, dtype::u8,  dtype::i8,  dtype::f8_e5m2, dtype::f8_e4m3,
                                       dtype::i16,     dtype::u16, dtype::f16, dtype::bf16,    dtype::i32,
                                       dtype::u32,     dtype::f32, dtype::i64, dtype::u64,     dtype::f64};

/// The name the file uses for `t`.
constexpr std::string_view dtype_name(dtype t) {
    switch (t) {
        case dtype::boolean: return "BOOL";
        case dtype::u8: return "U8";
        case dtype::i8: return "I8";
        case dtype::f8_e5m2: return "F8_E5M2";
        case dtype::f8_e4m3: return "F8_E4M3";
        case dtype::i16: return "I16";
        case dtype::u16: return "U16";
        case dtype::f16: return "F16";
        case dtype::bf16: return "BF16";
        case dtype::i32: return "I32";
        case dtype::u32: return "U32";
        case dtype::f32: return "F32";
        case dtype::i64: return "I64";
        case dtype::u64: return "U64";
        case dtype::f64: return "F64";
    }
    return "?";
}

/// Bytes per element.
constexpr std::size_t dtype_size(dtype t) {
    switch (t) {
        case dtype::boolean:
        case dtype::u8:
        case dtype::i8:
        case dtype::f8_e5m2:
        case dtype::f8_e4m3: return 1;
        case dtype::i16:
        case dtype::u16:
        case dtype::f16:
        case dtype::bf16: return 2;
        case dtype::i32:
        case dtype::u32:
        case dtype::f32: return 4;
        case dtype::i64:
        case dtype::u64:
        case dtype::f64: return 8;
    }
    return 0;
}

/// The dtype named `name` ("F32"), or nothing for a name the format does not define.
constexpr std::optional<dtype> parse_dtype(std::string_view name) {
    for (dtype t : all_dtypes)
        if (dtype_name(t) == name) return t;
    return std::nullopt;
}

/// Floating-point dtypes mnemo converts to and from float/double (the F8 types are read and
/// written as raw bytes only).
constexpr bool is_convertible_float(dtype t) {
    return t == dtype::f64 || t == dtype::f32 || t == dtype::f16 || t == dtype::bf16;
}
/// Integer dtypes mnemo converts to int64.
constexpr bool is_convertible_integer(dtype t) {
    return t == dtype::boolean || t == dtype::u8 || t == dtype::i8 || t == dtype::i16 || t == dtype::u16 ||
           t == dtype::i32 || t == dtype::u32 || t == dtype::i64 || t == dtype::u64;
}

/// dtype_of<T>::value: the dtype of the C++ element type T.
template <class T>
struct dtype_of {
    static_assert(sizeof(T) == 0,
                  "mnemo: no safetensors dtype for this element type (use float, double, bool or a "
                  "<cstdint> integer type)");
};
template <> struct dtype_of<float> { static constexpr dtype value = dtype::f32; };
template <> struct dtype_of<double> { static constexpr dtype value = dtype::f64; };
template <> struct dtype_of<bool> { static constexpr dtype value = dtype::boolean; };
template <> struct dtype_of<std::int8_t> { static constexpr dtype value = dtype::i8; };
template <> struct dtype_of<std::int16_t> { static constexpr dtype value = dtype::i16; };
template <> struct dtype_of<std::int32_t> { static constexpr dtype value = dtype::i32; };
template <> struct dtype_of<std::int64_t> { static constexpr dtype value = dtype::i64; };
template <> struct dtype_of<std::uint8_t> { static constexpr dtype value = dtype::u8; };
template <> struct dtype_of<std::uint16_t> { static constexpr dtype value = dtype::u16; };
template <> struct dtype_of<std::uint32_t> { static constexpr dtype value = dtype::u32; };
template <> struct dtype_of<std::uint64_t> { static constexpr dtype value = dtype::u64; };

template <class T>
inline constexpr dtype native_dtype = dtype_of<std::remove_cv_t<T>>::value;

static_assert(sizeof(bool) == 1 && sizeof(float) == 4 && sizeof(double) == 8 && std::numeric_limits<float>::is_iec559 &&
                  std::numeric_limits<double>::is_iec559,
              "mnemo: safetensors I/O assumes IEEE-754 float and double and a one-byte bool");

// ---------------------------------------------------------------------------------------------
// F16 and BF16 conversions (bit patterns held in uint16)
// ---------------------------------------------------------------------------------------------

/// IEEE binary16 bits to float (exact: every half is a float).
inline float half_to_float(std::uint16_t h) {
    const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
    const std::uint32_t exp = (h >> 10) & 0x1Fu, mant = h & 0x3FFu;
    if (exp == 0) {  // zero or subnormal: mant * 2^-24
        const float mag = static_cast<float>(mant) * 0x1p-24f;
        return sign ? -mag : mag;
    }
    if (exp == 31) return std::bit_cast<float>(sign | 0x7F800000u | (mant << 13));  // inf, NaN (payload kept)
    return std::bit_cast<float>(sign | ((exp + 112u) << 23) | (mant << 13));
}

/// bfloat16 bits to float (exact: bf16 is the top half of a float).
inline float bf16_to_float(std::uint16_t h) { return std::bit_cast<float>(static_cast<std::uint32_t>(h) << 16); }

namespace detail {
// Rounds x to the nearest value of a binary format with MantBits stored mantissa bits and
// ExpBits exponent bits (ties to even, overflow to infinity, subnormals kept), independent of the
// current floating-point rounding mode. Works from double so that double -> half rounds once.
template <int MantBits, int ExpBits>
inline std::uint16_t round_to_narrow_float(double x) {
    constexpr int bias = (1 << (ExpBits - 1)) - 1;
    constexpr int emin = 1 - bias;  // exponent of the smallest normal
    constexpr std::uint32_t inf_bits = ((1u << ExpBits) - 1u) << MantBits;
    const std::uint32_t sign = std::signbit(x) ? 0x8000u : 0u;
    if (std::isnan(x)) return static_cast<std::uint16_t>(sign | inf_bits | (1u << (MantBits - 1)));  // quiet NaN
    const double a = std::fabs(x);
    if (std::isinf(a)) return static_cast<std::uint16_t>(sign | inf_bits);
    if (a == 0.0) return static_cast<std::uint16_t>(sign);
    int e = 0;
    std::frexp(a, &e);                              // a in [2^(e-1), 2^e)
    const int ex = std::max(e - 1, emin);           // subnormals share the quantum of the smallest normal
    const double q = std::ldexp(a, MantBits - ex);  // a in units of the quantum 2^(ex - MantBits); exact
    double r = std::floor(q);
    const double frac = q - r;  // exact
    if (frac > 0.5 || (frac == 0.5 && std::fmod(r, 2.0) != 0.0)) r += 1.0;
    // (ex + bias - 1) << M plus the significand (hidden bit included) gives the encoding, and also
    // carries correctly when rounding reaches the next binade or leaves the subnormal range.
    const std::int64_t bits = (static_cast<std::int64_t>(ex + bias - 1) << MantBits) + static_cast<std::int64_t>(r);
    if (bits >= static_cast<std::int64_t>(inf_bits)) return static_cast<std::uint16_t>(sign | inf_bits);
    return static_cast<std::uint16_t>(sign | static_cast<std::uint32_t>(bits));
}
}  // namespace detail

/// x rounded to IEEE binary16 (nearest, ties to even; beyond 65504 to infinity).
inline std::uint16_t to_half_bits(double x) { return detail::round_to_narrow_float<10, 5>(x); }
/// x rounded to bfloat16 (nearest, ties to even).
inline std::uint16_t to_bf16_bits(double x) { return detail::round_to_narrow_float<7, 8>(x); }

// ---------------------------------------------------------------------------------------------
// Records
// ---------------------------------------------------------------------------------------------

/// "[4, 3]"; "[]" for a scalar.
template <class Int>
inline std::string shape_string(const std::vector<Int>& shape) {
    std::string s = "[";
    for (std::size_t i = 0; i < shape.size(); ++i) {
        if (i) s += ", ";
        s += std::to_string(shape[i]);
    }
    return s + "]";
}

/// String metadata kept in the header's "__metadata__" object.
using safetensors_metadata = std::map<std::string, std::string>;

/// One tensor of a file: its raw little-endian, row-major bytes.
struct safetensors_tensor {
    std::string name;
    dtype type = dtype::f32;
    std::vector<std::int64_t> shape;
    std::vector<std::uint8_t> bytes;

    /// Product of the shape (1 for a scalar).
    std::int64_t numel() const {
        std::int64_t n = 1;
        for (std::int64_t d : shape) n *= d;
        return n;
    }
};

namespace detail {

inline std::string errno_text(int e) { return std::generic_category().message(e); }

/// fsync of the directory holding `file`, so that a rename into it is durable.
inline void sync_directory_of(const std::string& file) {
    std::filesystem::path dir = std::filesystem::path(file).parent_path();
    if (dir.empty()) dir = ".";
    const int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dfd < 0) {
        const int e = errno;
        fail("cannot open the directory '", dir.string(), "' of '", file, "' to make a rename durable: ",
             errno_text(e));
    }
    const int rc = ::fsync(dfd);
    const int e = errno;
    ::close(dfd);
    // EINVAL: the file system cannot sync directories; there is nothing more to do.
    if (rc != 0 && e != EINVAL)
        fail("fsync of the directory '", dir.string(), "' of '", file, "' failed: ", errno_text(e));
}

template <class U>
inline U byteswap_unsigned(U u) {
    U r = 0;
    for (std::size_t i = 0; i < sizeof(U); ++i) {
        r = static_cast<U>((r << 8) | (u & 0xFFu));
        u = static_cast<U>(u >> 8);
    }
    return r;
}

/// Unsigned integer of sizeof U stored little-endian at p.
template <class U>
inline U load_le(const std::uint8_t* p) {
    U u;
    std::memcpy(&u, p, sizeof(U));
    if constexpr (std::endian::native == std::endian::big) u = byteswap_unsigned(u);
    return u;
}

template <class U>
inline void store_le(std::uint8_t* p, U u) {
    if constexpr (std::endian::native == std::endian::big) u = byteswap_unsigned(u);
    std::memcpy(p, &u, sizeof(U));
}

/// n host-order elements of `elem` bytes each to little-endian bytes.
inline void host_to_le(std::uint8_t* out, const std::uint8_t* in, std::size_t elem, std::size_t n) {
    if constexpr (std::endian::native == std::endian::little) {
        if (n) std::memcpy(out, in, elem * n);
    } else {
        for (std::size_t i = 0; i < n; ++i)
            for (std::size_t b = 0; b < elem; ++b) out[i * elem + b] = in[i * elem + elem - 1 - b];
    }
}

/// Number of elements of `shape` times `elem` bytes, or nothing on overflow of int64.
inline std::optional<std::uint64_t> byte_count(const std::vector<std::int64_t>& shape, std::size_t elem) {
    constexpr std::uint64_t limit = static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max());
    std::uint64_t n = elem;
    bool overflow = false;
    for (std::int64_t d : shape) {
        if (d < 0) return std::nullopt;
        if (d == 0) return 0;  // an empty tensor, however large its other extents
        const auto u = static_cast<std::uint64_t>(d);
        if (n > limit / u)
            overflow = true;
        else
            n *= u;
    }
    if (overflow) return std::nullopt;
    return n;
}

/// Decodes n little-endian elements of type `src` to floating T. Precondition: is_convertible_float(src).
template <class T>
inline void decode_float(dtype src, const std::uint8_t* in, T* out, std::size_t n) {
    switch (src) {
        case dtype::f64:
            for (std::size_t i = 0; i < n; ++i)
                out[i] = static_cast<T>(std::bit_cast<double>(load_le<std::uint64_t>(in + 8 * i)));
            return;
        case dtype::f32:
            for (std::size_t i = 0; i < n; ++i)
                out[i] = static_cast<T>(std::bit_cast<float>(load_le<std::uint32_t>(in + 4 * i)));
            return;
        case dtype::f16:
            for (std::size_t i = 0; i < n; ++i)
                out[i] = static_cast<T>(half_to_float(load_le<std::uint16_t>(in + 2 * i)));
            return;
        case dtype::bf16:
            for (std::size_t i = 0; i < n; ++i)
                out[i] = static_cast<T>(bf16_to_float(load_le<std::uint16_t>(in + 2 * i)));
            return;
        default: fail("safetensors: internal error: decode_float from ", dtype_name(src));
    }
}

/// Decodes n little-endian integers of type `src` to int64; returns the index of the first U64
/// value above INT64_MAX, or n. Precondition: is_convertible_integer(src).
inline std::size_t decode_integer(dtype src, const std::uint8_t* in, std::int64_t* out, std::size_t n) {
    for (std::size_t i = 0; i < n; ++i) {
        switch (src) {
            case dtype::boolean:
            case dtype::u8: out[i] = in[i]; break;
            case dtype::i8: out[i] = static_cast<std::int8_t>(in[i]); break;
            case dtype::i16: out[i] = static_cast<std::int16_t>(load_le<std::uint16_t>(in + 2 * i)); break;
            case dtype::u16: out[i] = load_le<std::uint16_t>(in + 2 * i); break;
            case dtype::i32: out[i] = static_cast<std::int32_t>(load_le<std::uint32_t>(in + 4 * i)); break;
            case dtype::u32: out[i] = load_le<std::uint32_t>(in + 4 * i); break;
            case dtype::i64: out[i] = static_cast<std::int64_t>(load_le<std::uint64_t>(in + 8 * i)); break;
            case dtype::u64: {
                const auto u = load_le<std::uint64_t>(in + 8 * i);
                if (u > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max())) return i;
                out[i] = static_cast<std::int64_t>(u);
                break;
            }
            default: fail("safetensors: internal error: decode_integer from ", dtype_name(src));
        }
    }
    return n;
}

/// Encodes n host floats or doubles (`src` is f32 or f64) as `dst` (a convertible float dtype).
inline void encode_float(dtype src, const void* in, std::size_t first, std::size_t n, dtype dst, std::uint8_t* out) {
    const auto x = [&](std::size_t i) -> double {
        return src == dtype::f32 ? static_cast<double>(static_cast<const float*>(in)[first + i])
                                 : static_cast<const double*>(in)[first + i];
    };
    switch (dst) {
        case dtype::f64:
            for (std::size_t i = 0; i < n; ++i) store_le(out + 8 * i, std::bit_cast<std::uint64_t>(x(i)));
            return;
        case dtype::f32:
            for (std::size_t i = 0; i < n; ++i)
                store_le(out + 4 * i, std::bit_cast<std::uint32_t>(static_cast<float>(x(i))));
            return;
        case dtype::f16:
            for (std::size_t i = 0; i < n; ++i) store_le(out + 2 * i, to_half_bits(x(i)));
            return;
        case dtype::bf16:
            for (std::size_t i = 0; i < n; ++i) store_le(out + 2 * i, to_bf16_bits(x(i)));
            return;
        default: fail("safetensors: internal error: encode_float to ", dtype_name(dst));
    }
}

class safetensors_loader;

}  // namespace detail

// ---------------------------------------------------------------------------------------------
// Reading
// ---------------------------------------------------------------------------------------------

/// A loaded, validated safetensors file: its tensors in header order, lookup by name, and the
/// "__metadata__" strings.
class safetensors_file {
public:
    safetensors_file() = default;

    /// The path (or the name given to parse_safetensors) the tensors came from.
    const std::string& path() const { return path_; }
    const std::vector<safetensors_tensor>& tensors() const { return tensors_; }
    const safetensors_metadata& metadata() const { return metadata_; }
    std::size_t size() const { return tensors_.size(); }

    bool contains(std::string_view name) const { return index_.find(name) != index_.end(); }
    /// The tensor named `name`, or nullptr.
    const safetensors_tensor* find(std::string_view name) const {
        const auto it = index_.find(name);
        return it == index_.end() ? nullptr : &tensors_[it->second];
    }
    /// The tensor named `name`; throws naming the tensor and the file when there is none.
    const safetensors_tensor& at(std::string_view name) const {
        const safetensors_tensor* t = find(name);
        if (!t) detail::fail("safetensors: no tensor '", name, "' in '", path_, "'");
        return *t;
    }

    /// Copies tensor `name` into dst[0, count), converted to T. T is float or double (the tensor
    /// must be F64, F32, F16 or BF16) or std::int64_t (the tensor must be an integer or BOOL);
    /// count must equal the tensor's number of elements. Errors name the tensor and the file.
    template <class T>
    void copy_to(std::string_view name, T* dst, std::size_t count) const {
        static_assert(std::is_same_v<T, float> || std::is_same_v<T, double> || std::is_same_v<T, std::int64_t>,
                      "mnemo: safetensors_file::copy_to converts to float, double or std::int64_t");
        const safetensors_tensor& t = at(name);
        const auto n = static_cast<std::size_t>(t.numel());
        if (count != n)
            detail::fail("safetensors: tensor '", t.name, "' in '", path_, "' has ", n, " elements (shape ",
                         shape_string(t.shape), ") but the destination holds ", count);
        if constexpr (std::is_floating_point_v<T>) {
            if (!is_convertible_float(t.type))
                detail::fail("safetensors: tensor '", t.name, "' in '", path_, "' has dtype ", dtype_name(t.type),
                             ", which cannot be read as ", std::is_same_v<T, float> ? "float" : "double",
                             " (expected F64, F32, F16 or BF16)");
            detail::decode_float(t.type, t.bytes.data(), dst, n);
        } else {
            if (!is_convertible_integer(t.type))
                detail::fail("safetensors: tensor '", t.name, "' in '", path_, "' has dtype ", dtype_name(t.type),
                             ", which cannot be read as int64 (expected an integer dtype or BOOL)");
            const std::size_t bad = detail::decode_integer(t.type, t.bytes.data(), dst, n);
            if (bad != n)
                detail::fail("safetensors: tensor '", t.name, "' in '", path_, "': element ", bad,
                             " of the U64 tensor does not fit in int64");
        }
    }

    /// Tensor `name` converted to T (see copy_to).
    template <class T>
    std::vector<T> to_vector(std::string_view name) const {
        const safetensors_tensor& t = at(name);
        std::vector<T> out(static_cast<std::size_t>(t.numel()));
        copy_to(name, out.data(), out.size());
        return out;
    }

private:
    friend class detail::safetensors_loader;

    std::string path_;
    std::vector<safetensors_tensor> tensors_;
    std::map<std::string, std::size_t, std::less<>> index_;
    safetensors_metadata metadata_;
};

/// The reference implementation's limit: no real header comes close, and a corrupt length must
/// not make the reader allocate gigabytes.
inline constexpr std::uint64_t safetensors_max_header_bytes = 100'000'000;

namespace detail {

// Byte sources for the loader: a file (read with pread-like seeks) or a block of memory.
class safetensors_file_source {
public:
    safetensors_file_source(std::FILE* f, std::uint64_t size, const std::string& path)
        : f_(f), size_(size), path_(path) {}
    std::uint64_t size() const { return size_; }
    void read(std::uint64_t offset, void* dst, std::size_t n) const {
        if (n == 0) return;
        if (offset > static_cast<std::uint64_t>(std::numeric_limits<off_t>::max()) ||
            ::fseeko(f_, static_cast<off_t>(offset), SEEK_SET) != 0) {
            const int e = errno;
            fail("safetensors: cannot seek to byte ", offset, " of '", path_, "': ", errno_text(e));
        }
        errno = 0;
        if (std::fread(dst, 1, n, f_) != n) {
            const int e = errno;
            if (std::ferror(f_) && e != 0)
                fail("safetensors: read error in '", path_, "' at byte ", offset, ": ", errno_text(e));
            fail("safetensors: '", path_, "' ended early while reading bytes [", offset, ", ", offset + n,
                 ") (was it modified while being read?)");
        }
    }

private:
    std::FILE* f_;
    std::uint64_t size_;
    const std::string& path_;
};

class safetensors_memory_source {
public:
    safetensors_memory_source(const std::uint8_t* data, std::size_t size) : data_(data), size_(size) {}
    std::uint64_t size() const { return size_; }
    void read(std::uint64_t offset, void* dst, std::size_t n) const {
        if (n) std::memcpy(dst, data_ + offset, n);  // ranges are validated before any read
    }

private:
    const std::uint8_t* data_;
    std::size_t size_;
};

class safetensors_loader {
public:
    template <class Source>
    static safetensors_file load(const Source& src, const std::string& path) {
        safetensors_file file;
        file.path_ = path;
        const std::uint64_t file_size = src.size();
        if (file_size < 8)
            fail("safetensors: '", path, "' is truncated: it has ", file_size,
                 " bytes, fewer than the 8-byte header length that starts every safetensors file");
        std::uint8_t len_bytes[8];
        src.read(0, len_bytes, 8);
        const std::uint64_t header_len = load_le<std::uint64_t>(len_bytes);
        if (header_len > safetensors_max_header_bytes)
            fail("safetensors: '", path, "' declares a header of ", header_len, " bytes, more than the limit of ",
                 safetensors_max_header_bytes, " (corrupt, or not a safetensors file)");
        if (header_len > file_size - 8)
            fail("safetensors: '", path, "' declares a header of ", header_len, " bytes, but only ", file_size - 8,
                 " bytes follow the header length (the header length is beyond the end of the file: truncated, "
                 "or not a safetensors file)");
        if (header_len < 2)
            fail("safetensors: '", path, "' declares a header of ", header_len,
                 " bytes, too short for a JSON object (corrupt, or not a safetensors file)");
        std::string header(static_cast<std::size_t>(header_len), '\0');
        src.read(8, header.data(), header.size());
        const std::uint64_t data_begin = 8 + header_len;
        const std::uint64_t data_size = file_size - data_begin;

        // The spec requires the header to start with '{' (no leading whitespace).
        if (header[0] != '{') {
            const auto c = static_cast<unsigned char>(header[0]);
            fail("safetensors: '", path, "': the header is not a JSON object: it must begin with '{' but begins with ",
                 c >= 0x20 && c < 0x7F ? std::string("'") + header[0] + "'" : "byte " + std::to_string(c));
        }
        json::value root;
        try {
            root = json::parse(header);
        } catch (const json::parse_error& e) {
            fail("safetensors: '", path, "': malformed JSON at byte ", e.position(), " of the header (byte ",
                 e.position() + 8, " of the file): ", e.detail());
        }

        struct info {
            std::size_t index;  // in header order
            std::uint64_t begin, end;
        };
        std::vector<info> ranges;
        for (std::size_t i = 0; i < root.size(); ++i) {
            const std::string& name = root.key(i);
            const json::value& entry = root.member(i);
            if (name == "__metadata__") {
                read_metadata(entry, path, file.metadata_);
                continue;
            }
            safetensors_tensor t;
            const auto [begin, end] = read_entry(name, entry, data_size, path, t);
            ranges.push_back({file.tensors_.size(), begin, end});
            file.index_.emplace(name, file.tensors_.size());
            file.tensors_.push_back(std::move(t));
        }

        check_coverage(file, ranges, data_size, path);

        for (const info& r : ranges) {
            safetensors_tensor& t = file.tensors_[r.index];
            t.bytes.resize(static_cast<std::size_t>(r.end - r.begin));
            src.read(data_begin + r.begin, t.bytes.data(), t.bytes.size());
        }
        return file;
    }

private:
    static void read_metadata(const json::value& m, const std::string& path, safetensors_metadata& out) {
        if (!m.is_object())
            fail("safetensors: '", path, "': \"__metadata__\" must be an object of strings, but it is ",
                 json::kind_name(m.type()));
        for (std::size_t i = 0; i < m.size(); ++i) {
            if (!m.member(i).is_string())
                fail("safetensors: '", path, "': \"__metadata__\" must map strings to strings, but key '", m.key(i),
                     "' holds ", json::kind_name(m.member(i).type()));
            out.emplace(m.key(i), m.member(i).as_string());
        }
    }

    // Validates one tensor entry and fills t (without data); returns its [begin, end) range.
    static std::pair<std::uint64_t, std::uint64_t> read_entry(const std::string& name, const json::value& e,
                                                              std::uint64_t data_size, const std::string& path,
                                                              safetensors_tensor& t) {
        const auto bad = [&](auto&&... parts) {
            fail("safetensors: '", path, "': tensor '", name, "': ", std::forward<decltype(parts)>(parts)...);
        };
        if (name.empty()) fail("safetensors: '", path, "': a tensor has an empty name");
        if (!e.is_object())
            bad("the entry is ", json::kind_name(e.type()), ", expected an object with dtype, shape and data_offsets");
        for (std::size_t k = 0; k < e.size(); ++k) {
            const std::string& key = e.key(k);
            if (key != "dtype" && key != "shape" && key != "data_offsets")
                bad("unexpected key \"", key, "\" in the entry (allowed: dtype, shape, data_offsets)");
        }
        const json::value* dt = e.find("dtype");
        const json::value* sh = e.find("shape");
        const json::value* off = e.find("data_offsets");
        if (!dt) bad("the entry has no \"dtype\"");
        if (!sh) bad("the entry has no \"shape\"");
        if (!off) bad("the entry has no \"data_offsets\"");

        if (!dt->is_string()) bad("\"dtype\" must be a string, but it is ", json::kind_name(dt->type()));
        const std::optional<dtype> type = parse_dtype(dt->as_string());
        if (!type) bad("unknown dtype \"", dt->as_string(), "\"");
        t.name = name;
        t.type = *type;

        if (!sh->is_array()) bad("\"shape\" must be an array of integers, but it is ", json::kind_name(sh->type()));
        t.shape.reserve(sh->size());
        for (std::size_t k = 0; k < sh->size(); ++k) {
            const json::value& d = (*sh)[k];
            if (!d.is_integer())
                bad("extent ", k, " of the shape is not an integer (it is ",
                    d.is_number() ? "a non-integer number" : json::kind_name(d.type()), ")");
            if (d.as_int64() < 0) bad("extent ", k, " of the shape is negative (", d.as_int64(), ")");
            t.shape.push_back(d.as_int64());
        }
        const std::optional<std::uint64_t> nbytes = byte_count(t.shape, dtype_size(t.type));
        if (!nbytes) bad("shape ", shape_string(t.shape), " has too many elements");

        if (!off->is_array() || off->size() != 2)
            bad("\"data_offsets\" must be [begin, end], but it is ",
                off->is_array() ? "an array of " + std::to_string(off->size()) + " values"
                                : json::kind_name(off->type()));
        for (std::size_t k = 0; k < 2; ++k) {
            const json::value& o = (*off)[k];
            if (!o.is_integer() || o.as_int64() < 0)
                bad("data_offsets ", k == 0 ? "begin" : "end", " must be a non-negative integer");
        }
        const auto begin = static_cast<std::uint64_t>((*off)[0].as_int64());
        const auto end = static_cast<std::uint64_t>((*off)[1].as_int64());
        if (begin > end) bad("data_offsets [", begin, ", ", end, "] have begin > end");
        if (end > data_size)
            bad("data_offsets [", begin, ", ", end, "] are out of range of the data section, which has ", data_size,
                " bytes (is the file truncated?)");
        if (end - begin != *nbytes)
            bad("dtype ", dtype_name(t.type), " and shape ", shape_string(t.shape), " need ", *nbytes,
                " bytes, but data_offsets [", begin, ", ", end, "] hold ", end - begin,
                " (size does not match the shape)");
        return {begin, end};
    }

    // The ranges must tile the data section: no overlap (two names for the same bytes), no gap
    // and no trailing bytes (the spec forbids holes, which would let a file hide other content).
    template <class Info>
    static void check_coverage(const safetensors_file& file, std::vector<Info>& ranges, std::uint64_t data_size,
                               const std::string& path) {
        std::stable_sort(ranges.begin(), ranges.end(), [](const Info& a, const Info& b) {
            return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
        });
        std::uint64_t covered = 0;    // end of the furthest-reaching range so far
        const Info* reach = nullptr;  // the tensor that reaches it
        for (const Info& r : ranges) {
            if (r.begin < covered)
                fail("safetensors: '", path, "': tensors '", file.tensors_[reach->index].name, "' (bytes [",
                     reach->begin, ", ", reach->end, ")) and '", file.tensors_[r.index].name, "' (bytes [", r.begin,
                     ", ", r.end, ")) overlap in the data section");
            if (r.begin > covered)
                fail("safetensors: '", path, "': bytes [", covered, ", ", r.begin,
                     ") of the data section belong to no tensor (a gap before tensor '", file.tensors_[r.index].name,
                     "'; the format requires the tensors to cover the data section exactly)");
            if (r.end > covered || !reach) {  // here r.begin == covered
                reach = &r;
                covered = r.end;
            }
        }
        if (covered != data_size)
            fail("safetensors: '", path, "': bytes [", covered, ", ", data_size,
                 ") of the data section belong to no tensor (trailing bytes; the format requires the tensors to "
                 "cover the data section exactly)");
    }
};

}  // namespace detail

/// Loads and validates the safetensors file at `path`. Throws mnemo::error naming the file (and
/// the tensor, where one is at fault) for anything that is not a well-formed safetensors file.
inline safetensors_file read_safetensors(const std::string& path) {
    std::FILE* f = std::fopen(path.c_str(), "rb");
    if (!f) {
        const int e = errno;
        detail::fail("safetensors: cannot open '", path, "' for reading: ", detail::errno_text(e));
    }
    struct closer {
        std::FILE* f;
        ~closer() { std::fclose(f); }
    } close_on_exit{f};
    struct stat st {};
    if (::fstat(::fileno(f), &st) != 0) {
        const int e = errno;
        detail::fail("safetensors: cannot stat '", path, "': ", detail::errno_text(e));
    }
    if (!S_ISREG(st.st_mode)) detail::fail("safetensors: cannot read '", path, "': not a regular file");
    const detail::safetensors_file_source src(f, static_cast<std::uint64_t>(st.st_size), path);
    return detail::safetensors_loader::load(src, path);
}

/// Parses and validates a safetensors image held in memory; `name` stands in for the path in errors.
inline safetensors_file parse_safetensors(const void* data, std::size_t size, const std::string& name = "<memory>") {
    MNEMO_CHECK(data || size == 0, "safetensors: parse_safetensors: null data with size ", size);
    const detail::safetensors_memory_source src(static_cast<const std::uint8_t*>(data), size);
    return detail::safetensors_loader::load(src, name);
}

// ---------------------------------------------------------------------------------------------
// Writing
// ---------------------------------------------------------------------------------------------

/// Collects named tensors (by pointer: the data must stay alive and unchanged until commit) and
/// writes them to `path` atomically with commit(). Tensors are laid out by element size, largest
/// first (then in the order added), so with the 8-byte-aligned header every tensor is aligned to
/// its element size in the file, as memory-mapping readers want.
class safetensors_writer {
public:
    explicit safetensors_writer(std::string path) : path_(std::move(path)) {}

    const std::string& path() const { return path_; }
    std::size_t size() const { return entries_.size(); }

    /// Adds tensor `name` of `shape` from prod(shape) host elements at `data`, stored as `on_disk`.
    /// float/double data may be stored as F64, F32, F16 or BF16 (rounded to nearest even);
    /// integer and bool data are stored as their own dtype only.
    template <class T>
    safetensors_writer& add(std::string name, std::vector<std::int64_t> shape, const T* data,
                            dtype on_disk = native_dtype<T>) {
        constexpr dtype src = native_dtype<T>;
        if (on_disk != src && !(std::is_floating_point_v<T> && is_convertible_float(on_disk)))
            detail::fail("safetensors: cannot write tensor '", name, "' to '", path_, "': ", dtype_name(src),
                         " data cannot be stored as ", dtype_name(on_disk),
                         std::is_floating_point_v<T> ? " (choose F64, F32, F16 or BF16)"
                                                     : " (integers are stored as their own dtype)");
        return add_entry(std::move(name), std::move(shape), on_disk, src, data, false);
    }

    /// Adds a tensor record as is (its bytes are already little-endian). The record must outlive commit().
    safetensors_writer& add(const safetensors_tensor& t) {
        const std::optional<std::uint64_t> nbytes = detail::byte_count(t.shape, dtype_size(t.type));
        if (nbytes && *nbytes != t.bytes.size())
            detail::fail("safetensors: cannot write tensor '", t.name, "' to '", path_, "': dtype ", dtype_name(t.type),
                         " and shape ", shape_string(t.shape), " need ", *nbytes, " bytes, but the record holds ",
                         t.bytes.size());
        return add_entry(t.name, t.shape, t.type, t.type, t.bytes.data(), true);
    }

    /// Sets one "__metadata__" entry (replacing an earlier value for the key).
    safetensors_writer& set_metadata(std::string key, std::string value) {
        metadata_[std::move(key)] = std::move(value);
        return *this;
    }
    safetensors_writer& set_metadata(const safetensors_metadata& m) {
        for (const auto& [k, v] : m) metadata_[k] = v;
        return *this;
    }

    /// Writes the file atomically (see the top of this header). On failure the previous file at
    /// path() is untouched, the temporary file is removed, and mnemo::error names the path and the
    /// system's reason.
    void commit() const {
        const std::string header = build_header();
        const std::string tmp = path_ + ".tmp." + std::to_string(::getpid());

        // O_NOFOLLOW: never write through a symlink planted at the temporary name.
        const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_NOFOLLOW | O_CLOEXEC, 0666);
        if (fd < 0) {
            const int e = errno;
            detail::fail("safetensors: cannot write '", path_, "': cannot create the temporary file '", tmp,
                         "': ", detail::errno_text(e));
        }
        temp_file guard(tmp, fd);
        guard.f = ::fdopen(fd, "wb");
        if (!guard.f) {
            const int e = errno;
            fail_write("fdopen of '" + tmp + "' failed", e);
        }
        const auto put = [&](const void* p, std::size_t n) {
            if (n && std::fwrite(p, 1, n, guard.f) != n) {
                const int e = errno;
                fail_write("write to '" + tmp + "' failed", e);
            }
        };

        std::uint8_t len[8];
        detail::store_le(len, static_cast<std::uint64_t>(header.size()));
        put(len, 8);
        put(header.data(), header.size());

        std::vector<std::uint8_t> staging;
        for (const entry* e : ordered()) {
            const std::size_t elem = dtype_size(e->on_disk);
            const auto n = static_cast<std::size_t>(e->nbytes / elem);
            const auto* src = static_cast<const std::uint8_t*>(e->data);
            if (e->src == e->on_disk && (e->little_endian || std::endian::native == std::endian::little)) {
                put(src, n * elem);  // already in the file's byte order
                continue;
            }
            constexpr std::size_t chunk = 1 << 16;  // elements per conversion batch
            staging.resize(std::min(n, chunk) * elem);
            for (std::size_t first = 0; first < n; first += chunk) {
                const std::size_t m = std::min(chunk, n - first);
                if (e->src == e->on_disk)
                    detail::host_to_le(staging.data(), src + first * elem, elem, m);
                else
                    detail::encode_float(e->src, e->data, first, m, e->on_disk, staging.data());
                put(staging.data(), m * elem);
            }
        }

        if (std::fflush(guard.f) != 0) {
            const int e = errno;
            fail_write("flushing '" + tmp + "' failed", e);
        }
        if (::fsync(::fileno(guard.f)) != 0) {
            const int e = errno;
            fail_write("fsync of '" + tmp + "' failed", e);
        }
        std::FILE* f = guard.f;
        guard.f = nullptr;
        guard.fd = -1;  // fclose releases the descriptor even when it fails
        if (std::fclose(f) != 0) {
            const int e = errno;
            fail_write("closing '" + tmp + "' failed", e);
        }
        if (std::rename(tmp.c_str(), path_.c_str()) != 0) {
            const int e = errno;
            fail_write("renaming '" + tmp + "' over it failed", e);
        }
        guard.armed = false;  // the temporary file is now the checkpoint

        detail::sync_directory_of(path_);  // makes the rename itself durable
    }

private:
    struct entry {
        std::string name;
        std::vector<std::int64_t> shape;
        dtype on_disk;
        dtype src;  // element type at `data`
        const void* data;
        bool little_endian;  // data is file bytes already (a record), not host values
        std::uint64_t nbytes;
    };

    // Owns the temporary file until it has been renamed: closes it and removes it on failure.
    struct temp_file {
        std::string path;
        int fd = -1;             // open descriptor while no FILE owns it
        std::FILE* f = nullptr;  // owns fd once fdopen succeeded
        bool armed = true;       // remove `path` on destruction
        temp_file(std::string p, int descriptor) : path(std::move(p)), fd(descriptor) {}
        temp_file(const temp_file&) = delete;
        temp_file& operator=(const temp_file&) = delete;
        ~temp_file() {
            if (f) {
                std::fclose(f);
            } else if (fd >= 0) {
                ::close(fd);
            }
            if (armed) ::unlink(path.c_str());
        }
    };

    [[noreturn]] void fail_write(const std::string& what, int err) const {
        detail::fail("safetensors: cannot write '", path_, "': ", what, ": ", detail::errno_text(err),
                     " (the previous file, if any, is unchanged)");
    }

    safetensors_writer& add_entry(std::string name, std::vector<std::int64_t> shape, dtype on_disk, dtype src,
                                  const void* data, bool little_endian) {
        const auto bad = [&](auto&&... parts) {
            detail::fail("safetensors: cannot write tensor '", name, "' to '", path_,
                         "': ", std::forward<decltype(parts)>(parts)...);
        };
        if (name.empty()) detail::fail("safetensors: cannot write to '", path_, "': a tensor name is empty");
        if (name == "__metadata__") bad("the name is reserved for the metadata");
        for (const entry& e : entries_)
            if (e.name == name) bad("a tensor of that name was already added");
        for (std::int64_t d : shape)
            if (d < 0) bad("shape ", shape_string(shape), " has a negative extent");
        const std::optional<std::uint64_t> nbytes = detail::byte_count(shape, dtype_size(on_disk));
        if (!nbytes) bad("shape ", shape_string(shape), " has too many elements");
        if (*nbytes > 0 && !data) bad("the data pointer is null");
        entries_.push_back({std::move(name), std::move(shape), on_disk, src, data, little_endian, *nbytes});
        return *this;
    }

    std::vector<const entry*> ordered() const {
        std::vector<const entry*> v;
        v.reserve(entries_.size());
        for (const entry& e : entries_) v.push_back(&e);
        std::stable_sort(v.begin(), v.end(), [](const entry* a, const entry* b) {
            return dtype_size(a->on_disk) > dtype_size(b->on_disk);
        });
        return v;
    }

    std::string build_header() const {
        std::string h = "{";
        bool first = true;
        if (!metadata_.empty()) {
            h += "\"__metadata__\":{";
            for (const auto& [k, v] : metadata_) {
                if (!first) h += ',';
                first = false;
                json::append_quoted(h, k);
                h += ':';
                json::append_quoted(h, v);
            }
            h += '}';
            first = false;
        }
        std::uint64_t offset = 0;
        for (const entry* e : ordered()) {
            if (!first) h += ',';
            first = false;
            json::append_quoted(h, e->name);
            h += ":{\"dtype\":\"";
            h += dtype_name(e->on_disk);
            h += "\",\"shape\":";
            h += shape_string(e->shape);
            h += ",\"data_offsets\":[";
            h += std::to_string(offset);
            h += ',';
            offset += e->nbytes;
            h += std::to_string(offset);
            h += "]}";
        }
        h += '}';
        // Names and metadata must be UTF-8 for any reader (ours included) to accept the file:
        // check before a byte is written rather than produce a checkpoint nobody can load.
        try {
            (void)json::parse(h);
        } catch (const json::parse_error& e) {
            detail::fail("safetensors: cannot write '", path_,
                         "': a tensor name or metadata string is not valid UTF-8 (", e.detail(), ")");
        }
        // Pad to a multiple of 8 so the data section (and every tensor, see ordered()) is aligned.
        h.append((8 - h.size() % 8) % 8, ' ');
        return h;
    }

    std::string path_;
    std::vector<entry> entries_;
    safetensors_metadata metadata_;
};

/// Writes `tensors` (and `metadata`) to `path` atomically. Names must be unique and non-empty.
inline void write_safetensors(const std::string& path, const std::vector<safetensors_tensor>& tensors,
                              const safetensors_metadata& metadata = {}) {
    safetensors_writer w(path);
    for (const safetensors_tensor& t : tensors) w.add(t);
    w.set_metadata(metadata);
    w.commit();
}

/// A tensor record holding prod(shape) elements from `data`, encoded as `on_disk` (see
/// safetensors_writer::add for the conversions allowed).
template <class T>
inline safetensors_tensor make_safetensors_tensor(std::string name, std::vector<std::int64_t> shape, const T* data,
                                                  dtype on_disk = native_dtype<T>) {
    constexpr dtype src = native_dtype<T>;
    MNEMO_CHECK(on_disk == src || (std::is_floating_point_v<T> && is_convertible_float(on_disk)),
                "safetensors: tensor '", name, "': ", dtype_name(src), " data cannot be stored as ",
                dtype_name(on_disk));
    const std::optional<std::uint64_t> nbytes = detail::byte_count(shape, dtype_size(on_disk));
    MNEMO_CHECK(nbytes.has_value(), "safetensors: tensor '", name, "': shape ", shape_string(shape),
                " is negative or has too many elements");
    safetensors_tensor t{std::move(name), on_disk, std::move(shape), std::vector<std::uint8_t>(*nbytes)};
    const std::size_t n = *nbytes / dtype_size(on_disk);
    MNEMO_CHECK(n == 0 || data, "safetensors: tensor '", t.name, "': the data pointer is null");
    if (on_disk == src)
        detail::host_to_le(t.bytes.data(), reinterpret_cast<const std::uint8_t*>(data), sizeof(T), n);
    else
        detail::encode_float(src, data, 0, n, on_disk, t.bytes.data());
    return t;
}

// ---------------------------------------------------------------------------------------------
// parameter_set glue
// ---------------------------------------------------------------------------------------------

/// Adds every tensor of `ps`, read from `buffer` (host memory in the set's layout: its values, its
/// gradients or an optimizer moment, downloaded for a backend other than the CPU), named prefix +
/// entry name, stored as `on_disk` (F64, F32, F16 or BF16).
template <class T, class Backend>
inline void add_parameter_buffer(safetensors_writer& w, const parameter_set<T, Backend>& ps, const T* buffer,
                                 const std::string& prefix = "", dtype on_disk = native_dtype<T>) {
    static_assert(std::is_floating_point_v<T>, "mnemo: parameter buffers are float or double");
    MNEMO_CHECK(buffer != nullptr, "safetensors: add_parameter_buffer: null buffer for '", w.path(), "'");
    for (const tensor_entry& e : ps.entries()) {
        std::vector<std::int64_t> shape(e.shape.begin(), e.shape.end());
        w.add(prefix + e.name, std::move(shape), buffer + e.offset, on_disk);
    }
}

/// Saves the values of every parameter of `ps` to `path` (atomically), stored as `on_disk`.
/// The default F32 is what PyTorch loads most readily; pass native_dtype<T> for a bitwise copy of
/// double parameters.
template <class T, class Backend>
inline void save_parameters(const std::string& path, const parameter_set<T, Backend>& ps, dtype on_disk = dtype::f32,
                            const safetensors_metadata& metadata = {}) {
    std::vector<T> values(static_cast<std::size_t>(ps.size()));  // the host path
    ps.download_all_values(values);
    safetensors_writer w(path);
    add_parameter_buffer(w, ps, values.data(), "", on_disk);
    w.set_metadata(metadata);
    w.commit();
}

/// Copies prefix + name of every entry of `ps` from `file` into `buffer` (host memory in the set's
/// layout) at the entry's offset, converted to T. Checks everything first (every tensor present, shapes
/// equal, a floating dtype), so on error `buffer` is untouched; errors name the tensor and the file.
template <class T, class Backend>
inline void read_parameter_buffer(const safetensors_file& file, const parameter_set<T, Backend>& ps, T* buffer,
                                  const std::string& prefix = "") {
    static_assert(std::is_floating_point_v<T>, "mnemo: parameter buffers are float or double");
    MNEMO_CHECK(buffer != nullptr, "safetensors: read_parameter_buffer: null buffer for '", file.path(), "'");
    std::size_t missing = 0;
    const tensor_entry* first_missing = nullptr;
    for (const tensor_entry& e : ps.entries())
        if (!file.contains(prefix + e.name)) {
            if (!first_missing) first_missing = &e;
            ++missing;
        }
    if (first_missing)
        detail::fail("safetensors: tensor '", prefix + first_missing->name, "' is missing from '", file.path(),
                     "' (the model declares it; ", missing, " of ", ps.entries().size(), " parameters are missing)");
    for (const tensor_entry& e : ps.entries()) {
        const safetensors_tensor& t = file.at(prefix + e.name);
        const bool same_shape = t.shape.size() == e.shape.size() &&
                                std::equal(t.shape.begin(), t.shape.end(), e.shape.begin(),
                                           [](std::int64_t a, index_t b) { return a == static_cast<std::int64_t>(b); });
        if (!same_shape)
            detail::fail("safetensors: tensor '", t.name, "' has shape ", shape_string(t.shape), " in '", file.path(),
                         "' but the model expects ", shape_string(e.shape));
        if (!is_convertible_float(t.type))
            detail::fail("safetensors: tensor '", t.name, "' in '", file.path(), "' has dtype ", dtype_name(t.type),
                         "; parameters must be stored as F32 or F64 (or F16/BF16)");
    }
    for (const tensor_entry& e : ps.entries())
        file.copy_to(prefix + e.name, buffer + e.offset, static_cast<std::size_t>(e.size));
}

struct parameter_load_options {
    /// Skip tensors in the file that the model does not declare (e.g. optimizer state saved
    /// alongside) instead of rejecting the file.
    bool ignore_unexpected = false;
};

/// Loads every parameter of `ps` (allocated) from `path`: each must be present with the model's
/// shape and a floating dtype (converted to T); a tensor the model does not declare is an error
/// unless opts.ignore_unexpected. On error the parameters are untouched. The values reach the set's
/// backend over the host path (read into host memory, then uploaded).
template <class T, class Backend>
inline void load_parameters(const safetensors_file& file, parameter_set<T, Backend>& ps, parameter_load_options opts = {}) {
    if (!opts.ignore_unexpected)
        for (const safetensors_tensor& t : file.tensors())
            if (!ps.find(t.name))
                detail::fail("safetensors: unexpected tensor '", t.name, "' in '", file.path(),
                             "': the model has no parameter of that name (set "
                             "parameter_load_options::ignore_unexpected to skip such tensors)");
    std::vector<T> values(static_cast<std::size_t>(ps.size()));
    ps.download_all_values(values);  // the alignment gaps, as they are
    read_parameter_buffer(file, ps, values.data());
    ps.upload_all_values(values);
}

template <class T, class Backend>
inline void load_parameters(const std::string& path, parameter_set<T, Backend>& ps, parameter_load_options opts = {}) {
    load_parameters(read_safetensors(path), ps, opts);
}

}  // namespace mnemo
