// CPU half-cast kernels (csrc/kernels/half_cast_cpu.cpp) against scalar loops
// over the rounding helpers, at sizes and offsets that break vector widths.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "kernels/half_cast.h"
#include "kernels/half_cast_f16c.h"

using fastddp::HalfKind;
namespace k = fastddp::kernels;

namespace {

std::vector<float> random_floats(size_t n, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = normal(rng) * std::ldexp(1.0f, static_cast<int>(i % 40) - 20);
  if (n > 3) {
    v[0] = NAN;
    v[1] = INFINITY;
    v[2] = -std::ldexp(1.0f, -140);  // float32 subnormal
    v[n - 1] = -INFINITY;
  }
  return v;
}

float back(HalfKind kind, uint16_t h) {
  return kind == HalfKind::kBFloat16 ? fastddp::float_from_bf16_bits(h)
                                     : fastddp::float_from_fp16_bits(h);
}

uint16_t to_half(HalfKind kind, float f) {
  return kind == HalfKind::kBFloat16 ? fastddp::bf16_bits_from_float(f)
                                     : fastddp::fp16_bits_from_float(f);
}

bool same(float a, float b) {
  return (std::isnan(a) && std::isnan(b)) || std::memcmp(&a, &b, sizeof(a)) == 0;
}

}  // namespace

TEST_CASE("compress, decompress and error feedback match the scalar definition") {
  for (HalfKind kind : {HalfKind::kBFloat16, HalfKind::kFloat16}) {
    for (int64_t n : {0, 1, 7, 33, 1000, 4099}) {
      for (int64_t offset : {0, 1, 3}) {  // unaligned starts
        const auto src = random_floats(static_cast<size_t>(n + offset), static_cast<unsigned>(n));
        const float scale = 1.0f / 3.0f;
        std::vector<uint16_t> dst(static_cast<size_t>(n + offset), 0xABCD);
        k::compress_cpu(kind, src.data() + offset, scale, nullptr, nullptr, dst.data() + offset,
                        n);
        for (int64_t i = 0; i < offset; ++i) REQUIRE(dst[i] == 0xABCD);
        for (int64_t i = 0; i < n; ++i) {
          REQUIRE(same(back(kind, dst[offset + i]), back(kind, to_half(kind, src[offset + i] * scale))));
        }
        std::vector<float> out(static_cast<size_t>(n + offset));
        k::decompress_cpu(kind, dst.data() + offset, out.data() + offset, n);
        for (int64_t i = 0; i < n; ++i) REQUIRE(same(out[offset + i], back(kind, dst[offset + i])));

        const std::vector<float> residual(static_cast<size_t>(n), 0.25f);
        std::vector<float> next(static_cast<size_t>(n), -1.0f);
        k::compress_cpu(kind, src.data() + offset, scale, residual.data(), next.data(),
                        dst.data() + offset, n);
        for (int64_t i = 0; i < n; ++i) {
          const float v = src[offset + i] * scale + 0.25f;
          REQUIRE(same(back(kind, dst[offset + i]), back(kind, to_half(kind, v))));
          REQUIRE(same(next[i], v - back(kind, to_half(kind, v))));
          REQUIRE(residual[i] == 0.25f);  // the residual read is left as it was
        }
      }
    }
  }
}

TEST_CASE("sum_shards adds in rank order in float and rounds once") {
  for (HalfKind kind : {HalfKind::kBFloat16, HalfKind::kFloat16}) {
    for (int64_t count : {1, 2, 5}) {
      const int64_t n = 2500, stride = 2503;
      const auto values = random_floats(static_cast<size_t>(stride * count), 7);
      std::vector<uint16_t> shards(values.size());
      for (size_t i = 0; i < values.size(); ++i) shards[i] = to_half(kind, values[i] * 1e-3f);
      std::vector<uint16_t> out(static_cast<size_t>(n));
      k::sum_shards_cpu(kind, shards.data(), stride, count, out.data(), n);
      for (int64_t i = 0; i < n; ++i) {
        float acc = back(kind, shards[i]);
        for (int64_t r = 1; r < count; ++r) acc += back(kind, shards[r * stride + i]);
        REQUIRE(same(back(kind, out[i]), back(kind, to_half(kind, acc))));
      }
    }
  }
}

static float fp16_back(uint16_t h) { return back(HalfKind::kFloat16, h); }
static uint16_t fp16_to(float f) { return to_half(HalfKind::kFloat16, f); }

TEST_CASE("float16 through F16C equals the portable rounding, edge values included") {
  // The F16C loops (half_cast_f16c.h) replace the portable ones on CPUs that have it: they
  // must give every bit the portable conversion gives (NaN: NaN-ness only, Note [half
  // rounding]). Values at the edges: zeros, the largest float16 and the rounding boundary
  // to infinity (65520), subnormals and the halfway points below the smallest one, ties.
  if (!k::f16c::available()) return;
  std::vector<float> v = {0.0f, -0.0f, 65504.0f, 65519.99f, 65520.0f, -65520.0f, 1e30f,
                          std::numeric_limits<float>::infinity(),
                          -std::numeric_limits<float>::infinity(),
                          std::numeric_limits<float>::quiet_NaN(), 5.960464477539063e-08f,
                          2.9802322387695312e-08f, 2.9802326e-08f, 8.940697e-08f,
                          6.103515625e-05f, 6.1035156e-05f, 1.00048828125f, 1.0009765625f,
                          1.00146484375f, 1e-40f, -3.0e-06f};
  const auto random = random_floats(4099, 11);
  for (float x : random) {
    for (float scale : {1.0f, 1e-3f, 1e-6f, 1e3f}) v.push_back(x * scale);
  }
  const auto n = static_cast<int64_t>(v.size());
  std::vector<uint16_t> got(v.size()), back_bits(v.size());
  std::vector<float> residual(v.size(), 1e-7f), next(v.size());
  k::f16c::from_float(v.data(), got.data(), n);
  for (int64_t i = 0; i < n; ++i) {
    INFO("value " << v[i]);
    REQUIRE(same(fp16_back(got[i]), fp16_back(fp16_to(v[i]))));
  }
  std::vector<float> as_float(v.size());
  k::f16c::to_float(got.data(), as_float.data(), n);
  for (int64_t i = 0; i < n; ++i) REQUIRE(same(as_float[i], fp16_back(got[i])));
  REQUIRE_FALSE(k::f16c::compress(v.data(), 0.5f, residual.data(), next.data(), got.data(), 2, true));
  REQUIRE(k::f16c::compress(v.data(), 0.5f, residual.data(), next.data(), got.data(), n, true));
  for (int64_t i = 0; i < n; ++i) {
    const float x = v[i] * 0.5f + 1e-7f;
    REQUIRE(same(fp16_back(got[i]), fp16_back(fp16_to(x))));
    REQUIRE(same(next[i], x - fp16_back(fp16_to(x))));
  }
  k::f16c::cast_divide(v.data(), 3.0f, got.data(), n, false);
  for (int64_t i = 0; i < n; ++i) {
    const float cast = fp16_back(fp16_to(v[i]));
    REQUIRE(same(fp16_back(got[i]), fp16_back(fp16_to(cast / 3.0f))));
  }
}
