// Tests for io/json.hpp and io/safetensors.hpp: round trips compared bit for bit, a file
// laid out by hand from the spec, every rejection the reader promises (each message checked for
// its key words, the file and the tensor), atomic writes under failure, and mutated files.
#include <doctest/doctest.h>
#include <sys/resource.h>
#include <unistd.h>

#include <atomic>
#include <csignal>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <string>
#include <vector>

#include "mnemo/io/json.hpp"
#include "mnemo/core/parameters.hpp"
#include "mnemo/core/rng.hpp"
#include "testing.hpp"
#include "mnemo/io/safetensors.hpp"

namespace fs = std::filesystem;

namespace {

// A fresh directory under the system temp directory, removed with everything in it.
// A scratch directory for this file's tests.
struct temp_dir : mnemo::testing::temp_dir {
    temp_dir() : mnemo::testing::temp_dir("safetensors") {}
};

std::vector<std::uint8_t> read_bytes(const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    REQUIRE(in);
    return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

void write_bytes(const std::string& path, const std::vector<std::uint8_t>& bytes) {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    REQUIRE(out);
    out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
    REQUIRE(out);
}

void append_u64(std::vector<std::uint8_t>& out, std::uint64_t v) {
    for (int i = 0; i < 8; ++i) out.push_back(static_cast<std::uint8_t>(v >> (8 * i)));
}

// A file image: the length of `header` (or `declared_len`), the header, then `data`.
std::vector<std::uint8_t> image(const std::string& header, const std::vector<std::uint8_t>& data,
                                std::optional<std::uint64_t> declared_len = std::nullopt) {
    std::vector<std::uint8_t> out;
    append_u64(out, declared_len ? *declared_len : header.size());
    out.insert(out.end(), header.begin(), header.end());
    out.insert(out.end(), data.begin(), data.end());
    return out;
}

// The message of the mnemo::error that f throws ("" and a failed check when it throws none).
template <class F>
std::string error_of(F&& f) {
    try {
        f();
    } catch (const mnemo::error& e) {
        return e.what();
    }
    FAIL_CHECK("expected a mnemo::error, none was thrown");
    return "";
}

// doctest::Contains from a std::string (it takes only doctest::String).
doctest::Contains has(const std::string& part) { return doctest::Contains(part.c_str()); }

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

// Checks that reading the file image `bytes` fails with a message containing every one of `parts`.
void check_rejected(const temp_dir& dir, const std::vector<std::uint8_t>& bytes,
                    std::initializer_list<std::string> parts) {
    const std::string path = dir.file("bad.safetensors");
    write_bytes(path, bytes);
    const std::string msg = error_of([&] { (void)mnemo::read_safetensors(path); });
    INFO("message: ", msg);
    CHECK(contains(msg, "mnemo: safetensors:"));
    CHECK(contains(msg, path));
    for (const std::string& p : parts) CHECK_MESSAGE(contains(msg, p), "missing \"", p, "\"");
    // The in-memory parser applies the same checks.
    const std::string mem = error_of([&] { (void)mnemo::parse_safetensors(bytes.data(), bytes.size(), "img"); });
    for (const std::string& p : parts) CHECK_MESSAGE(contains(mem, p), "in memory: missing \"", p, "\"");
}

std::vector<std::uint8_t> f32_bytes(std::initializer_list<float> v) {
    std::vector<std::uint8_t> out(v.size() * 4);
    std::memcpy(out.data(), std::data(v), out.size());  // the tests run on little-endian hosts
    return out;
}

template <class T>
std::vector<T> random_values(std::size_t n, std::uint64_t seed) {
    mnemo::rng r(seed);
    std::vector<T> v(n);
    for (auto& x : v) {
        if constexpr (std::is_floating_point_v<T>)
            x = static_cast<T>(r.normal());
        else
            x = static_cast<T>(static_cast<std::int64_t>(r.next_u32()) << 31 ^ r.next_u32());
    }
    return v;
}

}  // namespace

static_assert(std::endian::native == std::endian::little, "these tests build file images by memcpy");

// ---------------------------------------------------------------------------------------------
// json
// ---------------------------------------------------------------------------------------------

TEST_CASE("json: parses every kind of value") {
    const auto v = mnemo::json::parse(
        R"( {"s": "a\"b\\c\/d\b\f\n\r\t\u00e9\ud83d\ude00", "n": [0, -0, 12, -3.5e2, 1E-2, 9223372036854775807,
             -9223372036854775808, 9223372036854775808, 2.0], "t": true, "f": false, "z": null, "o": {}, "a": []} )");
    REQUIRE(v.is_object());
    CHECK(v.size() == 7);
    CHECK(v.key(0) == "s");
    CHECK(v.find("s")->as_string() == "a\"b\\c/d\b\f\n\r\t\xC3\xA9\xF0\x9F\x98\x80");
    const auto& n = *v.find("n");
    REQUIRE(n.size() == 9);
    CHECK((n[0].is_integer() && n[0].as_int64() == 0));
    CHECK((n[1].is_integer() && n[1].as_int64() == 0));
    CHECK(n[2].as_int64() == 12);
    CHECK((!n[3].is_integer() && n[3].as_double() == -350.0));
    CHECK(n[4].as_double() == 0.01);
    CHECK(n[5].as_int64() == INT64_MAX);
    CHECK(n[6].as_int64() == INT64_MIN);
    CHECK((n[7].is_number() && !n[7].is_integer() && n[7].as_double() == 9223372036854775808.0));
    CHECK((!n[8].is_integer() && n[8].as_double() == 2.0));
    CHECK_THROWS_WITH_AS((void)n[8].as_int64(), has("expected an integer"), mnemo::error);
    CHECK(v.find("t")->as_bool());
    CHECK(!v.find("f")->as_bool());
    CHECK(v.find("z")->is_null());
    CHECK((v.find("o")->is_object() && v.find("o")->size() == 0));
    CHECK((v.find("a")->is_array() && v.find("a")->size() == 0));
    CHECK(v.find("missing") == nullptr);
    CHECK_THROWS_WITH_AS((void)v.find("s")->as_int64(), has("found a string"), mnemo::error);
}

