#pragma once
// GRU-gated residual connection (Parisotto et al., 2019, "Stabilizing Transformers for Reinforcement
// Learning"), as lucidrains' compressive-transformer-pytorch `GRUGating`: the sub-layer output y is the
// input and the residual stream x the hidden state of one torch.nn.GRUCell(D, D) step, gru(y, x):
//
//   r   = σ(y·W_irᵀ + b_ir + x·W_hrᵀ + b_hr)            reset gate
//   z   = σ(y·W_izᵀ + b_iz + x·W_hzᵀ + b_hz)            update gate
//   hn  = x·W_hnᵀ + b_hn
//   n   = tanh(y·W_inᵀ + b_in + r ⊙ hn)                 candidate
//   out = (1 − z) ⊙ n + z ⊙ x  = n + z ⊙ (x − n)        (the latter is what PyTorch computes)
//
// Parameters (PyTorch names and layouts; the three gates stacked as rows r | z | n):
//   `<name>.weight_ih` [3D, D]   `<name>.weight_hh` [3D, D]   `<name>.bias_ih` [3D]   `<name>.bias_hh` [3D]
//
// Forward is two GEMMs, gi = y·W_ihᵀ and gh = x·W_hhᵀ (each [rows, 3D]), then one element-wise pass
// over rows (the biases are added there). Backward, with g = d_out:
//   dz = g ⊙ (x − n)            a_z = dz ⊙ z ⊙ (1 − z)
//   dn = g ⊙ (1 − z)            a_n = dn ⊙ (1 − n²)
//   dr = a_n ⊙ hn               a_r = dr ⊙ r ⊙ (1 − r)
//   dgi = [a_r | a_z | a_n]     dgh = [a_r | a_z | a_n ⊙ r]
//   dW_ih += dgiᵀ·y   db_ih += Σ_rows dgi   dW_hh += dghᵀ·x   db_hh += Σ_rows dgh
//   dy = dgi·W_ih               dx = dgh·W_hh + g ⊙ z
//
// Backward contract (module.hpp): parameter gradients +=, dx and dy assigned (or added on request;
// either may be an empty view to skip it). Forward copies x and y and keeps r, z, n and hn for
// backward in buffers that grow to the largest row count seen and are reused, so steady-state calls
// do not allocate; backward may be called more than once after one forward. Because forward copies
// its inputs before writing, `out` may share the memory of x or of y (e.g. the residual stream updated
// in place). Backward reads all of d_out before writing dx and dy, so ONE of dx, dy may share d_out's
// memory.
//
// The element-wise passes are kernels of ops<Backend> (gru_gate_forward, gru_gate_backward;
// kernels/cpu/gru.hpp for the CPU), as are the GEMMs.
#include <cmath>
#include <initializer_list>
#include <string>

#include "../core/buffer.hpp"
#include "../core/config.hpp"
#include "../core/rng.hpp"
#include "module.hpp"

namespace mnemo {

template <class T, std::size_t D, class Backend = cpu>
class gru_gate {
    using kernels = checked_ops<Backend>;
    [[no_unique_address]] extent_holder<D> d_;
    [[no_unique_address]] extent_holder<D == dynamic ? dynamic : 3 * D> d3_;

public:
    static constexpr std::size_t features = D;

    /// Declares `<name>.weight_ih` [3D, D], `<name>.weight_hh` [3D, D], `<name>.bias_ih` [3D],
    /// `<name>.bias_hh` [3D] (torch.nn.GRUCell's state_dict under `<name>`).
    gru_gate(parameter_set<T, Backend>& ps, const std::string& name) requires(D != dynamic)
        : gru_gate(ps, name, static_cast<index_t>(D)) {}
    /// Runtime extent (must equal D when that is static).
    gru_gate(parameter_set<T, Backend>& ps, const std::string& name, index_t d) : d_(d), d3_(3 * d) {
        check_extent<D>(d, ("gru_gate '" + name + "'").c_str(), "d_model");
        weight_ih_ = ps.declare(name + ".weight_ih", {d3_, d_});
        weight_hh_ = ps.declare(name + ".weight_hh", {d3_, d_});
        bias_ih_ = ps.declare(name + ".bias_ih", {d3_});
        bias_hh_ = ps.declare(name + ".bias_hh", {d3_});
    }

    /// PyTorch's default: every parameter ~ U(−1/√D, 1/√D), drawn in the order weight_ih, weight_hh,
    /// bias_ih, bias_hh.
    void reset_parameters(rng& r) const {
        const double bound = 1.0 / std::sqrt(static_cast<double>(d_));
        for (const param<T, Backend>* p : {&weight_ih_, &weight_hh_, &bias_ih_, &bias_hh_})
            p->generate([&] { return r.uniform(-bound, bound); });
    }

