// Checks shared by the Catch2 tests of the CPU orthogonalizations: random
// inputs and the properties any orthonormal basis of the input's span has.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

namespace orthogonalize_checks {

template <typename T>
std::vector<T> random_matrices(int64_t batch, int64_t n, int64_t r, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<double> normal(0.0, 1.0);
  std::vector<T> v(static_cast<size_t>(batch * n * r));
  for (T& x : v) x = static_cast<T>(normal(rng));
  return v;
}

// Element (row, col) of matrix b of a row-major (batch, n, r) buffer.
template <typename T>
T& at(std::vector<T>& m, int64_t n, int64_t r, int64_t b, int64_t row, int64_t col) {
  return m[static_cast<size_t>((b * n + row) * r + col)];
}

// max |P^T P - I| over the batch.
template <typename T>
double orthogonality_error(std::vector<T>& p, int64_t batch, int64_t n, int64_t r) {
  double worst = 0;
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t i = 0; i < r; ++i) {
      for (int64_t j = 0; j < r; ++j) {
        double dot = 0;
        for (int64_t k = 0; k < n; ++k) dot += double(at(p, n, r, b, k, i)) * at(p, n, r, b, k, j);
        worst = std::max(worst, std::abs(dot - (i == j ? 1.0 : 0.0)));
      }
    }
  }
  return worst;
}

// max |A - P P^T A| / max |A|: the columns of A lie in the span of P's.
template <typename T>
double span_error(std::vector<T>& a, std::vector<T>& p, int64_t batch, int64_t n, int64_t r) {
  double worst = 0, scale = 0;
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t j = 0; j < r; ++j) {
      std::vector<double> coef(static_cast<size_t>(r), 0.0);  // P^T a_j
      for (int64_t l = 0; l < r; ++l) {
        for (int64_t k = 0; k < n; ++k) coef[l] += double(at(p, n, r, b, k, l)) * at(a, n, r, b, k, j);
      }
      for (int64_t k = 0; k < n; ++k) {
        double projected = 0;
        for (int64_t l = 0; l < r; ++l) projected += at(p, n, r, b, k, l) * coef[l];
        worst = std::max(worst, std::abs(projected - at(a, n, r, b, k, j)));
        scale = std::max(scale, std::abs(double(at(a, n, r, b, k, j))));
      }
    }
  }
  return worst / scale;
}

}  // namespace orthogonalize_checks