TEST_CASE("json: rejects malformed input and names the byte") {
    struct bad {
        std::string text;
        std::size_t pos;
        std::string words;
    };
    const std::vector<bad> cases = {
        {"", 0, "expected a value, found the end of the input"},
        {"{\"a\":1,}", 7, "expected a string key"},
        {"[1,]", 3, "expected a value"},
        {"{\"a\" 1}", 5, "expected ':' after an object key, found '1'"},
        {"[1 2]", 3, "expected ',' or ']'"},
        {"[01]", 2, "leading zero"},
        {"-", 1, "expected a digit"},
        {"+1", 0, "expected a value, found '+'"},
        {"1.", 2, "expected a digit after the decimal point"},
        {".5", 0, "expected a value"},
        {"1e", 2, "expected a digit in the exponent"},
        {"NaN", 0, "expected a value"},
        {"nul", 0, "expected 'null'"},
        {"[1] x", 4, "expected the end of the document, found 'x'"},
        {"\"abc", 0, "unterminated string"},
        {"\"a\nb\"", 2, "raw control character (byte 0x0a)"},
        {"\"\\x\"", 2, "expected one of"},
        {"\"\\u12g4\"", 5, "four hex digits"},
        {"\"\\ud800\"", 1, "expected a low surrogate"},
        {"\"\\udc00\"", 1, "lone low surrogate"},
        {"\"\xff\"", 1, "invalid UTF-8"},
        {"\"\xc0\xaf\"", 1, "invalid UTF-8"},      // overlong '/'
        {"\"\xed\xa0\x80\"", 2, "invalid UTF-8"},  // an encoded surrogate
        {"\"\xe2\x82\"", 3, "invalid UTF-8"},      // cut short
        {"{\"a\":1,\"a\":2}", 7, "duplicate key \"a\""},
        {"1e999", 0, "out of the range of a double"},
        {"[1e-400]", 1, "out of the range of a double"},
        {"\xef\xbb\xbf{}", 0, "expected a value, found byte 0xef"},  // a byte-order mark
    };
    for (const bad& c : cases) {
        INFO("input: ", c.text);
        try {
            (void)mnemo::json::parse(c.text);
            FAIL_CHECK("accepted");
        } catch (const mnemo::json::parse_error& e) {
            CHECK(e.position() == c.pos);
            CHECK(contains(e.what(), "mnemo: malformed JSON at byte " + std::to_string(c.pos) + ": "));
            CHECK_MESSAGE(contains(e.detail(), c.words), e.what());
        }
    }
}

TEST_CASE("json: duplicate keys are found in large objects too") {
    std::string text = "{";
    for (int i = 0; i < 100; ++i) text += "\"k" + std::to_string(i) + "\":" + std::to_string(i) + ",";
    CHECK(mnemo::json::parse(text + "\"last\":0}").size() == 101);
    CHECK_THROWS_WITH_AS(mnemo::json::parse(text + "\"k42\":0}"), has("duplicate key \"k42\""),
                         mnemo::json::parse_error);
}

TEST_CASE("json: the depth limit stops hostile nesting") {
    const auto nested = [](std::size_t depth) { return std::string(depth, '[') + std::string(depth, ']'); };
    CHECK(mnemo::json::parse(nested(64)).is_array());
    CHECK_THROWS_WITH_AS(mnemo::json::parse(nested(65)), has("nesting deeper than 64 levels"),
                         mnemo::json::parse_error);
    // A megabyte of '[' fails fast instead of overflowing the stack.
    CHECK_THROWS_WITH_AS(mnemo::json::parse(std::string(1 << 20, '[')), has("nesting deeper"),
                         mnemo::json::parse_error);
    mnemo::json::parse_options deep;
    deep.max_depth = 200;
    CHECK(mnemo::json::parse(nested(200), deep).is_array());
}

TEST_CASE("json: append_quoted escapes every control character and parses back") {
    std::string s;
    for (int c = 1; c < 128; ++c) s += static_cast<char>(c);
    s += "\xC3\xA9\xF0\x9F\x98\x80";  // UTF-8 passes through
    s += '\0';
    const std::string q = mnemo::json::quoted(s);
    for (char c : q) CHECK(static_cast<unsigned char>(c) >= 0x20);
    CHECK(mnemo::json::parse(q).as_string() == s);
    CHECK(mnemo::json::quoted("a\"b\\") == R"("a\"b\\")");
    CHECK(mnemo::json::quoted(std::string("\x01\n", 2)) == R"("\u0001\n")");
}

// ---------------------------------------------------------------------------------------------
// dtypes and conversions
// ---------------------------------------------------------------------------------------------

TEST_CASE("safetensors: dtype names and sizes") {
    for (mnemo::dtype t : mnemo::all_dtypes) CHECK(mnemo::parse_dtype(mnemo::dtype_name(t)) == t);
    CHECK(mnemo::dtype_name(mnemo::dtype::bf16) == "BF16");
    CHECK(mnemo::dtype_name(mnemo::dtype::boolean) == "BOOL");
    CHECK(mnemo::dtype_size(mnemo::dtype::f64) == 8);
    CHECK(mnemo::dtype_size(mnemo::dtype::bf16) == 2);
    CHECK(mnemo::dtype_size(mnemo::dtype::i32) == 4);
    CHECK(mnemo::dtype_size(mnemo::dtype::boolean) == 1);
    CHECK(!mnemo::parse_dtype("f32").has_value());  // names are case-sensitive
    CHECK(!mnemo::parse_dtype("F33").has_value());
    static_assert(mnemo::native_dtype<float> == mnemo::dtype::f32);
    static_assert(mnemo::native_dtype<const std::int64_t> == mnemo::dtype::i64);
}

