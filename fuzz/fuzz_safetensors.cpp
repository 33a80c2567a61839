// libFuzzer harness: the safetensors reader on arbitrary bytes. Every tensor that parses is also
// converted (to float or int64, as its dtype allows), so the decoders run on hostile data too.
// A mnemo::error is the expected answer to bad input; anything else (a crash, a sanitizer report, an
// exception of another type, a leak) is a finding.
#include <cstddef>
#include <cstdint>

#include <mnemo/io/safetensors.hpp>

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
    try {
        const mnemo::safetensors_file f = mnemo::parse_safetensors(data, size, "fuzz.safetensors");
        for (const auto& [k, v] : f.metadata()) (void)(k.size() + v.size());
        for (const mnemo::safetensors_tensor& t : f.tensors()) {
            if (!f.contains(t.name)) __builtin_trap();  // the index must find every tensor
            if (mnemo::is_convertible_float(t.type)) {
                (void)f.to_vector<float>(t.name);
            } else if (mnemo::is_convertible_integer(t.type)) {
                (void)f.to_vector<std::int64_t>(t.name);
            }
        }
    } catch (const mnemo::error&) {
    }
    return 0;
}
