#pragma once
// Attention-reconstruction loss of the Compressive Transformer (Rae et al., 2019, §3.2; labml's
// AttentionReconstructionLoss; docs/reference.md §10). For one layer, with h this segment's layer input
// and m the memory slots just compressed away (both constants):
//
//   hn = LN(h), mn = LN(m), cn = LN(f_c(m))              the layer's attention norm, parameters detached
//   attn(x, y) = softmax_j( (x·Wqᵀ)·(y·Wkᵀ)ᵀ / sqrt(d_k) ) · (y·Wvᵀ + b_v)     per head; no positions,
//                                                        no mask, no output projection; weights detached
//   loss = mean( (attn(hn, cn) − attn(hn, mn))² )
//
// A post-LayerNorm layer (compressive_transformer with norm_kind::post) attends over its raw inputs,
// so its loss takes no norm (pass a null norm): hn = h, mn = m, cn = f_c(m).
//
// Padding (h_pad [Q·B] for h's rows, m_pad [n_old·B] for m's slots, nonzero = padding; null = none):
//   - a padded slot of m is masked out of attn(·, mn) (zero weight); a compressed slot is masked out of
//     attn(·, cn) iff all `rate` slots it was made from are padding (the memory's rule);
//   - a query row from a padded position of h is left out of the MSE: the mean runs over the N =
//     (unpadded rows of h)·D elements of the unpadded rows only (no row: the loss is 0, no gradient);
//   - an unpadded query whose keys are all masked on one side attends to nothing there: that side's
//     output is zero (the row still counts in the mean).
//   Without padding the loss is bitwise the one above.
//
// Its gradient reaches only f_c's parameters: every other parameter is read as a constant (the
// backward passes here use backward_input, which never touches a parameter gradient). Nothing is
// switched off in place, so the key/value weights keep training from the cross-entropy loss (the
// defect of a published implementation that detached them in place for good).
#include <cmath>
#include <cstdint>
#include <vector>

#include "../core/parallel.hpp"
#include "../core/buffer.hpp"
#include "../nn/layer_norm.hpp"
#include "../nn/relative_attention.hpp"

namespace mnemo {

template <class T, class Config, class Backend = cpu>
class attention_reconstruction {
    using K = checked_ops<Backend>;
    static constexpr std::size_t DM = Config::d_model;
    // d_model, heads, d_head: compile-time constants for a static config, runtime values for runtime_config.
    [[no_unique_address]] extent_holder<Config::d_model> D;
    [[no_unique_address]] extent_holder<Config::heads> H;
    [[no_unique_address]] extent_holder<Config::d_head> Dk;

public:
    /// `shape`: d_model and heads of a runtime-shape model (runtime_config); a static config's own
    /// (the default) otherwise.
    explicit attention_reconstruction(const model_shape& shape = config_shape<Config>())
        : D(check_shape<Config>(shape, "attention_reconstruction").d_model), H(shape.heads), Dk(shape.d_head()) {}

    /// What the layer's last forward computed from the same inputs, bitwise what compute() would:
    /// queries, the attention's query projection of the (normalised) h [Q·B, D]; normalized_m, the
    /// norm's output for m's rows [n_old·B, D] (null: computed here).
    struct saved_forward {
        const T* queries = nullptr;
        const T* normalized_m = nullptr;
    };

    /// The loss of one layer; when `with_grad`, f_c's parameter gradients += d loss / d θ_c.
    /// h [Q·B, D]; m [n_old·B, D] with n_old a multiple of the compression rate.
    template <class Compression>
    T compute(const layer_norm<T, DM, Backend>& norm, const relative_attention<T, Config, Backend>& attn,
              Compression& compress, view<const T, DM, Backend> h, view<const T, DM, Backend> m, index_t batch,
              bool with_grad, const std::uint8_t* h_pad = nullptr, const std::uint8_t* m_pad = nullptr) {
        return compute(&norm, attn, compress, h, m, batch, with_grad, h_pad, m_pad);
    }

