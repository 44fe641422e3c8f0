// CPU pieces of the tall-matrix orthogonalization (Note [tall
// orthogonalization]). Each works on one chunk of rows of one matrix; the
// caller (orthogonalize_tall_cpu in the header) threads them.
#include <algorithm>
#include <vector>

#include "cholesky_small.h"
#include "orthogonalize_tall.h"

namespace fastddp::kernels {
namespace {

template <typename T>
void gram(const T* a, int64_t n, int64_t r, int64_t chunk, double* partial) {
  std::fill(partial, partial + r * r, 0.0);
  const int64_t begin = chunk * kTallChunkRowsCpu;
  const int64_t end = std::min(n, begin + kTallChunkRowsCpu);
  double row[kOrthogonalizeCpuMaxRank];
  for (int64_t k = begin; k < end; ++k) {
    for (int64_t i = 0; i < r; ++i) row[i] = static_cast<double>(a[k * r + i]);
    for (int64_t i = 0; i < r; ++i) {
      for (int64_t j = i; j < r; ++j) partial[i * r + j] += row[i] * row[j];
    }
  }
}

template <typename T>
void apply(T* a, int64_t n, int64_t r, int64_t chunk, const double* inv) {
  const int64_t begin = chunk * kTallChunkRowsCpu;
  const int64_t end = std::min(n, begin + kTallChunkRowsCpu);
  double row[kOrthogonalizeCpuMaxRank];
  for (int64_t k = begin; k < end; ++k) {
    for (int64_t i = 0; i < r; ++i) row[i] = static_cast<double>(a[k * r + i]);
    multiply_row_by_inverse(row, static_cast<int>(r), inv);
    for (int64_t i = 0; i < r; ++i) a[k * r + i] = static_cast<T>(row[i]);
  }
}

}  // namespace

void tall_gram_cpu(const float* a, int64_t n, int64_t r, int64_t chunk, double* partial) {
  gram(a, n, r, chunk, partial);
}
void tall_gram_cpu(const double* a, int64_t n, int64_t r, int64_t chunk, double* partial) {
  gram(a, n, r, chunk, partial);
}

bool tall_factor_cpu(const double* partials, int64_t chunks, int64_t r, double* inv) {
  const auto rr = static_cast<size_t>(r * r);
  std::vector<double> g(rr, 0.0), scratch(rr);
  for (int64_t c = 0; c < chunks; ++c) {
    for (size_t e = 0; e < rr; ++e) g[e] += partials[c * r * r + static_cast<int64_t>(e)];
  }
  return cholesky_inverse(g.data(), static_cast<int>(r), scratch.data(), inv);
}

void tall_apply_cpu(float* a, int64_t n, int64_t r, int64_t chunk, const double* inv) {
  apply(a, n, r, chunk, inv);
}
void tall_apply_cpu(double* a, int64_t n, int64_t r, int64_t chunk, const double* inv) {
  apply(a, n, r, chunk, inv);
}

}  // namespace fastddp::kernels
