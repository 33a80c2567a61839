#pragma once
// The GRU gate's element-wise passes (nn/gru_gate.hpp has the math): the gates from the two
// projections and the gated output, and their backward.
#include <cmath>

#include "parallel.hpp"
#include "../../core/shape.hpp"

namespace mnemo::cpu_kernels {


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
    static void gru_gate_forward(index_t rows, index_t d, T* gi, T* gh, const T* b_ih, const T* b_hh, const T* x, T* out,
                        index_t ldo) {
        parallel_range(rows, rows * d >= parallel_min_elements, [&](index_t i_begin, index_t i_end) {
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
    static void gru_gate_backward(index_t rows, index_t d, const T* act, const T* gh, const T* x, const T* g, index_t ldg,
                         T* dgi, T* dgh, T* dx, index_t ldx, bool accumulate_dx) {
        parallel_range(rows, rows * d >= parallel_min_elements, [&](index_t i_begin, index_t i_end) {
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

}  // namespace mnemo::cpu_kernels
