// Block-scaled 4-bit quantization kernels (symmetric int4) for DiLoCo's
// wire="int4"; the per-value codes are core/quant4_codes.h.
//
// Note [int4 wire format]
// Values are split in blocks of `block` elements (an even number, so that a
// byte never holds codes of two blocks; the last block may be shorter). Block
// b's scale is scales[b] = absmax / 7 in float32, and value i's code is
// clamp(round_half_even(x[i] / scale), -7, 7), exactly
// `torch.clamp(torch.round(x / scale), -7, 7)`; a block of scale 0 (all zeros,
// or an absmax so small that absmax / 7 underflows) divides by 1 instead, so
// its codes are 0. A block holding a NaN or an infinity gets a NaN scale and
// codes 0: it reads back as NaN, all of it (as the 8-bit formats, Note [8-bit
// wire formats]). Codes are 4-bit two's complement, two a byte: element 2k in
// the low nibble of byte k, element 2k + 1 in the high one; for odd n the last
// byte's high nibble is 0. A value reads back as float(code) * scale.
//
// With error feedback, err[i] = x[i] - float(code[i]) * scale (two roundings,
// as torch's separate ops). For a finite block that subtraction is exact (the
// dequantized value is 0 or within a factor 2 of x: Sterbenz), so
// dequantized + err == x holds exactly in float32.
//
// Raw pointers and sizes only (no torch, no CUDA headers), like quant8.h, so
// the CPU versions are Catch2-tested without LibTorch. Threading is the
// caller's business: the CPU functions take a range of blocks
// [first_block, last_block).
#pragma once

#include <cstdint>

#include "../core/quant4_codes.h"

namespace fastddp::kernels {

// Bytes of codes for n values.
inline int64_t quant4_code_bytes(int64_t n) { return (n + 1) / 2; }

// A packed shard (what sum_shards4 reads): the codes, zero padding to a
// multiple of 4 bytes, then the float32 scales.
inline int64_t quant4_scales_offset(int64_t n) { return (quant4_code_bytes(n) + 3) / 4 * 4; }
inline int64_t quant4_shard_bytes(int64_t n, int64_t block) {
  return quant4_scales_offset(n) + 4 * ((n + block - 1) / block);
}

// codes (quant4_code_bytes(n) bytes) and scales[b] from src[0, n). With `err`
// (error feedback), also err[i] = src[i] - dequantized; err may be src itself.
void quantize4_cpu(const float* src, int64_t n, int64_t block, uint8_t* codes, float* scales,
                   float* err, int64_t first_block, int64_t last_block);

// dst[i] = float(code[i]) * scales[i / block] for i in the blocks' range, up to n.
void dequantize4_cpu(const uint8_t* codes, const float* scales, int64_t n, int64_t block,
                     float* dst, int64_t first_block, int64_t last_block);

// `count` packed shards of n values (shard r at shards + r * shard_bytes, laid
// out as quant4_shard_bytes says, 4-aligned) dequantized and summed in float32
// in shard order into dst (n values): dst = d_0 + d_1 + ... left to right.
void sum_shards4_cpu(const uint8_t* shards, int64_t shard_bytes, int64_t count, int64_t n,
                     int64_t block, float* dst, int64_t first_block, int64_t last_block);

// --- CUDA (built only with CUDA; `stream` is a cudaStream_t) ----------------------
// The same, all blocks in one launch each.
void quantize4_cuda(const float* src, int64_t n, int64_t block, uint8_t* codes, float* scales,
                    float* err, void* stream);
void dequantize4_cuda(const uint8_t* codes, const float* scales, int64_t n, int64_t block,
                      float* dst, void* stream);
void sum_shards4_cuda(const uint8_t* shards, int64_t shard_bytes, int64_t count, int64_t n,
                      int64_t block, float* dst, void* stream);

}  // namespace fastddp::kernels