TEST_CASE("safetensors: F16 and BF16 conversions round to nearest even") {
    using mnemo::to_half_bits;
    CHECK(to_half_bits(1.0) == 0x3C00);
    CHECK(to_half_bits(-2.0) == 0xC000);
    CHECK(to_half_bits(0.0) == 0x0000);
    CHECK(to_half_bits(-0.0) == 0x8000);
    CHECK(to_half_bits(65504.0) == 0x7BFF);
    CHECK(to_half_bits(65519.99) == 0x7BFF);
    CHECK(to_half_bits(65520.0) == 0x7C00);  // the tie rounds to even: 2^16, which overflows
    CHECK(to_half_bits(1e300) == 0x7C00);
    CHECK(to_half_bits(-INFINITY) == 0xFC00);
    CHECK(to_half_bits(0x1p-24) == 0x0001);                  // smallest subnormal
    CHECK(to_half_bits(0x1p-25) == 0x0000);                  // tie to even (zero)
    CHECK(to_half_bits(0x1.8p-24) == 0x0002);                // tie to even (2)
    CHECK(to_half_bits(0x1p-14 - 0x1p-25) == 0x0400);        // rounds up into the normals
    CHECK(to_half_bits(1.0 + 0x1p-11) == 0x3C00);            // tie to even
    CHECK(to_half_bits(1.0 + 0x1.8p-10) == 0x3C02);          // tie to even (up)
    CHECK(to_half_bits(1.0 + 0x1p-11 + 0x1p-40) == 0x3C01);  // just above the tie: double rounds once
    CHECK(std::isnan(mnemo::half_to_float(to_half_bits(NAN))));
    CHECK(mnemo::half_to_float(0x3555) == doctest::Approx(0.33325195));
    CHECK(mnemo::half_to_float(0x0001) == 0x1p-24f);
    CHECK(std::signbit(mnemo::half_to_float(0x8000)));

    using mnemo::to_bf16_bits;
    CHECK(to_bf16_bits(1.0) == 0x3F80);
    CHECK(to_bf16_bits(-2.5) == 0xC020);
    CHECK(to_bf16_bits(1.0 + 0x1p-8) == 0x3F80);    // tie to even
    CHECK(to_bf16_bits(1.0 + 0x1.8p-7) == 0x3F82);  // tie to even (up)
    CHECK(to_bf16_bits(3.4e38) == 0x7F80);          // beyond the largest bf16 (about 3.39e38)
    CHECK(to_bf16_bits(0x1p-133) == 0x0001);        // smallest subnormal
    CHECK(std::isnan(mnemo::bf16_to_float(to_bf16_bits(NAN))));

    // Every non-NaN half and bfloat16 survives the trip through float and back.
    for (std::uint32_t h = 0; h < 0x10000; ++h) {
        const auto b = static_cast<std::uint16_t>(h);
        const float hf = mnemo::half_to_float(b);
        if (!std::isnan(hf)) REQUIRE(to_half_bits(hf) == b);
        const float bf = mnemo::bf16_to_float(b);
        if (!std::isnan(bf)) REQUIRE(to_bf16_bits(bf) == b);
    }
    // And agree with float's own rounding for bfloat16 on random floats (top 16 bits, RNE).
    mnemo::rng r(7);
    for (int i = 0; i < 100000; ++i) {
        const std::uint32_t bits = r.next_u32();
        const float f = std::bit_cast<float>(bits);
        if (std::isnan(f)) continue;
        const std::uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
        REQUIRE(to_bf16_bits(f) == rounded);
    }
}

// ---------------------------------------------------------------------------------------------
// Round trips
// ---------------------------------------------------------------------------------------------

TEST_CASE("safetensors: F32, F64, I32 and I64 round trip bitwise") {
    temp_dir dir;
    const std::string path = dir.file("roundtrip.safetensors");
    const auto f32 = random_values<float>(3 * 5, 1);
    const auto f64 = random_values<double>(7, 2);
    const auto i32 = random_values<std::int32_t>(4 * 2, 3);
    const auto i64 = random_values<std::int64_t>(6, 4);
    const std::vector<std::uint8_t> flags = {1, 0, 1};
    const float scalar = 0.25f;

    std::vector<mnemo::safetensors_tensor> tensors;
    tensors.push_back(mnemo::make_safetensors_tensor("layer.0.weight", {3, 5}, f32.data()));
    tensors.push_back(mnemo::make_safetensors_tensor("layer.0.bias", {7}, f64.data()));
    tensors.push_back(mnemo::make_safetensors_tensor("tokens", {4, 2}, i32.data()));
    tensors.push_back(mnemo::make_safetensors_tensor("steps", {2, 1, 3}, i64.data()));
    tensors.push_back(mnemo::make_safetensors_tensor("flags", {3}, flags.data()));
    tensors.push_back(mnemo::make_safetensors_tensor("scale", {}, &scalar));
    tensors.push_back(mnemo::make_safetensors_tensor("empty", {0, 4}, static_cast<const float*>(nullptr)));
    const mnemo::safetensors_metadata meta = {{"format", "pt"}, {"note", "quote \" and\nnewline, \xC3\xA9"}};
    mnemo::write_safetensors(path, tensors, meta);

    // The header is padded so the data section starts 8-aligned, and tensors are ordered by
    // element size, so each is aligned to its own.
    const auto raw = read_bytes(path);
    std::uint64_t header_len = 0;
    std::memcpy(&header_len, raw.data(), 8);
    CHECK(header_len % 8 == 0);

    const mnemo::safetensors_file f = mnemo::read_safetensors(path);
    CHECK(f.path() == path);
    CHECK(f.size() == tensors.size());
    CHECK(f.metadata() == meta);
    for (const auto& t : tensors) {
        INFO("tensor ", t.name);
        const mnemo::safetensors_tensor* r = f.find(t.name);
        REQUIRE(r != nullptr);
        CHECK(r->type == t.type);
        CHECK(r->shape == t.shape);
        REQUIRE(r->bytes.size() == t.bytes.size());
        CHECK((t.bytes.empty() || std::memcmp(r->bytes.data(), t.bytes.data(), t.bytes.size()) == 0));
    }
    const auto header = mnemo::json::parse(
        std::string_view(reinterpret_cast<const char*>(raw.data()) + 8, static_cast<std::size_t>(header_len)));
    CHECK(header.key(0) == "__metadata__");
    std::int64_t prev_end = 0;
    for (std::size_t i = 1; i < header.size(); ++i) {  // header order is data order: offsets ascend
        const auto& offsets = *header.member(i).find("data_offsets");
        const std::size_t elem = mnemo::dtype_size(*mnemo::parse_dtype(header.member(i).find("dtype")->as_string()));
        INFO("tensor ", header.key(i));
        CHECK(offsets[0].as_int64() == prev_end);
        CHECK(offsets[0].as_int64() % static_cast<std::int64_t>(elem) == 0);
        prev_end = offsets[1].as_int64();
    }
    CHECK(prev_end + 8 + static_cast<std::int64_t>(header_len) == static_cast<std::int64_t>(raw.size()));

    // Converting accessors give the same bits.
    const auto f32_back = f.to_vector<float>("layer.0.weight");
    CHECK(std::memcmp(f32_back.data(), f32.data(), f32.size() * 4) == 0);
    const auto f64_back = f.to_vector<double>("layer.0.bias");
    CHECK(std::memcmp(f64_back.data(), f64.data(), f64.size() * 8) == 0);
    const auto i32_back = f.to_vector<std::int64_t>("tokens");
    for (std::size_t i = 0; i < i32.size(); ++i) CHECK(i32_back[i] == i32[i]);
    CHECK(f.to_vector<std::int64_t>("steps") == i64);
    CHECK(f.to_vector<std::int64_t>("flags") == std::vector<std::int64_t>{1, 0, 1});
    CHECK(f.to_vector<float>("scale") == std::vector<float>{0.25f});
    CHECK(f.to_vector<double>("empty").empty());
    CHECK(f.at("empty").shape == std::vector<std::int64_t>{0, 4});

    // Accessors refuse the wrong kind of conversion, the wrong count and unknown names.
    CHECK_THROWS_WITH_AS((void)f.to_vector<float>("tokens"),
                         has("tensor 'tokens' in '" + path + "' has dtype I32, which cannot be read as float"),
                         mnemo::error);
    CHECK_THROWS_WITH_AS((void)f.to_vector<std::int64_t>("layer.0.bias"),
                         has("tensor 'layer.0.bias' in '" + path + "' has dtype F64"), mnemo::error);
    float small[3];
    CHECK_THROWS_WITH_AS(f.copy_to("layer.0.weight", small, 3), has("has 15 elements (shape [3, 5])"), mnemo::error);
    CHECK_THROWS_WITH_AS((void)f.at("nope"), has("no tensor 'nope' in '" + path + "'"), mnemo::error);
}

