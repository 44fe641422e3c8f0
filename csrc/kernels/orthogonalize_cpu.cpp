// CPU version of the fused orthogonalization (see Note [fused orthogonalization]).
//
// Gram-Schmidt walks columns, and a row-major (n, r) column is strided by r,
// so each matrix is first transposed into a column-major scratch copy: every
// norm, dot product, division and update is then a unit-stride loop that the
// compiler vectorizes, and the whole matrix (a few hundred KB at most for
// PowerSGD's shapes) stays in L2 across the r passes. One transpose in and one
// out cost two passes, fewer than the r(r+1) column passes of the algorithm.
// r == 1 needs no copy: a one-column matrix is already a column.
// Out of place (src != dst), the transpose in reads src and the one out
// writes dst: the read is the pass the algorithm makes anyway.
#include <algorithm>
#include <cmath>
#include <memory>
#include <vector>

#include "orthogonalize.h"
#include "vector_clones.h"

namespace fastddp::kernels {

namespace {

// sum a[k] * b[k] in double. kLanes independent accumulators let the compiler
// vectorize without reassociating (no -ffast-math), fix the summation order
// (results do not depend on the vector width the CPU picked), and are enough
// vectors in flight to hide the adds' latency (8 would leave it latency-bound).
constexpr int kLanes = 32;

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
  for (int width = kLanes / 2; width > 0; width /= 2) {
    for (int l = 0; l < width; ++l) acc[l] += acc[l + width];
  }
  return acc[0];
}

// A division, not a multiplication by the reciprocal: torch's `col /= norm`
// rounds once per element.
template <typename T>
FASTDDP_VECTOR_CLONES void divide(T* __restrict a, T d, int64_t n) {
  for (int64_t k = 0; k < n; ++k) a[k] = a[k] / d;
}

// dst = src / d, the same rounding out of place.
template <typename T>
FASTDDP_VECTOR_CLONES void divide_from(T* __restrict dst, const T* __restrict src, T d,
                                       int64_t n) {
  for (int64_t k = 0; k < n; ++k) dst[k] = src[k] / d;
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
void complete_column(T* cols, int64_t n, int64_t ld, int64_t i) {
  std::vector<double> covered(static_cast<size_t>(n), 0.0);
  for (int64_t l = 0; l < i; ++l) {
    const T* cl = cols + l * ld;
    for (int64_t k = 0; k < n; ++k) covered[k] += static_cast<double>(cl[k]) * cl[k];
  }
  const int64_t best = std::min_element(covered.begin(), covered.end()) - covered.begin();
  T* ci = cols + i * ld;
  std::fill(ci, ci + n, T(0));
  ci[best] = T(1);
  for (int pass = 0; pass < 2; ++pass) {
    for (int64_t l = 0; l < i; ++l) {
      const T* cl = cols + l * ld;
      subtract_scaled(ci, static_cast<T>(dot(cl, ci, n)), cl, n);
    }
  }
  divide(ci, static_cast<T>(std::sqrt(dot(ci, ci, n))), n);
}

// r <= 2: torch's Gram-Schmidt, right-looking as torch's loop, in T.
template <typename T>
void gram_schmidt(T* cols, int64_t n, int64_t ld, int64_t r, double epsilon) {
  for (int64_t i = 0; i < r; ++i) {
    T* ci = cols + i * ld;
    // torch: norm (in T), then `norm + epsilon` in T.
    const T norm = static_cast<T>(std::sqrt(dot(ci, ci, n)));
    divide(ci, epsilon == 0 ? norm : norm + static_cast<T>(epsilon), n);
    for (int64_t j = i + 1; j < r; ++j) {
      T* cj = cols + j * ld;
      subtract_scaled(cj, static_cast<T>(dot(ci, cj, n)), ci, n);
    }
  }
}

// Re-orthogonalize a column when projecting out the earlier ones shrank it
// below this fraction of its length (Daniel, Gragg, Kaufman, Stewart 1976):
// only then has cancellation cost it orthogonality worth a second pass.
constexpr double kReorthogonalize = 0.7071067811865476;  // 1 / sqrt(2)

// r > 2, QR-like: modified Gram-Schmidt in its left-looking order (the same
// operations on each column as the right-looking loop above), in double, with
// the second projection pass ("twice is enough") applied to the columns that
// need it, not to all: random and well-conditioned inputs take one pass, half
// the work. In double for float input, the one pass already leaves the columns
// orthogonal far below float rounding whenever the condition number is below
// about 1e8; nearly dependent columns are caught by the criterion.
void qr_like(double* cols, int64_t n, int64_t ld, int64_t r) {
  for (int64_t i = 0; i < r; ++i) {
    double* ci = cols + i * ld;
    double norm = std::sqrt(dot(ci, ci, n));
    for (int pass = 0; pass < 2 && i > 0; ++pass) {
      const double before = norm;
      for (int64_t l = 0; l < i; ++l) {
        const double* cl = cols + l * ld;
        subtract_scaled(ci, dot(cl, ci, n), cl, n);
      }
      norm = std::sqrt(dot(ci, ci, n));
      if (norm >= kReorthogonalize * before) break;
    }
    if (norm == 0) {
      complete_column(cols, n, ld, i);
    } else {
      divide(ci, norm, n);
    }
  }
}

// The scratch copy's column stride: whole cache lines, and not a multiple of
// 1 KB elements, so that the r columns do not alias to the same cache sets
// (n = 4096 would put them exactly 16 KB apart).
int64_t column_stride(int64_t n) {
  int64_t ld = (n + 15) / 16 * 16;
  if (ld % 256 == 0) ld += 16;
  return ld;
}

// Row blocks of the transposes: each column's slice of a block is one cache line
// written (or read) whole, while the block's rows stay in L1.
constexpr int64_t kRowBlock = 16;

// Between the row-major matrix `a` (n, r) and its column-major copy `cols`
// (kIn: `a` is read, and may be a const T).
// R > 0 is r known at compile time, so that the compiler turns the strided
// accesses into vector shuffles for PowerSGD's usual ranks.
template <bool kIn, int R, typename T, typename W>
FASTDDP_VECTOR_CLONES void transpose_fixed(T* __restrict a, W* __restrict cols, int64_t n,
                                           int64_t r, int64_t ld) {
  if constexpr (R > 0) r = R;
  for (int64_t k0 = 0; k0 < n; k0 += kRowBlock) {
    const int64_t len = std::min(kRowBlock, n - k0);
    for (int64_t j = 0; j < r; ++j) {
      for (int64_t k = k0; k < k0 + len; ++k) {
        if constexpr (kIn) {
          cols[j * ld + k] = static_cast<W>(a[k * r + j]);
        } else {
          a[k * r + j] = static_cast<T>(cols[j * ld + k]);
        }
      }
    }
  }
}

template <bool kIn, typename T, typename W>
void transpose(T* a, W* cols, int64_t n, int64_t r, int64_t ld) {
  switch (r) {
    case 2: return transpose_fixed<kIn, 2>(a, cols, n, r, ld);
    case 4: return transpose_fixed<kIn, 4>(a, cols, n, r, ld);
    case 8: return transpose_fixed<kIn, 8>(a, cols, n, r, ld);
    case 16: return transpose_fixed<kIn, 16>(a, cols, n, r, ld);
    default: return transpose_fixed<kIn, 0>(a, cols, n, r, ld);
  }
}

template <typename T>
void orthogonalize_batch(const T* src, T* dst, int64_t batch, int64_t n, int64_t r,
                         double epsilon) {
  if (batch <= 0 || n <= 0 || r <= 0) return;
  if (r == 1) {  // a one-column matrix is already a column: no scratch
    for (int64_t b = 0; b < batch; ++b) {
      const T* column = src + b * n;
      T* out = dst + b * n;
      if (column == out) {
        gram_schmidt(out, n, n, 1, epsilon);
        continue;
      }
      // gram_schmidt's one column, reading `column` and writing `out`.
      const T norm = static_cast<T>(std::sqrt(dot(column, column, n)));
      divide_from(out, column, epsilon == 0 ? norm : norm + static_cast<T>(epsilon), n);
    }
    return;
  }
  const int64_t ld = column_stride(n);
  const auto size = static_cast<size_t>(ld * r);
  // Uninitialized on purpose: every element is written by the transpose first.
  if (orthogonalize_like_qr(r)) {
    std::unique_ptr<double[]> cols(new double[size]);
    for (int64_t b = 0; b < batch; ++b) {
      transpose<true>(src + b * n * r, cols.get(), n, r, ld);
      qr_like(cols.get(), n, ld, r);
      transpose<false>(dst + b * n * r, cols.get(), n, r, ld);
    }
  } else {
    std::unique_ptr<T[]> cols(new T[size]);
    for (int64_t b = 0; b < batch; ++b) {
      transpose<true>(src + b * n * r, cols.get(), n, r, ld);
      gram_schmidt(cols.get(), n, ld, r, epsilon);
      transpose<false>(dst + b * n * r, cols.get(), n, r, ld);
    }
  }
}

}  // namespace

void orthogonalize_cpu(float* matrices, int64_t batch, int64_t n, int64_t r, double epsilon) {
  orthogonalize_batch<float>(matrices, matrices, batch, n, r, epsilon);
}

void orthogonalize_cpu(double* matrices, int64_t batch, int64_t n, int64_t r, double epsilon) {
  orthogonalize_batch<double>(matrices, matrices, batch, n, r, epsilon);
}

void orthogonalize_cpu(const float* src, float* dst, int64_t batch, int64_t n, int64_t r,
                       double epsilon) {
  orthogonalize_batch<float>(src, dst, batch, n, r, epsilon);
}

void orthogonalize_cpu(const double* src, double* dst, int64_t batch, int64_t n, int64_t r,
                       double epsilon) {
  orthogonalize_batch<double>(src, dst, batch, n, r, epsilon);
}

}  // namespace fastddp::kernels
