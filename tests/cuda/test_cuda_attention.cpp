// The attention kernels of the CUDA backend against the CPU's (ops<cuda> vs ops<cpu> on host copies of
// the same random inputs), in the style of ggml's test-backend-ops: relative attention forward and
// backward (memory and none, clamp_len on and off, key padding with fully masked rows, one query per
// batch element, batch 1, 3 and 5, heads 1 to 3 with odd d_head), feedback attention (both memory_slots
// layouts), the plain attention of the reconstruction loss, its masks and the squared difference.
//
// Tolerances (cuBLAS and the warp reductions sum in other orders than the CPU):
//   GEMM-based results (scores, weights, context, every gradient): normalized_error below 2e-5 in
//   float, 1e-12 in double;
//   masks (keep, keep_any, keep_m, keep_c, any_m, any_c): exact;
//   squared difference: diff within 0 ulp (one subtraction), the double sum relative 1e-12, the row
//   count exact.
// Outputs the kernels assign are filled with NaN on the GPU first, so an element left unwritten fails.
// Every GPU run is repeated once and must give the same bits (no atomics, fixed reduction orders).
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "cuda_testing.hpp"

#include <mnemo/cuda.hpp>

using mnemo::index_t;
using cuda_testing::device_vector;
using cuda_testing::normalized_error;
using cuda_testing::random_values;
using cpu_ops = mnemo::ops<mnemo::cpu>;
using gpu_ops = mnemo::ops<mnemo::cuda>;