    /// The same with the norm optional: a null `norm` attends over h, m and f_c(m) as they are.
    /// `saved` may pass what the layer's last forward already computed from the same h and m (see
    /// saved_forward); the result is bitwise the same.
    template <class Compression>
    T compute(const layer_norm<T, DM, Backend>* norm, const relative_attention<T, Config, Backend>& attn,
              Compression& compress, view<const T, DM, Backend> h, view<const T, DM, Backend> m, index_t batch,
              bool with_grad, const std::uint8_t* h_pad = nullptr, const std::uint8_t* m_pad = nullptr,
              const saved_forward& saved = {}) {
        const index_t qb = h.rows(), mb = m.rows(), cb = compress.compressed_rows(mb, batch);
        const index_t q_len = qb / batch, m_len = mb / batch, c_len = cb / batch;
        view<T, DM, Backend> cm(cm_.ensure(cb * D), cb, D);
        compress.forward(m, batch, cm);

        // Normalise with the layer's norm, parameters read as constants.
        view<const T, DM, Backend> hn = h, mn = m, cn = cm;
        norm_stats<T> st_c{};
        if (norm) {
            view<T, DM, Backend> cw(cn_.ensure(cb * D), cb, D);
            st_c = {st_c_.ensure(cb), st_c_r_.ensure(cb)};
            if (!saved.queries) {
                view<T, DM, Backend> hw(hn_.ensure(qb * D), qb, D);
                norm->forward(h, hw, norm_stats<T>{});
                hn = hw;
            }
            if (saved.normalized_m) {
                mn = view<const T, DM, Backend>(saved.normalized_m, mb, D);
            } else {
                view<T, DM, Backend> mw(mn_.ensure(mb * D), mb, D);
                norm->forward(m, mw, norm_stats<T>{});
                mn = mw;
            }
            norm->forward(cm, cw, st_c);
            cn = cw;
        }

        view<T, DM, Backend> km(km_.ensure(mb * D), mb, D), vm(vm_.ensure(mb * D), mb, D),
            kc(kc_.ensure(cb * D), cb, D), vc(vc_.ensure(cb * D), cb, D);
        view<const T, DM, Backend> q(saved.queries, qb, D);
        if (!saved.queries) {
            view<T, DM, Backend> qw(q_.ensure(qb * D), qb, D);
            attn.query().forward(hn, qw);
            q = qw;
        }
        // Keys on one thread, values on the other (A: four 256- and 128-row products that two
        // threads each split poorly; gemm::concurrent_pair).
        parallel_invoke(
            K::concurrent_pair(mb, D, D),
            [&] {
                attn.key().forward(mn, km);
                attn.key().forward(cn, kc);
            },
            [&] {
                attn.value().forward(mn, vm);
                attn.value().forward(cn, vc);
            });

        view<T, DM, Backend> out_m(out_m_.ensure(qb * D), qb, D), out_c(out_c_.ensure(qb * D), qb, D);
        T* a_m = a_m_.ensure(batch * H * q_len * m_len);
        T* a_c = a_c_.ensure(batch * H * q_len * c_len);
        // Key masks [B, n] (1 = visible) from the padding of m and of the compressed slots.
        const std::uint8_t *keep_m = nullptr, *keep_c = nullptr;
        if (m_pad) {
            const index_t rate = c_len > 0 ? m_len / c_len : 1;
            std::uint8_t* km_keep = keep_m_.ensure(batch * m_len);
            std::uint8_t* kc_keep = keep_c_.ensure(batch * c_len);
            any_m_.assign(std::size_t(batch), 0);
            any_c_.assign(std::size_t(batch), 0);
            for (index_t b = 0; b < batch; ++b) {
                for (index_t s = 0; s < m_len; ++s) {
                    const bool pad = m_pad[s * batch + b] != 0;
                    km_keep[b * m_len + s] = pad ? 0 : 1;
                    any_m_[std::size_t(b)] |= std::uint8_t(pad);
                }
                for (index_t s = 0; s < c_len; ++s) {
                    bool all = true;
                    for (index_t t = 0; t < rate; ++t) all = all && m_pad[(s * rate + t) * batch + b] != 0;
                    kc_keep[b * c_len + s] = all ? 0 : 1;
                    any_c_[std::size_t(b)] |= std::uint8_t(all);
                }
            }
            keep_m = km_keep;
            keep_c = kc_keep;
        }
        plain_attention(q, km, vm, a_m, out_m, batch, q_len, m_len, keep_m, any_m_.data());
        plain_attention(q, kc, vc, a_c, out_c, batch, q_len, c_len, keep_c, any_c_.data());

        // MSE over the unpadded query rows, summed in double in a fixed order; d out_c = 2 (out_c − out_m) / N.
        index_t rows_counted = qb;
        if (h_pad)
            for (index_t r = 0; r < qb; ++r) rows_counted -= h_pad[r] != 0;
        const index_t n = rows_counted * D;
        double sum = 0;
        T* diff = diff_.ensure(qb * D);
        for (index_t r = 0; r < qb; ++r) {
            const bool skip = h_pad && h_pad[r];
            for (index_t i = r * D; i < (r + 1) * D; ++i) {
                diff[i] = skip ? T(0) : out_c.data()[i] - out_m.data()[i];
                if (!skip) sum += double(diff[i]) * double(diff[i]);
            }
        }
        if (n == 0) return T(0);
        const T loss = T(sum / double(n));
        if (!with_grad || !Compression::has_parameters) return loss;

        const T g = T(2) / T(n);
        for (index_t i = 0; i < qb * D; ++i) diff[i] *= g;  // now d loss / d out_c (0 on padded rows)
        view<T, DM, Backend> dkc(dkc_.ensure(cb * D), cb, D), dvc(dvc_.ensure(cb * D), cb, D),
            dcn(dcn_.ensure(cb * D), cb, D), dcm(dcm_.ensure(cb * D), cb, D);
        T* da = da_.ensure(batch * H * q_len * c_len);
        const T scale = T(1) / std::sqrt(T(index_t(Dk)));
        const index_t ld = batch * D;
        parallel_range(batch * H, true, [&](index_t begin, index_t end) {
            for (index_t bh = begin; bh < end; ++bh) {
                const index_t b = bh / H, hh = bh % H;
                const index_t off = b * D + hh * Dk, a_off = (b * H + hh) * q_len * c_len;
                T* dab = da + a_off;
                head_gemm_nt(q_len, c_len, diff + off, ld, vc.data() + off, ld, dab, c_len);      // dA
                head_gemm_tn(q_len, c_len, a_c + a_off, c_len, diff + off, ld, dvc.data() + off, ld);  // dv
                K::softmax_backward(q_len, c_len, a_c + a_off, c_len, dab, c_len, dab, c_len, scale);
                head_gemm_tn(q_len, c_len, dab, c_len, q.data() + off, ld, dkc.data() + off, ld);  // dk
            }
        });
        attn.key().backward_input(dkc, dcn);
        attn.value().backward_input(dvc, dcn, true);
        if (norm) norm->backward_input(cm, dcn, dcm, st_c);
        compress.backward(m, batch, norm ? dcm : dcn, view<T, DM, Backend>());
        return loss;
    }

private:
    // out [Q·B, D] = per (b, head) softmax(scale·q·kᵀ)·v over all n keys; a [B, H, Q, n] saved.
    // keep [B, n] (optional, 1 = visible) masks keys of the batch elements with any[b] set.
    void plain_attention(view<const T, DM, Backend> q, view<const T, DM, Backend> k, view<const T, DM, Backend> v,
                         T* a, view<T, DM, Backend> out, index_t batch, index_t q_len, index_t n,
                         const std::uint8_t* keep = nullptr, const std::uint8_t* any = nullptr) const {
        const T scale = T(1) / std::sqrt(T(index_t(Dk)));
        const index_t ld = batch * D;
        parallel_range(batch * H, true, [&](index_t begin, index_t end) {
            for (index_t bh = begin; bh < end; ++bh) {
                const index_t b = bh / H, hh = bh % H;
                const index_t off = b * D + hh * Dk;
                T* ab = a + (b * H + hh) * q_len * n;
                head_gemm_nt(q_len, n, q.data() + off, ld, k.data() + off, ld, ab, n);
                softmax_mask mask{};
                if (keep && any[b]) {
                    mask.keep = keep + b * n;
                    mask.ld_keep = 0;
                }
                if (!mask.keep) K::softmax_contiguous(q_len, n, ab, scale);
                else K::softmax_forward(q_len, n, ab, n, ab, n, scale, mask);
                head_gemm_nn(q_len, n, ab, n, v.data() + off, ld, out.data() + off, ld);
            }
        });
    }