TEST_CASE("safetensors: the writer stores host data from pointers and converts floats on request") {
    temp_dir dir;
    const std::string path = dir.file("writer.safetensors");
    const auto x = random_values<double>(64, 11);
    const std::int64_t step = 123456789012345;
    const std::uint64_t big = ~std::uint64_t{0};
    mnemo::safetensors_writer w(path);
    w.add("x.f64", {8, 8}, x.data())
        .add("x.f32", {8, 8}, x.data(), mnemo::dtype::f32)
        .add("x.f16", {64}, x.data(), mnemo::dtype::f16)
        .add("x.bf16", {64}, x.data(), mnemo::dtype::bf16)
        .add("step", {}, &step)
        .add("big", {1}, &big)
        .set_metadata("epoch", "3");
    CHECK(w.size() == 6);
    w.commit();

    const auto f = mnemo::read_safetensors(path);
    CHECK(f.metadata().at("epoch") == "3");
    CHECK(f.at("x.f32").type == mnemo::dtype::f32);
    const auto f64 = f.to_vector<double>("x.f64");
    const auto f32 = f.to_vector<double>("x.f32");
    const auto f16 = f.to_vector<float>("x.f16");
    const auto bf16 = f.to_vector<float>("x.bf16");
    for (std::size_t i = 0; i < x.size(); ++i) {
        CHECK(f64[i] == x[i]);
        CHECK(f32[i] == static_cast<double>(static_cast<float>(x[i])));
        CHECK(f16[i] == mnemo::half_to_float(mnemo::to_half_bits(x[i])));
        CHECK(bf16[i] == mnemo::bf16_to_float(mnemo::to_bf16_bits(x[i])));
    }
    CHECK(f.to_vector<std::int64_t>("step") == std::vector<std::int64_t>{step});
    CHECK_THROWS_WITH_AS((void)f.to_vector<std::int64_t>("big"), has("does not fit in int64"), mnemo::error);

    // Invalid additions are refused before anything is written.
    CHECK_THROWS_WITH_AS(w.add("x.f64", {64}, x.data()), has("tensor 'x.f64'"), mnemo::error);
    CHECK_THROWS_WITH_AS(w.add("__metadata__", {64}, x.data()), has("reserved"), mnemo::error);
    CHECK_THROWS_WITH_AS(w.add("neg", {-1, 4}, x.data()), has("negative extent"), mnemo::error);
    CHECK_THROWS_WITH_AS(w.add("i", {1}, &step, mnemo::dtype::i32), has("I64 data cannot be stored as I32"),
                         mnemo::error);
    CHECK_THROWS_WITH_AS(w.add("f8", {1}, x.data(), mnemo::dtype::f8_e4m3), has("F64 data cannot be stored as F8_E4M3"),
                         mnemo::error);
    CHECK_THROWS_WITH_AS(w.add("null", {2}, static_cast<const float*>(nullptr)), has("null"), mnemo::error);
}

TEST_CASE("safetensors: a parameter_set round trip is bitwise") {
    temp_dir dir;
    SUBCASE("float parameters as F32") {
        const std::string path = dir.file("model_f32.safetensors");
        mnemo::parameter_set<float> ps;
        ps.declare("embed.weight", {11, 4});
        ps.declare("layers.0.attn.qkv.weight", {12, 4});
        ps.declare("layers.0.attn.qkv.bias", {12});
        ps.declare("ln_f.weight", {4});
        ps.allocate();
        const auto v = random_values<float>(static_cast<std::size_t>(ps.size()), 21);
        std::memcpy(ps.values(), v.data(), v.size() * sizeof(float));
        mnemo::save_parameters(path, ps, mnemo::dtype::f32, {{"step", "10"}});

        mnemo::parameter_set<float> fresh;
        fresh.declare("embed.weight", {11, 4});
        fresh.declare("layers.0.attn.qkv.weight", {12, 4});
        fresh.declare("layers.0.attn.qkv.bias", {12});
        fresh.declare("ln_f.weight", {4});
        fresh.allocate();
        mnemo::load_parameters(path, fresh);
        for (const auto& e : ps.entries())
            CHECK_MESSAGE(std::memcmp(ps.values() + e.offset, fresh.values() + e.offset, sizeof(float) * e.size) == 0,
                          e.name);
        CHECK(mnemo::read_safetensors(path).metadata().at("step") == "10");
    }
    SUBCASE("double parameters as F64, with optimizer moments alongside") {
        const std::string path = dir.file("model_f64.safetensors");
        mnemo::parameter_set<double> ps;
        ps.declare("w", {3, 3});
        ps.declare("b", {3});
        ps.allocate();
        const auto v = random_values<double>(static_cast<std::size_t>(ps.size()), 22);
        std::memcpy(ps.values(), v.data(), v.size() * sizeof(double));
        const auto m = random_values<double>(static_cast<std::size_t>(ps.size()), 23);
        const std::int64_t step = 42;
        mnemo::safetensors_writer w(path);
        mnemo::add_parameter_buffer(w, ps, ps.values());
        mnemo::add_parameter_buffer(w, ps, m.data(), "adamw.m.");
        w.add("adamw.step", {}, &step);
        w.commit();

        mnemo::parameter_set<double> fresh;
        fresh.declare("w", {3, 3});
        fresh.declare("b", {3});
        fresh.allocate();
        const auto f = mnemo::read_safetensors(path);
        CHECK_THROWS_WITH_AS(mnemo::load_parameters(f, fresh), has("unexpected tensor 'adamw."), mnemo::error);
        mnemo::load_parameters(f, fresh, {.ignore_unexpected = true});
        std::vector<double> m_back(static_cast<std::size_t>(fresh.size()), 0.0);
        mnemo::read_parameter_buffer(f, fresh, m_back.data(), "adamw.m.");
        for (const auto& e : ps.entries()) {
            CHECK(std::memcmp(ps.values() + e.offset, fresh.values() + e.offset, sizeof(double) * e.size) == 0);
            CHECK(std::memcmp(m.data() + e.offset, m_back.data() + e.offset, sizeof(double) * e.size) == 0);
        }
        CHECK(f.to_vector<std::int64_t>("adamw.step") == std::vector<std::int64_t>{42});
    }
}