namespace {

constexpr mnemo::static_extents runtime_extents{};  // every extent at run time, as a runtime_config

template <class T>
double tolerance() {
    return std::is_same_v<T, float> ? 2e-5 : 1e-12;
}

template <class T>
std::vector<T> nans(std::size_t n) {
    return std::vector<T>(n, std::numeric_limits<T>::quiet_NaN());
}

template <class T>
void check_close(const std::string& what, const std::vector<T>& gpu, const std::vector<T>& cpu) {
    INFO(what);
    REQUIRE(gpu.size() == cpu.size());
    const double err = normalized_error<T>(std::span<const T>(gpu), std::span<const T>(cpu));
    INFO("normalized error " << err);
    CHECK(err <= tolerance<T>());
}

template <class T>
void check_bitwise(const std::string& what, const std::vector<T>& a, const std::vector<T>& b) {
    INFO(what << " differs between two GPU runs");
    REQUIRE(a.size() == b.size());
    bool same = true;
    for (std::size_t i = 0; i < a.size(); ++i)
        if (!(a[i] == b[i]) && !(std::isnan(double(a[i])) && std::isnan(double(b[i])))) same = false;
    CHECK(same);
}

void check_equal(const std::string& what, const std::vector<std::uint8_t>& gpu, const std::vector<std::uint8_t>& cpu) {
    INFO(what);
    CHECK(gpu == cpu);
}

/// A device vector's values on the host.
template <class T>
std::vector<T> host(const device_vector<T>& d) {
    std::vector<T> out(static_cast<std::size_t>(d.n));
    mnemo::device_memory<mnemo::cuda>::download(out.data(), d.data(), sizeof(T) * out.size());
    return out;
}

// ---- relative attention -------------------------------------------------------------------------------

struct rel_case {
    index_t batch, heads, d_head, q_len, mem, clamp_len;
    bool padding;
};

std::string describe(const rel_case& c) {
    return "B=" + std::to_string(c.batch) + " H=" + std::to_string(c.heads) + " dk=" + std::to_string(c.d_head) +
           " Q=" + std::to_string(c.q_len) + " M=" + std::to_string(c.mem) + " clamp=" + std::to_string(c.clamp_len) +
           (c.padding ? " padded" : "");
}

/// Key padding flags [K·B] (position·B + b): batch element 0 none (the unmasked path), 1 its first M + 1
/// keys (so query 0 sees only padding: an all-zero row), 2 and on a random third; with batch 1, element
/// 0 gets key 0 and a random third padded.
std::vector<std::uint8_t> padding_flags(index_t batch, index_t k_len, index_t mem, std::uint64_t seed) {
    std::mt19937_64 g(seed);
    std::vector<std::uint8_t> pad(std::size_t(k_len * batch), 0);
    for (index_t b = 0; b < batch; ++b)
        for (index_t j = 0; j < k_len; ++j) {
            bool p = false;
            if (batch == 1) p = j == 0 || g() % 3 == 0;
            else if (b == 1) p = j <= mem;
            else if (b >= 2) p = g() % 3 == 0;
            pad[std::size_t(j * batch + b)] = p ? 1 : 0;
        }
    return pad;
}

template <class T, class V, class B8>
mnemo::relative_attention_state<T> rel_state(const rel_case& c, V& v, B8* keep, B8* keep_any) {
    mnemo::relative_attention_state<T> st;
    st.batch = c.batch;
    st.heads = c.heads;
    st.d_model = c.heads * c.d_head;
    st.d_head = c.d_head;
    st.q_len = c.q_len;
    st.k_len = c.mem + c.q_len;
    st.clamp_len = c.clamp_len;
    st.absorbed = false;
    st.scale = T(1) / std::sqrt(T(c.d_head));
    st.q = v.q.data();
    st.qu = v.qu.data();
    st.kv = v.kv.data();
    st.r_win = v.r_win.data();
    st.s_win = v.s_win.data();
    st.keep = keep ? keep->data() : nullptr;
    st.keep_any = keep_any ? keep_any->data() : nullptr;
    st.pos = v.pos.data();
    st.attn = v.attn.data();
    st.ctx = v.ctx.data();
    st.d_ctx = v.d_ctx.data();
    st.d_scores = v.d_scores.data();
    st.dqu = v.dqu.data();
    st.dq = v.dq.data();
    st.dkv = v.dkv.data();
    st.dr_win = v.dr_win.data();
    st.ds_win = v.ds_win.data();
    st.col_sums = v.col_sums.data();
    return st;
}

/// The buffers of one relative attention call, as relative_attention allocates them (nn/attention/
/// relative.hpp): q, q + u, context, d context, d(q+u), dq [Q·B, D]; [k, v] and their gradients
/// [K·B, 2D]; R's window [W, D] and S's [W, H]; pos [H, Q·B, W]; attention weights and d scores
/// [B, H, Q, K]; col_sums [H, W] (keep [B, K] and keep_any [B] beside them).
template <class T>
struct rel_host {
    std::vector<T> q, qu, kv, r_win, s_win, d_ctx, pos, attn, ctx, d_scores, dqu, dq, dkv, dr_win, ds_win, col_sums;
};
template <class T>
struct rel_device {
    device_vector<T> q, qu, kv, r_win, s_win, d_ctx, pos, attn, ctx, d_scores, dqu, dq, dkv, dr_win, ds_win, col_sums;
};

template <class T>
struct rel_outputs {
    std::vector<T> attn, ctx, dqu, dq, dkv, dr_win, ds_win;
};

/// The inputs of one case (seeded), and the outputs' initial contents: the += outputs random, the
/// assigned ones 0 on the CPU (NaN on the GPU: see run_gpu).
template <class T>
rel_host<T> rel_inputs(const rel_case& c, std::uint64_t seed) {
    const index_t B = c.batch, H = c.heads, D = H * c.d_head, Q = c.q_len, K = c.mem + Q, W = K + Q, qb = Q * B;
    rel_host<T> h;
    h.q = random_values<T>(std::size_t(qb * D), seed + 1);
    h.qu = random_values<T>(std::size_t(qb * D), seed + 2);
    h.kv = random_values<T>(std::size_t(K * B * 2 * D), seed + 3);
    h.r_win = random_values<T>(std::size_t(W * D), seed + 4);
    h.s_win = random_values<T>(std::size_t(W * H), seed + 5);
    h.d_ctx = random_values<T>(std::size_t(qb * D), seed + 6);
    h.dr_win = random_values<T>(std::size_t(W * D), seed + 7);
    h.ds_win = random_values<T>(std::size_t(W * H), seed + 8);
    h.pos.assign(std::size_t(H * qb * W), T(0));
    h.attn.assign(std::size_t(B * H * Q * K), T(0));
    h.ctx.assign(std::size_t(qb * D), T(0));
    h.d_scores.assign(std::size_t(B * H * Q * K), T(0));
    h.dqu.assign(std::size_t(qb * D), T(0));
    h.dq.assign(std::size_t(qb * D), T(0));
    h.dkv.assign(std::size_t(K * B * 2 * D), T(0));
    h.col_sums.assign(std::size_t(H * W), T(0));
    return h;
}

template <class T>
rel_outputs<T> run_cpu(const rel_case& c, rel_host<T> h, const std::vector<std::uint8_t>& pad,
                       std::vector<std::uint8_t>& keep, std::vector<std::uint8_t>& keep_any) {
    const index_t K = c.mem + c.q_len;
    keep.assign(std::size_t(c.batch * K), 0);
    keep_any.assign(std::size_t(c.batch), 0);
    if (c.padding) cpu_ops::key_padding_keep(c.batch, K, pad.data(), keep.data(), keep_any.data());
    auto st = rel_state<T>(c, h, c.padding ? &keep : nullptr, c.padding ? &keep_any : nullptr);
    rel_outputs<T> o;
    cpu_ops::relative_attention_forward<runtime_extents>(st);
    o.attn = h.attn;
    o.ctx = h.ctx;
    cpu_ops::relative_attention_backward<runtime_extents>(st);
    o.dqu = h.dqu;
    o.dq = h.dq;
    o.dkv = h.dkv;
    o.dr_win = h.dr_win;
    o.ds_win = h.ds_win;
    return o;
}

template <class T>
rel_outputs<T> run_gpu(const rel_case& c, const rel_host<T>& h, const std::vector<std::uint8_t>& pad,
                       std::vector<std::uint8_t>& keep, std::vector<std::uint8_t>& keep_any) {
    const index_t K = c.mem + c.q_len;
    rel_device<T> d{device_vector<T>(h.q),        device_vector<T>(h.qu),
                    device_vector<T>(h.kv),       device_vector<T>(h.r_win),
                    device_vector<T>(h.s_win),    device_vector<T>(h.d_ctx),
                    device_vector<T>(nans<T>(h.pos.size())),
                    device_vector<T>(nans<T>(h.attn.size())),
                    device_vector<T>(nans<T>(h.ctx.size())),
                    device_vector<T>(nans<T>(h.d_scores.size())),
                    device_vector<T>(nans<T>(h.dqu.size())),
                    device_vector<T>(nans<T>(h.dq.size())),
                    device_vector<T>(nans<T>(h.dkv.size())),
                    device_vector<T>(h.dr_win),   device_vector<T>(h.ds_win),
                    device_vector<T>(nans<T>(h.col_sums.size()))};
    device_vector<std::uint8_t> d_pad(pad), d_keep(std::vector<std::uint8_t>(std::size_t(c.batch * K), 7)),
        d_keep_any(std::vector<std::uint8_t>(std::size_t(c.batch), 7));
    if (c.padding) {
        gpu_ops::key_padding_keep(c.batch, K, d_pad.data(), d_keep.data(), d_keep_any.data());
        keep = host(d_keep);
        keep_any = host(d_keep_any);
    }
    auto st = rel_state<T>(c, d, c.padding ? &d_keep : nullptr, c.padding ? &d_keep_any : nullptr);
    rel_outputs<T> o;
    gpu_ops::relative_attention_forward<runtime_extents>(st);
    o.attn = host(d.attn);
    o.ctx = host(d.ctx);
    gpu_ops::relative_attention_backward<runtime_extents>(st);
    o.dqu = host(d.dqu);
    o.dq = host(d.dq);
    o.dkv = host(d.dkv);
    o.dr_win = host(d.dr_win);
    o.ds_win = host(d.ds_win);
    return o;
}

template <class T>
void check_relative(const rel_case& c, std::uint64_t seed) {
    INFO(describe(c));
    const index_t K = c.mem + c.q_len;
    const rel_host<T> h = rel_inputs<T>(c, seed);
    const std::vector<std::uint8_t> pad = padding_flags(c.batch, K, c.mem, seed + 100);
    std::vector<std::uint8_t> keep_c, any_c, keep_g, any_g, keep_g2, any_g2;
    const rel_outputs<T> cpu = run_cpu<T>(c, h, pad, keep_c, any_c);
    const rel_outputs<T> gpu = run_gpu<T>(c, h, pad, keep_g, any_g);
    if (c.padding) {
        check_equal("keep", keep_g, keep_c);
        check_equal("keep_any", any_g, any_c);
    }
    // pos (q·R over the window, then d pos) and d_scores are each backend's own scratch
    // (relative_attention_state): the CPU fills pos over each query block's band of columns only, or
    // keeps a head's rows in its score block, so they are not compared; what they feed is.
    check_close("attn", gpu.attn, cpu.attn);
    check_close("ctx", gpu.ctx, cpu.ctx);
    check_close("dqu", gpu.dqu, cpu.dqu);
    check_close("dq", gpu.dq, cpu.dq);
    check_close("dkv", gpu.dkv, cpu.dkv);
    check_close("dr_win", gpu.dr_win, cpu.dr_win);
    check_close("ds_win", gpu.ds_win, cpu.ds_win);
    // A query row whose every visible key is padded has all-zero weights.
    if (c.padding && c.batch >= 2) {
        const index_t Q = c.q_len;
        for (index_t hh = 0; hh < c.heads; ++hh)
            for (index_t j = 0; j < K; ++j) CHECK(gpu.attn[std::size_t(((1 * c.heads + hh) * Q + 0) * K + j)] == T(0));
    }
    // Run to run: the same bits.
    const rel_outputs<T> again = run_gpu<T>(c, h, pad, keep_g2, any_g2);
    check_bitwise("attn", again.attn, gpu.attn);
    check_bitwise("ctx", again.ctx, gpu.ctx);
    check_bitwise("dqu", again.dqu, gpu.dqu);
    check_bitwise("dq", again.dq, gpu.dq);
    check_bitwise("dkv", again.dkv, gpu.dkv);
    check_bitwise("dr_win", again.dr_win, gpu.dr_win);
    check_bitwise("ds_win", again.ds_win, gpu.ds_win);
}

}  // namespace

