// The tall-matrix orthogonalization on the CPU (csrc/kernels/orthogonalize_tall*,
// Note [tall orthogonalization]), checked against what characterizes QR's Q and
// not against another copy of the algorithm: orthonormal columns, the input's
// span, and R = Q^T A upper triangular with a positive diagonal (the thin QR
// factorization with that sign convention is unique). Also: the same bits for
// any split of the work into threads, and the Gram-Schmidt route for matrices
// the Cholesky step refuses.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "kernels/cholesky_small.h"
#include "kernels/orthogonalize_tall.h"
#include "orthogonalize_checks.h"

namespace k = fastddp::kernels;
using namespace orthogonalize_checks;

namespace {

// Runs body over [0, count) in ranges of `step`, last range first: a different
// split and order than a serial loop, as threads would take them.
struct SplitFor {
  int64_t step;
  template <typename Body>
  void operator()(int64_t count, const Body& body) const {
    for (int64_t end = count; end > 0; end -= step) body(end > step ? end - step : 0, end);
  }
};

// Largest |(Q^T A)_ij| below the diagonal relative to max |A|, and the smallest
// diagonal entry of Q^T A (positive for QR's sign convention).
template <typename T>
void r_factor(std::vector<T>& a, std::vector<T>& q, int64_t batch, int64_t n, int64_t r,
              double* below, double* min_diagonal) {
  *below = 0;
  *min_diagonal = std::numeric_limits<double>::infinity();
  double scale = 0;
  for (T x : a) scale = std::max(scale, std::abs(double(x)));
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t i = 0; i < r; ++i) {
      for (int64_t j = 0; j <= i; ++j) {
        double rij = 0;  // (Q^T A)_ij
        for (int64_t row = 0; row < n; ++row) {
          rij += double(at(q, n, r, b, row, i)) * at(a, n, r, b, row, j);
        }
        if (j < i) *below = std::max(*below, std::abs(rij) / scale);
        if (j == i) *min_diagonal = std::min(*min_diagonal, rij);
      }
    }
  }
}

template <typename T>
void check_is_qr(int64_t batch, int64_t n, int64_t r, unsigned seed) {
  std::vector<T> a = random_matrices<T>(batch, n, r, seed), q = a;
  REQUIRE(k::orthogonalize_tall(n, r));
  k::orthogonalize_tall_cpu(q.data(), batch, n, r, SplitFor{1});
  // Rounding of the entries (a few eps) plus sqrt(n) eps for sums of n products:
  // the same allowance as the Gram-Schmidt path's tests.
  const double eps = std::numeric_limits<T>::epsilon();
  const double tol = eps * (4 + std::sqrt(double(n)));
  double below = 0, min_diagonal = 0;
  r_factor(a, q, batch, n, r, &below, &min_diagonal);
  INFO("batch " << batch << " n " << n << " r " << r << " tol " << tol);
  CHECK(orthogonality_error(q, batch, n, r) < tol);
  CHECK(span_error(a, q, batch, n, r) < tol);
  CHECK(below < tol);
  CHECK(min_diagonal > 0);
}

}  // namespace

TEST_CASE("cholesky_inverse: R^-T G R^-1 = I, and refusals", "[orthogonalize]") {
  // G = A^T A for A = [[2, 1, 0], [0, 3, 1], [1, 0, 4]].
  const double g[9] = {5, 2, 4, 2, 10, 3, 4, 3, 17};
  double scratch[9], inv[9];
  REQUIRE(k::cholesky_inverse(g, 3, scratch, inv));
  for (int i = 0; i < 3; ++i) {
    for (int j = 0; j < 3; ++j) {
      double e = 0;  // (X^T G X)_ij with X = inv, upper triangular
      for (int p = 0; p <= i; ++p) {
        for (int s = 0; s <= j; ++s) e += inv[p * 3 + i] * g[p * 3 + s] * inv[s * 3 + j];
      }
      CHECK(e == Approx(i == j ? 1.0 : 0.0).margin(1e-14));  // double rounding of 3x3 sums
    }
    CHECK(inv[i * 3 + i] > 0);
  }
  const double singular[4] = {1, 2, 2, 4};  // columns (1, 0)-ish and twice it
  CHECK_FALSE(k::cholesky_inverse(singular, 2, scratch, inv));
  const double zero[4] = {0, 0, 0, 1};
  CHECK_FALSE(k::cholesky_inverse(zero, 2, scratch, inv));
  const double nan[4] = {1, std::nan(""), std::nan(""), 1};
  CHECK_FALSE(k::cholesky_inverse(nan, 2, scratch, inv));
  const double inf[4] = {INFINITY, 0, 0, 1};
  CHECK_FALSE(k::cholesky_inverse(inf, 2, scratch, inv));
}

TEST_CASE("orthogonalize_tall_cpu: QR's Q with a positive diagonal", "[orthogonalize]") {
  check_is_qr<float>(1, k::kTallRows, 3, 1);
  check_is_qr<float>(2, k::kTallRows + 1, 8, 2);  // a short last chunk
  check_is_qr<double>(1, 3 * k::kTallChunkRowsCpu + k::kTallRows, 4, 3);
  check_is_qr<double>(2, k::kTallRows, 16, 4);
  CHECK_FALSE(k::orthogonalize_tall(k::kTallRows - 1, 8));
  CHECK_FALSE(k::orthogonalize_tall(1 << 20, 2));  // r <= 2 keeps torch's Gram-Schmidt
}

TEST_CASE("orthogonalize_tall_cpu: the same bits for any split of the work",
          "[orthogonalize]") {
  const int64_t batch = 3, n = k::kTallRows + 77, r = 5;
  const std::vector<float> a = random_matrices<float>(batch, n, r, 7);
  std::vector<float> whole = a, ones = a, threes = a;
  k::orthogonalize_tall_cpu(whole.data(), batch, n, r, SplitFor{1 << 30});
  k::orthogonalize_tall_cpu(ones.data(), batch, n, r, SplitFor{1});
  k::orthogonalize_tall_cpu(threes.data(), batch, n, r, SplitFor{3});
  CHECK(whole == ones);
  CHECK(whole == threes);
}

TEST_CASE("orthogonalize_tall_cpu: refused matrices take Gram-Schmidt", "[orthogonalize]") {
  const int64_t batch = 4, n = k::kTallRows, r = 4;
  std::vector<float> a = random_matrices<float>(batch, n, r, 9);
  for (int64_t row = 0; row < n; ++row) {
    at(a, n, r, 1, row, 2) = 0;                         // a zero column
    at(a, n, r, 2, row, 3) = 3 * at(a, n, r, 2, row, 0);  // a dependent one
  }
  at(a, n, r, 3, 5, 1) = std::nanf("");
  std::vector<float> q = a;
  k::orthogonalize_tall_cpu(q.data(), batch, n, r, SplitFor{2});
  // Matrices 0-2: orthonormal (the completed column included) and spanning the
  // input; the tolerance is check_is_qr's.
  const double tol = std::numeric_limits<float>::epsilon() * (4 + std::sqrt(double(n)));
  std::vector<float> a3(a.begin(), a.begin() + 3 * n * r), q3(q.begin(), q.begin() + 3 * n * r);
  CHECK(orthogonality_error(q3, 3, n, r) < tol);
  CHECK(span_error(a3, q3, 3, n, r) < tol);
  // A NaN input stays NaN, as on the Gram-Schmidt path.
  bool any_nan = false;
  for (int64_t row = 0; row < n; ++row) any_nan = any_nan || std::isnan(at(q, n, r, 3, row, 1));
  CHECK(any_nan);
}