TEST_CASE("safetensors: parameters saved as BF16 and F64 load back converted") {
    temp_dir dir;
    mnemo::parameter_set<float> ps;
    ps.declare("w", {5, 2});
    ps.allocate();
    const auto v = random_values<float>(static_cast<std::size_t>(ps.size()), 31);
    std::memcpy(ps.values(), v.data(), v.size() * sizeof(float));

    mnemo::save_parameters(dir.file("bf16.safetensors"), ps, mnemo::dtype::bf16);
    CHECK(mnemo::read_safetensors(dir.file("bf16.safetensors")).at("w").type == mnemo::dtype::bf16);
    mnemo::parameter_set<float> back;
    back.declare("w", {5, 2});
    back.allocate();
    mnemo::load_parameters(dir.file("bf16.safetensors"), back);
    for (mnemo::index_t i = 0; i < 10; ++i) CHECK(back.values()[i] == mnemo::bf16_to_float(mnemo::to_bf16_bits(v[i])));

    mnemo::save_parameters(dir.file("f64.safetensors"), ps, mnemo::dtype::f64);
    mnemo::load_parameters(dir.file("f64.safetensors"), back);  // F64 to float: exact for float data
    CHECK(std::memcmp(back.values(), ps.values(), 10 * sizeof(float)) == 0);
}

// ---------------------------------------------------------------------------------------------
// A file laid out by hand from the spec (what the Python library writes)
// ---------------------------------------------------------------------------------------------

TEST_CASE("safetensors: reads a hand-made file and writes the same bytes") {
    temp_dir dir;
    // {"b": int64 scalar 7, "a": float32 [2] = {1, -2}}; compact JSON, padded with spaces to a
    // multiple of 8, larger elements first, offsets relative to the data section.
    std::string header = R"({"__metadata__":{"format":"pt"},"b":{"dtype":"I64","shape":[],"data_offsets":[0,8]},)"
                         R"("a":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}})";
    header.append((8 - header.size() % 8) % 8, ' ');
    REQUIRE(header.size() % 8 == 0);
    const std::vector<std::uint8_t> data = {0x07, 0,    0,    0,    0, 0, 0, 0,  // int64 7
                                            0x00, 0x00, 0x80, 0x3F,              // 1.0f
                                            0x00, 0x00, 0x00, 0xC0};             // -2.0f
    const auto expected = image(header, data);
    const std::string path = dir.file("python.safetensors");
    write_bytes(path, expected);

    const auto f = mnemo::read_safetensors(path);
    REQUIRE(f.size() == 2);
    CHECK(f.tensors()[0].name == "b");
    CHECK(f.tensors()[1].name == "a");
    CHECK(f.metadata() == mnemo::safetensors_metadata{{"format", "pt"}});
    CHECK(f.at("a").shape == std::vector<std::int64_t>{2});
    CHECK(f.at("b").shape.empty());
    CHECK(f.to_vector<float>("a") == std::vector<float>{1.0f, -2.0f});
    CHECK(f.to_vector<std::int64_t>("b") == std::vector<std::int64_t>{7});

    // Our writer produces exactly these bytes from the same tensors (added in the other order).
    const float a[] = {1.0f, -2.0f};
    const std::int64_t b = 7;
    const std::string ours = dir.file("ours.safetensors");
    mnemo::safetensors_writer w(ours);
    w.add("a", {2}, a).add("b", {}, &b).set_metadata("format", "pt").commit();
    CHECK(read_bytes(ours) == expected);

    // Spaces, tabs and newlines in the header are fine (other writers pretty-print it).
    const std::string pretty = "{\n  \"x\": {\"dtype\": \"F32\",\t\"shape\": [1], \"data_offsets\": [0, 4]}\n}   ";
    write_bytes(path, image(pretty, f32_bytes({3.5f})));
    CHECK(mnemo::read_safetensors(path).to_vector<float>("x") == std::vector<float>{3.5f});
}

// ---------------------------------------------------------------------------------------------
// Rejections
// ---------------------------------------------------------------------------------------------

TEST_CASE("safetensors: rejects a missing file") {
    temp_dir dir;
    const std::string path = dir.file("does_not_exist.safetensors");
    CHECK_THROWS_WITH_AS(
        (void)mnemo::read_safetensors(path),
        ("mnemo: safetensors: cannot open '" + path + "' for reading: No such file or directory").c_str(),
        mnemo::error);
    CHECK_THROWS_WITH_AS((void)mnemo::read_safetensors(dir.path.string()), has("not a regular file"), mnemo::error);
}

