#pragma once
// mnemo::fenced, a test-only backend that proves module code reaches tensors only through kernels.
//
// Its memory (device_memory<fenced>) is whole pages from mmap, kept PROT_NONE: no access at all. Its
// kernels (ops<fenced>) are the CPU kernels, each run with every fenced page opened for reading and
// writing and closed again when the outermost kernel returns (the host path, upload and download, is
// fenced the same way). Module, model or trainer code that reads or writes a fenced buffer itself, on
// the host, outside a kernel, therefore faults; the SIGSEGV handler says which buffer, at which offset,
// and prints the stack (names with -rdynamic), then lets the signal kill the test.
//
// The fence is process-wide (mprotect), so a kernel's OpenMP threads and two kernels on two threads
// (a module's parallel_invoke) see it open; it closes when the last kernel running returns.
#include <execinfo.h>
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <type_traits>
#include <utility>

#include "mnemo/kernels/cpu/memory.hpp"
#include "mnemo/kernels/cpu/ops.hpp"
#include "mnemo/kernels/kernel_table.hpp"

namespace mnemo {

struct fenced {
    static constexpr const char* name = "fenced";
};

namespace fence {

struct region {
    std::uintptr_t begin = 0;
    std::size_t bytes = 0;  // 0: free slot
    std::size_t id = 0;     // allocation number, for the message
};

inline constexpr std::size_t max_regions = 8192;

struct state {
    std::mutex lock;
    std::array<region, max_regions> regions{};
    std::size_t next_id = 1;
    int depth = 0;  // kernels running now; the fence is open while > 0
    std::size_t downloads = 0;  // transfers to the host so far (what would make a GPU wait)
    struct sigaction previous{};  // the handler before ours (doctest's, which names the test case)
};
inline state& global() {
    static state s;
    return s;
}

inline std::size_t page() { return std::size_t(sysconf(_SC_PAGESIZE)); }

// Under the lock.
inline void protect_all(int prot) {
    for (const region& r : global().regions)
        if (r.bytes && mprotect(reinterpret_cast<void*>(r.begin), r.bytes, prot) != 0) {
            std::perror("fenced backend: mprotect");
            std::abort();
        }
}

inline void write_str(const char* s) { (void)!write(2, s, std::strlen(s)); }
inline void write_num(std::size_t v) {
    char buf[32];
    int n = 0;
    do {
        buf[n++] = char('0' + v % 10);
        v /= 10;
    } while (v);
    while (n) (void)!write(2, &buf[--n], 1);
}

inline void on_segv(int sig, siginfo_t* info, void*) {
    const std::uintptr_t at = reinterpret_cast<std::uintptr_t>(info->si_addr);
    for (const region& r : global().regions) {
        if (!r.bytes || at < r.begin || at >= r.begin + r.bytes) continue;
        write_str("fenced backend: host code touched fenced buffer #");
        write_num(r.id);
        write_str(" (");
        write_num(r.bytes);
        write_str(" bytes) at byte ");
        write_num(at - r.begin);
        write_str(" outside any kernel of ops<fenced>; the access was made from:\n");
        void* frames[48];
        backtrace_symbols_fd(frames, backtrace(frames, 48), 2);
        break;
    }
    // Returning re-runs the access, which now reaches the handler before ours (a test framework's,
    // which reports the test case) or the default action (the process dies of SIGSEGV).
    sigaction(sig, &global().previous, nullptr);
}

/// Puts on_segv in front of whatever handles SIGSEGV now. Called at every allocation, since a test
/// framework may install its own handler per test case (doctest does).
inline void install_handler() {
    // Under the lock.
    struct sigaction current{};
    sigaction(SIGSEGV, nullptr, &current);
    if ((current.sa_flags & SA_SIGINFO) && current.sa_sigaction == on_segv) return;
    struct sigaction sa{};
    sa.sa_sigaction = on_segv;
    sa.sa_flags = SA_SIGINFO;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGSEGV, &sa, &global().previous);
}

/// Opens the fence for the scope of one kernel (nested and concurrent kernels share the opening).
struct open_scope {
    open_scope() {
        std::lock_guard g(global().lock);
        if (global().depth++ == 0) protect_all(PROT_READ | PROT_WRITE);
    }
    ~open_scope() {
        std::lock_guard g(global().lock);
        if (--global().depth == 0) protect_all(PROT_NONE);
    }
    open_scope(const open_scope&) = delete;
    open_scope& operator=(const open_scope&) = delete;
};

/// Downloads (device_memory<fenced>::download) so far in this process.
inline std::size_t downloads() {
    std::lock_guard g(global().lock);
    return global().downloads;
}

/// Fenced buffers alive now.
inline std::size_t live_regions() {
    std::lock_guard g(global().lock);
    std::size_t n = 0;
    for (const region& r : global().regions) n += r.bytes != 0;
    return n;
}

}  // namespace fence

