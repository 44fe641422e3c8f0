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

__device__ __forceinline__ int nonfinite(float x) { return (x - x) != 0.0f; }

// One element of the compression: scale, add the residual (error feedback), round.
template <HalfKind K, bool kFeedback>
struct CompressOp {
  float scale;
  float* residual;  // read element by element: it needs no alignment
  __device__ __forceinline__ uint16_t operator()(float g, int64_t i) const {
    float v = mul_rn(g, scale);
    if constexpr (kFeedback) v = add_rn(v, residual[i]);
    const uint16_t h = half_bits_from_float<K>(v);
    if constexpr (kFeedback) residual[i] = v - float_from_half_bits<K>(h);
    return h;
  }
};

// torch's rounding: cast, then divide (Note [torch's half rounding]). ATen's CUDA
// division by a CPU scalar multiplies by the float reciprocal (BinaryDivTrueKernel.cu):
// one product, rounded once, then the 16-bit store.
template <HalfKind K>
struct CastTimesOp {
  float inverse;
  __device__ __forceinline__ uint16_t operator()(float g, int64_t) const {
    return half_bits_from_float<K>(mul_rn(float_from_half_bits<K>(half_bits_from_float<K>(g)),
                                          inverse));
  }
};

// dst[i] = op(src[i], i) over a grid-stride loop, 16-byte loads and 8-byte stores
// when kVector. nonfinite_flag (check_for_nan_in_grad): set to 1 by any thread that
// saw a NaN or an infinity; every writer stores the same value, so no atomics.
template <typename Op, bool kVector>
__global__ void to_half_kernel(const float* __restrict__ src, Op op, uint16_t* __restrict__ dst,
                               int64_t n, int32_t* nonfinite_flag) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  int64_t scalar_begin = 0;
  int bad = 0;
  if constexpr (kVector) {
    const int64_t n4 = n / 4;
    for (int64_t q = tid; q < n4; q += stride) {
      const float4 g = reinterpret_cast<const float4*>(src)[q];
      bad |= nonfinite(g.x) | nonfinite(g.y) | nonfinite(g.z) | nonfinite(g.w);
      const int64_t i = 4 * q;
      ushort4 h;
      h.x = op(g.x, i);
      h.y = op(g.y, i + 1);
      h.z = op(g.z, i + 2);
      h.w = op(g.w, i + 3);
      reinterpret_cast<ushort4*>(dst)[q] = h;
    }
    scalar_begin = 4 * n4;
  }
  for (int64_t i = scalar_begin + tid; i < n; i += stride) {
    bad |= nonfinite(src[i]);
    dst[i] = op(src[i], i);
  }
  if (bad && nonfinite_flag != nullptr) *nonfinite_flag = 1;
}

template <typename Op>
void launch_to_half(const Op& op, const float* src, uint16_t* dst, int64_t n,
                    cudaStream_t stream, int32_t* flag, const char* what) {
  const bool vector = aligned(src, 16) && aligned(dst, 8);
  const int grid = grid_for(vector ? n / 4 : n);
  if (vector) {
    to_half_kernel<Op, true><<<grid, kThreads, 0, stream>>>(src, op, dst, n, flag);
  } else {
    to_half_kernel<Op, false><<<grid, kThreads, 0, stream>>>(src, op, dst, n, flag);
  }
  check(cudaGetLastError(), what);
}

template <HalfKind K>
void launch_compress(const float* src, float scale, float* residual, uint16_t* dst, int64_t n,
                     cudaStream_t stream, int32_t* flag) {
  if (residual != nullptr) {
    launch_to_half(CompressOp<K, true>{scale, residual}, src, dst, n, stream, flag,
                   "compress_cuda launch");
  } else {
    launch_to_half(CompressOp<K, false>{scale, nullptr}, src, dst, n, stream, flag,
                   "compress_cuda launch");
  }
}

template <HalfKind K>
void launch_cast_divide(const float* src, float divisor, uint16_t* dst, int64_t n,
                        cudaStream_t stream, int32_t* flag) {
  // The reciprocal in float on the host, as ATen computes it (opmath_t(1.0) / b).
  launch_to_half(CastTimesOp<K>{1.0f / divisor}, src, dst, n, stream, flag,
                 "cast_divide_cuda launch");
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
  kind == HalfKind::kBFloat16
      ? launch_compress<HalfKind::kBFloat16>(src, scale, residual, dst, n, stream, nonfinite)
      : launch_compress<HalfKind::kFloat16>(src, scale, residual, dst, n, stream, nonfinite);
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