TEST_CASE("safetensors: rejects a truncated file") {
    temp_dir dir;
    check_rejected(dir, {}, {"is truncated", "it has 0 bytes", "8-byte header length"});
    check_rejected(dir, {0x10, 0, 0, 0, 0}, {"is truncated", "it has 5 bytes"});
    // A valid file cut anywhere short of its end is rejected (and never read out of bounds).
    const float v[] = {1, 2, 3};
    const auto t = mnemo::make_safetensors_tensor("v", {3}, v);
    const std::string good = dir.file("good.safetensors");
    mnemo::write_safetensors(good, {t});
    const auto bytes = read_bytes(good);
    for (std::size_t n = 0; n < bytes.size(); ++n) {
        INFO("cut at ", n, " of ", bytes.size());
        const std::vector<std::uint8_t> cut(bytes.begin(), bytes.begin() + static_cast<std::ptrdiff_t>(n));
        CHECK_THROWS_AS((void)mnemo::parse_safetensors(cut.data(), cut.size()), mnemo::error);
    }
    CHECK(mnemo::parse_safetensors(bytes.data(), bytes.size()).to_vector<float>("v") == std::vector<float>{1, 2, 3});
}

TEST_CASE("safetensors: rejects a header length beyond the file") {
    temp_dir dir;
    const std::string header = R"({"x":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})";
    check_rejected(dir, image(header, f32_bytes({1}), 1000),
                   {"declares a header of 1000 bytes", "beyond the end of the file"});
    // An absurd length is refused before anything is allocated for it.
    check_rejected(dir, image(header, {}, std::uint64_t{1} << 62),
                   {"declares a header of 4611686018427387904 bytes", "more than the limit of 100000000"});
    check_rejected(dir, image(header, {}, ~std::uint64_t{0}), {"more than the limit"});
    check_rejected(dir, image("{", {}), {"too short for a JSON object"});
}

TEST_CASE("safetensors: rejects malformed JSON") {
    temp_dir dir;
    check_rejected(dir, image(R"({"x":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},})", f32_bytes({1})),
                   {"malformed JSON at byte 54 of the header (byte 62 of the file)", "expected a string key"});
    check_rejected(dir, image(R"({"x":{"dtype":"F32" "shape":[1]}})", {}),
                   {"malformed JSON at byte 20 of the header", "expected ',' or '}'"});
    check_rejected(dir, image(std::string("{\"x\":{}}\0\0\0\0\0\0\0\0", 16), {}),
                   {"malformed JSON", "expected the end of the document"});  // NUL padding is not whitespace
    check_rejected(dir, image(R"({"x":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"x":{}})", f32_bytes({1})),
                   {"malformed JSON", "duplicate key \"x\""});
    check_rejected(dir, image(R"([{"x":1}])", {}), {"the header is not a JSON object", "begins with '['"});
    check_rejected(dir, image(R"( {})", {}), {"the header is not a JSON object", "begins with ' '"});
}

TEST_CASE("safetensors: rejects tensor entries without dtype, shape or data_offsets") {
    temp_dir dir;
    check_rejected(dir, image(R"({"w":{"shape":[1],"data_offsets":[0,4]}})", f32_bytes({1})),
                   {"tensor 'w'", "no \"dtype\""});
    check_rejected(dir, image(R"({"w":{"dtype":"F32","data_offsets":[0,4]}})", f32_bytes({1})),
                   {"tensor 'w'", "no \"shape\""});
    check_rejected(dir, image(R"({"w":{"dtype":"F32","shape":[1]}})", f32_bytes({1})),
                   {"tensor 'w'", "no \"data_offsets\""});
    check_rejected(dir, image(R"({"w":[1,2]})", {}), {"tensor 'w'", "the entry is an array"});
    check_rejected(dir, image(R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4],"extra":1}})", f32_bytes({1})),
                   {"tensor 'w'", "unexpected key \"extra\""});
    check_rejected(dir, image(R"({"w":{"dtype":32,"shape":[1],"data_offsets":[0,4]}})", f32_bytes({1})),
                   {"tensor 'w'", "\"dtype\" must be a string"});
    check_rejected(dir, image(R"({"":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", f32_bytes({1})),
                   {"empty name"});
    check_rejected(dir, image(R"({"__metadata__":{"a":1}})", {}),
                   {"\"__metadata__\" must map strings to strings", "'a'"});
    check_rejected(dir, image(R"({"__metadata__":"x"})", {}), {"\"__metadata__\" must be an object"});
}

TEST_CASE("safetensors: rejects an unknown dtype and names it") {
    temp_dir dir;
    check_rejected(dir, image(R"({"layer.w":{"dtype":"F33","shape":[1],"data_offsets":[0,4]}})", f32_bytes({1})),
                   {"tensor 'layer.w'", "unknown dtype \"F33\""});
    check_rejected(dir, image(R"({"w":{"dtype":"f32","shape":[1],"data_offsets":[0,4]}})", f32_bytes({1})),
                   {"tensor 'w'", "unknown dtype \"f32\""});
}

TEST_CASE("safetensors: rejects negative and non-integer shapes") {
    temp_dir dir;
    check_rejected(dir, image(R"({"w":{"dtype":"F32","shape":[2,-1],"data_offsets":[0,4]}})", f32_bytes({1})),
                   {"tensor 'w'", "extent 1 of the shape is negative (-1)"});
    check_rejected(dir, image(R"({"w":{"dtype":"F32","shape":[1.0],"data_offsets":[0,4]}})", f32_bytes({1})),
                   {"tensor 'w'", "extent 0 of the shape is not an integer"});
    check_rejected(dir, image(R"({"w":{"dtype":"F32","shape":["1"],"data_offsets":[0,4]}})", f32_bytes({1})),
                   {"tensor 'w'", "not an integer (it is a string)"});
    check_rejected(dir, image(R"({"w":{"dtype":"F32","shape":4,"data_offsets":[0,4]}})", f32_bytes({1})),
                   {"tensor 'w'", "\"shape\" must be an array"});
    check_rejected(dir,
                   image(R"({"w":{"dtype":"F64","shape":[4294967296,4294967296],"data_offsets":[0,8]}})",
                         std::vector<std::uint8_t>(8)),
                   {"tensor 'w'", "has too many elements"});
}

TEST_CASE("safetensors: rejects data_offsets out of range") {
    temp_dir dir;
    check_rejected(dir, image(R"({"w":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})", f32_bytes({1, 2})),
                   {"tensor 'w'", "data_offsets [0, 16] are out of range of the data section, which has 8 bytes"});
    check_rejected(dir, image(R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[8,4]}})", f32_bytes({1, 2})),
                   {"tensor 'w'", "begin > end"});
    check_rejected(dir, image(R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[-4,0]}})", f32_bytes({1})),
                   {"tensor 'w'", "begin must be a non-negative integer"});
    check_rejected(dir, image(R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4,8]}})", f32_bytes({1})),
                   {"tensor 'w'", "must be [begin, end]", "an array of 3 values"});
    check_rejected(
        dir, image(R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[0,18446744073709551615]}})", f32_bytes({1})),
        {"tensor 'w'", "end must be a non-negative integer"});
}

