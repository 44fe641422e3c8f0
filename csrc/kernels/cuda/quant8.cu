// CUDA versions of the 8-bit block quantization (see quant8.h): one thread
// block of kThreads per quantization block (the hook's blocks are 256
// elements: one element per thread), the block's absmax bit pattern reduced
// with warp shuffles, the per-value codes from core/quant8_codes.h. Explicit
// _rn intrinsics keep every rounding where the CPU version has it (no FMA
// contraction). Built without --use_fast_math (setup.py).
//
// The hook's own block of 256 values has a faster path (issue 32: the general
// kernel ran at 30% of a copy's bandwidth on an H100): one warp per block, 8
// values per lane in two 16-byte loads, the absmax reduced with shuffles alone
// (no shared memory, no __syncthreads), codes stored 4 bytes at a time. Same
// codes, scales and errors bit for bit: the same functions in the same order.
#include <cuda_runtime.h>

#include <algorithm>

#include "../quant8.h"
#include "launch.cuh"

namespace fastddp::kernels {
namespace {

using cuda_launch::aligned;
using cuda_launch::capped;
using cuda_launch::check;
using cuda_launch::full_grid;

constexpr int kThreads = 256;
constexpr int kMaxGridBlocks = 132 * 8;
constexpr int64_t kWarpBlock = 256;  // the hook's block: 32 lanes x 8 values

// The max of v over the thread block (every thread gets it). Every thread of
// the block must call it; blockDim.x is kThreads (a whole number of warps).
__device__ __forceinline__ uint32_t block_max(uint32_t v, uint32_t* partial) {
  for (int offset = 16; offset > 0; offset >>= 1) {
    v = max(v, __shfl_xor_sync(0xFFFFFFFFu, v, offset));
  }
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  v = lane < static_cast<int>(blockDim.x / 32) ? partial[lane] : 0u;
  for (int offset = 16; offset > 0; offset >>= 1) {
    v = max(v, __shfl_xor_sync(0xFFFFFFFFu, v, offset));
  }
  __syncthreads();  // partial may be reused
  return v;
}

// Encodes this thread's values x[i] (i = threadIdx.x, + blockDim.x, ...) of a
// block whose absmax bits are known; err may be x itself.
template <Quant8Format F>
__device__ __forceinline__ void encode_block(const float* x, int64_t len, uint32_t absmax,
                                             uint8_t* codes, float* scale_out, float* err) {
  const float scale = quant8_scale_from_absmax_bits<F>(absmax);
  if (threadIdx.x == 0) *scale_out = scale;
  const bool nonfinite = scale != scale;
  const float divisor = quant8_divisor(scale);
  for (int64_t i = threadIdx.x; i < len; i += blockDim.x) {
    const float v = x[i];
    const uint8_t c = nonfinite ? uint8_t{0} : quant8_code_from_float<F>(__fdiv_rn(v, divisor));
    codes[i] = c;
    if (err != nullptr) err[i] = __fsub_rn(v, __fmul_rn(float_from_quant8_code<F>(c), scale));
  }
}

template <Quant8Format F>
__global__ void quantize_kernel(const float* src, int64_t n, int64_t block, uint8_t* codes,
                                float* scales, float* err) {
  __shared__ uint32_t partial[kThreads / 32];
  const int64_t b = blockIdx.x;
  const int64_t begin = b * block;
  const int64_t len = min(block, n - begin);
  uint32_t m = 0;
  for (int64_t i = threadIdx.x; i < len; i += blockDim.x) {
    m = max(m, float_bits(src[begin + i]) & 0x7FFFFFFFu);
  }
  m = block_max(m, partial);
  encode_block<F>(src + begin, len, m, codes + begin, scales + b,
                  err != nullptr ? err + begin : nullptr);
}

__device__ __forceinline__ uint32_t abs_bits(float v) { return float_bits(v) & 0x7FFFFFFFu; }

template <Quant8Format F>
__device__ __forceinline__ uint32_t encode4(const float4 v, float scale, float divisor,
                                            bool nonfinite, float4* err) {
  const float x[4] = {v.x, v.y, v.z, v.w};
  uint8_t c[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    c[k] = nonfinite ? uint8_t{0} : quant8_code_from_float<F>(__fdiv_rn(x[k], divisor));
  }
  if (err != nullptr) {
    float e[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      e[k] = __fsub_rn(x[k], __fmul_rn(float_from_quant8_code<F>(c[k]), scale));
    }
    *err = make_float4(e[0], e[1], e[2], e[3]);
  }
  // Little-endian: byte k of the word is value k.
  return c[0] | (uint32_t{c[1]} << 8) | (uint32_t{c[2]} << 16) | (uint32_t{c[3]} << 24);
}

// Blocks of 256 whole values from 16-byte aligned src (and err), 4-byte aligned codes.
// Lane l holds values 4l..4l+3 and 128+4l..128+4l+3: both loads are coalesced.
template <Quant8Format F>
__global__ void quantize_warp_kernel(const float* src, int64_t blocks, uint8_t* codes,
                                     float* scales, float* err) {
  const int lane = threadIdx.x % 32;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * blockDim.x / 32;
  for (int64_t b = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
       b < blocks; b += warps) {
    const float4* x = reinterpret_cast<const float4*>(src + b * kWarpBlock);
    const float4 lo = x[lane];
    const float4 hi = x[lane + 32];
    uint32_t m = max(max(max(abs_bits(lo.x), abs_bits(lo.y)), max(abs_bits(lo.z), abs_bits(lo.w))),
                     max(max(abs_bits(hi.x), abs_bits(hi.y)), max(abs_bits(hi.z), abs_bits(hi.w))));
    for (int offset = 16; offset > 0; offset >>= 1) {
      m = max(m, __shfl_xor_sync(0xFFFFFFFFu, m, offset));
    }
    const float scale = quant8_scale_from_absmax_bits<F>(m);
    if (lane == 0) scales[b] = scale;
    const bool nonfinite = scale != scale;
    const float divisor = quant8_divisor(scale);
    float4* e = err != nullptr ? reinterpret_cast<float4*>(err + b * kWarpBlock) : nullptr;
    uint32_t* c = reinterpret_cast<uint32_t*>(codes + b * kWarpBlock);
    float4* e_lo = e != nullptr ? e + lane : nullptr;
    float4* e_hi = e != nullptr ? e + lane + 32 : nullptr;
    c[lane] = encode4<F>(lo, scale, divisor, nonfinite, e_lo);
    c[lane + 32] = encode4<F>(hi, scale, divisor, nonfinite, e_hi);
  }
}

template <Quant8Format F>
__global__ void dequantize_kernel(const uint8_t* __restrict__ codes,
                                  const float* __restrict__ scales, int64_t n, int64_t block,
                                  float* __restrict__ dst) {
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += step) {
    dst[i] = __fmul_rn(float_from_quant8_code<F>(codes[i]), scales[i / block]);
  }
}

// Each thread sums its own values in shard order into shared memory, so the
// encode reads back only what the same thread wrote.
template <Quant8Format F>
__global__ void sum_shards_kernel(const uint8_t* __restrict__ shards, int64_t shard_bytes,
                                  int64_t count, int64_t n, int64_t block,
                                  uint8_t* __restrict__ out_codes,
                                  float* __restrict__ out_scales) {
  extern __shared__ float acc[];
  __shared__ uint32_t partial[kThreads / 32];
  const int64_t b = blockIdx.x;
  const int64_t begin = b * block;
  const int64_t len = min(block, n - begin);
  uint32_t m = 0;
  for (int64_t i = threadIdx.x; i < len; i += blockDim.x) {
    float a = 0.0f;
    for (int64_t r = 0; r < count; ++r) {
      const uint8_t* shard = shards + r * shard_bytes;
      const float s = reinterpret_cast<const float*>(shard + n)[b];
      const float v = __fmul_rn(float_from_quant8_code<F>(shard[begin + i]), s);
      a = r == 0 ? v : __fadd_rn(a, v);
    }
    acc[i] = a;
    m = max(m, float_bits(a) & 0x7FFFFFFFu);
  }
  m = block_max(m, partial);
  encode_block<F>(acc, len, m, out_codes + begin, out_scales + b, nullptr);
}

int64_t blocks_of(int64_t n, int64_t block) { return (n + block - 1) / block; }

template <Quant8Format F>
void launch_quantize(const float* src, int64_t n, int64_t block, uint8_t* codes, float* scales,
                     float* err, cudaStream_t stream) {
  int64_t whole = 0;  // blocks done by the warp kernel
  if (block == kWarpBlock && aligned(src, 16) && aligned(codes, 4) &&
      (err == nullptr || aligned(err, 16))) {
    whole = n / kWarpBlock;
    if (whole > 0) {
      const int grid = capped((whole * 32 + kThreads - 1) / kThreads,
                              full_grid<quantize_warp_kernel<F>>(kThreads));
      quantize_warp_kernel<F><<<grid, kThreads, 0, stream>>>(src, whole, codes, scales, err);
    }
  }
  const int64_t begin = whole * block;
  if (begin < n) {  // every block (general case) or the short last one
    quantize_kernel<F><<<static_cast<unsigned>(blocks_of(n - begin, block)), kThreads, 0,
                         stream>>>(src + begin, n - begin, block, codes + begin,
                                   scales + whole, err != nullptr ? err + begin : nullptr);
  }
  check(cudaGetLastError(), "quantize8_cuda launch");
}

// Four values per thread (a 4-byte load, a 16-byte store, one scale) when the block is a
// power of two of at least 4 and the pointers allow it: a shift finds the scale, no
// 64-bit division per value.
template <Quant8Format F>
__global__ void dequantize4_kernel(const uint8_t* __restrict__ codes,
                                   const float* __restrict__ scales, int64_t n, int shift,
                                   float* __restrict__ dst) {
  const int64_t n4 = n / 4;
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (int64_t q = first; q < n4; q += step) {
    const uchar4 c = reinterpret_cast<const uchar4*>(codes)[q];
    const float s = scales[(4 * q) >> shift];
    reinterpret_cast<float4*>(dst)[q] = make_float4(
        __fmul_rn(float_from_quant8_code<F>(c.x), s), __fmul_rn(float_from_quant8_code<F>(c.y), s),
        __fmul_rn(float_from_quant8_code<F>(c.z), s), __fmul_rn(float_from_quant8_code<F>(c.w), s));
  }
  const int64_t i = 4 * n4 + first;  // the last n % 4 values, by the first threads
  if (i < n) dst[i] = __fmul_rn(float_from_quant8_code<F>(codes[i]), scales[i >> shift]);
}

template <Quant8Format F>
void launch_dequantize(const uint8_t* codes, const float* scales, int64_t n, int64_t block,
                       float* dst, cudaStream_t stream) {
  int shift = 0;
  while ((int64_t{1} << shift) < block) ++shift;
  if (block >= 4 && (int64_t{1} << shift) == block && aligned(codes, 4) && aligned(dst, 16)) {
    const int grid = capped((n / 4 + kThreads - 1) / kThreads,
                            full_grid<dequantize4_kernel<F>>(kThreads));
    dequantize4_kernel<F><<<grid, kThreads, 0, stream>>>(codes, scales, n, shift, dst);
  } else {
    const int grid = capped((n + kThreads - 1) / kThreads, kMaxGridBlocks);
    dequantize_kernel<F><<<grid, kThreads, 0, stream>>>(codes, scales, n, block, dst);
  }
  check(cudaGetLastError(), "dequantize8_cuda launch");
}

template <Quant8Format F>
void launch_sum_shards(const uint8_t* shards, int64_t shard_bytes, int64_t count, int64_t n,
                       int64_t block, uint8_t* out_codes, float* out_scales,
                       cudaStream_t stream) {
  const size_t shared = static_cast<size_t>(block) * sizeof(float);
  sum_shards_kernel<F><<<static_cast<unsigned>(blocks_of(n, block)), kThreads, shared, stream>>>(
      shards, shard_bytes, count, n, block, out_codes, out_scales);
  check(cudaGetLastError(), "sum_shards8_cuda launch");
}

}  // namespace