template <>
struct device_memory<fenced> {
    static void* allocate(std::size_t bytes) {
        const std::size_t pg = fence::page(), size = (std::max<std::size_t>(bytes, 1) + pg - 1) / pg * pg;
        void* p = mmap(nullptr, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (p == MAP_FAILED) throw std::bad_alloc();
        std::lock_guard g(fence::global().lock);
        fence::install_handler();
        for (fence::region& r : fence::global().regions)
            if (!r.bytes) {
                r = {reinterpret_cast<std::uintptr_t>(p), size, fence::global().next_id++};
                // Inside an open fence (a buffer grown between kernels never is, but be exact) the
                // new pages are open too.
                if (fence::global().depth > 0) mprotect(p, size, PROT_READ | PROT_WRITE);
                return p;
            }
        std::fputs("fenced backend: more than fence::max_regions buffers alive\n", stderr);
        std::abort();
    }
    static void deallocate(void* p, std::size_t bytes) noexcept {
        const std::size_t pg = fence::page(), size = (std::max<std::size_t>(bytes, 1) + pg - 1) / pg * pg;
        std::lock_guard g(fence::global().lock);
        for (fence::region& r : fence::global().regions)
            if (r.bytes && r.begin == reinterpret_cast<std::uintptr_t>(p)) r = {};
        munmap(p, size);
    }
    static void fill_zero(void* p, std::size_t bytes) {
        fence::open_scope open;
        device_memory<cpu>::fill_zero(p, bytes);
    }
    static void copy(void* dst, const void* src, std::size_t bytes) {
        fence::open_scope open;
        device_memory<cpu>::copy(dst, src, bytes);
    }
    static void upload(void* dst, const void* host, std::size_t bytes) {
        fence::open_scope open;
        device_memory<cpu>::upload(dst, host, bytes);
    }
    static void download(void* host, const void* src, std::size_t bytes) {
        {
            std::lock_guard g(fence::global().lock);
            ++fence::global().downloads;
        }
        fence::open_scope open;
        device_memory<cpu>::download(host, src, bytes);
    }
};

/// Pointer arguments. A kernel of a device backend can only reach device memory, so every pointer a
/// module hands a kernel must point into a fenced buffer (or be null): a host pointer (a token array,
/// a host vector of flags) would read on the CPU and fail on a GPU. check_pointer_args names the
/// kernel and the argument (and, inside an argument struct, the field) and aborts. The argument
/// structs are looked into field by field (pointer_fields below); spans are host metadata.
namespace fence {
inline bool fenced_or_null(const void* p) {
    if (!p) return true;
    const std::uintptr_t at = reinterpret_cast<std::uintptr_t>(p);
    std::lock_guard g(global().lock);
    for (const region& r : global().regions)
        if (r.bytes && at >= r.begin && at <= r.begin + r.bytes) return true;
    return false;
}
inline void check_pointer(const char* kernel, int i, const char* field, const void* p) {
    if (fenced_or_null(p)) return;
    write_str("fenced backend: kernel '");
    write_str(kernel);
    write_str("' was given a host pointer as argument ");
    write_num(std::size_t(i));
    if (field) {
        write_str(", field ");
        write_str(field);
    }
    write_str(" (a backend's kernels reach only its own memory); called from:\n");
    void* frames[48];
    backtrace_symbols_fd(frames, backtrace(frames, 48), 2);
    std::abort();
}

/// f(name, pointer) for every pointer field of the kernels' argument structs (the memory a kernel
/// reaches through them; deferred_decay's log and counters are host metadata, its values are not).
#define MNEMO_FIELD(x) f(#x, static_cast<const void*>(a.x))
template <class T, class F>
void pointer_fields(const frozen_key_rows<T>& a, F&& f) {
    MNEMO_FIELD(zhat), MNEMO_FIELD(gamma), MNEMO_FIELD(beta), MNEMO_FIELD(dgamma), MNEMO_FIELD(dbeta);
}
template <class T, class F>
void pointer_fields(const relative_attention_state<T>& a, F&& f) {
    MNEMO_FIELD(q), MNEMO_FIELD(qu), MNEMO_FIELD(kv), MNEMO_FIELD(kv_lo), MNEMO_FIELD(r_win), MNEMO_FIELD(s_win), MNEMO_FIELD(keep),
        MNEMO_FIELD(keep_any), MNEMO_FIELD(z), MNEMO_FIELD(wk), MNEMO_FIELD(wv), MNEMO_FIELD(bv), MNEMO_FIELD(pos),
        MNEMO_FIELD(attn), MNEMO_FIELD(ctx), MNEMO_FIELD(q_absorbed), MNEMO_FIELD(mem_mix), MNEMO_FIELD(mem_mix_hat),
        MNEMO_FIELD(row_mass), MNEMO_FIELD(thread_blocks), MNEMO_FIELD(d_ctx), MNEMO_FIELD(d_scores), MNEMO_FIELD(dqu),
        MNEMO_FIELD(dq), MNEMO_FIELD(dkv), MNEMO_FIELD(dr_win), MNEMO_FIELD(ds_win), MNEMO_FIELD(col_sums),
        MNEMO_FIELD(gk), MNEMO_FIELD(gv), MNEMO_FIELD(gbv), MNEMO_FIELD(d_mem_mix), MNEMO_FIELD(d_q_absorbed),
        MNEMO_FIELD(d_bias_score), MNEMO_FIELD(dz_blocks), MNEMO_FIELD(norm_partial), MNEMO_FIELD(d_zkv);
    pointer_fields(a.hat, f);
    pointer_fields(a.frozen, f);
}
template <class T, class F>
void pointer_fields(const feedback_attention_state<T>& a, F&& f) {
    MNEMO_FIELD(q), MNEMO_FIELD(qu), MNEMO_FIELD(keys.data), MNEMO_FIELD(values.data), MNEMO_FIELD(r_win),
        MNEMO_FIELD(s_win), MNEMO_FIELD(attn), MNEMO_FIELD(ctx), MNEMO_FIELD(saved_attn), MNEMO_FIELD(d_ctx),
        MNEMO_FIELD(d_scores), MNEMO_FIELD(d_qu), MNEMO_FIELD(d_q), MNEMO_FIELD(d_keys.data), MNEMO_FIELD(d_values.data),
        MNEMO_FIELD(dr_win), MNEMO_FIELD(ds_win);
}
template <class T, class F>
void pointer_fields(const memory_slots<T>& a, F&& f) {
    MNEMO_FIELD(data);
}
template <class T, class F>
void pointer_fields(const adam_step_args<T>& a, F&& f) {
    MNEMO_FIELD(params), MNEMO_FIELD(grads), MNEMO_FIELD(m), MNEMO_FIELD(v), MNEMO_FIELD(cold);
    if (a.deferral) MNEMO_FIELD(deferral->values);
}
template <class T, class F>
void pointer_fields(const sgd_step_args<T>& a, F&& f) {
    MNEMO_FIELD(params), MNEMO_FIELD(grads), MNEMO_FIELD(b);
}
template <class T, class F>
void pointer_fields(const deferred_decay<T>& a, F&& f) {
    MNEMO_FIELD(values);
}
#undef MNEMO_FIELD

template <class A>
void check_pointer_arg(const char* kernel, int i, const A& a) {
    using U = std::remove_cvref_t<A>;
    if constexpr (std::is_pointer_v<U>) {
        check_pointer(kernel, i, nullptr, static_cast<const void*>(a));
    } else if constexpr (requires { pointer_fields(a, [](const char*, const void*) {}); }) {
        pointer_fields(a, [&](const char* field, const void* p) { check_pointer(kernel, i, field, p); });
    }
}
template <class... A>
void check_pointer_args(const char* kernel, const A&... a) {
    int i = 0;
    (check_pointer_arg(kernel, i++, a), ...);
}
}  // namespace fence

/// Every kernel of the table: the CPU's, inside an open fence, after check_pointer_args. Three forms per name: no explicit
/// template arguments, a value (head_gemm_nt<d_head>) or a type (activation_forward<relu>).
namespace fence {
/// ops<cpu>, named through the call's argument types so that `::template name<V>` is looked up only
/// for the kernels that are templates (at instantiation).
template <class... A>
struct cpu_ops {
    using type = ops<cpu>;
};
}  // namespace fence

template <>
struct ops<fenced> {
#define MNEMO_FENCED_KERNEL(name)                                                      \
    template <class... A>                                                              \
    static decltype(auto) name(A&&... a) {                                             \
        fence::check_pointer_args(#name, a...);                                        \
        fence::open_scope open;                                                        \
        return ops<cpu>::name(std::forward<A>(a)...);                                  \
    }                                                                                  \
    template <auto V, class... A>                                                      \
    static decltype(auto) name(A&&... a) {                                             \
        fence::check_pointer_args(#name, a...);                                        \
        fence::open_scope open;                                                        \
        return fence::cpu_ops<A...>::type::template name<V>(std::forward<A>(a)...);                      \
    }                                                                                  \
    template <class U, class... A>                                                     \
    static decltype(auto) name(A&&... a) {                                             \
        fence::check_pointer_args(#name, a...);                                        \
        fence::open_scope open;                                                        \
        return fence::cpu_ops<A...>::type::template name<U>(std::forward<A>(a)...);                      \
    }
    MNEMO_KERNELS(MNEMO_FENCED_KERNEL)
#undef MNEMO_FENCED_KERNEL
    static constexpr bool absorbs_memory = ops<cpu>::absorbs_memory;
    static constexpr bool defers_weight_decay = ops<cpu>::defers_weight_decay;
    static constexpr bool scores_grad_scratch = ops<cpu>::scores_grad_scratch;
    static constexpr index_t positional_scratch_from = ops<cpu>::positional_scratch_from;
    static constexpr bool plain_attention_scratch = ops<cpu>::plain_attention_scratch;
    static constexpr bool splits_key_rows = ops<cpu>::splits_key_rows;
    /// fn(), the threads not held: every kernel here opens and closes the fence with mprotect, and a
    /// held thread spinning on the other core turns each into a TLB shootdown to it (the fenced
    /// generation test took 84 s instead of 33 on the 2-core VM). Holding changes no result.
    template <class F>
    static decltype(auto) hold_threads(F&& fn) {
        return fn();
    }
};

static_assert(check_kernel_table<fenced>());

}  // namespace mnemo
