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
// Padding (h_pad [Q·B] for h's rows, m_pad [n_old·B] for m's slots, in the backend's memory, nonzero =
// padding; null = none):
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

#include "../core/buffer.hpp"
#include "../nn/layer_norm.hpp"
#include "../nn/attention/relative.hpp"

namespace mnemo {

template <class T, class Config, class Backend = cpu>
class attention_reconstruction {
    using kernels = checked_ops<Backend>;
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
        queue(norm, attn, compress, h, m, batch, with_grad, sum_.ensure(2), h_pad, m_pad, saved);
        double sums[2] = {0, 0};  // the host path: the loss is returned now
        device_memory<Backend>::download(sums, sum_.data(), sizeof(sums));
        return loss(sums);
    }

    /// compute() leaving the loss in backend memory: `sums` (two doubles of Backend's memory) get the
    /// squared differences' sum and the number of unpadded query rows; loss() turns them into the loss
    /// once the caller has read them. The gradient (with_grad) takes its scale 2/(rows·D) from the
    /// count on the backend (scale_by_count), so nothing is read on the host here. With every query row
    /// padded the gradient pass runs on zeros and adds nothing.
    template <class Compression>
    void queue(const layer_norm<T, DM, Backend>* norm, const relative_attention<T, Config, Backend>& attn,
               Compression& compress, view<const T, DM, Backend> h, view<const T, DM, Backend> m, index_t batch,
               bool with_grad, double* sums, const std::uint8_t* h_pad = nullptr, const std::uint8_t* m_pad = nullptr,
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
        kernels::key_value_projections(mb, cb, index_t(D), mn.data(), mn.ld(), cn.data(), cn.ld(),
                                 attn.key().weight().value(), attn.value().weight().value(),
                                 attn.value().bias().value(), km.data(), kc.data(), vm.data(), vc.data());

        view<T, DM, Backend> out_m(out_m_.ensure(qb * D), qb, D), out_c(out_c_.ensure(qb * D), qb, D);
        // The target attention's probabilities are not read back: a backend with
        // plain_attention_scratch keeps them in scratch of its own (kernels/kernel_table.hpp).
        T* a_m = kernels::plain_attention_scratch ? nullptr : a_m_.ensure(batch * H * q_len * m_len);
        T* a_c = a_c_.ensure(batch * H * q_len * c_len);
        // Key masks [B, n] (1 = visible) from the padding of m and of the compressed slots.
        const std::uint8_t *keep_m = nullptr, *keep_c = nullptr, *any_m = nullptr, *any_c = nullptr;
        if (m_pad) {
            kernels::reconstruction_keep(batch, m_len, c_len, m_pad, keep_m_.ensure(batch * m_len),
                                   keep_c_.ensure(batch * c_len), any_m_.ensure(batch), any_c_.ensure(batch));
            keep_m = keep_m_.data();
            keep_c = keep_c_.data();
            any_m = any_m_.data();
            any_c = any_c_.data();
        }
        const T scale = T(1) / std::sqrt(T(index_t(Dk)));
        kernels::template plain_attention_forward<extents>(batch, H, D, Dk, q_len, m_len, scale, q.data(), km.data(),
                                                     vm.data(), a_m, out_m.data(), keep_m, any_m);
        kernels::template plain_attention_forward<extents>(batch, H, D, Dk, q_len, c_len, scale, q.data(), kc.data(),
                                                     vc.data(), a_c, out_c.data(), keep_c, any_c);

        // MSE over the unpadded query rows, summed in double in a fixed order; d out_c = 2 (out_c − out_m) / N.
        T* diff = diff_.ensure(qb * D);
        kernels::squared_difference_rows(qb, index_t(D), out_c.data(), index_t(D), out_m.data(), index_t(D), h_pad, diff,
                                   index_t(D), sums);
        if (!with_grad || !Compression::has_parameters) return;

        // now d loss / d out_c = 2 (out_c − out_m) / N (0 on padded rows)
        kernels::scale_by_count(qb * D, diff, sums + 1, index_t(D), T(2));
        view<T, DM, Backend> dkc(dkc_.ensure(cb * D), cb, D), dvc(dvc_.ensure(cb * D), cb, D),
            dcn(dcn_.ensure(cb * D), cb, D), dcm(dcm_.ensure(cb * D), cb, D);
        T* da = da_.ensure(batch * H * q_len * c_len);
        kernels::template plain_attention_backward<extents>(batch, H, D, Dk, q_len, c_len, scale, q.data(), vc.data(), a_c,
                                                      diff, da, dkc.data(), dvc.data());
        attn.key().backward_input(dkc, dcn);
        attn.value().backward_input(dvc, dcn, true);
        if (norm) norm->backward_input(cm, dcn, dcm, st_c);
        compress.backward(m, batch, norm ? dcm : dcn, view<T, DM, Backend>());
    }

    /// The loss from queue()'s two sums, read on the host: sum / (rows·D) in T; 0 with no row.
    T loss(const double sums[2]) const {
        const index_t n = index_t(sums[1]) * D;
        return n == 0 ? T(0) : T(sums[0] / double(n));
    }

private:
    /// The extents the kernels take as compile-time constants (`dynamic` for a runtime shape).
    static constexpr static_extents extents{Config::d_model, Config::heads, Config::d_head};

    buffer<T, Backend> cm_, hn_, mn_, cn_, q_, km_, vm_, kc_, vc_, out_m_, out_c_, a_m_, a_c_, diff_;
    buffer<T, Backend> st_c_, st_c_r_;
    buffer<T, Backend> dkc_, dvc_, dcn_, dcm_, da_;
    buffer<double, Backend> sum_;  // compute()'s sums: the squared differences' sum and the rows counted
    buffer<std::uint8_t, Backend> keep_m_, keep_c_, any_m_, any_c_;
};

}  // namespace mnemo
