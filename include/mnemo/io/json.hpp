#pragma once
// A small, strict JSON parser (RFC 8259) and a string-escaping writer helper: enough for
// safetensors headers and small config files, without a third-party dependency.
//
// Strict means: no comments, no trailing commas, no leading zeros or '+', no NaN/Infinity, no
// control characters or invalid UTF-8 inside strings, no lone surrogates in \u escapes, no
// duplicate object keys (the safetensors spec forbids them, and two parsers resolving a duplicate
// differently is a known attack on model files), nothing but whitespace after the value, and no
// number beyond the range of a double (1e999 and 1e-400 are errors, not infinity or zero).
// Every error is a json::parse_error (a mnemo::error) whose message gives the byte position:
//   "mnemo: malformed JSON at byte 17: expected ':' after an object key, found ','"
// Nesting is limited (parse_options::max_depth) so hostile input cannot overflow the stack.
// Memory: about 72 bytes per parsed value, so a document costs at most ~40x its length.
#include <charconv>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <system_error>
#include <unordered_set>
#include <utility>
#include <vector>

#include "../core/error.hpp"

namespace mnemo::json {

enum class kind : std::uint8_t { null, boolean, number, string, array, object };

/// The name of a kind, for error messages ("an object", "a string", ...).
constexpr const char* kind_name(kind k) {
    switch (k) {
        case kind::null: return "null";
        case kind::boolean: return "a boolean";
        case kind::number: return "a number";
        case kind::string: return "a string";
        case kind::array: return "an array";
        case kind::object: return "an object";
    }
    return "an unknown kind";
}

/// Thrown for malformed input; position() is the byte offset into the text where parsing stopped
/// and detail() the message without the "mnemo: malformed JSON at byte N: " prefix, so a caller
/// (the safetensors reader) can restate it with its own context.
class parse_error : public error {
public:
    parse_error(std::size_t position, std::string detail)
        : error("mnemo: malformed JSON at byte " + std::to_string(position) + ": " + detail),
          position_(position),
          detail_(std::move(detail)) {}
    std::size_t position() const { return position_; }
    const std::string& detail() const { return detail_; }

private:
    std::size_t position_;
    std::string detail_;
};

class value;
namespace detail {
class parser;
}

/// A parsed JSON value. Objects keep their members in document order.
class value {
public:
    value() = default;

    kind type() const { return kind_; }
    bool is_null() const { return kind_ == kind::null; }
    bool is_bool() const { return kind_ == kind::boolean; }
    bool is_number() const { return kind_ == kind::number; }
    bool is_string() const { return kind_ == kind::string; }
    bool is_array() const { return kind_ == kind::array; }
    bool is_object() const { return kind_ == kind::object; }
    /// True for a number written without fraction or exponent that fits in int64 exactly
    /// ("12", "-0"); "12.0", "1e3" and 2^63 are numbers but not integers.
    bool is_integer() const { return kind_ == kind::number && is_integer_; }

    bool as_bool() const {
        expect(kind::boolean);
        return scalar_.boolean;
    }
    /// The number as a double (integers beyond 2^53 round).
    double as_double() const {
        expect(kind::number);
        return is_integer_ ? static_cast<double>(scalar_.integer) : scalar_.number;
    }
    /// The exact integer; throws unless is_integer().
    std::int64_t as_int64() const {
        MNEMO_CHECK(is_integer(), "json: expected an integer, found ",
                    kind_ == kind::number ? "a non-integer number" : kind_name(kind_));
        return scalar_.integer;
    }
    const std::string& as_string() const {
        expect(kind::string);
        return string_;
    }

