// CUDA versions of the half casts (see half_cast.h), bandwidth-bound:
// 16-byte float loads and 8-byte half stores where both sides are aligned,
// a scalar path otherwise (bucket offsets are arbitrary), and one launch for
// a whole bucket's decompression (multi-tensor apply, after apex).
// Built without --use_fast_math (setup.py): see Note [half rounding].
#include <cuda_runtime.h>

#include <algorithm>

#include "../half_cast.h"
#include "launch.cuh"

namespace fastddp::kernels {
namespace {

using cuda_launch::aligned;
using cuda_launch::capped;
using cuda_launch::check;
using cuda_launch::full_grid;

constexpr int kThreads = 256;
constexpr int kMaxGridBlocks = 132 * 8;  // enough to fill an H100/H200 several times over

int grid_for(int64_t work) { return capped((work + kThreads - 1) / kThreads, kMaxGridBlocks); }

__device__ __forceinline__ int nonfinite(float x) { return (x - x) != 0.0f; }

// One element of the compression: scale, add the residual (error feedback), round.
template <HalfKind K, bool kFeedback>
struct CompressOp {
  float scale;
  const float* residual;  // read element by element: it needs no alignment
  float* new_residual;    // another buffer (Note [double-buffered step state])
  __device__ __forceinline__ uint16_t operator()(float g, int64_t i) const {
    float v = mul_rn(g, scale);
    if constexpr (kFeedback) v = add_rn(v, residual[i]);
    const uint16_t h = half_bits_from_float<K>(v);
    if constexpr (kFeedback) new_residual[i] = v - float_from_half_bits<K>(h);
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
void launch_compress(const float* src, float scale, const float* residual, float* new_residual,
                     uint16_t* dst, int64_t n, cudaStream_t stream, int32_t* flag) {
  if (residual != nullptr) {
    launch_to_half(CompressOp<K, true>{scale, residual, new_residual}, src, dst, n, stream, flag,
                   "compress_cuda launch");
  } else {
    launch_to_half(CompressOp<K, false>{scale, nullptr, nullptr}, src, dst, n, stream, flag,
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
// Up to kMaxRanges ranges per launch, cut into chunks of kChunk elements; a grid that
// fills the device once strides over the chunks of all of them (full_grid), so that one
// launch moves a whole bucket at the copy's speed.

constexpr int kMaxRanges = 48;
constexpr int64_t kChunk = 16 * 1024;  // elements per chunk: a multiple of 4

struct DecompressArgs {
  const uint16_t* src[kMaxRanges];
  float* dst[kMaxRanges];
  int64_t n[kMaxRanges];
  int64_t first_chunk[kMaxRanges + 1];  // chunks before each range; [count]: all of them
  int count;
};

template <HalfKind K>
__global__ void decompress_chunks(DecompressArgs args) {
  const int64_t total = args.first_chunk[args.count];
  int r = 0;
  for (int64_t c = blockIdx.x; c < total; c += gridDim.x) {
    while (args.first_chunk[r + 1] <= c) ++r;  // c only grows: the scan never restarts
    const int64_t begin = (c - args.first_chunk[r]) * kChunk;
    const int64_t len = min(kChunk, args.n[r] - begin);
    const uint16_t* src = args.src[r] + begin;
    float* dst = args.dst[r] + begin;
    int64_t scalar_begin = 0;
    // kChunk is a multiple of 4, so a range aligned at its start stays aligned per chunk.
    if (reinterpret_cast<uintptr_t>(src) % 8 == 0 &&
        reinterpret_cast<uintptr_t>(dst) % 16 == 0) {
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
}

template <HalfKind K>
void launch_decompress(const DecompressArgs& args, cudaStream_t stream) {
  const int grid = capped(args.first_chunk[args.count], full_grid<decompress_chunks<K>>(kThreads));
  decompress_chunks<K><<<grid, kThreads, 0, stream>>>(args);
  check(cudaGetLastError(), "decompress_multi_cuda launch");
}

template <HalfKind K>
void decompress_multi(const DecompressRange* ranges, int64_t count, cudaStream_t stream) {
  DecompressArgs args;
  args.count = 0;
  args.first_chunk[0] = 0;
  for (int64_t i = 0; i < count; ++i) {
    if (ranges[i].n == 0) continue;
    const int k = args.count;
    args.src[k] = ranges[i].src;
    args.dst[k] = ranges[i].dst;
    args.n[k] = ranges[i].n;
    args.first_chunk[k + 1] = args.first_chunk[k] + (ranges[i].n + kChunk - 1) / kChunk;
    if (++args.count == kMaxRanges) {
      launch_decompress<K>(args, stream);
      args.count = 0;
    }
  }
  if (args.count > 0) launch_decompress<K>(args, stream);
}

// --- float32 sum of 16-bit shards -------------------------------------------------
// Each output element is the float32 sum of the shards' elements in shard order, rounded
// once. Four elements per thread (8-byte loads from every shard, one 8-byte store) where
// the shards and the output allow it, then the rest one by one.

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

template <HalfKind K>
__global__ void sum_shards4_kernel(const uint16_t* __restrict__ shards, int64_t stride,
                                   int64_t count, uint16_t* __restrict__ out, int64_t n4) {
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t q = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; q < n4;
       q += step) {
    const ushort4 h = reinterpret_cast<const ushort4*>(shards)[q];
    float a = float_from_half_bits<K>(h.x), b = float_from_half_bits<K>(h.y);
    float c = float_from_half_bits<K>(h.z), d = float_from_half_bits<K>(h.w);
    for (int64_t r = 1; r < count; ++r) {
      const ushort4 g = reinterpret_cast<const ushort4*>(shards + r * stride)[q];
      a = add_rn(a, float_from_half_bits<K>(g.x));
      b = add_rn(b, float_from_half_bits<K>(g.y));
      c = add_rn(c, float_from_half_bits<K>(g.z));
      d = add_rn(d, float_from_half_bits<K>(g.w));
    }
    ushort4 o;
    o.x = half_bits_from_float<K>(a);
    o.y = half_bits_from_float<K>(b);
    o.z = half_bits_from_float<K>(c);
    o.w = half_bits_from_float<K>(d);
    reinterpret_cast<ushort4*>(out)[q] = o;
  }
}

template <HalfKind K>
void launch_sum_shards(const uint16_t* shards, int64_t stride, int64_t count, uint16_t* out,
                       int64_t n, cudaStream_t stream) {
  int64_t done = 0;
  if (aligned(shards, 8) && aligned(out, 8) && stride % 4 == 0) {
    const int64_t n4 = n / 4;
    if (n4 > 0) {
      const int grid = capped((n4 + kThreads - 1) / kThreads,
                              full_grid<sum_shards4_kernel<K>>(kThreads));
      sum_shards4_kernel<K><<<grid, kThreads, 0, stream>>>(shards, stride, count, out, n4);
    }
    done = 4 * n4;
  }
  if (done < n) {
    sum_shards_kernel<K><<<grid_for(n - done), kThreads, 0, stream>>>(
        shards + done, stride, count, out + done, n - done);
  }
  check(cudaGetLastError(), "sum_shards_cuda launch");
}

}  // namespace

void compress_cuda(HalfKind kind, const float* src, float scale, const float* residual,
                   float* new_residual, uint16_t* dst, int64_t n, void* stream_ptr,
                   int32_t* nonfinite) {
  if (n == 0) return;
  auto stream = static_cast<cudaStream_t>(stream_ptr);
  const float* r = residual;
  float* nr = new_residual;
  kind == HalfKind::kBFloat16
      ? launch_compress<HalfKind::kBFloat16>(src, scale, r, nr, dst, n, stream, nonfinite)
      : launch_compress<HalfKind::kFloat16>(src, scale, r, nr, dst, n, stream, nonfinite);
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
  kind == HalfKind::kBFloat16
      ? launch_sum_shards<HalfKind::kBFloat16>(shards, stride, count, out, n, stream)
      : launch_sum_shards<HalfKind::kFloat16>(shards, stride, count, out, n, stream);
}

}  // namespace fastddp::kernels
