// PowerSGD's three skinny products on CPU, for float32 row-major (n, m)
// matrices M and rank r (small: 1 to a few dozen):
//   project       P (n x r) = M Q          (Q: m x r)
//   back_project  Q (m x r) = M^T P
//   expand        out (n x m) = P Q^T
// Each streams M (or out) once from memory, with r multiply-adds per
// element against a transposed r x m copy of Q that stays in cache; a BLAS
// bmm at r = 4 reads M at a fraction of memory speed. Sums run in kLanes
// independent float accumulators (vectorized without reassociation; the
// order does not depend on the CPU), so results agree with bmm to float
// rounding, not bit for bit.
//
// Raw pointers only (torch-free). Threading is the caller's: project and
// expand take a row range, back_project one whole matrix.
#pragma once

#include <cstdint>

namespace fastddp::kernels {

// q_t: Q transposed (r x m). Rows [row_begin, row_end) of P.
void lowrank_project_cpu(const float* mat, int64_t m, const float* q_t, int64_t r, float* p,
                         int64_t row_begin, int64_t row_end);

// q_t_out: Q^T (r x m), overwritten.
void lowrank_back_project_cpu(const float* mat, int64_t n, int64_t m, const float* p, int64_t r,
                              float* q_t_out);

// q_t: Q transposed (r x m). Rows [row_begin, row_end) of out. With src
// and err (n x m, or null): also err = src - out, row by row while the row
// is in L1 (PowerSGD's error feedback without another pass).
void lowrank_expand_cpu(const float* p, const float* q_t, int64_t m, int64_t r, float* out,
                        const float* src, float* err, int64_t row_begin, int64_t row_end);

// (rows x cols) row-major -> (cols x rows) row-major.
void transpose_cpu(const float* src, int64_t rows, int64_t cols, float* dst);

}  // namespace fastddp::kernels