    /// Number of elements (array) or members (object); 0 for scalars.
    std::size_t size() const {
        if (kind_ == kind::array) return items_.size();
        if (kind_ == kind::object) return items_.size() / 2;
        return 0;
    }
    /// Array element i.
    const value& operator[](std::size_t i) const {
        expect(kind::array);
        MNEMO_CHECK(i < items_.size(), "json: index ", i, " out of range of an array of ", items_.size());
        return items_[i];
    }
    /// Key and value of object member i, in document order.
    const std::string& key(std::size_t i) const {
        expect(kind::object);
        MNEMO_CHECK(i < size(), "json: member ", i, " out of range of an object of ", size());
        return items_[2 * i].string_;
    }
    const value& member(std::size_t i) const {
        expect(kind::object);
        MNEMO_CHECK(i < size(), "json: member ", i, " out of range of an object of ", size());
        return items_[2 * i + 1];
    }
    /// The member named `k`, or nullptr (also for non-objects). Linear: objects here are small,
    /// and callers that need many lookups iterate once instead.
    const value* find(std::string_view k) const {
        if (kind_ != kind::object) return nullptr;
        for (std::size_t i = 0; i + 1 < items_.size(); i += 2)
            if (items_[i].string_ == k) return &items_[i + 1];
        return nullptr;
    }

private:
    friend class detail::parser;

    void expect(kind k) const {
        MNEMO_CHECK(kind_ == k, "json: expected ", kind_name(k), ", found ", kind_name(kind_));
    }

    kind kind_ = kind::null;
    bool is_integer_ = false;
    union {
        bool boolean;
        std::int64_t integer;
        double number;
    } scalar_{};
    std::string string_;
    // Array: the elements. Object: key, value, key, value, ... (keys as string values), which keeps
    // a value at 72 bytes instead of carrying a second vector for keys.
    std::vector<value> items_;
};

struct parse_options {
    /// Deepest nesting of arrays and objects accepted; safetensors headers need 3.
    std::size_t max_depth = 64;
};

namespace detail {

class parser {
public:
    parser(std::string_view text, parse_options opts) : s_(text), opts_(opts) {}

    value parse_document() {
        value v;
        skip_ws();
        parse_value(v, 0);
        skip_ws();
        if (pos_ != s_.size()) fail_found("expected the end of the document");
        return v;
    }

private:
    [[noreturn]] void fail_at(std::size_t pos, std::string detail) const { throw parse_error(pos, std::move(detail)); }
    [[noreturn]] void fail(std::string detail) const { fail_at(pos_, std::move(detail)); }
    // "expected X, found 'c'" with the offending character made printable.
    [[noreturn]] void fail_found(const std::string& expected) const { fail(expected + ", found " + describe_here()); }
    std::string describe_here() const {
        if (pos_ >= s_.size()) return "the end of the input";
        const auto c = static_cast<unsigned char>(s_[pos_]);
        if (c >= 0x20 && c < 0x7f) return std::string("'") + static_cast<char>(c) + "'";
        static constexpr char hex[] = "0123456789abcdef";
        return std::string("byte 0x") + hex[c >> 4] + hex[c & 15];
    }

    bool at_end() const { return pos_ >= s_.size(); }
    char peek() const { return s_[pos_]; }

    void skip_ws() {
        while (!at_end()) {
            const char c = peek();
            if (c != ' ' && c != '\t' && c != '\n' && c != '\r') break;
            ++pos_;
        }
    }

    void expect_literal(std::string_view lit) {
        if (s_.substr(pos_, lit.size()) != lit) fail_found("expected '" + std::string(lit) + "'");
        pos_ += lit.size();
    }

    void parse_value(value& v, std::size_t depth) {
        if (at_end()) fail_found("expected a value");
        switch (peek()) {
            case '{': parse_object(v, depth + 1); return;
            case '[': parse_array(v, depth + 1); return;
            case '"':
                v.kind_ = kind::string;
                parse_string(v.string_);
                return;
            case 't':
                expect_literal("true");
                v.kind_ = kind::boolean;
                v.scalar_.boolean = true;
                return;
            case 'f':
                expect_literal("false");
                v.kind_ = kind::boolean;
                v.scalar_.boolean = false;
                return;
            case 'n':
                expect_literal("null");
                v.kind_ = kind::null;
                return;
            default:
                if (peek() == '-' || (peek() >= '0' && peek() <= '9')) {
                    parse_number(v);
                    return;
                }
                fail_found("expected a value");
        }
    }

