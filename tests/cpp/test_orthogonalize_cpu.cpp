// CPU fused orthogonalization (csrc/kernels/orthogonalize_cpu.cpp): orthonormal
// columns spanning the input's, torch's Gram-Schmidt op order for r <= 2, and
// its zero-column behaviour (epsilon, NaN), on sizes that break vector widths.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "kernels/orthogonalize.h"
#include "orthogonalize_checks.h"

namespace k = fastddp::kernels;
using namespace orthogonalize_checks;

namespace {

// torch's _orthogonalize_gram_schmidt written out directly on the row-major
// layout: the op order the kernel promises for r <= 2.
template <typename T>
void reference_gram_schmidt(std::vector<T>& m, int64_t batch, int64_t n, int64_t r,
                            double epsilon) {
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t i = 0; i < r; ++i) {
      double ss = 0;
      for (int64_t k = 0; k < n; ++k) ss += double(at(m, n, r, b, k, i)) * at(m, n, r, b, k, i);
      const T norm = static_cast<T>(std::sqrt(ss));
      const T d = epsilon == 0 ? norm : norm + static_cast<T>(epsilon);
      for (int64_t k = 0; k < n; ++k) at(m, n, r, b, k, i) = at(m, n, r, b, k, i) / d;
      for (int64_t j = i + 1; j < r; ++j) {
        double dot = 0;
        for (int64_t k = 0; k < n; ++k) {
          dot += double(at(m, n, r, b, k, i)) * at(m, n, r, b, k, j);
        }
        const T c = static_cast<T>(dot);
        for (int64_t k = 0; k < n; ++k) {
          at(m, n, r, b, k, j) = at(m, n, r, b, k, j) - c * at(m, n, r, b, k, i);
        }
      }
    }
  }
}

// The largest condition number (sigma_max / sigma_min) of the batch's (n, 2) matrices,
// from the eigenvalues of their 2 x 2 Gram matrices; 1 for other r.
template <typename T>
double condition_of_two_columns(std::vector<T>& a, int64_t batch, int64_t n, int64_t r) {
  double worst = 1.0;
  for (int64_t b = 0; b < batch && r == 2; ++b) {
    double g00 = 0, g01 = 0, g11 = 0;
    for (int64_t k = 0; k < n; ++k) {
      const double x = at(a, n, r, b, k, 0), y = at(a, n, r, b, k, 1);
      g00 += x * x;
      g01 += x * y;
      g11 += y * y;
    }
    const double mid = (g00 + g11) / 2;
    const double rad = std::sqrt((g00 - g11) * (g00 - g11) / 4 + g01 * g01);
    worst = std::max(worst, std::sqrt((mid + rad) / (mid - rad)));
  }
  return worst;
}

// What rounding in T allows: a few eps for the entries' own rounding plus sqrt(n) eps for
// sums of n products (measured: <= 10 eps at n = 1029 in double, <= 2 eps in float, where
// the sums run in double); Gram-Schmidt in T (r <= 2, torch's op order) also loses
// orthogonality in proportion to the columns' condition number kappa (Bjorck 1967),
// measured 0.09 kappa eps at kappa = 1.4e3; r > 2 runs in double with a second pass where
// needed, independent of kappa.
template <typename T>
double rounding_tolerance(int64_t n, int64_t r, double kappa) {
  const double eps = std::numeric_limits<T>::epsilon();
  return eps * (4 + std::sqrt(double(n)) + (r <= 2 ? kappa / 10 : 0.0));
}

template <typename T>
void check_orthonormal_basis(int64_t batch, int64_t n, int64_t r, unsigned seed) {
  std::vector<T> a = random_matrices<T>(batch, n, r, seed);
  std::vector<T> p = a;
  k::orthogonalize_cpu(p.data(), batch, n, r, 0.0);
  const double tol = rounding_tolerance<T>(n, r, condition_of_two_columns(a, batch, n, r));
  INFO("batch " << batch << " n " << n << " r " << r << " tol " << tol);
  CHECK(orthogonality_error(p, batch, n, r) < tol);
  CHECK(span_error(a, p, batch, n, r) < tol);
}

}  // namespace

TEST_CASE("orthogonalize_cpu: orthonormal columns spanning the input", "[orthogonalize]") {
  for (int64_t r : {1, 2, 3, 4, 8, 16, 33, 64}) {
    for (int64_t n : {r, r + 1, r + 7, int64_t{100}, int64_t{1029}}) {
      if (n < r) continue;
      check_orthonormal_basis<float>(3, n, r, static_cast<unsigned>(n * 131 + r));
      check_orthonormal_basis<double>(2, n, r, static_cast<unsigned>(n * 17 + r));
    }
  }
}

TEST_CASE("orthogonalize_cpu: r <= 2 follows torch's Gram-Schmidt op order", "[orthogonalize]") {
  for (int64_t r : {1, 2}) {
    for (int64_t n : {int64_t{2}, int64_t{9}, int64_t{1000}, int64_t{4099}}) {
      for (double eps : {0.0, 1e-8, 0.5}) {
        std::vector<float> got = random_matrices<float>(5, n, r, static_cast<unsigned>(n + r));
        std::vector<float> want = got;
        k::orthogonalize_cpu(got.data(), 5, n, r, eps);
        reference_gram_schmidt(want, 5, n, r, eps);
        INFO("n " << n << " r " << r << " eps " << eps);
        // Bit for bit: the same float ops in the same order; the two double dot products
        // (32 lanes here, one there) differ by ~n 2^-53, which moves no float rounding of
        // these fixed inputs (and -ffp-contract=off keeps the order on every CPU).
        for (size_t e = 0; e < got.size(); ++e) REQUIRE(got[e] == want[e]);
      }
    }
  }
}

