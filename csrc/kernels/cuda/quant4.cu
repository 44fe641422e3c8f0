// CUDA versions of the 4-bit block quantization (see quant4.h, Note [int4 wire
// format]). Quantize: one warp per quantization block (grid-stride over the
// blocks), each lane one byte (two values) at a time, the block's absmax bit
// pattern reduced with warp shuffles alone (no shared memory, no
// __syncthreads). Dequantize and the shard sum: one thread per byte,
// grid-stride. The per-value codes are core/quant4_codes.h; explicit _rn
// intrinsics keep every rounding where the CPU version has it (no FMA
// contraction). Built without --use_fast_math (setup.py).
#include <cuda_runtime.h>

#include "../quant4.h"
#include "launch.cuh"

namespace fastddp::kernels {
namespace {

using cuda_launch::capped;
using cuda_launch::check;
using cuda_launch::full_grid;

constexpr int kThreads = 256;

__device__ __forceinline__ uint32_t abs_bits(float v) { return float_bits(v) & 0x7FFFFFFFu; }

// The value of a nibble (the low 4 bits) times its block's scale.
__device__ __forceinline__ float decoded(uint32_t nibble, float scale) {
  return __fmul_rn(float_from_int4_code(nibble), scale);
}

__global__ void quantize_kernel(const float* src, int64_t n, int64_t block, int64_t blocks,
                                uint8_t* codes, float* scales, float* err) {
  const int lane = threadIdx.x % 32;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * blockDim.x / 32;
  for (int64_t b = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
       b < blocks; b += warps) {
    const int64_t begin = b * block;
    const int64_t len = min(block, n - begin);
    const float* x = src + begin;
    uint32_t m = 0;
    for (int64_t i = lane; i < len; i += 32) m = max(m, abs_bits(x[i]));
    for (int offset = 16; offset > 0; offset >>= 1) {
      m = max(m, __shfl_xor_sync(0xFFFFFFFFu, m, offset));
    }
    const float scale = quant4_scale_from_absmax_bits(m);
    if (lane == 0) scales[b] = scale;
    const bool nonfinite = scale != scale;
    const float divisor = quant8_divisor(scale);
    uint8_t* c = codes + begin / 2;  // block is even: a block starts on a byte
    float* e = err != nullptr ? err + begin : nullptr;
    const int64_t bytes = (len + 1) / 2;
    for (int64_t k = lane; k < bytes; k += 32) {
      const bool pair = 2 * k + 1 < len;
      const float x0 = x[2 * k];
      const float x1 = pair ? x[2 * k + 1] : 0.0f;
      const uint32_t lo = nonfinite ? 0u : int4_code_from_float(__fdiv_rn(x0, divisor));
      const uint32_t hi = nonfinite || !pair ? 0u : int4_code_from_float(__fdiv_rn(x1, divisor));
      c[k] = static_cast<uint8_t>(lo | (hi << 4));
      if (e != nullptr) {  // e may be x itself: each lane reads its values before writing
        e[2 * k] = __fsub_rn(x0, decoded(lo, scale));
        if (pair) e[2 * k + 1] = __fsub_rn(x1, decoded(hi, scale));
      }
    }
  }
}

// dst = the values of the shards' codes summed in shard order (one shard: dequantize).
// Shard r's codes at codes + r * shard_bytes, its scales at scales + r * shard_bytes / 4.
__global__ void decode_sum_kernel(const uint8_t* __restrict__ codes,
                                  const float* __restrict__ scales, int64_t shard_bytes,
                                  int64_t count, int64_t n, int64_t block,
                                  float* __restrict__ dst) {
  const int64_t bytes = (n + 1) / 2;
  const int64_t half_block = block / 2;
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t k = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; k < bytes;
       k += step) {
    const int64_t b = k / half_block;
    float lo = 0.0f;
    float hi = 0.0f;
    for (int64_t r = 0; r < count; ++r) {
      const uint32_t c = codes[r * shard_bytes + k];
      const float s = scales[r * (shard_bytes / 4) + b];
      const float vlo = decoded(c, s);
      const float vhi = decoded(c >> 4, s);
      lo = r == 0 ? vlo : __fadd_rn(lo, vlo);
      hi = r == 0 ? vhi : __fadd_rn(hi, vhi);
    }
    dst[2 * k] = lo;
    if (2 * k + 1 < n) dst[2 * k + 1] = hi;
  }
}

int64_t blocks_of(int64_t n, int64_t block) { return (n + block - 1) / block; }

void launch_decode_sum(const uint8_t* codes, const float* scales, int64_t shard_bytes,
                       int64_t count, int64_t n, int64_t block, float* dst, cudaStream_t stream,
                       const char* what) {
  const int grid = capped((quant4_code_bytes(n) + kThreads - 1) / kThreads,
                          full_grid<decode_sum_kernel>(kThreads));
  decode_sum_kernel<<<grid, kThreads, 0, stream>>>(codes, scales, shard_bytes, count, n, block,
                                                   dst);
  check(cudaGetLastError(), what);
}

}  // namespace

void quantize4_cuda(const float* src, int64_t n, int64_t block, uint8_t* codes, float* scales,
                    float* err, void* stream_ptr) {
  if (n == 0) return;
  const int64_t blocks = blocks_of(n, block);
  const int grid =
      capped((blocks * 32 + kThreads - 1) / kThreads, full_grid<quantize_kernel>(kThreads));
  quantize_kernel<<<grid, kThreads, 0, static_cast<cudaStream_t>(stream_ptr)>>>(
      src, n, block, blocks, codes, scales, err);
  check(cudaGetLastError(), "quantize4_cuda launch");
}

void dequantize4_cuda(const uint8_t* codes, const float* scales, int64_t n, int64_t block,
                      float* dst, void* stream_ptr) {
  if (n == 0) return;
  // One shard; its stride is never used.
  launch_decode_sum(codes, scales, 0, 1, n, block, dst, static_cast<cudaStream_t>(stream_ptr),
                    "dequantize4_cuda launch");
}

void sum_shards4_cuda(const uint8_t* shards, int64_t shard_bytes, int64_t count, int64_t n,
                      int64_t block, float* dst, void* stream_ptr) {
  if (n == 0 || count <= 0) return;
  const auto* scales = reinterpret_cast<const float*>(shards + quant4_scales_offset(n));
  launch_decode_sum(shards, scales, shard_bytes, count, n, block, dst,
                    static_cast<cudaStream_t>(stream_ptr), "sum_shards4_cuda launch");
}

}  // namespace fastddp::kernels
