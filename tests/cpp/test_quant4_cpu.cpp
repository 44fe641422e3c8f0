// CPU 4-bit block quantization kernels (csrc/kernels/quant4_cpu.cpp) against a
// scalar reference written from the C library (std::nearbyint rounds half to
// even in the default rounding mode, as torch.round does), and the packing
// rules of Note [int4 wire format]: nibble order, ties, zero and non-finite
// blocks, odd n, a short last block, negative zero, the error-feedback
// identity, the sum of packed shards. (The codes are checked against torch ops
// in tests/python/hooks/test_quant4_kernels.py.)
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "kernels/quant4.h"

namespace k = fastddp::kernels;

namespace {

struct Quantized {
  std::vector<uint8_t> codes;
  std::vector<float> scales, err, back;
};

Quantized run(const std::vector<float>& x, int64_t block) {
  const auto n = static_cast<int64_t>(x.size());
  const int64_t blocks = (n + block - 1) / block;
  Quantized q{std::vector<uint8_t>(k::quant4_code_bytes(n), 0xAB), std::vector<float>(blocks),
              std::vector<float>(n), std::vector<float>(n)};
  k::quantize4_cpu(x.data(), n, block, q.codes.data(), q.scales.data(), q.err.data(), 0, blocks);
  k::dequantize4_cpu(q.codes.data(), q.scales.data(), n, block, q.back.data(), 0, blocks);
  return q;
}

// The code of element i as a signed integer, from its nibble.
int nibble(const std::vector<uint8_t>& codes, int64_t i) {
  const int c = (codes[i / 2] >> (i % 2 == 0 ? 0 : 4)) & 0xF;
  return c >= 8 ? c - 16 : c;
}

// clamp(round_half_even(x / scale), -7, 7) per value, from absmax / 7 per block.
void reference(const std::vector<float>& x, int64_t block, std::vector<int>& codes,
               std::vector<float>& scales) {
  const auto n = static_cast<int64_t>(x.size());
  for (int64_t b = 0; b * block < n; ++b) {
    const int64_t end = std::min(n, (b + 1) * block);
    float absmax = 0.0f;
    for (int64_t i = b * block; i < end; ++i) absmax = std::max(absmax, std::fabs(x[i]));
    scales.push_back(absmax / 7.0f);
    const float divisor = absmax / 7.0f > 0.0f ? absmax / 7.0f : 1.0f;
    for (int64_t i = b * block; i < end; ++i) {
      codes.push_back(static_cast<int>(std::clamp(std::nearbyint(x[i] / divisor), -7.0f, 7.0f)));
    }
  }
}

}  // namespace

TEST_CASE("quantize4_cpu packs the even element low, rounds ties to even", "[quant4]") {
  // absmax 7: scale 1 exactly, so the values are the codes before rounding.
  const std::vector<float> x = {7.0f, -7.0f, 0.5f, 1.5f, 2.5f, -0.5f, -1.5f, -2.5f, 6.5f, -6.5f,
                                3.0f, -3.49f};
  const std::vector<int> want = {7, -7, 0, 2, 2, 0, -2, -2, 6, -6, 3, -3};
  const Quantized q = run(x, 64);
  REQUIRE(q.scales == std::vector<float>{1.0f});
  for (size_t i = 0; i < x.size(); ++i) CHECK(nibble(q.codes, i) == want[i]);
  CHECK(q.codes[0] == 0x97);  // 7 low, -7 (0b1001) high
  for (size_t i = 0; i < x.size(); ++i) CHECK(q.back[i] == static_cast<float>(want[i]));
}

TEST_CASE("quantize4_cpu: zero block, negative zero, odd n, short last block", "[quant4]") {
  const int64_t block = 8;
  std::vector<float> x(8 * 2 + 5);  // two whole blocks and a short odd one: n = 21
  for (int i = 0; i < 8; ++i) x[i] = (i % 2 == 0) ? -0.0f : 0.0f;  // a zero block
  for (int i = 8; i < 16; ++i) x[i] = static_cast<float>(i - 12);
  for (int i = 16; i < 21; ++i) x[i] = 0.25f * static_cast<float>(i - 18);  // its own absmax
  const Quantized q = run(x, block);
  REQUIRE(q.codes.size() == 11);
  CHECK(q.scales[0] == 0.0f);
  for (int i = 0; i < 4; ++i) CHECK(q.codes[i] == 0);
  for (int i = 0; i < 8; ++i) {
    CHECK(q.back[i] == 0.0f);
    CHECK(!std::signbit(q.back[i]));  // code 0 times scale 0: +0, the sign is not kept
    CHECK(std::signbit(q.err[i]) == std::signbit(x[i]));  // -0 - 0 = -0: the error keeps it
  }
  CHECK(q.scales[2] == 0.5f / 7.0f);
  CHECK((q.codes[10] & 0xF0) == 0);  // odd n: the last byte's high nibble is 0
  CHECK(nibble(q.codes, 20) == 7);
  std::vector<int> want;
  std::vector<float> want_scales;
  reference(x, block, want, want_scales);
  CHECK(q.scales == want_scales);
  for (int64_t i = 0; i < 21; ++i) CHECK(nibble(q.codes, i) == want[i]);
}

