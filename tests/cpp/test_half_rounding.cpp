// Rounding helpers (csrc/core/half_rounding.h) against independent references:
// every 16-bit pattern round-trips, and random floats round like a
// nearest-even quantizer written in double arithmetic.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>

#include "core/half_rounding.h"

using fastddp::bf16_bits_from_float;
using fastddp::float_bits;
using fastddp::float_from_bf16_bits;
using fastddp::float_from_bits;
using fastddp::float_from_fp16_bits;
using fastddp::fp16_bits_from_float;

namespace {

// Nearest-even quantization to `mantissa_bits` explicit bits, with the given
// smallest normal exponent and largest finite value; overflow gives Inf.
double quantize(double x, int mantissa_bits, int min_exp, double max_finite) {
  if (x == 0 || std::isinf(x)) return x;
  int exp = std::ilogb(x);
  if (exp < min_exp) exp = min_exp;  // subnormals share the smallest quantum
  const double quantum = std::ldexp(1.0, exp - mantissa_bits);
  const double q = std::nearbyint(x / quantum) * quantum;  // default mode: ties to even
  const double overflow = max_finite + quantum / 2;        // halfway to the next power
  if (std::fabs(x) >= overflow) return std::copysign(INFINITY, x);
  return q;
}

float random_float(std::mt19937& rng) {
  // Random bit patterns cover every exponent, subnormals and NaN included.
  return float_from_bits(static_cast<uint32_t>(rng()));
}

}  // namespace

TEST_CASE("every bfloat16 value survives a round trip through float") {
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const float f = float_from_bf16_bits(static_cast<uint16_t>(h));
    if (std::isnan(f)) {
      CHECK(std::isnan(float_from_bf16_bits(bf16_bits_from_float(f))));
    } else {
      CHECK(bf16_bits_from_float(f) == h);
    }
  }
}

TEST_CASE("every float16 value survives a round trip through float") {
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const float f = float_from_fp16_bits(static_cast<uint16_t>(h));
    if (std::isnan(f)) {
      CHECK(std::isnan(float_from_fp16_bits(fp16_bits_from_float(f))));
    } else {
      CHECK(fp16_bits_from_float(f) == h);
    }
  }
  // Spot values: the smallest subnormal, the largest normal, 1.
  CHECK(float_from_fp16_bits(0x0001) == std::ldexp(1.0f, -24));
  CHECK(float_from_fp16_bits(0x7BFF) == 65504.0f);
  CHECK(float_from_fp16_bits(0x3C00) == 1.0f);
}

TEST_CASE("float to bfloat16 rounds to nearest, ties to even") {
  CHECK(bf16_bits_from_float(1.0f) == 0x3F80);
  // 1 + 2^-8 is halfway between 1 and 1 + 2^-7: the tie goes to the even 1.
  CHECK(bf16_bits_from_float(1.0f + std::ldexp(1.0f, -8)) == 0x3F80);
  // 1 + 3 * 2^-8 is halfway between odd 1 + 2^-7 and even 1 + 2^-6: up.
  CHECK(bf16_bits_from_float(1.0f + 3 * std::ldexp(1.0f, -8)) == 0x3F82);
  CHECK(bf16_bits_from_float(INFINITY) == 0x7F80);
  CHECK(bf16_bits_from_float(-INFINITY) == 0xFF80);
  CHECK(bf16_bits_from_float(std::numeric_limits<float>::max()) == 0x7F80);  // rounds up to Inf
  CHECK(std::isnan(float_from_bf16_bits(bf16_bits_from_float(NAN))));
  std::mt19937 rng(1);
  for (int i = 0; i < 200000; ++i) {
    const float f = random_float(rng);
    if (std::isnan(f)) continue;
    const double expect = quantize(f, 7, -126, 0x1.FEp127);
    const float got = float_from_bf16_bits(bf16_bits_from_float(f));
    INFO("bits " << std::hex << float_bits(f));
    REQUIRE(static_cast<double>(got) == expect);
    REQUIRE(std::signbit(got) == std::signbit(f));
  }
}

TEST_CASE("float to float16 rounds to nearest even, subnormals and overflow included") {
  CHECK(fp16_bits_from_float(65504.0f) == 0x7BFF);
  CHECK(fp16_bits_from_float(65520.0f) == 0x7C00);  // halfway to 2^16: the tie goes to Inf
  CHECK(fp16_bits_from_float(65519.0f) == 0x7BFF);
  CHECK(fp16_bits_from_float(std::ldexp(1.0f, -25)) == 0x0000);  // tie between 0 and 2^-24
  CHECK(fp16_bits_from_float(std::ldexp(1.5f, -25)) == 0x0001);
  CHECK(fp16_bits_from_float(-0.0f) == 0x8000);
  CHECK(std::isnan(float_from_fp16_bits(fp16_bits_from_float(NAN))));
  std::mt19937 rng(2);
  std::uniform_real_distribution<float> mantissa(-2.0f, 2.0f);
  std::uniform_int_distribution<int> exponent(-30, 17);
  for (int i = 0; i < 200000; ++i) {
    // Half of the samples near float16's range, where the rounding is interesting.
    const float f = i % 2 ? random_float(rng) : std::ldexp(mantissa(rng), exponent(rng));
    if (std::isnan(f)) continue;
    const double expect = quantize(f, 10, -14, 65504.0);
    const float got = float_from_fp16_bits(fp16_bits_from_float(f));
    INFO("value " << f << " bits " << std::hex << float_bits(f));
    REQUIRE(static_cast<double>(got) == expect);
    REQUIRE(std::signbit(got) == std::signbit(f));
  }
}