    void check_depth(std::size_t depth) const {
        if (depth > opts_.max_depth)
            fail("nesting deeper than " + std::to_string(opts_.max_depth) + " levels of arrays and objects");
    }

    void parse_array(value& v, std::size_t depth) {
        check_depth(depth);
        v.kind_ = kind::array;
        ++pos_;  // '['
        skip_ws();
        if (!at_end() && peek() == ']') {
            ++pos_;
            return;
        }
        for (;;) {
            skip_ws();
            v.items_.emplace_back();
            parse_value(v.items_.back(), depth);
            skip_ws();
            if (at_end()) fail_found("expected ',' or ']' in an array");
            if (peek() == ',') {
                ++pos_;
                continue;
            }
            if (peek() == ']') {
                ++pos_;
                return;
            }
            fail_found("expected ',' or ']' in an array");
        }
    }

    void parse_object(value& v, std::size_t depth) {
        check_depth(depth);
        v.kind_ = kind::object;
        ++pos_;  // '{'
        skip_ws();
        if (!at_end() && peek() == '}') {
            ++pos_;
            return;
        }
        // Duplicate keys: a linear scan while the object is small, a hash set once it is not, so a
        // header with many thousands of tensors stays linear.
        constexpr std::size_t linear_limit = 16;
        std::unordered_set<std::string> seen;
        for (;;) {
            skip_ws();
            if (at_end() || peek() != '"') fail_found("expected a string key in an object");
            const std::size_t key_pos = pos_;
            value key;
            key.kind_ = kind::string;
            parse_string(key.string_);
            const std::size_t members = v.items_.size() / 2;
            bool duplicate = false;
            if (members < linear_limit) {
                for (std::size_t i = 0; i < v.items_.size(); i += 2)
                    if (v.items_[i].string_ == key.string_) duplicate = true;
            } else {
                if (seen.empty())
                    for (std::size_t i = 0; i < v.items_.size(); i += 2) seen.insert(v.items_[i].string_);
                duplicate = !seen.insert(key.string_).second;
            }
            if (duplicate) fail_at(key_pos, "duplicate key \"" + key.string_ + "\" in an object");
            skip_ws();
            if (at_end() || peek() != ':') fail_found("expected ':' after an object key");
            ++pos_;
            skip_ws();
            v.items_.push_back(std::move(key));
            v.items_.emplace_back();
            parse_value(v.items_.back(), depth);
            skip_ws();
            if (at_end()) fail_found("expected ',' or '}' in an object");
            if (peek() == ',') {
                ++pos_;
                continue;
            }
            if (peek() == '}') {
                ++pos_;
                return;
            }
            fail_found("expected ',' or '}' in an object");
        }
    }

    static int hex_digit(char c) {
        if (c >= '0' && c <= '9') return c - '0';
        if (c >= 'a' && c <= 'f') return c - 'a' + 10;
        if (c >= 'A' && c <= 'F') return c - 'A' + 10;
        return -1;
    }

    // Four hex digits after "\u"; pos_ is at the first digit.
    std::uint32_t parse_hex4() {
        std::uint32_t u = 0;
        for (int i = 0; i < 4; ++i) {
            const int d = at_end() ? -1 : hex_digit(peek());
            if (d < 0) fail_found("expected four hex digits after \\u");
            u = u * 16 + static_cast<std::uint32_t>(d);
            ++pos_;
        }
        return u;
    }

    static void append_utf8(std::string& out, std::uint32_t cp) {
        if (cp < 0x80) {
            out += static_cast<char>(cp);
        } else if (cp < 0x800) {
            out += static_cast<char>(0xC0 | (cp >> 6));
            out += static_cast<char>(0x80 | (cp & 0x3F));
        } else if (cp < 0x10000) {
            out += static_cast<char>(0xE0 | (cp >> 12));
            out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
            out += static_cast<char>(0x80 | (cp & 0x3F));
        } else {
            out += static_cast<char>(0xF0 | (cp >> 18));
            out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
            out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
            out += static_cast<char>(0x80 | (cp & 0x3F));
        }
    }

