// CUDA versions of the half casts (see half_cast.h), bandwidth-bound:
// 16-byte float loads and 8-byte half stores where both sides are aligned,
// a scalar path otherwise (bucket offsets are arbitrary), and one launch for
// a whole bucket's decompression (multi-tensor apply, after apex).
// Built without --use_fast_math (setup.py): see Note [half rounding].
#include <cuda_runtime.h>

#include <algorithm>
#include <stdexcept>
#include <string>

#include "../half_cast.h"

namespace fastddp::kernels {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxGridBlocks = 132 * 8;  // enough to fill an H100/H200 several times over

void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    throw std::runtime_error(std::string("fastddp ") + what + ": " + cudaGetErrorString(err));
  }
}

int grid_for(int64_t work) {
  const int64_t blocks = (work + kThreads - 1) / kThreads;
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(blocks, kMaxGridBlocks)));
}

bool aligned(const void* p, uintptr_t bytes) {
  return reinterpret_cast<uintptr_t>(p) % bytes == 0;
}

template <HalfKind K, bool kFeedback>
__device__ __forceinline__ uint16_t compress_one(float g, float scale, float* residual,
                                                 int64_t i) {
  float v = mul_rn(g, scale);
  if constexpr (kFeedback) v = add_rn(v, residual[i]);
  const uint16_t h = half_bits_from_float<K>(v);
  if constexpr (kFeedback) residual[i] = v - float_from_half_bits<K>(h);
  return h;
}

__device__ __forceinline__ int nonfinite(float x) { return (x - x) != 0.0f; }

// nonfinite_flag (check_for_nan_in_grad): set to 1 by any thread that saw a
// NaN or an infinity; every writer stores the same value, so no atomics.
template <HalfKind K, bool kFeedback, bool kVector>
__global__ void compress_kernel(const float* __restrict__ src, float scale,
                                float* __restrict__ residual, uint16_t* __restrict__ dst,
                                int64_t n, int32_t* nonfinite_flag) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  int64_t scalar_begin = 0;
  int bad = 0;
  if constexpr (kVector) {
    // Residual is read element by element: it needs no alignment.
    const int64_t n4 = n / 4;
    for (int64_t q = tid; q < n4; q += stride) {
      const float4 g = reinterpret_cast<const float4*>(src)[q];
      bad |= nonfinite(g.x) | nonfinite(g.y) | nonfinite(g.z) | nonfinite(g.w);
      const int64_t i = 4 * q;
      ushort4 h;
      h.x = compress_one<K, kFeedback>(g.x, scale, residual, i);
      h.y = compress_one<K, kFeedback>(g.y, scale, residual, i + 1);
      h.z = compress_one<K, kFeedback>(g.z, scale, residual, i + 2);
      h.w = compress_one<K, kFeedback>(g.w, scale, residual, i + 3);
      reinterpret_cast<ushort4*>(dst)[q] = h;
    }
    scalar_begin = 4 * n4;
  }
  for (int64_t i = scalar_begin + tid; i < n; i += stride) {
    bad |= nonfinite(src[i]);
    dst[i] = compress_one<K, kFeedback>(src[i], scale, residual, i);
  }
  if (bad && nonfinite_flag != nullptr) *nonfinite_flag = 1;
}

template <HalfKind K, bool kFeedback>
void launch_compress(const float* src, float scale, float* residual, uint16_t* dst, int64_t n,
                     cudaStream_t stream, int32_t* flag) {
  const bool vector = aligned(src, 16) && aligned(dst, 8);
  const int grid = grid_for(vector ? n / 4 : n);
  if (vector) {
    compress_kernel<K, kFeedback, true>
        <<<grid, kThreads, 0, stream>>>(src, scale, residual, dst, n, flag);
  } else {
    compress_kernel<K, kFeedback, false>
        <<<grid, kThreads, 0, stream>>>(src, scale, residual, dst, n, flag);
  }
  check(cudaGetLastError(), "compress_cuda launch");
}

// --- torch's rounding: cast, then divide (Note [torch's half rounding]) -----------

// ATen's CUDA division by a CPU scalar multiplies by the float reciprocal
// (BinaryDivTrueKernel.cu): one product, rounded once, then the 16-bit store.
template <HalfKind K>
__device__ __forceinline__ uint16_t cast_times(float g, float inverse) {
  return half_bits_from_float<K>(mul_rn(float_from_half_bits<K>(half_bits_from_float<K>(g)),
                                        inverse));
}