TEST_CASE_TEMPLATE("cuda relative attention matches the CPU", T, float, double) {
    const rel_case cases[] = {
        // batch, heads, d_head, q_len, mem, clamp_len, padding
        {3, 3, 5, 7, 11, 0, false},   // memory, no clamp, no padding (batched over heads per batch element)
        {3, 3, 5, 7, 11, 4, true},    // clamp and padding
        {1, 1, 7, 9, 0, 0, true},     // no memory, batch 1, one head, padding with key 0 padded
        {1, 1, 7, 9, 0, 3, false},    // no memory, clamp
        {3, 1, 3, 1, 37, 0, false},   // one query (generation), batch 3 > heads 1: batched over the batch
        {1, 3, 9, 1, 40, 10, true},   // one query, clamp, padding
        {3, 3, 1, 1, 0, 0, true},     // one query, no memory: K = 1, d_head 1
        {3, 2, 33, 13, 0, 5, true},   // d_head 33, no memory, clamp
        {5, 2, 3, 4, 6, 3, true},     // batch 5 > heads 2
        {2, 3, 5, 3, 5, 20, false},   // clamp_len beyond every distance: as without
        {3, 3, 5, 40, 31, 17, true},  // rows longer than a warp
    };
    std::uint64_t seed = 1000;
    for (const rel_case& c : cases) check_relative<T>(c, seed += 17);
}

