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
// The element-wise passes are plain loops in cpu_kernels::gru_pointwise below, reached through
// gru_ops<Backend> (the seam a CUDA build specialises); the GEMMs go through ops<Backend>.
#include <cmath>
#include <initializer_list>
#include <string>

#include "../core/buffer.hpp"
#include "../core/parallel.hpp"
#include "../core/config.hpp"
#include "../core/rng.hpp"
#include "module.hpp"

namespace mnemo {

namespace cpu_kernels {

/// The element-wise halves of a GRU cell. Gate buffers are [rows, 3d] dense, columns r | z | n.
/// Rows are independent, so threads split them (parallel_range: no OpenMP region for small inputs).
struct gru_pointwise {
    template <class T>
    static T sigmoid(T a) {
        return T(1) / (T(1) + std::exp(-a));
    }

    /// In: gi = y·W_ihᵀ, gh = x·W_hhᵀ (no biases), x [rows, d] dense. Out: out = the GRU output;
    /// gi overwritten with r | z | n; gh's n columns overwritten with hn = x·W_hnᵀ + b_hn (its r and z
    /// columns are left as they were). out may be x's memory (x[i, j] is read before out[i, j] is written).
    template <class T>
    static void forward(index_t rows, index_t d, T* gi, T* gh, const T* b_ih, const T* b_hh, const T* x, T* out,
                        index_t ldo) {
        parallel_range(rows, rows * d >= 65536, [&](index_t i_begin, index_t i_end) {
        for (index_t i = i_begin; i < i_end; ++i) {
            T* a = gi + i * 3 * d;
            T* h = gh + i * 3 * d;
            const T* xi = x + i * d;
            T* o = out + i * ldo;
            for (index_t j = 0; j < d; ++j) {
                const T r = sigmoid(a[j] + b_ih[j] + h[j] + b_hh[j]);
                const T z = sigmoid(a[d + j] + b_ih[d + j] + h[d + j] + b_hh[d + j]);
                const T hn = h[2 * d + j] + b_hh[2 * d + j];
                const T n = std::tanh(a[2 * d + j] + b_ih[2 * d + j] + r * hn);
                const T xv = xi[j];
                a[j] = r;
                a[d + j] = z;
                a[2 * d + j] = n;
                h[2 * d + j] = hn;
                o[j] = n + z * (xv - n);
            }
        }
        });
    }

    /// In: act = r | z | n and gh (n columns = hn) as forward left them, x [rows, d] dense, g = d_out.
    /// Out: dgi, dgh [rows, 3d] dense (assigned); dx = g ⊙ z (or += when accumulate_dx; skipped when dx
    /// is null). g is read at each element before dx is written there, so dx may be g's memory.
    template <class T>
    static void backward(index_t rows, index_t d, const T* act, const T* gh, const T* x, const T* g, index_t ldg,
                         T* dgi, T* dgh, T* dx, index_t ldx, bool accumulate_dx) {
        parallel_range(rows, rows * d >= 65536, [&](index_t i_begin, index_t i_end) {
        for (index_t i = i_begin; i < i_end; ++i) {
            const T* a = act + i * 3 * d;
            const T* hn = gh + i * 3 * d + 2 * d;
            const T* xi = x + i * d;
            const T* gr = g + i * ldg;
            T* di = dgi + i * 3 * d;
            T* dh = dgh + i * 3 * d;
            T* dxi = dx ? dx + i * ldx : nullptr;
            for (index_t j = 0; j < d; ++j) {
                const T r = a[j], z = a[d + j], n = a[2 * d + j], gv = gr[j];
                const T a_z = gv * (xi[j] - n) * z * (T(1) - z);
                const T a_n = gv * (T(1) - z) * (T(1) - n * n);
                const T a_r = a_n * hn[j] * r * (T(1) - r);
                di[j] = a_r;
                di[d + j] = a_z;
                di[2 * d + j] = a_n;
                dh[j] = a_r;
                dh[d + j] = a_z;
                dh[2 * d + j] = a_n * r;
                if (dxi) dxi[j] = accumulate_dx ? dxi[j] + gv * z : gv * z;
            }
        }
        });
    }
};

}  // namespace cpu_kernels

/// gru_ops<Backend>: the element-wise GRU kernels above, per backend (the seam a CUDA build
/// specialises, as ops<Backend>). The primary template only names the missing backend.
template <class Backend>
struct gru_ops {
    static_assert(dependent_false<Backend>,
                  "mnemo: this backend has no GRU kernels: gru_ops<Backend> is not specialised for it");
};
template <>
struct gru_ops<cpu> : cpu_kernels::gru_pointwise {};

/// One torch.nn.GRUCell(D, D) step used as a gated residual: out = GRU(input y, hidden x). D may be
/// `dynamic` (a runtime-shape model): it is then given at construction.
template <class T, std::size_t D, class Backend = cpu>
class gru_gate {
    using K = checked_ops<Backend>;
    using G = gru_ops<Backend>;
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
        K::copy(rows, d_, x.data(), x.ld(), xs, d_);
        K::copy(rows, d_, y.data(), y.ld(), ys, d_);
        K::gemm_nt(rows, d3_, d_, ys, d_, weight_ih_.value(), d_, gi, d3_);
        K::gemm_nt(rows, d3_, d_, xs, d_, weight_hh_.value(), d_, gh, d3_);
        G::forward(rows, d_, gi, gh, bias_ih_.value(), bias_hh_.value(), xs, out.data(), out.ld());
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
        G::backward(rows, d_, gi_.data(), gh_.data(), x_.data(), d_out.data(), d_out.ld(), dgi, dgh, dx.data(),
                    dx.ld(), accumulate_dx);
        K::gemm_tn(d3_, d_, rows, dgi, d3_, y_.data(), d_, weight_ih_.grad(), d_, T(1));
        K::gemm_tn(d3_, d_, rows, dgh, d3_, x_.data(), d_, weight_hh_.grad(), d_, T(1));
        K::sum_rows_accumulate(rows, d3_, dgi, d3_, bias_ih_.grad());
        K::sum_rows_accumulate(rows, d3_, dgh, d3_, bias_hh_.grad());
        if (dx.data()) K::gemm_nn(rows, d_, d3_, dgh, d3_, weight_hh_.value(), d_, dx.data(), dx.ld(), T(1));
        if (dy.data())
            K::gemm_nn(rows, d_, d3_, dgi, d3_, weight_ih_.value(), d_, dy.data(), dy.ld(),
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