template <HalfKind K, bool kVector>
__global__ void cast_divide_kernel(const float* __restrict__ src, float inverse,
                                   uint16_t* __restrict__ dst, int64_t n,
                                   int32_t* nonfinite_flag) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  int64_t scalar_begin = 0;
  int bad = 0;
  if constexpr (kVector) {
    const int64_t n4 = n / 4;
    for (int64_t q = tid; q < n4; q += stride) {
      const float4 g = reinterpret_cast<const float4*>(src)[q];
      bad |= nonfinite(g.x) | nonfinite(g.y) | nonfinite(g.z) | nonfinite(g.w);
      ushort4 h;
      h.x = cast_times<K>(g.x, inverse);
      h.y = cast_times<K>(g.y, inverse);
      h.z = cast_times<K>(g.z, inverse);
      h.w = cast_times<K>(g.w, inverse);
      reinterpret_cast<ushort4*>(dst)[q] = h;
    }
    scalar_begin = 4 * n4;
  }
  for (int64_t i = scalar_begin + tid; i < n; i += stride) {
    bad |= nonfinite(src[i]);
    dst[i] = cast_times<K>(src[i], inverse);
  }
  if (bad && nonfinite_flag != nullptr) *nonfinite_flag = 1;
}

template <HalfKind K>
void launch_cast_divide(const float* src, float divisor, uint16_t* dst, int64_t n,
                        cudaStream_t stream, int32_t* flag) {
  // The reciprocal in float on the host, as ATen computes it (opmath_t(1.0) / b).
  const float inverse = 1.0f / divisor;
  const bool vector = aligned(src, 16) && aligned(dst, 8);
  const int grid = grid_for(vector ? n / 4 : n);
  if (vector) {
    cast_divide_kernel<K, true><<<grid, kThreads, 0, stream>>>(src, inverse, dst, n, flag);
  } else {
    cast_divide_kernel<K, false><<<grid, kThreads, 0, stream>>>(src, inverse, dst, n, flag);
  }
  check(cudaGetLastError(), "cast_divide_cuda launch");
}

// --- multi-tensor decompression ---------------------------------------------------

constexpr int kMaxRanges = 48;
constexpr int kMaxBlocks = 320;
constexpr int64_t kChunk = 16 * 1024;  // elements per block

struct DecompressArgs {
  const uint16_t* src[kMaxRanges];
  float* dst[kMaxRanges];
  int64_t n[kMaxRanges];
  unsigned char block_range[kMaxBlocks];
  int block_chunk[kMaxBlocks];
};

template <HalfKind K>
__global__ void decompress_chunks(DecompressArgs args) {
  const int r = args.block_range[blockIdx.x];
  const int64_t begin = static_cast<int64_t>(args.block_chunk[blockIdx.x]) * kChunk;
  const int64_t len = min(kChunk, args.n[r] - begin);
  const uint16_t* src = args.src[r] + begin;
  float* dst = args.dst[r] + begin;
  int64_t scalar_begin = 0;
  // kChunk is a multiple of 4, so a range aligned at its start stays aligned per chunk.
  if (reinterpret_cast<uintptr_t>(src) % 8 == 0 && reinterpret_cast<uintptr_t>(dst) % 16 == 0) {
    const int64_t n4 = len / 4;
    for (int64_t q = threadIdx.x; q < n4; q += blockDim.x) {
      const ushort4 h = reinterpret_cast<const ushort4*>(src)[q];
      reinterpret_cast<float4*>(dst)[q] =
          make_float4(float_from_half_bits<K>(h.x), float_from_half_bits<K>(h.y),
                      float_from_half_bits<K>(h.z), float_from_half_bits<K>(h.w));
    }
    scalar_begin = 4 * n4;
  }
  for (int64_t i = scalar_begin + threadIdx.x; i < len; i += blockDim.x) {
    dst[i] = float_from_half_bits<K>(src[i]);
  }
}

template <HalfKind K>
void launch_decompress(const DecompressArgs& args, int blocks, cudaStream_t stream) {
  decompress_chunks<K><<<blocks, kThreads, 0, stream>>>(args);
  check(cudaGetLastError(), "decompress_multi_cuda launch");
}

