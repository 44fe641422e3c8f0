// CPU versions of the 4-bit block quantization (see quant4.h, Note [int4 wire
// format]).
//
// Each block is branch-free loops over pairs of values (one byte each) that
// vectorize like the 8-bit ones (FASTDDP_VECTOR_CLONES): the block's largest
// |x| as an unsigned max over the float bit patterns (it finds a NaN or an
// infinity in the same pass), the encode, and the error. An odd last element
// (odd n) is done on its own after the pairs.
#include <algorithm>

#include "quant4.h"
#include "block_absmax.h"
#include "vector_clones.h"

namespace fastddp::kernels {

namespace {

#define FASTDDP_QUANT4_INLINE inline __attribute__((always_inline))

FASTDDP_QUANT4_INLINE void encode(const float* __restrict x, int64_t len, float divisor,
                                  uint8_t* __restrict codes) {
  const int64_t pairs = len / 2;
  for (int64_t k = 0; k < pairs; ++k) {
    const uint32_t lo = int4_code_from_float(x[2 * k] / divisor);
    const uint32_t hi = int4_code_from_float(x[2 * k + 1] / divisor);
    codes[k] = static_cast<uint8_t>(lo | (hi << 4));
  }
  if (len % 2 != 0) codes[pairs] = int4_code_from_float(x[len - 1] / divisor);  // high nibble 0
}

// x and err may be the same memory (no __restrict: the compiler checks at run time).
FASTDDP_QUANT4_INLINE void residual(const uint8_t* __restrict codes, int64_t len, float scale,
                                    const float* x, float* err) {
  const int64_t pairs = len / 2;
  for (int64_t k = 0; k < pairs; ++k) {
    const uint32_t c = codes[k];
    err[2 * k] = x[2 * k] - float_from_int4_code(c) * scale;
    err[2 * k + 1] = x[2 * k + 1] - float_from_int4_code(c >> 4) * scale;
  }
  if (len % 2 != 0) err[len - 1] = x[len - 1] - float_from_int4_code(codes[pairs]) * scale;
}

// acc = values (first) or acc + values, the values read back from codes * scale.
template <bool kFirst>
FASTDDP_QUANT4_INLINE void decode(const uint8_t* __restrict codes, int64_t len, float scale,
                                  float* __restrict acc) {
  const int64_t pairs = len / 2;
  for (int64_t k = 0; k < pairs; ++k) {
    const uint32_t c = codes[k];
    const float lo = float_from_int4_code(c) * scale;
    const float hi = float_from_int4_code(c >> 4) * scale;
    acc[2 * k] = kFirst ? lo : acc[2 * k] + lo;
    acc[2 * k + 1] = kFirst ? hi : acc[2 * k + 1] + hi;
  }
  if (len % 2 != 0) {
    const float v = float_from_int4_code(codes[pairs]) * scale;
    acc[len - 1] = kFirst ? v : acc[len - 1] + v;
  }
}

FASTDDP_VECTOR_CLONES void quantize_range(const float* src, int64_t n, int64_t block,
                                          uint8_t* codes, float* scales, float* err, int64_t b0,
                                          int64_t b1) {
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t begin = b * block;
    const int64_t len = std::min(block, n - begin);
    if (len <= 0) break;
    const float* x = src + begin;
    uint8_t* c = codes + begin / 2;  // block is even: a block starts on a byte
    const float scale = quant4_scale_from_absmax_bits(block_absmax_bits(x, len));
    scales[b] = scale;
    if (scale != scale) {
      // A NaN or an infinity: codes 0 and a NaN scale, so the block reads back as NaN.
      std::fill(c, c + quant4_code_bytes(len), uint8_t{0});
    } else {
      encode(x, len, quant8_divisor(scale), c);
    }
    if (err != nullptr) residual(c, len, scale, x, err + begin);
  }
}

template <bool kFirst>
FASTDDP_VECTOR_CLONES void decode_range(const uint8_t* codes, const float* scales, int64_t n,
                                        int64_t block, float* dst, int64_t b0, int64_t b1) {
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t begin = b * block;
    const int64_t len = std::min(block, n - begin);
    if (len <= 0) break;
    decode<kFirst>(codes + begin / 2, len, scales[b], dst + begin);
  }
}

}  // namespace

void quantize4_cpu(const float* src, int64_t n, int64_t block, uint8_t* codes, float* scales,
                   float* err, int64_t first_block, int64_t last_block) {
  quantize_range(src, n, block, codes, scales, err, first_block, last_block);
}

void dequantize4_cpu(const uint8_t* codes, const float* scales, int64_t n, int64_t block,
                     float* dst, int64_t first_block, int64_t last_block) {
  decode_range<true>(codes, scales, n, block, dst, first_block, last_block);
}

void sum_shards4_cpu(const uint8_t* shards, int64_t shard_bytes, int64_t count, int64_t n,
                     int64_t block, float* dst, int64_t first_block, int64_t last_block) {
  const int64_t offset = quant4_scales_offset(n);
  // Shard by shard over the caller's range of blocks: dst holds the running sum.
  for (int64_t r = 0; r < count; ++r) {
    const uint8_t* shard = shards + r * shard_bytes;
    const float* scales = reinterpret_cast<const float*>(shard + offset);
    if (r == 0) {
      decode_range<true>(shard, scales, n, block, dst, first_block, last_block);
    } else {
      decode_range<false>(shard, scales, n, block, dst, first_block, last_block);
    }
  }
}

}  // namespace fastddp::kernels