TEST_CASE("cuda relative attention refuses the absorbed route") {
    mnemo::relative_attention_state<float> st;
    st.batch = 1;
    st.heads = 1;
    st.d_model = st.d_head = 4;
    st.q_len = st.k_len = 2;
    st.absorbed = true;
    CHECK_THROWS_AS(gpu_ops::relative_attention_forward<runtime_extents>(st), mnemo::error);
    CHECK_THROWS_AS(gpu_ops::relative_attention_backward<runtime_extents>(st), mnemo::error);
}

// ---- feedback attention ---------------------------------------------------------------------------------

namespace {

struct fb_case {
    index_t batch, heads, d_head, t;
    bool batch_major;  // [B, capacity, D] with capacity > t; else sequence-major [t, B, D]
};

template <class T>
void check_feedback(const fb_case& c, std::uint64_t seed) {
    INFO("B=" << c.batch << " H=" << c.heads << " dk=" << c.d_head << " t=" << c.t
              << (c.batch_major ? " batch-major" : " sequence-major"));
    const index_t B = c.batch, H = c.heads, Dk = c.d_head, D = H * Dk, t = c.t;
    const index_t cap = c.batch_major ? t + 3 : t;
    const index_t slot_stride = c.batch_major ? D : B * D, batch_stride = c.batch_major ? cap * D : D;
    const std::size_t slots_n = std::size_t(c.batch_major ? B * cap * D : t * B * D);
    const auto q = random_values<T>(std::size_t(B * D), seed + 1), qu = random_values<T>(std::size_t(B * D), seed + 2),
               keys = random_values<T>(slots_n, seed + 3), values = random_values<T>(slots_n, seed + 4),
               r_win = random_values<T>(std::size_t(t * D), seed + 5), s_win = random_values<T>(std::size_t(t * H), seed + 6),
               d_ctx = random_values<T>(std::size_t(B * D), seed + 7),
               d_keys0 = random_values<T>(slots_n, seed + 8), d_values0 = random_values<T>(slots_n, seed + 9),
               dr_win0 = random_values<T>(std::size_t(t * D), seed + 10),
               ds_win0 = random_values<T>(std::size_t(t * H), seed + 11);
    const std::size_t na = std::size_t(B * H * t), nd = std::size_t(B * D);

    struct outputs {
        std::vector<T> attn, ctx, d_scores, d_qu, d_q, d_keys, d_values, dr_win, ds_win;
    };
    auto fill = [&](auto& st, const T* pq, const T* pqu, const T* pk, const T* pv, const T* pr, const T* ps, T* attn,
                    T* ctx, const T* pdc, T* ds, T* dqu, T* dq, T* dk, T* dv, T* dr, T* dsw) {
        st.batch = B;
        st.heads = H;
        st.d_model = D;
        st.d_head = Dk;
        st.t = t;
        st.scale = T(1) / std::sqrt(T(Dk));
        st.q = pq;
        st.qu = pqu;
        st.keys = mnemo::memory_slots<const T>(pk, t, slot_stride, batch_stride);
        st.values = mnemo::memory_slots<const T>(pv, t, slot_stride, batch_stride);
        st.r_win = pr;
        st.s_win = ps;
        st.attn = attn;
        st.ctx = ctx;
        st.saved_attn = attn;
        st.d_ctx = pdc;
        st.d_scores = ds;
        st.d_qu = dqu;
        st.d_q = dq;
        st.d_keys = mnemo::memory_slots<T>(dk, t, slot_stride, batch_stride);
        st.d_values = mnemo::memory_slots<T>(dv, t, slot_stride, batch_stride);
        st.dr_win = dr;
        st.ds_win = dsw;
    };

    outputs cpu{std::vector<T>(na), std::vector<T>(nd), std::vector<T>(na), std::vector<T>(nd), std::vector<T>(nd),
                d_keys0, d_values0, dr_win0, ds_win0};
    {
        mnemo::feedback_attention_state<T> st;
        fill(st, q.data(), qu.data(), keys.data(), values.data(), r_win.data(), s_win.data(), cpu.attn.data(),
             cpu.ctx.data(), d_ctx.data(), cpu.d_scores.data(), cpu.d_qu.data(), cpu.d_q.data(), cpu.d_keys.data(),
             cpu.d_values.data(), cpu.dr_win.data(), cpu.ds_win.data());
        cpu_ops::feedback_attention_forward<runtime_extents>(st);
        cpu_ops::feedback_attention_backward<runtime_extents>(st);
    }
    auto gpu_run = [&] {
        device_vector<T> dq_(q), dqu_(qu), dk_(keys), dv_(values), dr_(r_win), ds_(s_win), attn(nans<T>(na)),
            ctx(nans<T>(nd)), dc(d_ctx), dsc(nans<T>(na)), gqu(nans<T>(nd)), gq(nans<T>(nd)), gk(d_keys0),
            gv(d_values0), gr(dr_win0), gs(ds_win0);
        mnemo::feedback_attention_state<T> st;
        fill(st, dq_.data(), dqu_.data(), dk_.data(), dv_.data(), dr_.data(), ds_.data(), attn.data(), ctx.data(),
             dc.data(), dsc.data(), gqu.data(), gq.data(), gk.data(), gv.data(), gr.data(), gs.data());
        gpu_ops::feedback_attention_forward<runtime_extents>(st);
        gpu_ops::feedback_attention_backward<runtime_extents>(st);
        return outputs{host(attn), host(ctx), host(dsc), host(gqu), host(gq), host(gk), host(gv), host(gr), host(gs)};
    };
    const outputs gpu = gpu_run();
    check_close("attn", gpu.attn, cpu.attn);
    check_close("ctx", gpu.ctx, cpu.ctx);
    check_close("d_scores", gpu.d_scores, cpu.d_scores);
    check_close("d_qu", gpu.d_qu, cpu.d_qu);
    check_close("d_q", gpu.d_q, cpu.d_q);
    check_close("d_keys", gpu.d_keys, cpu.d_keys);  // the slots' padding (capacity > t) untouched on both
    check_close("d_values", gpu.d_values, cpu.d_values);
    check_close("dr_win", gpu.dr_win, cpu.dr_win);
    check_close("ds_win", gpu.ds_win, cpu.ds_win);
    const outputs again = gpu_run();
    check_bitwise("ctx", again.ctx, gpu.ctx);
    check_bitwise("d_keys", again.d_keys, gpu.d_keys);
    check_bitwise("dr_win", again.dr_win, gpu.dr_win);
    check_bitwise("ds_win", again.ds_win, gpu.ds_win);
}

}  // namespace

