// The fused low-rank products against naive double-precision loops.
#include <catch2/catch.hpp>

#include <cmath>
#include <random>
#include <vector>

#include "kernels/lowrank.h"

using namespace fastddp::kernels;

namespace {

std::vector<float> random_vector(size_t n, unsigned seed) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> dist;
  std::vector<float> v(n);
  for (float& x : v) x = dist(gen);
  return v;
}

// A float sum of k products, in any order, is within gamma_k = k u / (1 - k u) of the
// sum of their absolute values (u = 2^-24; Higham, Accuracy and Stability of Numerical
// Algorithms, 3.1): the bound for each element, from the exact sums in double.
void check_close(const std::vector<float>& got, const std::vector<double>& want,
                 const std::vector<double>& abs_sum, int64_t k) {
  REQUIRE(got.size() == want.size());
  const double u = std::ldexp(1.0, -24), gamma = k * u / (1 - k * u);
  for (size_t i = 0; i < got.size(); ++i) {
    REQUIRE(std::abs(got[i] - want[i]) <= gamma * abs_sum[i]);
  }
}

}  // namespace

TEST_CASE("lowrank products equal naive loops", "[lowrank]") {
  for (auto [n, m, r] : {std::array<int64_t, 3>{1, 1, 1}, {7, 33, 1}, {64, 100, 4},
                         {17, 257, 3}, {300, 16, 8}}) {
    CAPTURE(n, m, r);
    const auto mat = random_vector(static_cast<size_t>(n * m), 1);
    const auto q = random_vector(static_cast<size_t>(m * r), 2);  // m x r
    const auto p_in = random_vector(static_cast<size_t>(n * r), 3);  // n x r

    std::vector<float> q_t(static_cast<size_t>(r * m));
    transpose_cpu(q.data(), m, r, q_t.data());
    for (int64_t j = 0; j < m; ++j) {
      for (int64_t k = 0; k < r; ++k) REQUIRE(q_t[k * m + j] == q[j * r + k]);
    }

    std::vector<float> p(static_cast<size_t>(n * r));
    lowrank_project_cpu(mat.data(), m, q_t.data(), r, p.data(), 0, n / 2);
    lowrank_project_cpu(mat.data(), m, q_t.data(), r, p.data(), n / 2, n);  // two row ranges
    std::vector<double> want_p(p.size(), 0.0), abs_p(p.size(), 0.0);
    for (int64_t i = 0; i < n; ++i)
      for (int64_t k = 0; k < r; ++k)
        for (int64_t j = 0; j < m; ++j) {
          want_p[i * r + k] += double(mat[i * m + j]) * q[j * r + k];
          abs_p[i * r + k] += std::abs(double(mat[i * m + j]) * q[j * r + k]);
        }
    check_close(p, want_p, abs_p, m);

    std::vector<float> back(static_cast<size_t>(r * m));
    lowrank_back_project_cpu(mat.data(), n, m, p_in.data(), r, back.data());
    std::vector<double> want_back(back.size(), 0.0), abs_back(back.size(), 0.0);  // Q^T, r x m
    for (int64_t k = 0; k < r; ++k)
      for (int64_t j = 0; j < m; ++j)
        for (int64_t i = 0; i < n; ++i) {
          want_back[k * m + j] += double(mat[i * m + j]) * p_in[i * r + k];
          abs_back[k * m + j] += std::abs(double(mat[i * m + j]) * p_in[i * r + k]);
        }
    check_close(back, want_back, abs_back, n);

    std::vector<float> out(static_cast<size_t>(n * m));
    std::vector<float> err(static_cast<size_t>(n * m));
    lowrank_expand_cpu(p_in.data(), q_t.data(), m, r, out.data(), mat.data(), err.data(), 0, n);
    std::vector<double> want_out(out.size(), 0.0), abs_out(out.size(), 0.0);
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j < m; ++j)
        for (int64_t k = 0; k < r; ++k) {
          want_out[i * m + j] += double(p_in[i * r + k]) * q[j * r + k];
          abs_out[i * m + j] += std::abs(double(p_in[i * r + k]) * q[j * r + k]);
        }
    check_close(out, want_out, abs_out, r);
    // exact: the kernel's error feedback is this one float subtraction
    for (size_t i = 0; i < err.size(); ++i) REQUIRE(err[i] == mat[i] - out[i]);
    std::vector<float> plain(out.size());
    lowrank_expand_cpu(p_in.data(), q_t.data(), m, r, plain.data(), nullptr, nullptr, 0, n);
    REQUIRE(plain == out);
  }
}

TEST_CASE("lowrank back projection of an empty matrix is zero", "[lowrank]") {
  std::vector<float> q_t(6, 1.0f);
  lowrank_back_project_cpu(nullptr, 0, 3, nullptr, 2, q_t.data());
  for (float x : q_t) REQUIRE(x == 0.0f);
}
