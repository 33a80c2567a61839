#pragma once
// Which x86 microarchitecture this process runs on, read once from CPUID (vendor, family, model), for
// the kernels whose blocking was measured per microarchitecture (gemm_packed.hpp's packed_tuning,
// gemm.hpp's gemv_tuning).
// Only what was measured is told apart: AMD's Zen generations by family and model, Intel's
// Sapphire Rapids / Emerald Rapids Xeons (Golden Cove and Raptor Cove cores: 48 KiB L1d, 2 MiB L2 a
// core) and Granite Rapids Xeons (Redwood Cove: the same L1d and L2). Hypervisors do not always pass
// the model through (a Granite Rapids VM measured here reported model A7h, a client part's number),
// so a family-6 Intel CPU of no known Xeon model that has AMX (the tile registers only these Xeons
// have) counts as the newest of them. Everything else (other Intel cores, other vendors, non-x86
// builds) is `other` and gets the defaults.
#include <cstring>
#include <string_view>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

namespace mnemo::cpu_kernels {

enum class cpu_model { zen1, zen2, zen3, zen4, zen5, xeon_spr, xeon_gnr, other };

inline const char* cpu_model_name(cpu_model m) {
    switch (m) {
        case cpu_model::zen1: return "zen1";
        case cpu_model::zen2: return "zen2";
        case cpu_model::zen3: return "zen3";
        case cpu_model::zen4: return "zen4";
        case cpu_model::zen5: return "zen5";
        case cpu_model::xeon_spr: return "xeon-spr";
        case cpu_model::xeon_gnr: return "xeon-gnr";
        case cpu_model::other: break;
    }
    return "other";
}

/// The microarchitecture of an AMD CPU of CPUID family `family` and model `model` (the display
/// values, extended fields included): family 17h is Zen 1/Zen+ below model 30h and Zen 2 from it;
/// 19h is Zen 4 at models 10h-1Fh, 60h-7Fh and A0h-AFh and Zen 3 elsewhere; 1Ah is Zen 5.
inline cpu_model amd_cpu_model(unsigned family, unsigned model) {
    if (family == 0x17) return model < 0x30 ? cpu_model::zen1 : cpu_model::zen2;
    if (family == 0x19) {
        const bool zen4 = (model >= 0x10 && model <= 0x1f) || (model >= 0x60 && model <= 0x7f) || (model >= 0xa0 && model <= 0xaf);
        return zen4 ? cpu_model::zen4 : cpu_model::zen3;
    }
    if (family == 0x1a) return cpu_model::zen5;
    return cpu_model::other;
}

/// The microarchitecture of an Intel CPU of CPUID family `family` and model `model` (display
/// values), `amx` whether it has AMX tiles (CPUID leaf 7, EDX bit 24): family 6, model 8Fh (Sapphire
/// Rapids) or CFh (Emerald Rapids) is xeon_spr; ADh or AEh (Granite Rapids), or any other family-6
/// model with AMX (a hypervisor's stand-in model), is xeon_gnr; the rest is other.
inline cpu_model intel_cpu_model(unsigned family, unsigned model, bool amx = false) {
    if (family != 6) return cpu_model::other;
    if (model == 0x8f || model == 0xcf) return cpu_model::xeon_spr;
    if (model == 0xad || model == 0xae || amx) return cpu_model::xeon_gnr;
    return cpu_model::other;
}

/// This machine's microarchitecture, detected once per process.
inline cpu_model this_cpu_model() {
    static const cpu_model model = [] {
#if defined(__x86_64__) || defined(__i386__)
        unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
        if (!__get_cpuid(0, &eax, &ebx, &ecx, &edx)) return cpu_model::other;
        char vendor[13] = {};
        std::memcpy(vendor, &ebx, 4);
        std::memcpy(vendor + 4, &edx, 4);
        std::memcpy(vendor + 8, &ecx, 4);
        const std::string_view v(vendor);
        if ((v != "AuthenticAMD" && v != "GenuineIntel") || !__get_cpuid(1, &eax, &ebx, &ecx, &edx)) return cpu_model::other;
        // Display family and model (Intel's SDM and AMD's manuals agree): the extended family is
        // added at base family Fh; the extended model is prefixed at base family 6 or Fh.
        const unsigned base_family = (eax >> 8) & 0xf, base_model = (eax >> 4) & 0xf;
        const unsigned family = base_family == 0xf ? base_family + ((eax >> 20) & 0xff) : base_family;
        const unsigned model = base_family == 0xf || base_family == 6 ? base_model | (((eax >> 16) & 0xf) << 4) : base_model;
        if (v == "AuthenticAMD") return amd_cpu_model(family, model);
        unsigned e7 = 0, b7 = 0, c7 = 0, d7 = 0;
        const bool amx = __get_cpuid_count(7, 0, &e7, &b7, &c7, &d7) && ((d7 >> 24) & 1u);
        return intel_cpu_model(family, model, amx);
#else
        return cpu_model::other;
#endif
    }();
    return model;
}

}  // namespace mnemo::cpu_kernels