    // One raw (unescaped) UTF-8 sequence starting at pos_, validated: no overlong forms, no
    // encoded surrogates, nothing above U+10FFFF (the rules of RFC 3629).
    void copy_utf8_sequence(std::string& out) {
        const std::size_t start = pos_;
        const auto b0 = static_cast<unsigned char>(s_[pos_]);
        std::size_t len;
        unsigned char lo = 0x80, hi = 0xBF;  // allowed range of the second byte
        if (b0 >= 0xC2 && b0 <= 0xDF) {
            len = 2;
        } else if (b0 >= 0xE0 && b0 <= 0xEF) {
            len = 3;
            if (b0 == 0xE0) lo = 0xA0;  // overlong
            if (b0 == 0xED) hi = 0x9F;  // surrogates
        } else if (b0 >= 0xF0 && b0 <= 0xF4) {
            len = 4;
            if (b0 == 0xF0) lo = 0x90;  // overlong
            if (b0 == 0xF4) hi = 0x8F;  // above U+10FFFF
        } else {
            fail("invalid UTF-8 in a string (byte 0x" + hex_byte(b0) + ")");
        }
        for (std::size_t i = 1; i < len; ++i) {
            if (start + i >= s_.size())
                fail_at(start, "invalid UTF-8 in a string (sequence cut off by the end of the input)");
            const auto b = static_cast<unsigned char>(s_[start + i]);
            const unsigned char l = i == 1 ? lo : 0x80, h = i == 1 ? hi : 0xBF;
            if (b < l || b > h) fail_at(start + i, "invalid UTF-8 in a string (byte 0x" + hex_byte(b) + ")");
        }
        out.append(s_.data() + start, len);
        pos_ = start + len;
    }

    static std::string hex_byte(unsigned char b) {
        static constexpr char hex[] = "0123456789abcdef";
        return {hex[b >> 4], hex[b & 15]};
    }

    // pos_ is at the opening quote.
    void parse_string(std::string& out) {
        const std::size_t open = pos_;
        ++pos_;
        for (;;) {
            if (at_end()) fail_at(open, "unterminated string (expected a closing '\"' before the end of the input)");
            const auto c = static_cast<unsigned char>(peek());
            if (c == '"') {
                ++pos_;
                return;
            }
            if (c < 0x20)
                fail("expected an escape sequence instead of a raw control character (byte 0x" + hex_byte(c) +
                     ") in a string");
            if (c >= 0x80) {
                copy_utf8_sequence(out);
                continue;
            }
            if (c != '\\') {
                // A run of plain printable ASCII is appended in one piece.
                std::size_t end = pos_ + 1;
                while (end < s_.size()) {
                    const auto d = static_cast<unsigned char>(s_[end]);
                    if (d == '"' || d == '\\' || d < 0x20 || d >= 0x80) break;
                    ++end;
                }
                out.append(s_.data() + pos_, end - pos_);
                pos_ = end;
                continue;
            }
            const std::size_t esc = pos_;
            ++pos_;
            if (at_end()) fail_found("expected an escape character after '\\'");
            const char e = peek();
            ++pos_;
            switch (e) {
                case '"': out += '"'; break;
                case '\\': out += '\\'; break;
                case '/': out += '/'; break;
                case 'b': out += '\b'; break;
                case 'f': out += '\f'; break;
                case 'n': out += '\n'; break;
                case 'r': out += '\r'; break;
                case 't': out += '\t'; break;
                case 'u': {
                    std::uint32_t cp = parse_hex4();
                    if (cp >= 0xDC00 && cp <= 0xDFFF)
                        fail_at(esc, "lone low surrogate \\u" + hex4(cp) + " in a string");
                    if (cp >= 0xD800 && cp <= 0xDBFF) {
                        // A high surrogate must be followed by an escaped low one.
                        if (s_.substr(pos_, 2) != "\\u")
                            fail_at(esc,
                                    "expected a low surrogate \\uDC00-\\uDFFF after the high surrogate \\u" + hex4(cp));
                        pos_ += 2;
                        const std::uint32_t lo = parse_hex4();
                        if (lo < 0xDC00 || lo > 0xDFFF)
                            fail_at(esc,
                                    "expected a low surrogate \\uDC00-\\uDFFF after the high surrogate \\u" + hex4(cp));
                        cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
                    }
                    append_utf8(out, cp);
                    break;
                }
                default:
                    --pos_;  // point at the character after the backslash
                    fail_found("expected one of \\\" \\\\ \\/ \\b \\f \\n \\r \\t \\u after '\\'");
            }
        }
    }

