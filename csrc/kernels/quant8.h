// Block-scaled 8-bit quantization kernels (int8, fp8 e4m3fn, fp8 e5m2) for the
// "int8" / "fp8" comm hooks: Note [8-bit wire formats] in hooks/quant8/quant8_hook.h
// says what is computed; the per-value codes are core/quant8_codes.h.
//
// Raw pointers and sizes only (no torch, no CUDA headers), like half_cast.h,
// so the CPU versions are Catch2-tested without LibTorch. Values are split in
// blocks of `block` elements (the last one may be shorter); block b's scale is
// scales[b]. Threading is the caller's business: the CPU functions take a
// range of blocks [first_block, last_block).
#pragma once

#include <cstdint>

#include "../core/quant8_codes.h"

namespace fastddp::kernels {

// The most elements per block the kernels take (CPU stack / CUDA shared memory).
constexpr int64_t kQuant8MaxBlock = 4096;

// codes[i], scales[b] from src[0, n). With `err` (error feedback), also
// err[i] = src[i] - float(codes[i]) * scales[b]; err may be src itself.
void quantize8_cpu(Quant8Format format, const float* src, int64_t n, int64_t block,
                   uint8_t* codes, float* scales, float* err, int64_t first_block,
                   int64_t last_block);

// dst[i] = float(codes[i]) * scales[i / block] for i in the blocks' range, up
// to n (dst may cover fewer elements than the codes: pass n = its size).
void dequantize8_cpu(Quant8Format format, const uint8_t* codes, const float* scales, int64_t n,
                     int64_t block, float* dst, int64_t first_block, int64_t last_block);

// The local step of the float32-accumulation reduction: `count` packed shards
// of n values (shard r at shards + r * shard_bytes: n codes, then the scales
// as float32 at byte offset n, which must be 4-aligned) are dequantized and
// summed in float32 in shard order, and the sum re-quantized into out_codes /
// out_scales.
void sum_shards8_cpu(Quant8Format format, const uint8_t* shards, int64_t shard_bytes,
                     int64_t count, int64_t n, int64_t block, uint8_t* out_codes,
                     float* out_scales, int64_t first_block, int64_t last_block);

// --- CUDA (built only with CUDA; `stream` is a cudaStream_t) ----------------------
// The same, all blocks in one launch each.
void quantize8_cuda(Quant8Format format, const float* src, int64_t n, int64_t block,
                    uint8_t* codes, float* scales, float* err, void* stream);
void dequantize8_cuda(Quant8Format format, const uint8_t* codes, const float* scales, int64_t n,
                      int64_t block, float* dst, void* stream);
void sum_shards8_cuda(Quant8Format format, const uint8_t* shards, int64_t shard_bytes,
                      int64_t count, int64_t n, int64_t block, uint8_t* out_codes,
                      float* out_scales, void* stream);

}  // namespace fastddp::kernels