template <HalfKind K>
void decompress_multi(const DecompressRange* ranges, int64_t count, cudaStream_t stream) {
  DecompressArgs args;
  int n_ranges = 0;
  int n_blocks = 0;
  for (int64_t i = 0; i < count; ++i) {
    if (ranges[i].n == 0) continue;
    args.src[n_ranges] = ranges[i].src;
    args.dst[n_ranges] = ranges[i].dst;
    args.n[n_ranges] = ranges[i].n;
    const int64_t chunks = (ranges[i].n + kChunk - 1) / kChunk;
    for (int64_t c = 0; c < chunks; ++c) {
      args.block_range[n_blocks] = static_cast<unsigned char>(n_ranges);
      args.block_chunk[n_blocks] = static_cast<int>(c);
      if (++n_blocks == kMaxBlocks) {
        launch_decompress<K>(args, n_blocks, stream);
        n_blocks = 0;
      }
    }
    // A full range table starts a new pack; ranges already launched need no slot.
    if (++n_ranges == kMaxRanges) {
      if (n_blocks > 0) launch_decompress<K>(args, n_blocks, stream);
      n_blocks = 0;
      n_ranges = 0;
    }
  }
  if (n_blocks > 0) launch_decompress<K>(args, n_blocks, stream);
}

// --- float32 sum of 16-bit shards -------------------------------------------------

template <HalfKind K>
__global__ void sum_shards_kernel(const uint16_t* __restrict__ shards, int64_t stride,
                                  int64_t count, uint16_t* __restrict__ out, int64_t n) {
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += step) {
    float acc = float_from_half_bits<K>(shards[i]);
    for (int64_t r = 1; r < count; ++r) acc = add_rn(acc, float_from_half_bits<K>(shards[r * stride + i]));
    out[i] = half_bits_from_float<K>(acc);
  }
}

}  // namespace

void compress_cuda(HalfKind kind, const float* src, float scale, float* residual, uint16_t* dst,
                   int64_t n, void* stream_ptr, int32_t* nonfinite) {
  if (n == 0) return;
  auto stream = static_cast<cudaStream_t>(stream_ptr);
  if (kind == HalfKind::kBFloat16) {
    residual
        ? launch_compress<HalfKind::kBFloat16, true>(src, scale, residual, dst, n, stream, nonfinite)
        : launch_compress<HalfKind::kBFloat16, false>(src, scale, residual, dst, n, stream,
                                                      nonfinite);
  } else {
    residual
        ? launch_compress<HalfKind::kFloat16, true>(src, scale, residual, dst, n, stream, nonfinite)
        : launch_compress<HalfKind::kFloat16, false>(src, scale, residual, dst, n, stream,
                                                     nonfinite);
  }
}

void cast_divide_cuda(HalfKind kind, const float* src, float divisor, uint16_t* dst, int64_t n,
                      void* stream_ptr, int32_t* nonfinite) {
  if (n == 0) return;
  auto stream = static_cast<cudaStream_t>(stream_ptr);
  kind == HalfKind::kBFloat16
      ? launch_cast_divide<HalfKind::kBFloat16>(src, divisor, dst, n, stream, nonfinite)
      : launch_cast_divide<HalfKind::kFloat16>(src, divisor, dst, n, stream, nonfinite);
}

void decompress_multi_cuda(HalfKind kind, const DecompressRange* ranges, int64_t count,
                           void* stream_ptr) {
  auto stream = static_cast<cudaStream_t>(stream_ptr);
  kind == HalfKind::kBFloat16 ? decompress_multi<HalfKind::kBFloat16>(ranges, count, stream)
                              : decompress_multi<HalfKind::kFloat16>(ranges, count, stream);
}

void sum_shards_cuda(HalfKind kind, const uint16_t* shards, int64_t stride, int64_t count,
                     uint16_t* out, int64_t n, void* stream_ptr) {
  if (n == 0 || count <= 0) return;
  auto stream = static_cast<cudaStream_t>(stream_ptr);
  const int grid = grid_for(n);
  if (kind == HalfKind::kBFloat16) {
    sum_shards_kernel<HalfKind::kBFloat16><<<grid, kThreads, 0, stream>>>(shards, stride, count, out, n);
  } else {
    sum_shards_kernel<HalfKind::kFloat16><<<grid, kThreads, 0, stream>>>(shards, stride, count, out, n);
  }
  check(cudaGetLastError(), "sum_shards_cuda launch");
}

}  // namespace fastddp::kernels
