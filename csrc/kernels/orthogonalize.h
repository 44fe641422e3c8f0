// Fused orthogonalization of PowerSGD's P and Q matrices: one call for a
// batch of small row-major (n, r) matrices instead of torch's op-by-op
// Gram-Schmidt (a dozen kernel launches per column) or batched linalg.qr.
//
// Raw pointers and sizes only (no torch, no CUDA headers), so any layer may
// include this and the CPU version is Catch2-tested without LibTorch.
//
// Note [fused orthogonalization]
// `batch` matrices lie back to back, each row-major (n, r), contiguous, with
// 1 <= r <= n. Their columns are orthonormalized in place.
//
// r <= 2: torch's _orthogonalize_gram_schmidt, op for op (torch uses it for
//   these ranks): for i in 0..r-1:
//     col_i /= norm(col_i) + epsilon   (col_i /= norm(col_i) when epsilon == 0:
//                                       a zero column becomes NaN, as in torch)
//     col_j -= dot(col_i, col_j) * col_i   for every j > i
//   Element-wise operations round in T as torch's do; norms and dot products
//   accumulate in double, so results agree with torch to a few ulps.
// r > 2: torch uses linalg.qr, which stays orthogonal on nearly dependent
//   columns where one Gram-Schmidt pass does not. Here: modified Gram-Schmidt
//   with a second projection pass ("twice is enough", Giraud et al. 2005),
//   which is as orthogonal as QR; columns equal QR's up to sign (PowerSGD's
//   P Q^T does not depend on signs). The CUDA kernel runs both passes over all
//   columns; the CPU one works in double and re-projects only the columns that
//   cancellation shrank below 1/sqrt(2) of their length (the DGKS criterion).
//   As QR, epsilon is ignored and the result is always orthonormal: a column that is exactly zero after projection (rank-deficient
//   input, e.g. an all-zero gradient) is replaced by a unit vector orthogonal
//   to the earlier columns instead of becoming NaN.
// From kTallRows rows, r > 2 takes the tall path instead (CholeskyQR2 over
// row chunks, Note [tall orthogonalization] in orthogonalize_tall.h).
#pragma once

#include <cstdint>

namespace fastddp::kernels {

// Whether rank r takes the QR-like path (two passes, epsilon ignored).
constexpr bool orthogonalize_like_qr(int64_t r) { return r > 2; }

// Largest r the CPU kernels take: the column-major scratch copy of one matrix
// stays in L2 up to about this rank for PowerSGD's n; beyond it LAPACK's
// blocked QR wins. Callers check it (r is not checked again here).
constexpr int64_t kOrthogonalizeCpuMaxRank = 64;

// CPU: single-threaded over the `batch` matrices starting at `matrices`; the
// caller threads by handing out chunks of the batch. Vectorized per column.
void orthogonalize_cpu(float* matrices, int64_t batch, int64_t n, int64_t r, double epsilon);
void orthogonalize_cpu(double* matrices, int64_t batch, int64_t n, int64_t r, double epsilon);
// Out of place: the `batch` matrices at `src` (only read) orthonormalized into
// `dst` (same layout; src == dst is in place). The algorithm's first pass reads
// src: a hook whose state is the input (PowerSGD's warm-started Q) writes the
// result into its spare with no copy of the state (Note [double-buffered step
// state], reducer/comm_hook.h).
void orthogonalize_cpu(const float* src, float* dst, int64_t batch, int64_t n, int64_t r,
                       double epsilon);
void orthogonalize_cpu(const double* src, double* dst, int64_t batch, int64_t n, int64_t r,
                       double epsilon);

// --- CUDA (built only with CUDA; `stream` is a cudaStream_t) ----------------------

// Largest r the CUDA kernel takes (one warp per later column fits any r, but
// PowerSGD ranks are small and larger ones are better served by cuSOLVER).
constexpr int64_t kOrthogonalizeCudaMaxRank = 32;

// One thread block per matrix; `src` as orthogonalize_cpu's (nullptr or
// `matrices`: in place), loaded by each block before its first column.
void orthogonalize_cuda(float* matrices, int64_t batch, int64_t n, int64_t r, double epsilon,
                        void* stream, const float* src = nullptr);
void orthogonalize_cuda(double* matrices, int64_t batch, int64_t n, int64_t r, double epsilon,
                        void* stream, const double* src = nullptr);

}  // namespace fastddp::kernels