TEST_CASE("safetensors: rejects overlapping offsets and names both tensors") {
    temp_dir dir;
    const std::string header = R"({"first":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                               R"("second":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})";
    check_rejected(dir, image(header, f32_bytes({1, 2, 3})),
                   {"tensors 'first' (bytes [0, 8)) and 'second' (bytes [4, 12)) overlap"});
    // Two names for the same bytes: the aliasing a duplicate-tolerant reader would miss.
    const std::string alias = R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                              R"("b":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})";
    check_rejected(dir, image(alias, f32_bytes({1})), {"'a'", "'b'", "overlap"});
    // An empty tensor inside another one's bytes.
    const std::string inside = R"({"big":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                               R"("empty":{"dtype":"F32","shape":[0],"data_offsets":[4,4]}})";
    check_rejected(dir, image(inside, f32_bytes({1, 2})), {"'big'", "'empty'", "overlap"});
}

TEST_CASE("safetensors: rejects a byte size that does not match the shape") {
    temp_dir dir;
    check_rejected(dir,
                   image(R"({"w":{"dtype":"F32","shape":[2,3],"data_offsets":[0,20]}})", std::vector<std::uint8_t>(20)),
                   {"tensor 'w'", "dtype F32 and shape [2, 3] need 24 bytes, but data_offsets [0, 20] hold 20"});
    check_rejected(dir, image(R"({"w":{"dtype":"BF16","shape":[],"data_offsets":[0,4]}})", f32_bytes({1})),
                   {"tensor 'w'", "shape [] need 2 bytes", "hold 4"});
}

