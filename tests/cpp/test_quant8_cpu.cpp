// CPU 8-bit block quantization kernels (csrc/kernels/quant8_cpu.cpp) against a
// scalar loop over the per-value codes (core/quant8_codes.h), and the block
// rules of Note [8-bit wire formats]: zero blocks, non-finite blocks, the sum
// of packed shards. (The codes themselves are checked against torch's float8
// casts in tests/python/hooks/test_quant8_kernels.py.)
#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "kernels/quant8.h"

using fastddp::Quant8Format;
namespace k = fastddp::kernels;

namespace {

template <Quant8Format F>
void scalar_quantize(const std::vector<float>& x, int64_t block, std::vector<uint8_t>& codes,
                     std::vector<float>& scales) {
  const auto n = static_cast<int64_t>(x.size());
  for (int64_t b = 0; b * block < n; ++b) {
    float absmax = 0.0f;
    bool bad = false;
    const int64_t end = std::min(n, (b + 1) * block);
    for (int64_t i = b * block; i < end; ++i) {
      bad = bad || !std::isfinite(x[i]);
      absmax = std::max(absmax, std::fabs(x[i]));
    }
    const float scale = bad ? NAN : absmax / fastddp::quant8_max(F);
    scales[b] = scale;
    for (int64_t i = b * block; i < end; ++i) {
      const float divisor = scale > 0 ? scale : 1.0f;
      codes[i] = bad ? 0 : fastddp::quant8_code_from_float<F>(x[i] / divisor);
    }
  }
}

template <Quant8Format F>
void check_format() {
  const int64_t block = 256;
  const int64_t n = 256 * 6 + 77;  // a short last block
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> x(n);
  for (int64_t i = 0; i < n; ++i) {
    x[i] = normal(rng) * std::ldexp(1.0f, static_cast<int>(i / 256) * 5 - 10);  // per-block scales
  }
  for (int64_t i = 256; i < 512; ++i) x[i] = 0.0f;  // a zero block
  x[600] = NAN;                                      // a non-finite block
  const int64_t blocks = (n + block - 1) / block;
  std::vector<uint8_t> codes(n), want_codes(n);
  std::vector<float> scales(blocks), want_scales(blocks), err(n), back(n);
  k::quantize8_cpu(F, x.data(), n, block, codes.data(), scales.data(), err.data(), 0, blocks);
  scalar_quantize<F>(x, block, want_codes, want_scales);
  CHECK(codes == want_codes);
  for (int64_t b = 0; b < blocks; ++b) {
    CHECK((scales[b] == want_scales[b] ||
           (std::isnan(scales[b]) && std::isnan(want_scales[b]))));
  }
  k::dequantize8_cpu(F, codes.data(), scales.data(), n, block, back.data(), 0, blocks);
  for (int64_t i = 0; i < n; ++i) {
    if (i >= 512 && i < 768) {
      CHECK(std::isnan(back[i]));  // the NaN block reads back as NaN, all of it
    } else if (i >= 256 && i < 512) {
      CHECK(back[i] == 0.0f);
    } else {
      CHECK(err[i] == x[i] - back[i]);
    }
  }
}

}  // namespace

TEST_CASE("quantize8_cpu matches the scalar codes, block by block", "[quant8]") {
  check_format<Quant8Format::kInt8>();
  check_format<Quant8Format::kFp8E4M3>();
  check_format<Quant8Format::kFp8E5M2>();
}

TEST_CASE("sum_shards8_cpu sums packed shards in order and re-quantizes", "[quant8]") {
  const int64_t block = 256, n = 512, count = 3, blocks = 2;
  const int64_t shard_bytes = n + 4 * blocks;
  std::vector<uint8_t> shards(count * shard_bytes);
  std::vector<float> total(n, 0.0f);
  for (int64_t r = 0; r < count; ++r) {
    std::vector<float> x(n);
    for (int64_t i = 0; i < n; ++i) x[i] = std::sin(static_cast<float>(i * (r + 1)));
    uint8_t* shard = shards.data() + r * shard_bytes;
    std::vector<float> scales(blocks), back(n);
    k::quantize8_cpu(Quant8Format::kInt8, x.data(), n, block, shard, scales.data(), nullptr, 0,
                     blocks);
    std::memcpy(shard + n, scales.data(), 4 * blocks);
    k::dequantize8_cpu(Quant8Format::kInt8, shard, scales.data(), n, block, back.data(), 0,
                       blocks);
    for (int64_t i = 0; i < n; ++i) total[i] = r == 0 ? back[i] : total[i] + back[i];
  }
  std::vector<uint8_t> out(n), want(n);
  std::vector<float> out_scales(blocks), want_scales(blocks);
  k::sum_shards8_cpu(Quant8Format::kInt8, shards.data(), shard_bytes, count, n, block, out.data(),
                     out_scales.data(), 0, blocks);
  k::quantize8_cpu(Quant8Format::kInt8, total.data(), n, block, want.data(), want_scales.data(),
                   nullptr, 0, blocks);
  CHECK(out == want);
  CHECK(out_scales == want_scales);
}
