// Casts between float32 gradients and 16-bit (bfloat16 / float16) wire
// buffers, fused with what the comm hooks need around them: the 1/world_size
// scale, error feedback, and the float32 sum of 16-bit shards.
//
// Raw pointers and sizes only (no torch, no CUDA headers), so any layer may
// include this and the CPU versions are Catch2-tested without LibTorch.
// 16-bit values are uint16_t bit patterns; rounding is Note [half rounding].
// No alignment is required anywhere: bucket offsets are arbitrary.
#pragma once

#include <cstdint>

#include "../core/half_rounding.h"

namespace fastddp::kernels {

// dst[i] = half(src[i] * scale). With residual (error feedback):
//   v = src[i] * scale + residual[i];  dst[i] = half(v);  new_residual[i] = v - float(dst[i])
// (each operation rounded on its own, as the same torch ops would be). The new
// residual goes elsewhere than the one read (Note [double-buffered step state]):
// the two must not overlap. residual and new_residual: both or neither.
// With `nonfinite` (check_for_nan_in_grad), *nonfinite is set to 1 when some
// src[i] is NaN or infinite, in the same pass (it is never cleared).
void compress_cpu(HalfKind kind, const float* src, float scale, const float* residual,
                  float* new_residual, uint16_t* dst, int64_t n, int32_t* nonfinite = nullptr);

// torch's fp16_compress_hook / bf16_compress_hook, bit for bit (Note [torch's half
// rounding]): the gradient is cast first, then divided in 16 bits as ATen divides a
// 16-bit tensor by a scalar on the CPU, in float and rounded again:
//   dst[i] = half(float(half(src[i])) / divisor)
// `nonfinite` as for compress_cpu.
void cast_divide_cpu(HalfKind kind, const float* src, float divisor, uint16_t* dst, int64_t n,
                     int32_t* nonfinite = nullptr);

// dst[i] = float(src[i]) (exact).
void decompress_cpu(HalfKind kind, const uint16_t* src, float* dst, int64_t n);

// out[i] = half(sum over r = 0..count-1, in that order, of float(shards[r * stride + i])):
// the local step of the float32-accumulation reduction.
void sum_shards_cpu(HalfKind kind, const uint16_t* shards, int64_t stride, int64_t count,
                    uint16_t* out, int64_t n);

// --- CUDA (built only with CUDA; `stream` is a cudaStream_t) ----------------------

// One grad into its slice of the wire buffer (the copy-in of one parameter).
// `nonfinite`: device memory, as for compress_cpu.
void compress_cuda(HalfKind kind, const float* src, float scale, const float* residual,
                   float* new_residual, uint16_t* dst, int64_t n, void* stream,
                   int32_t* nonfinite = nullptr);

// The CUDA twin of cast_divide_cpu, as ATen divides on CUDA by a CPU scalar: it
// multiplies by the float reciprocal (BinaryDivTrueKernel.cu), so
//   dst[i] = half(float(half(src[i])) * (1.0f / divisor))
// which can differ from the CPU's quotient in its last bit.
void cast_divide_cuda(HalfKind kind, const float* src, float divisor, uint16_t* dst, int64_t n,
                      void* stream, int32_t* nonfinite = nullptr);

// A bucket's worth of decompression in one launch: many (src, dst, n) ranges.
struct DecompressRange {
  const uint16_t* src;
  float* dst;
  int64_t n;
};
void decompress_multi_cuda(HalfKind kind, const DecompressRange* ranges, int64_t count,
                           void* stream);

void sum_shards_cuda(HalfKind kind, const uint16_t* shards, int64_t stride, int64_t count,
                     uint16_t* out, int64_t n, void* stream);

}  // namespace fastddp::kernels
