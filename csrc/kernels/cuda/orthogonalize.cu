// CUDA version of the fused orthogonalization (see Note [fused orthogonalization]).
//
// One thread block per matrix; the matrix stays where it is (row-major in
// global memory, small enough to live in L1/L2 across the passes). Per column
// i: the block reduces its norm and normalizes it, then each warp takes some of
// the later columns j, reduces dot(col_i, col_j) with shuffles and updates
// col_j: no block-wide reduction for the r - i - 1 dot products. Sums are in
// double for float too. The element-wise steps round as torch's separate ops
// (explicit _rn intrinsics: no FMA contraction), so results match the CPU
// kernel to the last bits of the double sums.
#include <cuda_runtime.h>

#include <cfloat>
#include <cstdint>

#include "../orthogonalize.h"
#include "../orthogonalize_tall.h"
#include "launch.cuh"

namespace fastddp::kernels {
namespace {

using cuda_launch::check;

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int64_t kMaxGrid = int64_t{1} << 30;

__device__ __forceinline__ float sub_scaled(float a, float c, float b) {
  return __fsub_rn(a, __fmul_rn(c, b));
}
__device__ __forceinline__ double sub_scaled(double a, double c, double b) {
  return __dsub_rn(a, __dmul_rn(c, b));
}

// xor butterfly: every lane ends with the same bits (addition commutes).
__device__ __forceinline__ double warp_sum(double v) {
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// Every thread gets the same total (same order over the warps' partials), so
// branches on it are block-uniform.
__device__ double block_sum(double v, double* shared) {
  v = warp_sum(v);
  if (threadIdx.x % 32 == 0) shared[threadIdx.x / 32] = v;
  __syncthreads();
  double total = 0;
  for (int w = 0; w < kWarps; ++w) total += shared[w];
  __syncthreads();  // shared is reused by the next call
  return total;
}

// The row of the smallest value (the first such row on ties), block-wide.
__device__ int64_t block_argmin(double v, int64_t row, double* shared_v, int64_t* shared_row) {
  for (int offset = 16; offset > 0; offset >>= 1) {
    const double other_v = __shfl_xor_sync(0xffffffffu, v, offset);
    const int64_t other_row = __shfl_xor_sync(0xffffffffu, row, offset);
    if (other_v < v || (other_v == v && other_row < row)) {
      v = other_v;
      row = other_row;
    }
  }
  if (threadIdx.x % 32 == 0) {
    shared_v[threadIdx.x / 32] = v;
    shared_row[threadIdx.x / 32] = row;
  }
  __syncthreads();
  for (int w = 0; w < kWarps; ++w) {
    if (shared_v[w] < v || (shared_v[w] == v && shared_row[w] < row)) {
      v = shared_v[w];
      row = shared_row[w];
    }
  }
  __syncthreads();
  return row;
}

struct Shared {
  double v[kWarps];
  int64_t row[kWarps];
};

// Column i is zero after projection (rank-deficient input, r > 2 only): put
// in the basis vector least covered by columns 0..i-1, projected out twice,
// then normalized, as the CPU kernel does (see complete_column there for why
// it is well conditioned). Each thread touches only its own rows of column i.
template <typename T>
__device__ void complete_column(T* a, int64_t n, int r, int i, Shared& sh) {
  double best = DBL_MAX;
  int64_t best_row = n;
  for (int64_t k = threadIdx.x; k < n; k += blockDim.x) {
    double covered = 0;
    for (int l = 0; l < i; ++l) covered += static_cast<double>(a[k * r + l]) * a[k * r + l];
    if (covered < best) {
      best = covered;
      best_row = k;
    }
  }
  const int64_t row = block_argmin(best, best_row, sh.v, sh.row);
  for (int64_t k = threadIdx.x; k < n; k += blockDim.x) a[k * r + i] = k == row ? T(1) : T(0);
  for (int pass = 0; pass < 2; ++pass) {
    for (int l = 0; l < i; ++l) {
      double partial = 0;
      for (int64_t k = threadIdx.x; k < n; k += blockDim.x) {
        partial += static_cast<double>(a[k * r + l]) * a[k * r + i];
      }
      const T c = static_cast<T>(block_sum(partial, sh.v));
      for (int64_t k = threadIdx.x; k < n; k += blockDim.x) {
        a[k * r + i] = sub_scaled(a[k * r + i], c, a[k * r + l]);
      }
    }
  }
  double partial = 0;
  for (int64_t k = threadIdx.x; k < n; k += blockDim.x) {
    partial += static_cast<double>(a[k * r + i]) * a[k * r + i];
  }
  const T norm = static_cast<T>(sqrt(block_sum(partial, sh.v)));
  for (int64_t k = threadIdx.x; k < n; k += blockDim.x) a[k * r + i] = a[k * r + i] / norm;
}

// One modified Gram-Schmidt pass over the columns of one (n, r) matrix.
template <typename T>
__device__ void gram_schmidt_pass(T* a, int64_t n, int r, double epsilon, bool like_qr,
                                  Shared& sh) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int i = 0; i < r; ++i) {
    double partial = 0;
    for (int64_t k = threadIdx.x; k < n; k += blockDim.x) {
      partial += static_cast<double>(a[k * r + i]) * a[k * r + i];
    }
    const T norm = static_cast<T>(sqrt(block_sum(partial, sh.v)));
    if (like_qr && norm == T(0)) {
      complete_column(a, n, r, i, sh);
    } else {
      const T d = epsilon == 0 ? norm : norm + static_cast<T>(epsilon);
      for (int64_t k = threadIdx.x; k < n; k += blockDim.x) a[k * r + i] = a[k * r + i] / d;
    }
    __syncthreads();  // column i is final before the warps read all its rows
    for (int j = i + 1 + warp; j < r; j += kWarps) {
      double dot = 0;
      for (int64_t k = lane; k < n; k += 32) dot += static_cast<double>(a[k * r + i]) * a[k * r + j];
      const T c = static_cast<T>(warp_sum(dot));
      for (int64_t k = lane; k < n; k += 32) a[k * r + j] = sub_scaled(a[k * r + j], c, a[k * r + i]);
    }
    __syncthreads();  // the later columns are updated before column i + 1's norm
  }
}

// `only`, when given, holds a flag per matrix of the launch: the blocks of the
// matrices whose flag is 0 return at once (the tall path's Gram-Schmidt step).
// `src`, when given, is read in place of `matrices` (out of place): each block
// loads its matrix first, a pass it makes anyway, so a hook reading its state
// writes its spare without a copy of its own (orthogonalize.h).
template <typename T>
__global__ void orthogonalize_kernel(T* matrices, int64_t n, int r, double epsilon,
                                     bool like_qr, const int32_t* only, const T* src) {
  if (only != nullptr && only[blockIdx.x] == 0) return;  // block-uniform
  __shared__ Shared sh;
  T* a = matrices + static_cast<int64_t>(blockIdx.x) * n * r;
  if (src != nullptr) {
    const T* from = src + static_cast<int64_t>(blockIdx.x) * n * r;
    for (int64_t k = threadIdx.x; k < n * r; k += blockDim.x) a[k] = from[k];
    __syncthreads();  // every row is loaded before the first column's norm
  }
  if (like_qr) {
    gram_schmidt_pass(a, n, r, 0.0, true, sh);
    gram_schmidt_pass(a, n, r, 0.0, true, sh);
  } else {
    gram_schmidt_pass(a, n, r, epsilon, false, sh);
  }
}

template <typename T>
void launch(T* matrices, int64_t batch, int64_t n, int64_t r, double epsilon, void* stream_ptr,
            const int32_t* only = nullptr, const T* src = nullptr) {
  if (batch <= 0 || n <= 0 || r <= 0) return;
  if (r > kOrthogonalizeCudaMaxRank) {
    throw std::invalid_argument("fastddp orthogonalize_cuda: rank " + std::to_string(r) +
                                " is above " + std::to_string(kOrthogonalizeCudaMaxRank));
  }
  if (src == matrices) src = nullptr;  // in place
  auto stream = static_cast<cudaStream_t>(stream_ptr);
  for (int64_t begin = 0; begin < batch; begin += kMaxGrid) {
    const int64_t blocks = batch - begin < kMaxGrid ? batch - begin : kMaxGrid;
    orthogonalize_kernel<T><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
        matrices + begin * n * r, n, static_cast<int>(r), epsilon, orthogonalize_like_qr(r),
        only == nullptr ? nullptr : only + begin, src == nullptr ? nullptr : src + begin * n * r);
    check(cudaGetLastError(), "orthogonalize_cuda launch");
  }
}

}  // namespace

void orthogonalize_cuda(float* matrices, int64_t batch, int64_t n, int64_t r, double epsilon,
                        void* stream, const float* src) {
  launch(matrices, batch, n, r, epsilon, stream, nullptr, src);
}

void orthogonalize_cuda(double* matrices, int64_t batch, int64_t n, int64_t r, double epsilon,
                        void* stream, const double* src) {
  launch(matrices, batch, n, r, epsilon, stream, nullptr, src);
}

void orthogonalize_cuda_where(float* matrices, int64_t batch, int64_t n, int64_t r,
                              const int32_t* only, void* stream) {
  launch(matrices, batch, n, r, 0.0, stream, only);
}

void orthogonalize_cuda_where(double* matrices, int64_t batch, int64_t n, int64_t r,
                              const int32_t* only, void* stream) {
  launch(matrices, batch, n, r, 0.0, stream, only);
}

}  // namespace fastddp::kernels
