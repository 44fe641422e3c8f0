// CUDA versions of the 8-bit block quantization (see quant8.h): one thread
// block of kThreads per quantization block (the hook's blocks are 256
// elements: one element per thread), the block's absmax bit pattern reduced
// with warp shuffles, the per-value codes from core/quant8_codes.h. Explicit
// _rn intrinsics keep every rounding where the CPU version has it (no FMA
// contraction). Built without --use_fast_math (setup.py).
#include <cuda_runtime.h>

#include <algorithm>
#include <stdexcept>
#include <string>

#include "../quant8.h"

namespace fastddp::kernels {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxGridBlocks = 132 * 8;

void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    throw std::runtime_error(std::string("fastddp ") + what + ": " + cudaGetErrorString(err));
  }
}

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
  quantize_kernel<F><<<static_cast<unsigned>(blocks_of(n, block)), kThreads, 0, stream>>>(
      src, n, block, codes, scales, err);
  check(cudaGetLastError(), "quantize8_cuda launch");
}

template <Quant8Format F>
void launch_dequantize(const uint8_t* codes, const float* scales, int64_t n, int64_t block,
                       float* dst, cudaStream_t stream) {
  const int64_t want = (n + kThreads - 1) / kThreads;
  const int grid = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(want, kMaxGridBlocks)));
  dequantize_kernel<F><<<grid, kThreads, 0, stream>>>(codes, scales, n, block, dst);
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
