// The small dense step of the tall-matrix orthogonalization (Note [tall
// orthogonalization]): the Cholesky factor R of an r x r Gram matrix G = A^T A
// and its inverse, in double. Header-only and torch-free so that the CPU path,
// the CUDA kernel (one thread per matrix) and the Catch2 tests run the same
// arithmetic in the same order.
#pragma once

#include <cmath>
#include <cstdint>

#if !defined(FASTDDP_HOST_DEVICE)
#if defined(__CUDACC__)
#define FASTDDP_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define FASTDDP_HOST_DEVICE inline
#endif
#endif

namespace fastddp::kernels {

// A column whose part outside the span of the earlier columns has a squared
// length below this fraction of its own (below 1e-4 of its length) is called
// dependent: the Cholesky route would lose orthogonality there (its error grows
// as the condition number squared), so such a matrix goes to Gram-Schmidt.
constexpr double kCholeskyPivotFloor = 1e-8;

// g: the upper triangle (i <= j) of a row-major r x r symmetric matrix, read
// only. On success writes into `inv` the upper triangle of R^{-1}, where
// R^T R = G, R upper triangular with a positive diagonal, and returns true;
// `r_scratch` (r * r doubles) holds R. Returns false, with `inv` unspecified,
// when a pivot falls below kCholeskyPivotFloor times its column's squared
// length or is not a number (NaN or infinite input, zero columns).
FASTDDP_HOST_DEVICE bool cholesky_inverse(const double* g, int r, double* r_scratch,
                                          double* inv) {
  double* R = r_scratch;
  for (int j = 0; j < r; ++j) {
    double d = g[j * r + j];
    for (int k = 0; k < j; ++k) d -= R[k * r + j] * R[k * r + j];
    // Written so that NaN fails too (every comparison with NaN is false).
    if (!(d > kCholeskyPivotFloor * g[j * r + j]) || !(d < INFINITY)) return false;
    const double rjj = sqrt(d);
    R[j * r + j] = rjj;
    for (int i = j + 1; i < r; ++i) {
      double s = g[j * r + i];
      for (int k = 0; k < j; ++k) s -= R[k * r + j] * R[k * r + i];
      R[j * r + i] = s / rjj;
    }
  }
  // Back substitution, one column c of R X = I at a time (X upper triangular).
  for (int c = 0; c < r; ++c) {
    inv[c * r + c] = 1.0 / R[c * r + c];
    for (int i = c - 1; i >= 0; --i) {
      double s = 0;
      for (int k = i + 1; k <= c; ++k) s += R[i * r + k] * inv[k * r + c];
      inv[i * r + c] = -s / R[i * r + i];
    }
  }
  return true;
}

// One row x (length r) of A becomes x R^{-1}: x_j <- sum_{i <= j} x_i inv_ij, in
// double, computed from the last column down so that x is overwritten in place.
FASTDDP_HOST_DEVICE void multiply_row_by_inverse(double* x, int r, const double* inv) {
  for (int j = r - 1; j >= 0; --j) {
    double s = 0;
    for (int i = 0; i <= j; ++i) s += x[i] * inv[i * r + j];
    x[j] = s;
  }
}

}  // namespace fastddp::kernels