    // The per-head products with d_head a compile-time width (static config) or a runtime one.
    template <class... A>
    void head_gemm_nt(A... a) const {
        if constexpr (Config::d_head != dynamic) K::template head_gemm_nt<index_t(Config::d_head)>(a...);
        else K::head_gemm_nt(index_t(Dk), a...);
    }
    template <class... A>
    void head_gemm_nn(A... a) const {
        if constexpr (Config::d_head != dynamic) K::template head_gemm_nn<index_t(Config::d_head)>(a...);
        else K::head_gemm_nn(index_t(Dk), a...);
    }
    template <class... A>
    void head_gemm_tn(A... a) const {
        if constexpr (Config::d_head != dynamic) K::template head_gemm_tn<index_t(Config::d_head)>(a...);
        else K::head_gemm_tn(index_t(Dk), a...);
    }

    buffer<T, Backend> cm_, hn_, mn_, cn_, q_, km_, vm_, kc_, vc_, out_m_, out_c_, a_m_, a_c_, diff_;
    buffer<T, Backend> st_c_, st_c_r_;
    buffer<T, Backend> dkc_, dvc_, dcn_, dcm_, da_;
    buffer<std::uint8_t> keep_m_, keep_c_;
    std::vector<std::uint8_t> any_m_, any_c_;
};

}  // namespace mnemo