void quantize8_cuda(Quant8Format format, const float* src, int64_t n, int64_t block,
                    uint8_t* codes, float* scales, float* err, void* stream_ptr) {
  if (n == 0) return;
  auto stream = static_cast<cudaStream_t>(stream_ptr);
  switch (format) {
    case Quant8Format::kInt8:
      return launch_quantize<Quant8Format::kInt8>(src, n, block, codes, scales, err, stream);
    case Quant8Format::kFp8E4M3:
      return launch_quantize<Quant8Format::kFp8E4M3>(src, n, block, codes, scales, err, stream);
    case Quant8Format::kFp8E5M2:
      return launch_quantize<Quant8Format::kFp8E5M2>(src, n, block, codes, scales, err, stream);
  }
}

void dequantize8_cuda(Quant8Format format, const uint8_t* codes, const float* scales, int64_t n,
                      int64_t block, float* dst, void* stream_ptr) {
  if (n == 0) return;
  auto stream = static_cast<cudaStream_t>(stream_ptr);
  switch (format) {
    case Quant8Format::kInt8:
      return launch_dequantize<Quant8Format::kInt8>(codes, scales, n, block, dst, stream);
    case Quant8Format::kFp8E4M3:
      return launch_dequantize<Quant8Format::kFp8E4M3>(codes, scales, n, block, dst, stream);
    case Quant8Format::kFp8E5M2:
      return launch_dequantize<Quant8Format::kFp8E5M2>(codes, scales, n, block, dst, stream);
  }
}

void sum_shards8_cuda(Quant8Format format, const uint8_t* shards, int64_t shard_bytes,
                      int64_t count, int64_t n, int64_t block, uint8_t* out_codes,
                      float* out_scales, void* stream_ptr) {
  if (n == 0 || count <= 0) return;
  auto stream = static_cast<cudaStream_t>(stream_ptr);
  switch (format) {
    case Quant8Format::kInt8:
      return launch_sum_shards<Quant8Format::kInt8>(shards, shard_bytes, count, n, block,
                                                    out_codes, out_scales, stream);
    case Quant8Format::kFp8E4M3:
      return launch_sum_shards<Quant8Format::kFp8E4M3>(shards, shard_bytes, count, n, block,
                                                       out_codes, out_scales, stream);
    case Quant8Format::kFp8E5M2:
      return launch_sum_shards<Quant8Format::kFp8E5M2>(shards, shard_bytes, count, n, block,
                                                       out_codes, out_scales, stream);
  }
}

}  // namespace fastddp::kernels