TEST_CASE("orthogonalize_cpu: out of place equals in place, the input untouched",
          "[orthogonalize]") {
  // PowerSGD reads its state's Q and writes the spare with this form (Note
  // [double-buffered step state]): it must give the in-place result bit for bit (the
  // overflow tests compare whole runs bit for bit), every rank and path alike.
  for (int64_t r : {1, 2, 3, 4, 8}) {
    for (int64_t n : {r, int64_t{33}, int64_t{1029}}) {
      for (double eps : {0.0, 1e-8}) {
        const std::vector<float> src = random_matrices<float>(4, n, r, static_cast<unsigned>(n + r));
        std::vector<float> in_place = src;
        std::vector<float> out(src.size(), -1.0f);
        k::orthogonalize_cpu(in_place.data(), 4, n, r, eps);
        std::vector<float> read = src;
        k::orthogonalize_cpu(read.data(), out.data(), 4, n, r, eps);
        INFO("n " << n << " r " << r << " eps " << eps);
        REQUIRE(read == src);
        for (size_t e = 0; e < out.size(); ++e) REQUIRE(out[e] == in_place[e]);
      }
    }
  }
}

TEST_CASE("orthogonalize_cpu: nearly dependent columns stay orthogonal for r > 2",
          "[orthogonalize]") {
  const int64_t n = 512, r = 8;
  std::vector<float> a = random_matrices<float>(1, n, r, 7);
  // Every column is column 0 plus a perturbation of 1e-4: condition number ~1e4.
  for (int64_t k2 = 0; k2 < n; ++k2) {
    for (int64_t j = 1; j < r; ++j) {
      at(a, n, r, 0, k2, j) = at(a, n, r, 0, k2, 0) + 1e-4f * at(a, n, r, 0, k2, j);
    }
  }
  std::vector<float> p = a;
  k::orthogonalize_cpu(p.data(), 1, n, r, 0.0);
  // Orthogonal in double (reorthogonalized), then each entry rounded to float once:
  // |P^T P - I| <= 2u sum |p_i||q_i| <= eps whatever the condition number.
  CHECK(orthogonality_error(p, 1, n, r) < std::numeric_limits<float>::epsilon());
}

TEST_CASE("orthogonalize_cpu: a zero column", "[orthogonalize]") {
  const int64_t n = 37;
  SECTION("with epsilon it stays zero and the other column is normalized (r = 2)") {
    std::vector<float> m = random_matrices<float>(1, n, 2, 3);
    for (int64_t row = 0; row < n; ++row) at(m, n, 2, 0, row, 0) = 0.0f;
    k::orthogonalize_cpu(m.data(), 1, n, 2, 1e-8);
    double norm1 = 0;
    for (int64_t row = 0; row < n; ++row) {
      CHECK(at(m, n, 2, 0, row, 0) == 0.0f);
      norm1 += double(at(m, n, 2, 0, row, 1)) * at(m, n, 2, 0, row, 1);
    }
    // The float norm (u) and each entry's division (u): within eps of 1.
    CHECK(std::sqrt(norm1) == Approx(1.0).epsilon(std::numeric_limits<float>::epsilon()));
  }
  SECTION("without epsilon it becomes NaN, as in torch (r = 1, 2)") {
    for (int64_t r : {1, 2}) {
      std::vector<float> m = random_matrices<float>(2, n, r, 5);
      for (int64_t row = 0; row < n; ++row) at(m, n, r, 1, row, 0) = 0.0f;
      k::orthogonalize_cpu(m.data(), 2, n, r, 0.0);
      // Matrix 1 is all NaN (the zero column, then what was projected on it);
      // matrix 0 is untouched by its neighbour's NaN.
      for (int64_t row = 0; row < n; ++row) {
        for (int64_t j = 0; j < r; ++j) {
          CHECK(std::isnan(at(m, n, r, 1, row, j)));
          CHECK(std::isfinite(at(m, n, r, 0, row, j)));
        }
      }
    }
  }
  SECTION("r > 2 completes it to an orthonormal basis, as QR does") {
    for (double eps : {0.0, 1e-8}) {
      const int64_t r = 4;
      std::vector<double> m = random_matrices<double>(1, n, r, 11);
      for (int64_t row = 0; row < n; ++row) {
        at(m, n, r, 0, row, 1) = 0.0;                           // zero column
        at(m, n, r, 0, row, 3) = 2.0 * at(m, n, r, 0, row, 0);  // dependent column
      }
      std::vector<double> p = m;
      k::orthogonalize_cpu(p.data(), 1, n, r, eps);
      // Rank-deficient (kappa infinite), but r > 2 completes the basis in double.
      CHECK(orthogonality_error(p, 1, n, r) < rounding_tolerance<double>(n, r, 1.0));
      CHECK(span_error(m, p, 1, n, r) < rounding_tolerance<double>(n, r, 1.0));
    }
  }
  SECTION("an all-zero matrix with r > 2 becomes orthonormal") {
    const int64_t r = 5;
    std::vector<float> p(static_cast<size_t>(n * r), 0.0f);
    k::orthogonalize_cpu(p.data(), 1, n, r, 0.0);
    // Completed in double from unit vectors, rounded to float once (as above).
    CHECK(orthogonality_error(p, 1, n, r) < std::numeric_limits<float>::epsilon());
  }
}

TEST_CASE("orthogonalize_cpu: square matrices and empty batches", "[orthogonalize]") {
  check_orthonormal_basis<double>(4, 1, 1, 1);
  check_orthonormal_basis<double>(4, 3, 3, 2);
  check_orthonormal_basis<float>(2, 16, 16, 3);
  std::vector<float> none;
  k::orthogonalize_cpu(none.data(), 0, 10, 2, 0.0);  // nothing to touch
}