    /// out [rows, D] = GRUCell(input y, hidden x), x and y [rows, D]. out may share x's or y's memory.
    /// Keeps x, y and the gates for backward.
    template <view_of<T> X, view_of<T> Y, view_of<T> O>
    void forward(const X& x, const Y& y, const O& out) {
        static_assert(check_view<D, X, axis::d_model, Backend>());
        static_assert(check_view<D, Y, axis::d_model, Backend>());
        static_assert(check_view<D, O, axis::d_model, Backend>());
        check_cols(x, d_, "gru_gate", "x");
        check_cols(y, d_, "gru_gate", "y");
        check_cols(out, d_, "gru_gate", "out");
        check_rows(x, y, "gru_gate", "x", "y");
        check_rows(x, out, "gru_gate", "x", "out");
        const index_t rows = x.rows();
        T* xs = x_.ensure(rows * d_);
        T* ys = y_.ensure(rows * d_);
        T* gi = gi_.ensure(rows * d3_);
        T* gh = gh_.ensure(rows * d3_);
        saved_rows_ = rows;
        kernels::copy(rows, d_, x.data(), x.ld(), xs, d_);
        kernels::copy(rows, d_, y.data(), y.ld(), ys, d_);
        kernels::gemm_nt(rows, d3_, d_, ys, d_, weight_ih_.value(), d_, gi, d3_);
        kernels::gemm_nt(rows, d3_, d_, xs, d_, weight_hh_.value(), d_, gh, d3_);
        kernels::gru_gate_forward(rows, d_, gi, gh, bias_ih_.value(), bias_hh_.value(), xs, out.data(), out.ld());
    }

    /// dW_ih, dW_hh, db_ih, db_hh +=; dx (stream / hidden) and dy (sub-layer output / input) assigned,
    /// or added when accumulate_dx / accumulate_dy; an empty view skips it. Follows a forward over the
    /// same number of rows. One of dx, dy may share d_out's memory.
    template <view_of<T> DO, view_of<T> DX, view_of<T> DY>
    void backward(const DO& d_out, const DX& dx, const DY& dy, bool accumulate_dx = false,
                  bool accumulate_dy = false) {
        static_assert(check_view<D, DO, axis::d_model, Backend>());
        static_assert(check_view<D, DX, axis::d_model, Backend>());
        static_assert(check_view<D, DY, axis::d_model, Backend>());
        check_cols(d_out, d_, "gru_gate", "d_out");
        const index_t rows = d_out.rows();
        if (saved_rows_ < 0) detail::fail("gru_gate: backward called before forward");
        MNEMO_CHECK(rows == saved_rows_, "gru_gate: backward over ", rows, " rows but the last forward saw ",
                    saved_rows_);
        if (dx.data()) {
            check_cols(dx, d_, "gru_gate", "dx");
            check_rows(d_out, dx, "gru_gate", "d_out", "dx");
        }
        if (dy.data()) {
            check_cols(dy, d_, "gru_gate", "dy");
            check_rows(d_out, dy, "gru_gate", "d_out", "dy");
        }
        T* dgi = dgi_.ensure(rows * d3_);
        T* dgh = dgh_.ensure(rows * d3_);
        kernels::gru_gate_backward(rows, d_, gi_.data(), gh_.data(), x_.data(), d_out.data(), d_out.ld(), dgi, dgh, dx.data(),
                    dx.ld(), accumulate_dx);
        kernels::gemm_tn(d3_, d_, rows, dgi, d3_, y_.data(), d_, weight_ih_.grad(), d_, T(1));
        kernels::gemm_tn(d3_, d_, rows, dgh, d3_, x_.data(), d_, weight_hh_.grad(), d_, T(1));
        kernels::sum_rows_accumulate(rows, d3_, dgi, d3_, bias_ih_.grad());
        kernels::sum_rows_accumulate(rows, d3_, dgh, d3_, bias_hh_.grad());
        if (dx.data()) kernels::gemm_nn(rows, d_, d3_, dgh, d3_, weight_hh_.value(), d_, dx.data(), dx.ld(), T(1));
        if (dy.data())
            kernels::gemm_nn(rows, d_, d3_, dgi, d3_, weight_ih_.value(), d_, dy.data(), dy.ld(),
                       accumulate_dy ? T(1) : T(0));
    }

    const param<T, Backend>& weight_ih() const { return weight_ih_; }
    const param<T, Backend>& weight_hh() const { return weight_hh_; }
    const param<T, Backend>& bias_ih() const { return bias_ih_; }
    const param<T, Backend>& bias_hh() const { return bias_hh_; }

private:
    param<T, Backend> weight_ih_;  // [3D, D], rows r | z | n
    param<T, Backend> weight_hh_;  // [3D, D]
    param<T, Backend> bias_ih_;    // [3D]
    param<T, Backend> bias_hh_;    // [3D]
    buffer<T, Backend> x_, y_;     // [rows, D]: copies of the inputs
    buffer<T, Backend> gi_, gh_;   // [rows, 3D]: r | z | n, and hn in gh's n columns
    buffer<T, Backend> dgi_, dgh_; // [rows, 3D]: pre-activation gradients
    index_t saved_rows_ = -1;
};

}  // namespace mnemo