TEST_CASE("safetensors: rejects gaps and trailing bytes in the data section") {
    temp_dir dir;
    const std::string gap = R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                            R"("b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}})";
    check_rejected(dir, image(gap, f32_bytes({1, 2, 3})),
                   {"bytes [4, 8) of the data section belong to no tensor", "gap before tensor 'b'", "cover"});
    check_rejected(dir, image(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", f32_bytes({1, 2})),
                   {"bytes [4, 8) of the data section belong to no tensor", "trailing bytes"});
    check_rejected(dir, image(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", f32_bytes({1, 2})),
                   {"bytes [0, 4)", "gap before tensor 'a'"});
    check_rejected(dir, image("{}", f32_bytes({1})), {"bytes [0, 4)", "trailing bytes"});
    // An empty file body is fine.
    const auto ok = image("{}      ", {});
    CHECK(mnemo::parse_safetensors(ok.data(), ok.size()).size() == 0);
}

// ---------------------------------------------------------------------------------------------
// Loading into a model
// ---------------------------------------------------------------------------------------------

namespace {
void declare_model(mnemo::parameter_set<float>& ps, mnemo::index_t in) {
    ps.declare("x.weight", {4, in});
    ps.declare("x.bias", {4});
    ps.allocate();
}
}  // namespace

TEST_CASE("safetensors: rejects a shape that does not match the model") {
    temp_dir dir;
    const std::string path = dir.file("model.safetensors");
    mnemo::parameter_set<float> saved;
    declare_model(saved, 3);
    mnemo::save_parameters(path, saved);
    mnemo::parameter_set<float> model;
    declare_model(model, 5);
    std::fill(model.values(), model.values() + model.size(), 9.0f);
    CHECK_THROWS_WITH_AS(
        mnemo::load_parameters(path, model),
        ("mnemo: safetensors: tensor 'x.weight' has shape [4, 3] in '" + path + "' but the model expects [4, 5]")
            .c_str(),
        mnemo::error);
    // Nothing was loaded: x.bias matched, but the load checks everything before copying anything.
    for (mnemo::index_t i = 0; i < model.size(); ++i) REQUIRE(model.values()[i] == 9.0f);
}

TEST_CASE("safetensors: rejects a checkpoint missing a tensor of the model") {
    temp_dir dir;
    const std::string path = dir.file("model.safetensors");
    const float b[4] = {};
    mnemo::safetensors_writer w(path);
    w.add("x.bias", {4}, b).commit();
    mnemo::parameter_set<float> model;
    declare_model(model, 3);
    CHECK_THROWS_WITH_AS(mnemo::load_parameters(path, model), has("tensor 'x.weight' is missing from '" + path + "'"),
                         mnemo::error);
}

TEST_CASE("safetensors: rejects an unexpected tensor unless asked to ignore it") {
    temp_dir dir;
    const std::string path = dir.file("model.safetensors");
    mnemo::parameter_set<float> saved;
    saved.declare("x.weight", {4, 3});
    saved.declare("x.bias", {4});
    saved.declare("y.extra", {2});
    saved.allocate();
    saved.values()[0] = 1.5f;
    mnemo::save_parameters(path, saved);
    mnemo::parameter_set<float> model;
    declare_model(model, 3);
    CHECK_THROWS_WITH_AS(mnemo::load_parameters(path, model), has("unexpected tensor 'y.extra' in '" + path + "'"),
                         mnemo::error);
    CHECK(model.values()[0] == 0.0f);
    mnemo::load_parameters(path, model, {.ignore_unexpected = true});
    CHECK(model.values()[0] == 1.5f);
}

TEST_CASE("safetensors: rejects parameters stored as integers") {
    temp_dir dir;
    const std::string path = dir.file("model.safetensors");
    const std::int32_t w[12] = {};
    const float b[4] = {};
    mnemo::safetensors_writer wr(path);
    wr.add("x.weight", {4, 3}, w).add("x.bias", {4}, b).commit();
    mnemo::parameter_set<float> model;
    declare_model(model, 3);
    CHECK_THROWS_WITH_AS(
        mnemo::load_parameters(path, model),
        has("tensor 'x.weight' in '" + path + "' has dtype I32; parameters must be stored as F32 or F64"),
        mnemo::error);
}

// ---------------------------------------------------------------------------------------------
// Atomic writes
// ---------------------------------------------------------------------------------------------

TEST_CASE("safetensors: a failed write leaves the previous checkpoint intact") {
    temp_dir dir;
    const std::string path = dir.file("ckpt.safetensors");
    const auto v = random_values<float>(16, 41);
    mnemo::write_safetensors(path, {mnemo::make_safetensors_tensor("v", {16}, v.data())});
    const auto before = read_bytes(path);
    CHECK(dir.listing() == std::vector<std::string>{"ckpt.safetensors"});
    const auto w2 = random_values<float>(16, 42);
    const auto second = mnemo::make_safetensors_tensor("v", {16}, w2.data());

    SUBCASE("the temporary file cannot be created") {
        const std::string tmp = path + ".tmp." + std::to_string(::getpid());
        fs::create_directory(tmp);  // occupies the temporary name
        const std::string msg = error_of([&] { mnemo::write_safetensors(path, {second}); });
        CHECK(contains(msg, "cannot write '" + path + "'"));
        CHECK(contains(msg, "cannot create the temporary file '" + tmp + "'"));
        CHECK(contains(msg, "Is a directory"));
        CHECK(read_bytes(path) == before);
        CHECK(fs::is_directory(tmp));  // not ours to remove
        fs::remove(tmp);
        CHECK(dir.listing() == std::vector<std::string>{"ckpt.safetensors"});
    }
    SUBCASE("the directory does not exist") {
        const std::string missing = dir.file("no_such_dir/ckpt.safetensors");
        const std::string msg = error_of([&] { mnemo::write_safetensors(missing, {second}); });
        CHECK(contains(msg, "cannot write '" + missing + "'"));
        CHECK(contains(msg, "No such file or directory"));
        CHECK(dir.listing() == std::vector<std::string>{"ckpt.safetensors"});
    }
    SUBCASE("the target is a directory") {
        const std::string target = dir.file("taken");
        fs::create_directory(target);
        const std::string msg = error_of([&] { mnemo::write_safetensors(target, {second}); });
        CHECK(contains(msg, "renaming"));
        CHECK(contains(msg, "the previous file, if any, is unchanged"));
        CHECK(dir.listing() == std::vector<std::string>{"ckpt.safetensors", "taken"});
        CHECK(fs::is_empty(target));
    }
    SUBCASE("the disk fills up part way through the data") {
        // RLIMIT_FSIZE makes write() fail with EFBIG past the limit (with SIGXFSZ ignored), a
        // stand-in for a full disk that strikes after the temporary file exists.
        const auto big = random_values<float>(1 << 18, 43);  // 1 MiB
        rlimit old{};
        REQUIRE(::getrlimit(RLIMIT_FSIZE, &old) == 0);
        auto* old_handler = std::signal(SIGXFSZ, SIG_IGN);
        rlimit small = old;
        small.rlim_cur = 64 * 1024;
        REQUIRE(::setrlimit(RLIMIT_FSIZE, &small) == 0);
        std::string msg;
        try {
            mnemo::write_safetensors(path, {mnemo::make_safetensors_tensor("v", {1 << 18}, big.data())});
        } catch (const mnemo::error& e) {
            msg = e.what();
        }
        ::setrlimit(RLIMIT_FSIZE, &old);
        std::signal(SIGXFSZ, old_handler);
        INFO("message: ", msg);
        CHECK(contains(msg, "cannot write '" + path + "'"));
        CHECK(contains(msg, "File too large"));
        CHECK(read_bytes(path) == before);
        CHECK(dir.listing() == std::vector<std::string>{"ckpt.safetensors"});
    }
    SUBCASE("invalid tensors are refused before any file is touched") {
        CHECK_THROWS_WITH_AS(mnemo::write_safetensors(path, {second, second}), has("already added"), mnemo::error);
        CHECK_THROWS_WITH_AS(
            mnemo::write_safetensors(path, {mnemo::make_safetensors_tensor("bad\xff", {16}, w2.data())}),
            has("not valid UTF-8"), mnemo::error);
        mnemo::safetensors_tensor wrong = second;
        wrong.bytes.pop_back();
        CHECK_THROWS_WITH_AS(mnemo::write_safetensors(path, {wrong}), has("need 64 bytes, but the record holds 63"),
                             mnemo::error);
        CHECK(read_bytes(path) == before);
        CHECK(dir.listing() == std::vector<std::string>{"ckpt.safetensors"});
    }
    SUBCASE("a successful write replaces the file") {
        mnemo::write_safetensors(path, {second});
        CHECK(mnemo::read_safetensors(path).to_vector<float>("v") == w2);
        CHECK(dir.listing() == std::vector<std::string>{"ckpt.safetensors"});
    }
}

// ---------------------------------------------------------------------------------------------
// Mutated files
// ---------------------------------------------------------------------------------------------

TEST_CASE("safetensors: mutated files are rejected cleanly or read within bounds") {
    temp_dir dir;
    const std::string path = dir.file("seed.safetensors");
    const auto a = random_values<float>(6, 51);
    const std::int64_t s = 3;
    mnemo::safetensors_writer w(path);
    w.add("layers.0.w", {2, 3}, a.data()).add("step", {}, &s).set_metadata("k", "v").commit();
    const auto seed = read_bytes(path);
    std::uint64_t header_len = 0;
    std::memcpy(&header_len, seed.data(), 8);

    mnemo::rng r(52);
    int accepted = 0;
    for (int trial = 0; trial < 20000; ++trial) {
        auto m = seed;
        const int flips = 1 + static_cast<int>(r.next_u32() % 3);
        for (int k = 0; k < flips; ++k) {
            // Mostly the length and the header, where the parsing happens.
            const std::size_t span = r.next_u32() % 4 == 0 ? m.size() : static_cast<std::size_t>(8 + header_len);
            const std::size_t at = r.next_u32() % span;
            static const char interesting[] = "{}[],:\"\\0123456789-.eE \x01\xff";
            m[at] = r.next_u32() % 2 ? static_cast<std::uint8_t>(interesting[r.next_u32() % (sizeof(interesting) - 1)])
                                     : static_cast<std::uint8_t>(r.next_u32());
        }
        try {
            const auto f = mnemo::parse_safetensors(m.data(), m.size());
            ++accepted;
            std::size_t total = 0;  // whatever was accepted must tile the data section
            for (const auto& t : f.tensors()) total += t.bytes.size();
            REQUIRE(total <= m.size());
        } catch (const mnemo::error&) {
        }
    }
    CHECK(accepted > 0);  // flips in the data section leave the file valid
}