TEST_CASE_TEMPLATE("cuda feedback attention matches the CPU", T, float, double) {
    const fb_case cases[] = {
        {1, 1, 5, 1, false},    // one slot: weight 1
        {3, 3, 7, 9, false},    // sequence-major
        {3, 3, 7, 9, true},     // batch-major, capacity > t
        {2, 4, 33, 40, true},   // d_head beyond a warp
        {5, 2, 3, 150, false},  // more slots than threads of a block
    };
    std::uint64_t seed = 5000;
    for (const fb_case& c : cases) check_feedback<T>(c, seed += 31);
}

// ---- reconstruction: plain attention, masks, squared difference ---------------------------------------------

namespace {

struct plain_case {
    index_t batch, heads, d_head, q_len, n;
    bool masked;
};

template <class T>
void check_plain(const plain_case& c, std::uint64_t seed) {
    INFO("B=" << c.batch << " H=" << c.heads << " dk=" << c.d_head << " Q=" << c.q_len << " n=" << c.n
              << (c.masked ? " masked" : ""));
    const index_t B = c.batch, H = c.heads, dk = c.d_head, d = H * dk, Q = c.q_len, n = c.n;
    const T scale = T(1) / std::sqrt(T(dk));
    const auto q = random_values<T>(std::size_t(Q * B * d), seed + 1), k = random_values<T>(std::size_t(n * B * d), seed + 2),
               v = random_values<T>(std::size_t(n * B * d), seed + 3),
               d_out = random_values<T>(std::size_t(Q * B * d), seed + 4);
    // keep [B, n]: element 0 unmasked (any 0), element 1 every key masked (a zero output), others random.
    std::vector<std::uint8_t> keep(std::size_t(B * n), 1), any(std::size_t(B), 0);
    std::mt19937_64 g(seed + 5);
    for (index_t b = 1; b < B; ++b) {
        for (index_t j = 0; j < n; ++j) keep[std::size_t(b * n + j)] = b == 1 ? 0 : (g() % 3 != 0);
        any[std::size_t(b)] = 1;
    }
    const std::size_t na = std::size_t(B * H * Q * n), no = std::size_t(Q * B * d), nkv = std::size_t(n * B * d);
    std::vector<T> a_c(na), out_c(no), da_c(na), dk_c(nkv), dv_c(nkv);
    const std::uint8_t* kp = c.masked ? keep.data() : nullptr;
    const std::uint8_t* ap = c.masked ? any.data() : nullptr;
    cpu_ops::plain_attention_forward<runtime_extents>(B, H, d, dk, Q, n, scale, q.data(), k.data(), v.data(), a_c.data(),
                                                      out_c.data(), kp, ap);
    cpu_ops::plain_attention_backward<runtime_extents>(B, H, d, dk, Q, n, scale, q.data(), v.data(), a_c.data(),
                                                       d_out.data(), da_c.data(), dk_c.data(), dv_c.data());
    auto gpu_run = [&] {
        device_vector<T> dq(q), dkk(k), dvv(v), ddo(d_out), a(nans<T>(na)), out(nans<T>(no)), da(nans<T>(na)),
            gk(nans<T>(nkv)), gv(nans<T>(nkv));
        device_vector<std::uint8_t> dkeep(keep), dany(any);
        gpu_ops::plain_attention_forward<runtime_extents>(B, H, d, dk, Q, n, scale, dq.data(), dkk.data(), dvv.data(),
                                                          a.data(), out.data(), c.masked ? dkeep.data() : nullptr,
                                                          c.masked ? dany.data() : nullptr);
        gpu_ops::plain_attention_backward<runtime_extents>(B, H, d, dk, Q, n, scale, dq.data(), dvv.data(), a.data(),
                                                           ddo.data(), da.data(), gk.data(), gv.data());
        return std::vector<std::vector<T>>{host(a), host(out), host(da), host(gk), host(gv)};
    };
    const auto gpu = gpu_run();
    check_close("a", gpu[0], a_c);
    check_close("out", gpu[1], out_c);
    check_close("da", gpu[2], da_c);
    check_close("dk", gpu[3], dk_c);
    check_close("dv", gpu[4], dv_c);
    if (c.masked && B >= 2)  // batch element 1 sees no key: zero weights, zero output
        for (index_t i = 0; i < Q; ++i)
            for (index_t x = 0; x < d; ++x) CHECK(gpu[1][std::size_t((i * B + 1) * d + x)] == T(0));
    const auto again = gpu_run();
    for (std::size_t i = 0; i < gpu.size(); ++i) check_bitwise("plain attention output " + std::to_string(i), again[i], gpu[i]);
}

}  // namespace

