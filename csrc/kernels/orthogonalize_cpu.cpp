// CPU version of the fused orthogonalization (see Note [fused orthogonalization]).
//
// Gram-Schmidt walks columns, and a row-major (n, r) column is strided by r,
// so each matrix is first transposed into a column-major scratch copy: every
// norm, dot product, division and update is then a unit-stride loop that the
// compiler vectorizes, and the whole matrix (a few hundred KB at most for
// PowerSGD's shapes) stays in L2 across the r passes. One transpose in and one
// out cost two passes, fewer than the r(r+1) column passes of the algorithm.
// r == 1 needs no copy: a one-column matrix is already a column.
#include <algorithm>
#include <cmath>
#include <vector>

#include "orthogonalize.h"

namespace fastddp::kernels {

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && defined(__linux__)
#define FASTDDP_VECTOR_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define FASTDDP_VECTOR_CLONES
#endif

namespace {

constexpr int kLanes = 8;

// sum a[k] * b[k] in double. kLanes independent accumulators let the compiler
// vectorize without reassociating (no -ffast-math), and fix the summation
// order, so results do not depend on the vector width the CPU picked.
template <typename T>
FASTDDP_VECTOR_CLONES double dot(const T* __restrict a, const T* __restrict b, int64_t n) {
  double acc[kLanes] = {};
  int64_t k = 0;
  for (; k + kLanes <= n; k += kLanes) {
    for (int l = 0; l < kLanes; ++l) {
      acc[l] += static_cast<double>(a[k + l]) * static_cast<double>(b[k + l]);
    }
  }
  for (int l = 0; k + l < n; ++l) {
    acc[l] += static_cast<double>(a[k + l]) * static_cast<double>(b[k + l]);
  }
  return ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
}

// A division, not a multiplication by the reciprocal: torch's `col /= norm`
// rounds once per element.
template <typename T>
FASTDDP_VECTOR_CLONES void divide(T* __restrict a, T d, int64_t n) {
  for (int64_t k = 0; k < n; ++k) a[k] = a[k] / d;
}

// a -= c * b, rounded twice as torch's `rest -= dot * col` (-ffp-contract=off
// keeps the compiler from fusing it into an FMA).
template <typename T>
FASTDDP_VECTOR_CLONES void subtract_scaled(T* __restrict a, T c, const T* __restrict b,
                                           int64_t n) {
  for (int64_t k = 0; k < n; ++k) a[k] = a[k] - c * b[k];
}

// Column i of `cols` is zero after projection: the input is rank-deficient.
// QR would still return an orthonormal column; so do we. The basis vector
// e_k least covered by the earlier (orthonormal) columns, the k minimizing
// sum_l cols[l][k]^2, keeps a residual of at least (n - i) / n >= 1 / n of
// its length after projection (the residuals' squares sum to n - i over k),
// so two projection passes leave it orthogonal to working precision.
template <typename T>
void complete_column(T* cols, int64_t n, int64_t i) {
  std::vector<double> covered(static_cast<size_t>(n), 0.0);
  for (int64_t l = 0; l < i; ++l) {
    const T* cl = cols + l * n;
    for (int64_t k = 0; k < n; ++k) covered[k] += static_cast<double>(cl[k]) * cl[k];
  }
  const int64_t best = std::min_element(covered.begin(), covered.end()) - covered.begin();
  T* ci = cols + i * n;
  std::fill(ci, ci + n, T(0));
  ci[best] = T(1);
  for (int pass = 0; pass < 2; ++pass) {
    for (int64_t l = 0; l < i; ++l) {
      const T* cl = cols + l * n;
      subtract_scaled(ci, static_cast<T>(dot(cl, ci, n)), cl, n);
    }
  }
  divide(ci, static_cast<T>(std::sqrt(dot(ci, ci, n))), n);
}

// One modified Gram-Schmidt pass over the r columns (each n long, contiguous).
template <typename T>
void gram_schmidt_pass(T* cols, int64_t n, int64_t r, double epsilon, bool like_qr) {
  for (int64_t i = 0; i < r; ++i) {
    T* ci = cols + i * n;
    // torch: norm (in T), then `norm + epsilon` in T.
    const T norm = static_cast<T>(std::sqrt(dot(ci, ci, n)));
    if (like_qr && norm == T(0)) {
      complete_column(cols, n, i);
    } else {
      divide(ci, epsilon == 0 ? norm : norm + static_cast<T>(epsilon), n);
    }
    for (int64_t j = i + 1; j < r; ++j) {
      T* cj = cols + j * n;
      subtract_scaled(cj, static_cast<T>(dot(ci, cj, n)), ci, n);
    }
  }
}

template <typename T>
void orthogonalize_one(T* a, int64_t n, int64_t r, double epsilon, T* scratch) {
  T* cols = r == 1 ? a : scratch;
  if (r > 1) {
    for (int64_t k = 0; k < n; ++k) {
      for (int64_t j = 0; j < r; ++j) cols[j * n + k] = a[k * r + j];
    }
  }
  if (orthogonalize_like_qr(r)) {
    gram_schmidt_pass(cols, n, r, 0.0, true);
    gram_schmidt_pass(cols, n, r, 0.0, true);
  } else {
    gram_schmidt_pass(cols, n, r, epsilon, false);
  }
  if (r > 1) {
    for (int64_t k = 0; k < n; ++k) {
      for (int64_t j = 0; j < r; ++j) a[k * r + j] = cols[j * n + k];
    }
  }
}

template <typename T>
void orthogonalize_batch(T* matrices, int64_t batch, int64_t n, int64_t r, double epsilon) {
  if (batch <= 0 || n <= 0 || r <= 0) return;
  std::vector<T> scratch(r > 1 ? static_cast<size_t>(n * r) : 0);
  for (int64_t b = 0; b < batch; ++b) {
    orthogonalize_one(matrices + b * n * r, n, r, epsilon, scratch.data());
  }
}

}  // namespace

void orthogonalize_cpu(float* matrices, int64_t batch, int64_t n, int64_t r, double epsilon) {
  orthogonalize_batch(matrices, batch, n, r, epsilon);
}

void orthogonalize_cpu(double* matrices, int64_t batch, int64_t n, int64_t r, double epsilon) {
  orthogonalize_batch(matrices, batch, n, r, epsilon);
}

}  // namespace fastddp::kernels
