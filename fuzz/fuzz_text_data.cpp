// libFuzzer harness: the trainer's data reader (mnemo/train/text_data.hpp) on arbitrary bytes: the
// vocabulary, the 90/10 split, the encoding, the default prompt; then a prompt (the input's second
// half) encoded against the first half's vocabulary, as `train --prompt` does. A mnemo::error is the
// expected answer to bad input; anything else is a finding.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include <mnemo/train/text_data.hpp>

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
    const std::string_view all(reinterpret_cast<const char*>(data), size);
    const std::string_view text = all.substr(0, size / 2), prompt = all.substr(size / 2);
    try {
        const mnemo::text_corpus c = mnemo::split_text(text, "fuzz.txt");
        if (c.train.size() + c.valid.size() != text.size()) __builtin_trap();
        for (mnemo::token_t t : c.train)
            if (t < 0 || t >= c.vocab.size() || c.vocab.byte(t) == '\0') __builtin_trap();
        (void)c.vocab.encode(c.valid_start, "the default prompt");
        (void)c.vocab.encode(prompt, "--prompt");
    } catch (const mnemo::error&) {
    }
    return 0;
}