    static std::string hex4(std::uint32_t u) {
        static constexpr char hex[] = "0123456789ABCDEF";
        return {hex[(u >> 12) & 15], hex[(u >> 8) & 15], hex[(u >> 4) & 15], hex[u & 15]};
    }

    bool digit_here() const { return !at_end() && peek() >= '0' && peek() <= '9'; }

    // -?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?
    void parse_number(value& v) {
        const std::size_t start = pos_;
        if (peek() == '-') ++pos_;
        if (!digit_here()) fail_found("expected a digit in a number");
        if (peek() == '0') {
            ++pos_;
            if (digit_here()) fail("expected no leading zero in a number");
        } else {
            while (digit_here()) ++pos_;
        }
        bool integral = true;
        if (!at_end() && peek() == '.') {
            integral = false;
            ++pos_;
            if (!digit_here()) fail_found("expected a digit after the decimal point");
            while (digit_here()) ++pos_;
        }
        if (!at_end() && (peek() == 'e' || peek() == 'E')) {
            integral = false;
            ++pos_;
            if (!at_end() && (peek() == '+' || peek() == '-')) ++pos_;
            if (!digit_here()) fail_found("expected a digit in the exponent");
            while (digit_here()) ++pos_;
        }
        const char* first = s_.data() + start;
        const char* last = s_.data() + pos_;
        v.kind_ = kind::number;
        if (integral) {
            std::int64_t i = 0;
            const auto r = std::from_chars(first, last, i);
            if (r.ec == std::errc() && r.ptr == last) {
                v.is_integer_ = true;
                v.scalar_.integer = i;
                return;
            }
            // Too large for int64: still a valid number, held as a double.
        }
        double d = 0;
        const auto r = std::from_chars(first, last, d);
        if (r.ec == std::errc::result_out_of_range)
            fail_at(start, "number " + std::string(first, last) + " is out of the range of a double");
        if (r.ec != std::errc() || r.ptr != last) fail_at(start, "expected a number");
        v.is_integer_ = false;
        v.scalar_.number = d;
    }

    std::string_view s_;
    parse_options opts_;
    std::size_t pos_ = 0;
};

}  // namespace detail

/// Parses a complete JSON document (surrounding whitespace allowed). Throws json::parse_error.
inline value parse(std::string_view text, parse_options opts = {}) {
    return detail::parser(text, opts).parse_document();
}

/// Appends `s` to `out` as a JSON string literal: quotes added, '"' '\\' and control characters
/// escaped. Other bytes pass through unchanged (the caller supplies UTF-8).
inline void append_quoted(std::string& out, std::string_view s) {
    static constexpr char hex[] = "0123456789abcdef";
    out += '"';
    for (const char ch : s) {
        const auto c = static_cast<unsigned char>(ch);
        switch (c) {
            case '"': out += "\\\""; break;
            case '\\': out += "\\\\"; break;
            case '\b': out += "\\b"; break;
            case '\f': out += "\\f"; break;
            case '\n': out += "\\n"; break;
            case '\r': out += "\\r"; break;
            case '\t': out += "\\t"; break;
            default:
                if (c < 0x20) {
                    out += "\\u00";
                    out += hex[c >> 4];
                    out += hex[c & 15];
                } else {
                    out += ch;
                }
        }
    }
    out += '"';
}

/// `s` as a JSON string literal.
inline std::string quoted(std::string_view s) {
    std::string out;
    out.reserve(s.size() + 2);
    append_quoted(out, s);
    return out;
}

}  // namespace mnemo::json
