#pragma once
// Backend tags select kernels at compile time (as CUTLASS's architecture tags). A tensor view carries
// its backend in its type, so a device view passed to a CPU kernel does not compile.
//
//   mnemo::cpu   Eigen GEMM, xsimd element-wise kernels, OpenMP over independent rows.
//   mnemo::cuda  the seam for the CUDA backend: declared here; its kernels specialise ops<cuda>.
#include <concepts>
#include <type_traits>

namespace mnemo {

struct cpu {
    static constexpr const char* name = "cpu";
};
struct cuda {
    static constexpr const char* name = "cuda";
};

template <class B>
concept backend = requires {
    { B::name } -> std::convertible_to<const char*>;
};

template <class>
inline constexpr bool dependent_false = false;

/// ops<Backend>: the kernel table of a backend. Each backend specialises it (kernels/cpu/ops.hpp for
/// mnemo::cpu). The primary template exists only to turn a missing backend into one readable error.
template <class Backend>
struct ops {
    static_assert(dependent_false<Backend>,
                  "mnemo: this backend has no kernels: ops<Backend> is not specialised for it "
                  "(mnemo::cpu is implemented; mnemo::cuda is declared but its kernels are not part of this build)");
};

/// device_memory<Backend>: where a backend's buffers live and the host path to them. Each backend
/// specialises it (kernels/cpu/memory.hpp for mnemo::cpu) with
///   allocate(bytes) -> void*        deallocate(p, bytes)        fill_zero(p, bytes)
///   copy(dst, src, bytes)           within the backend, ranges may overlap
///   upload(dst, host, bytes)        download(host, src, bytes)   the host path
/// buffer<T, Backend> and parameter_set<T, Backend> allocate and clear through it; checkpoints and
/// initialisation go through upload and download. Nothing else reaches a backend's memory but its kernels.
template <class Backend>
struct device_memory {
    static_assert(dependent_false<Backend>, "mnemo: this backend has no memory: device_memory<Backend> is not "
                                            "specialised for it (see core/backend.hpp)");
};

/// expect_backend<Expected, Got>: a view of one backend passed to a module of another.
template <class Expected, class Got>
struct expect_backend {
    static constexpr bool same = std::is_same_v<Expected, Got>;
    static_assert(same, "mnemo: backend mismatch: a view of backend Got was passed to a module of backend Expected "
                        "(see expect_backend<Expected, Got>)");
    static constexpr bool value = true;
};

}  // namespace mnemo