TEST_CASE_TEMPLATE("cuda plain attention matches the CPU", T, float, double) {
    const plain_case cases[] = {
        {1, 1, 5, 1, 1, false},    // one query, one key
        {3, 3, 7, 9, 4, false},    // short rows (the CPU's contiguous softmax)
        {3, 3, 7, 9, 37, true},    // masked, one batch element fully
        {2, 4, 33, 5, 70, true},   // d_head 33, rows over two warps' width
        {5, 2, 3, 12, 12, false},  // batch 5 > heads 2 (one batched call either way)
    };
    std::uint64_t seed = 9000;
    for (const plain_case& c : cases) check_plain<T>(c, seed += 13);
}

TEST_CASE("cuda reconstruction_keep and key_padding_keep match the CPU") {
    struct keep_case {
        index_t batch, m_len, c_len;
    };
    for (const keep_case c : {keep_case{1, 1, 1}, keep_case{3, 12, 4}, keep_case{4, 9, 3}, keep_case{2, 5, 0},
                              keep_case{3, 300, 100}}) {
        INFO("B=" << c.batch << " m=" << c.m_len << " c=" << c.c_len);
        std::mt19937_64 g(std::uint64_t(c.batch * 1000 + c.m_len));
        std::vector<std::uint8_t> pad(std::size_t(c.m_len * c.batch));
        for (auto& p : pad) p = std::uint8_t(g() % 2 ? 3 : 0);  // any nonzero is padding
        if (c.m_len >= 3)  // a whole compressed group padded in batch element 0
            for (index_t s = 0; s < 3; ++s) pad[std::size_t(s * c.batch)] = 1;
        const std::size_t nm = std::size_t(c.batch * c.m_len), nc = std::size_t(c.batch * c.c_len),
                          nb = std::size_t(c.batch);
        std::vector<std::uint8_t> km(nm), kc(nc), am(nb), ac(nb);
        cpu_ops::reconstruction_keep(c.batch, c.m_len, c.c_len, pad.data(), km.data(), kc.data(), am.data(), ac.data());
        device_vector<std::uint8_t> dpad(pad), dkm(std::vector<std::uint8_t>(nm, 7)), dkc(std::vector<std::uint8_t>(nc, 7)),
            dam(std::vector<std::uint8_t>(nb, 7)), dac(std::vector<std::uint8_t>(nb, 7));
        gpu_ops::reconstruction_keep(c.batch, c.m_len, c.c_len, dpad.data(), dkm.data(), dkc.data(), dam.data(), dac.data());
        check_equal("keep_m", host(dkm), km);
        check_equal("keep_c", host(dkc), kc);
        check_equal("any_m", host(dam), am);
        check_equal("any_c", host(dac), ac);

        // key_padding_keep over the same flags read as [K·B] keys.
        std::vector<std::uint8_t> keep(nm), any(nb);
        cpu_ops::key_padding_keep(c.batch, c.m_len, pad.data(), keep.data(), any.data());
        device_vector<std::uint8_t> dkeep(std::vector<std::uint8_t>(nm, 7)), dany(std::vector<std::uint8_t>(nb, 7));
        gpu_ops::key_padding_keep(c.batch, c.m_len, dpad.data(), dkeep.data(), dany.data());
        check_equal("keep", host(dkeep), keep);
        check_equal("keep_any", host(dany), any);
    }
}

