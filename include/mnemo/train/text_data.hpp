#pragma once
// Character-level text data: a byte vocabulary (the distinct bytes of the text, sorted; a token is
// its byte's index) and a text file split 90/10 into training and validation tokens.
//
// The file is untrusted input: an empty file, a directory, an unreadable file and a binary file (one
// holding a NUL byte) are errors naming the file; nothing else about the bytes is assumed.
#include <algorithm>
#include <array>
#include <cinttypes>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <string_view>
#include <system_error>
#include <vector>

#include "../core/error.hpp"
#include "../nn/embedding.hpp"

namespace mnemo {

/// Sorted distinct bytes; token id = index.
struct byte_vocabulary {
    std::vector<std::uint8_t> bytes;
    std::array<token_t, 256> ids{};

    static byte_vocabulary of_bytes(std::vector<std::uint8_t> b) {
        std::sort(b.begin(), b.end());
        b.erase(std::unique(b.begin(), b.end()), b.end());
        byte_vocabulary v;
        v.bytes = std::move(b);
        v.ids.fill(-1);
        for (std::size_t i = 0; i < v.bytes.size(); ++i) v.ids[v.bytes[i]] = token_t(i);
        return v;
    }
    static byte_vocabulary of_text(std::string_view text) {
        std::array<bool, 256> seen{};
        for (unsigned char c : text) seen[c] = true;
        std::vector<std::uint8_t> b;
        for (int c = 0; c < 256; ++c)
            if (seen[std::size_t(c)]) b.push_back(std::uint8_t(c));
        return of_bytes(std::move(b));
    }
    index_t size() const { return index_t(bytes.size()); }
    token_t id(char c) const { return ids[static_cast<unsigned char>(c)]; }
    char byte(token_t t) const { return static_cast<char>(bytes[std::size_t(t)]); }

    /// The tokens of `text`; a byte outside the vocabulary is an error naming `what` and the offset.
    std::vector<token_t> encode(std::string_view text, const char* what) const {
        std::vector<token_t> out(text.size());
        for (std::size_t i = 0; i < text.size(); ++i) {
            out[i] = id(text[i]);
            if (out[i] < 0)
                detail::fail(what, " has the byte 0x", hex_byte(static_cast<unsigned char>(text[i])), " at offset ", i,
                             ", which is not in the model's vocabulary");
        }
        return out;
    }
    std::string hex() const {
        std::string s;
        for (std::uint8_t b : bytes) s += hex_byte(b);
        return s;
    }
    static std::string hex_byte(unsigned char b) {
        const char* d = "0123456789abcdef";
        return {d[b >> 4], d[b & 15]};
    }
};

/// 64-bit FNV-1a of a string.
inline std::uint64_t fnv1a64(std::string_view s) {
    std::uint64_t h = 0xcbf29ce484222325ull;
    for (unsigned char c : s) h = (h ^ c) * 0x100000001b3ull;
    return h;
}

/// A text split 90/10 into training and validation tokens over its own byte vocabulary.
struct text_corpus {
    byte_vocabulary vocab;
    std::vector<token_t> train, valid;
    std::size_t bytes = 0, split = 0;  // the text's size; where validation starts
    std::string fingerprint;           // "<size>:<fnv1a64 hex>": identifies the text on resume
    std::string valid_start;           // up to 64 bytes of validation text from a line start
};

/// Splits `text` (named `name` in errors) into a text_corpus.
inline text_corpus split_text(std::string_view text, const std::string& name) {
    if (text.empty()) detail::fail("data file '", name, "' is empty");
    if (const std::size_t nul = text.find('\0'); nul != std::string_view::npos)
        detail::fail("data file '", name, "' looks binary (a NUL byte at offset ", nul, "); give a text file");
    text_corpus c;
    c.vocab = byte_vocabulary::of_text(text);
    c.bytes = text.size();
    c.split = text.size() * 9 / 10;
    c.train = c.vocab.encode(text.substr(0, c.split), "the data");
    c.valid = c.vocab.encode(text.substr(c.split), "the data");
    // 64 bytes of validation text from its first line start (not mid-word), where there is one.
    const std::size_t line = text.find('\n', c.split);
    const bool line_start = line != std::string_view::npos && line + 1 < std::min(c.split + 64, text.size());
    c.valid_start = std::string(text.substr(line_start ? line + 1 : c.split, 64));
    char f[64];
    std::snprintf(f, sizeof f, "%zu:%016" PRIx64, text.size(), fnv1a64(text));
    c.fingerprint = f;
    return c;
}

/// Reads the text file at `path` and splits it (split_text).
inline text_corpus read_text_corpus(const std::string& path) {
    std::error_code ec;
    if (!std::filesystem::exists(path, ec)) detail::fail("data file '", path, "' does not exist");
    if (std::filesystem::is_directory(path, ec)) detail::fail("data file '", path, "' is a directory");
    std::ifstream in(path, std::ios::binary);
    if (!in.good()) detail::fail("cannot open data file '", path, "'");
    const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    if (in.bad()) detail::fail("cannot read data file '", path, "'");
    return split_text(text, path);
}

}  // namespace mnemo
