// CPU versions of the 8-bit block quantization (see quant8.h).
//
// Each block is three branch-free loops that vectorize like the half casts
// (FASTDDP_VECTOR_CLONES: AVX-512 / AVX2 / SSE2 clones on x86-64 GCC): the
// block's largest |x| as an unsigned max over the float bit patterns (a float
// max would not vectorize without giving up NaN rules, and the bit max finds a
// NaN or an infinity in the same pass), the encode, and the error.
#include <algorithm>

#include "quant8.h"
#include "block_absmax.h"
#include "vector_clones.h"

namespace fastddp::kernels {

namespace {

#define FASTDDP_QUANT8_INLINE inline __attribute__((always_inline))

template <Quant8Format F>
FASTDDP_QUANT8_INLINE void encode(const float* __restrict x, int64_t len, float divisor,
                                  uint8_t* __restrict codes) {
  for (int64_t i = 0; i < len; ++i) codes[i] = quant8_code_from_float<F>(x[i] / divisor);
}

// x and err may be the same memory (no __restrict: the compiler checks at run time).
template <Quant8Format F>
FASTDDP_QUANT8_INLINE void residual(const uint8_t* __restrict codes, int64_t len, float scale,
                                    const float* x, float* err) {
  for (int64_t i = 0; i < len; ++i) err[i] = x[i] - float_from_quant8_code<F>(codes[i]) * scale;
}

template <Quant8Format F>
FASTDDP_QUANT8_INLINE void quantize_block(const float* x, int64_t len, uint8_t* codes,
                                          float* scale_out, float* err) {
  const float scale = quant8_scale_from_absmax_bits<F>(block_absmax_bits(x, len));
  *scale_out = scale;
  if (scale != scale) {
    // A NaN or an infinity: codes 0 and a NaN scale, so the block reads back as NaN.
    std::fill(codes, codes + len, uint8_t{0});
  } else {
    encode<F>(x, len, quant8_divisor(scale), codes);
  }
  if (err != nullptr) residual<F>(codes, len, scale, x, err);
}

template <Quant8Format F>
FASTDDP_VECTOR_CLONES void quantize_range(const float* src, int64_t n, int64_t block,
                                          uint8_t* codes, float* scales, float* err, int64_t b0,
                                          int64_t b1) {
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t begin = b * block;
    const int64_t len = std::min(block, n - begin);
    if (len <= 0) break;
    quantize_block<F>(src + begin, len, codes + begin, scales + b,
                      err != nullptr ? err + begin : nullptr);
  }
}

template <Quant8Format F>
FASTDDP_VECTOR_CLONES void dequantize_range(const uint8_t* __restrict codes,
                                            const float* __restrict scales, int64_t n,
                                            int64_t block, float* __restrict dst, int64_t b0,
                                            int64_t b1) {
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t begin = b * block;
    const int64_t len = std::min(block, n - begin);
    if (len <= 0) break;
    const float s = scales[b];
    const uint8_t* c = codes + begin;
    float* d = dst + begin;
    for (int64_t i = 0; i < len; ++i) d[i] = float_from_quant8_code<F>(c[i]) * s;
  }
}

template <Quant8Format F>
FASTDDP_VECTOR_CLONES void sum_shards_range(const uint8_t* shards, int64_t shard_bytes,
                                            int64_t count, int64_t n, int64_t block,
                                            uint8_t* out_codes, float* out_scales, int64_t b0,
                                            int64_t b1) {
  float acc[kQuant8MaxBlock];
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t begin = b * block;
    const int64_t len = std::min(block, n - begin);
    if (len <= 0) break;
    for (int64_t r = 0; r < count; ++r) {
      const uint8_t* shard = shards + r * shard_bytes;
      const float s = reinterpret_cast<const float*>(shard + n)[b];
      const uint8_t* c = shard + begin;
      if (r == 0) {
        for (int64_t i = 0; i < len; ++i) acc[i] = float_from_quant8_code<F>(c[i]) * s;
      } else {
        for (int64_t i = 0; i < len; ++i) acc[i] = acc[i] + float_from_quant8_code<F>(c[i]) * s;
      }
    }
    quantize_block<F>(acc, len, out_codes + begin, out_scales + b, nullptr);
  }
}

}  // namespace

void quantize8_cpu(Quant8Format format, const float* src, int64_t n, int64_t block,
                   uint8_t* codes, float* scales, float* err, int64_t first_block,
                   int64_t last_block) {
  switch (format) {
    case Quant8Format::kInt8:
      return quantize_range<Quant8Format::kInt8>(src, n, block, codes, scales, err, first_block,
                                                 last_block);
    case Quant8Format::kFp8E4M3:
      return quantize_range<Quant8Format::kFp8E4M3>(src, n, block, codes, scales, err,
                                                    first_block, last_block);
    case Quant8Format::kFp8E5M2:
      return quantize_range<Quant8Format::kFp8E5M2>(src, n, block, codes, scales, err,
                                                    first_block, last_block);
  }
}

void dequantize8_cpu(Quant8Format format, const uint8_t* codes, const float* scales, int64_t n,
                     int64_t block, float* dst, int64_t first_block, int64_t last_block) {
  switch (format) {
    case Quant8Format::kInt8:
      return dequantize_range<Quant8Format::kInt8>(codes, scales, n, block, dst, first_block,
                                                   last_block);
    case Quant8Format::kFp8E4M3:
      return dequantize_range<Quant8Format::kFp8E4M3>(codes, scales, n, block, dst, first_block,
                                                      last_block);
    case Quant8Format::kFp8E5M2:
      return dequantize_range<Quant8Format::kFp8E5M2>(codes, scales, n, block, dst, first_block,
                                                      last_block);
  }
}

void sum_shards8_cpu(Quant8Format format, const uint8_t* shards, int64_t shard_bytes,
                     int64_t count, int64_t n, int64_t block, uint8_t* out_codes,
                     float* out_scales, int64_t first_block, int64_t last_block) {
  if (count <= 0) return;
  switch (format) {
    case Quant8Format::kInt8:
      return sum_shards_range<Quant8Format::kInt8>(shards, shard_bytes, count, n, block,
                                                   out_codes, out_scales, first_block,
                                                   last_block);
    case Quant8Format::kFp8E4M3:
      return sum_shards_range<Quant8Format::kFp8E4M3>(shards, shard_bytes, count, n, block,
                                                      out_codes, out_scales, first_block,
                                                      last_block);
    case Quant8Format::kFp8E5M2:
      return sum_shards_range<Quant8Format::kFp8E5M2>(shards, shard_bytes, count, n, block,
                                                      out_codes, out_scales, first_block,
                                                      last_block);
  }
}

}  // namespace fastddp::kernels