TEST_CASE_TEMPLATE("cuda squared_difference_rows matches the CPU", T, float, double) {
    struct sq_case {
        index_t rows, d, lda, ldb, ldd;
        bool padded, in_place;
    };
    const sq_case cases[] = {
        {1, 1, 1, 1, 1, false, false},      {7, 5, 9, 6, 5, true, false},  // strides beyond the width
        {33, 129, 129, 131, 130, true, false}, {300, 37, 40, 37, 40, false, true},  // diff is a's memory
        {5, 3, 3, 3, 3, true, false},  // every row padded below (pad all): sum 0, count 0
    };
    std::uint64_t seed = 300;
    int k = 0;
    for (const sq_case& c : cases) {
        INFO("case " << k);
        const bool all_padded = k++ == 4;
        const auto a0 = random_values<T>(std::size_t(c.rows * c.lda), ++seed), b = random_values<T>(std::size_t(c.rows * c.ldb), ++seed);
        std::vector<std::uint8_t> pad(std::size_t(c.rows), 0);
        std::mt19937_64 g(seed);
        for (auto& p : pad) p = all_padded ? 1 : std::uint8_t(g() % 4 == 0);
        const std::uint8_t* pp = c.padded ? pad.data() : nullptr;
        const std::size_t ndiff = std::size_t(c.rows * c.ldd);
        std::vector<T> a_c = a0, diff_c(ndiff, T(0));
        double sum_c[2] = {0, 0};
        T* out_c = c.in_place ? a_c.data() : diff_c.data();
        cpu_ops::squared_difference_rows(c.rows, c.d, a_c.data(), c.lda, b.data(), c.ldb, pp, out_c, c.ldd, sum_c);

        device_vector<T> da(a0), db(b), ddiff(std::vector<T>(ndiff, T(0)));
        device_vector<std::uint8_t> dpad(pad);
        device_vector<double> dsum(std::vector<double>{-1.0, -1.0});
        T* out_g = c.in_place ? da.data() : ddiff.data();
        gpu_ops::squared_difference_rows(c.rows, c.d, static_cast<const T*>(da.data()), c.lda,
                                         static_cast<const T*>(db.data()), c.ldb, c.padded ? dpad.data() : nullptr,
                                         out_g, c.ldd, dsum.data());
        const std::vector<T> got = c.in_place ? host(da) : host(ddiff);
        const std::vector<T>& want = c.in_place ? a_c : diff_c;
        CHECK(cuda_testing::max_ulp<T>(std::span<const T>(got), std::span<const T>(want)) == 0.0);
        const std::vector<double> s = host(dsum);
        CHECK(s[1] == sum_c[1]);
        CHECK(std::abs(s[0] - sum_c[0]) <= 1e-12 * std::max(1.0, std::abs(sum_c[0])));
        // The same bits on a second run.
        device_vector<T> da2(a0), ddiff2(std::vector<T>(ndiff, T(0)));
        device_vector<double> dsum2(std::vector<double>{-1.0, -1.0});
        gpu_ops::squared_difference_rows(c.rows, c.d, static_cast<const T*>(da2.data()), c.lda,
                                         static_cast<const T*>(db.data()), c.ldb, c.padded ? dpad.data() : nullptr,
                                         c.in_place ? da2.data() : ddiff2.data(), c.ldd, dsum2.data());
        CHECK(host(dsum2)[0] == s[0]);
    }
}