TEST_CASE("quantize4_cpu: a NaN or an infinity makes its block read back as NaN", "[quant4]") {
  std::vector<float> x(24, 1.0f);
  x[3] = NAN;
  x[9] = INFINITY;
  x[17] = -INFINITY;
  const Quantized q = run(x, 8);
  for (int b = 0; b < 3; ++b) CHECK(std::isnan(q.scales[b]));
  for (uint8_t c : q.codes) CHECK(c == 0);
  for (int64_t i = 0; i < 24; ++i) {
    CHECK(std::isnan(q.back[i]));
    CHECK(std::isnan(q.err[i]));  // x - 0 * NaN
  }
}

TEST_CASE("quantize4_cpu matches the scalar reference and keeps x == back + err", "[quant4]") {
  const int64_t n = 256 * 9 + 77;  // a short, odd last block
  std::mt19937 rng(11);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> x(n);
  for (int64_t i = 0; i < n; ++i) {
    x[i] = normal(rng) * std::ldexp(1.0f, static_cast<int>(i / 256) * 9 - 40);  // tiny to huge
  }
  for (const int64_t block : {256, 64, 2, 100}) {
    const Quantized q = run(x, block);
    std::vector<int> want;
    std::vector<float> want_scales;
    reference(x, block, want, want_scales);
    CHECK(q.scales == want_scales);
    int64_t bad = 0;
    for (int64_t i = 0; i < n; ++i) bad += nibble(q.codes, i) != want[i];
    CHECK(bad == 0);
    for (int64_t i = 0; i < n; ++i) {
      // Exact, no tolerance: x - back is exact for a finite block (Note [int4 wire format]).
      if (q.back[i] + q.err[i] != x[i]) FAIL("x != back + err at " << i << ", block " << block);
    }
  }
}

TEST_CASE("quantize4_cpu over block ranges, in place error, equals one call", "[quant4]") {
  const int64_t n = 1001, block = 16, blocks = (n + block - 1) / block;
  std::vector<float> x(n);
  for (int64_t i = 0; i < n; ++i) x[i] = std::sin(0.37f * static_cast<float>(i)) * 3.0f;
  const Quantized whole = run(x, block);
  std::vector<uint8_t> codes(k::quant4_code_bytes(n));
  std::vector<float> scales(blocks), inplace = x;
  k::quantize4_cpu(inplace.data(), n, block, codes.data(), scales.data(), inplace.data(), 40,
                   blocks);
  k::quantize4_cpu(inplace.data(), n, block, codes.data(), scales.data(), inplace.data(), 0, 40);
  CHECK(codes == whole.codes);
  CHECK(scales == whole.scales);
  CHECK(inplace == whole.err);
}

TEST_CASE("sum_shards4_cpu sums packed shards in shard order", "[quant4]") {
  const int64_t block = 64, n = 301, count = 3, blocks = 5;
  const int64_t bytes = k::quant4_shard_bytes(n, block);
  REQUIRE(k::quant4_scales_offset(n) == 152);  // 151 code bytes, padded to 4
  REQUIRE(bytes == 152 + 4 * blocks);
  std::vector<uint8_t> shards(count * bytes, 0);
  std::vector<float> total(n);
  for (int64_t r = 0; r < count; ++r) {
    std::vector<float> x(n);
    for (int64_t i = 0; i < n; ++i) x[i] = std::cos(static_cast<float>(i * (r + 2))) * (r + 1);
    const Quantized q = run(x, block);
    std::memcpy(shards.data() + r * bytes, q.codes.data(), q.codes.size());
    std::memcpy(shards.data() + r * bytes + 152, q.scales.data(), 4 * blocks);
    for (int64_t i = 0; i < n; ++i) total[i] = r == 0 ? q.back[i] : total[i] + q.back[i];
  }
  std::vector<float> out(n);
  k::sum_shards4_cpu(shards.data(), bytes, count, n, block, out.data(), 0, blocks);
  CHECK(out == total);
}
