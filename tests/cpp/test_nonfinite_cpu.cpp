// The fused non-finite checks (csrc/kernels/nonfinite_cpu.cpp) against
// std::isfinite, one bad value at every position of lengths that break
// vector widths, and the copy against a scalar multiply.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "kernels/half_cast.h"
#include "kernels/nonfinite.h"

namespace k = fastddp::kernels;

namespace {

template <typename T>
std::vector<T> finite_values(size_t n) {
  std::vector<T> v(n);
  for (size_t i = 0; i < n; ++i) {
    // Large, tiny, subnormal and negative zero values are all finite.
    const T big = std::numeric_limits<T>::max() / T(1 + i % 3);
    const T tiny = std::numeric_limits<T>::denorm_min() * T(i % 5);
    v[i] = i % 4 == 0 ? big : i % 4 == 1 ? -tiny : i % 4 == 2 ? T(-0.0) : T(i) * T(0.37);
  }
  return v;
}

template <typename T>
void check_type() {
  const T bad_values[] = {std::numeric_limits<T>::quiet_NaN(), std::numeric_limits<T>::infinity(),
                          -std::numeric_limits<T>::infinity()};
  for (size_t n : {1, 7, 16, 33, 100}) {
    std::vector<T> src = finite_values<T>(n);
    std::vector<T> dst(n);
    REQUIRE_FALSE(k::any_nonfinite_cpu(src.data(), static_cast<int64_t>(n)));
    REQUIRE_FALSE(k::scale_copy_check_cpu(src.data(), dst.data(), T(0.5), static_cast<int64_t>(n)));
    for (size_t i = 0; i < n; ++i) REQUIRE(dst[i] == src[i] * T(0.5));
    for (size_t pos = 0; pos < n; ++pos) {
      for (T bad : bad_values) {
        std::vector<T> s = src;
        s[pos] = bad;
        INFO("n=" << n << " pos=" << pos << " value=" << bad);
        REQUIRE(k::any_nonfinite_cpu(s.data(), static_cast<int64_t>(n)));
        REQUIRE(k::scale_copy_check_cpu(s.data(), dst.data(), T(1), static_cast<int64_t>(n)));
        // In place (gradient_as_bucket_view) too.
        REQUIRE(k::scale_copy_check_cpu(s.data(), s.data(), T(0.25), static_cast<int64_t>(n)));
      }
    }
  }
}

}  // namespace

TEST_CASE("non-finite check and scaled copy, float32", "[nonfinite]") { check_type<float>(); }

TEST_CASE("non-finite check and scaled copy, float64", "[nonfinite]") { check_type<double>(); }

TEST_CASE("a finite value scaled to overflow is not reported", "[nonfinite]") {
  // The check judges the gradient, not its scaled copy.
  const float src[2] = {std::numeric_limits<float>::max(), 1.0f};
  float dst[2];
  REQUIRE_FALSE(k::scale_copy_check_cpu(src, dst, 4.0f, 2));
  REQUIRE(std::isinf(dst[0]));
}

TEST_CASE("the 16-bit compression reports non-finite values and writes what it would without",
          "[nonfinite]") {
  using fastddp::HalfKind;
  for (HalfKind kind : {HalfKind::kBFloat16, HalfKind::kFloat16}) {
    for (bool feedback : {false, true}) {
      const size_t n = 37;
      std::vector<float> src = finite_values<float>(n);
      for (float& x : src) x = x / 1e30f;  // in range for float16
      for (int bad_at : {-1, 0, 17, 36}) {
        std::vector<float> s = src;
        if (bad_at >= 0) s[static_cast<size_t>(bad_at)] = std::numeric_limits<float>::infinity();
        const std::vector<float> r0(n, 0.25f);
        std::vector<float> r1(n), r2(n);  // the new residuals: another buffer than the one read
        std::vector<uint16_t> plain(n), checked(n);
        int32_t flag = 0;
        k::compress_cpu(kind, s.data(), 0.5f, feedback ? r0.data() : nullptr,
                        feedback ? r1.data() : nullptr, plain.data(), static_cast<int64_t>(n));
        k::compress_cpu(kind, s.data(), 0.5f, feedback ? r0.data() : nullptr,
                        feedback ? r2.data() : nullptr, checked.data(), static_cast<int64_t>(n),
                        &flag);
        INFO("kind=" << static_cast<int>(kind) << " feedback=" << feedback << " bad_at=" << bad_at);
        REQUIRE(flag == (bad_at >= 0 ? 1 : 0));
        REQUIRE(plain == checked);
        for (size_t i = 0; i < n; ++i) {
          REQUIRE((r1[i] == r2[i] || (std::isnan(r1[i]) && std::isnan(r2[i]))));
        }
      }
    }
  }
}
