// CUDA version of the tall-matrix orthogonalization (Note [tall
// orthogonalization]): CholeskyQR2 over blocks of rows, so that one tall
// matrix fills the GPU instead of one SM (the Gram-Schmidt kernel's one block
// per matrix). Per pass, three launches, none waiting for the host:
//   gram    (chunk, matrix) blocks: the chunk's partial Gram matrix, in double;
//   factor  one block per matrix: the partials summed in chunk order (no
//           atomics: the same bits every run), then cholesky_small.h on one
//           thread; a nearly dependent or non-finite matrix sets its flag;
//   apply   (row block, matrix) blocks: each thread one row times R^{-1}.
// Then the Gram-Schmidt kernel runs for the flagged matrices only (its other
// blocks return at once).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "../cholesky_small.h"
#include "../orthogonalize_tall.h"
#include "launch.cuh"

namespace fastddp::kernels {
namespace {

using cuda_launch::check;

constexpr int kThreads = 256;
constexpr int kMaxR = static_cast<int>(kOrthogonalizeCudaMaxRank);
constexpr int64_t kMaxGridY = 65535;
// Rows per chunk: at least a block's worth of rows, and at most this many
// chunks per matrix, so that the factor step's sums stay short.
constexpr int64_t kMinChunkRows = kThreads;
constexpr int64_t kMaxChunks = 256;

int64_t chunk_rows(int64_t n) {
  const int64_t rows = (n + kMaxChunks - 1) / kMaxChunks;
  return std::max(kMinChunkRows, (rows + kMinChunkRows - 1) / kMinChunkRows * kMinChunkRows);
}

int64_t chunk_count(int64_t n) {
  const int64_t rows = chunk_rows(n);
  return (n + rows - 1) / rows;
}

struct Workspace {
  double* partials;  // (batch, chunks, r, r), upper triangles
  double* inv;       // (batch, r, r), upper triangles of R^{-1}
  int32_t* gram_schmidt;  // (batch): 1 where the matrix goes to Gram-Schmidt
};

int64_t doubles_of(int64_t batch, int64_t n, int64_t r) {
  return batch * (chunk_count(n) + 1) * r * r;
}

Workspace carve(void* workspace, int64_t batch, int64_t n, int64_t r) {
  auto* partials = static_cast<double*>(workspace);
  double* inv = partials + batch * chunk_count(n) * r * r;
  return {partials, inv, reinterpret_cast<int32_t*>(partials + doubles_of(batch, n, r))};
}

// Pair number p of the upper triangle, row by row: (0,0), (0,1), ..., (1,1), ...
__device__ __forceinline__ void pair_of(int p, int r, int& i, int& j) {
  i = 0;
  while (p >= r - i) {
    p -= r - i;
    ++i;
  }
  j = i + p;
}

// When the r(r+1)/2 pairs fit in a block, the block's threads split into
// groups that each take every groups-th row for every pair, and the groups'
// sums are added in group order; otherwise each thread takes whole pairs.
template <typename T>
__global__ void gram_kernel(const T* matrices, int64_t n, int r, int64_t rows, int64_t chunks,
                            double* partials, const int32_t* gram_schmidt) {
  const int64_t b = blockIdx.y, chunk = blockIdx.x;
  if (gram_schmidt[b]) return;
  const T* a = matrices + b * n * r;
  const int64_t begin = chunk * rows, end = min(n, begin + rows);
  double* out = partials + (b * chunks + chunk) * r * r;
  const int pairs = r * (r + 1) / 2, t = threadIdx.x;
  if (pairs <= kThreads) {
    __shared__ double sums[kThreads];
    const int groups = kThreads / pairs;
    double acc = 0;
    if (t < groups * pairs) {
      int i, j;
      pair_of(t % pairs, r, i, j);
      for (int64_t k = begin + t / pairs; k < end; k += groups) {
        acc += static_cast<double>(a[k * r + i]) * static_cast<double>(a[k * r + j]);
      }
    }
    sums[t] = acc;
    __syncthreads();
    if (t < pairs) {
      double total = 0;
      for (int g = 0; g < groups; ++g) total += sums[g * pairs + t];
      int i, j;
      pair_of(t, r, i, j);
      out[i * r + j] = total;
    }
    return;
  }
  for (int p = t; p < pairs; p += kThreads) {
    int i, j;
    pair_of(p, r, i, j);
    double acc = 0;
    for (int64_t k = begin; k < end; ++k) {
      acc += static_cast<double>(a[k * r + i]) * static_cast<double>(a[k * r + j]);
    }
    out[i * r + j] = acc;
  }
}

__global__ void factor_kernel(const double* partials, int64_t chunks, int r, double* inv,
                              int32_t* gram_schmidt) {
  const int64_t b = blockIdx.x;
  if (gram_schmidt[b]) return;  // block-uniform
  __shared__ double g[kMaxR * kMaxR], factor[kMaxR * kMaxR], x[kMaxR * kMaxR];
  __shared__ bool ok;
  const int pairs = r * (r + 1) / 2;
  const double* mine = partials + b * chunks * r * r;
  for (int p = threadIdx.x; p < pairs; p += kThreads) {
    int i, j;
    pair_of(p, r, i, j);
    double s = 0;
    for (int64_t c = 0; c < chunks; ++c) s += mine[c * r * r + i * r + j];
    g[i * r + j] = s;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    ok = cholesky_inverse(g, r, factor, x);
    if (!ok) gram_schmidt[b] = 1;
  }
  __syncthreads();
  if (!ok) return;
  for (int e = threadIdx.x; e < r * r; e += kThreads) inv[b * r * r + e] = x[e];
}

template <typename T>
__global__ void apply_kernel(T* matrices, int64_t n, int r, const double* inv,
                             const int32_t* gram_schmidt) {
  const int64_t b = blockIdx.y;
  if (gram_schmidt[b]) return;
  __shared__ double x[kMaxR * kMaxR];
  for (int e = threadIdx.x; e < r * r; e += kThreads) x[e] = inv[b * r * r + e];
  __syncthreads();
  const int64_t k = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (k >= n) return;
  T* row = matrices + (b * n + k) * r;
  double v[kMaxR];
  for (int i = 0; i < r; ++i) v[i] = static_cast<double>(row[i]);
  multiply_row_by_inverse(v, r, x);
  for (int i = 0; i < r; ++i) row[i] = static_cast<T>(v[i]);
}

template <typename T>
void launch(T* matrices, int64_t batch, int64_t n, int64_t r, void* workspace, void* stream_ptr) {
  if (batch <= 0) return;
  if (!orthogonalize_tall(n, r) || r > kOrthogonalizeCudaMaxRank) {
    throw std::invalid_argument("fastddp orthogonalize_tall_cuda: (n, r) = (" +
                                std::to_string(n) + ", " + std::to_string(r) +
                                ") is not a tall shape it takes");
  }
  auto stream = static_cast<cudaStream_t>(stream_ptr);
  const Workspace ws = carve(workspace, batch, n, r);
  const int64_t rows = chunk_rows(n), chunks = chunk_count(n);
  const auto row_blocks = static_cast<unsigned>((n + kThreads - 1) / kThreads);
  const int ri = static_cast<int>(r);
  check(cudaMemsetAsync(ws.gram_schmidt, 0, batch * sizeof(int32_t), stream), "memset");
  for (int pass = 0; pass < 2; ++pass) {
    for (int64_t b0 = 0; b0 < batch; b0 += kMaxGridY) {
      const auto bs = static_cast<unsigned>(std::min(kMaxGridY, batch - b0));
      T* m = matrices + b0 * n * r;
      double* partials = ws.partials + b0 * chunks * r * r;
      double* inv = ws.inv + b0 * r * r;
      int32_t* flags = ws.gram_schmidt + b0;
      gram_kernel<T><<<dim3(static_cast<unsigned>(chunks), bs), kThreads, 0, stream>>>(
          m, n, ri, rows, chunks, partials, flags);
      factor_kernel<<<bs, kThreads, 0, stream>>>(partials, chunks, ri, inv, flags);
      apply_kernel<T><<<dim3(row_blocks, bs), kThreads, 0, stream>>>(m, n, ri, inv, flags);
      check(cudaGetLastError(), "orthogonalize_tall_cuda launch");
    }
  }
  orthogonalize_cuda_where(matrices, batch, n, r, ws.gram_schmidt, stream_ptr);
}

}  // namespace

int64_t tall_workspace_bytes_cuda(int64_t batch, int64_t n, int64_t r) {
  return doubles_of(batch, n, r) * static_cast<int64_t>(sizeof(double)) +
         batch * static_cast<int64_t>(sizeof(int32_t));
}

void orthogonalize_tall_cuda(float* matrices, int64_t batch, int64_t n, int64_t r,
                             void* workspace, void* stream) {
  launch(matrices, batch, n, r, workspace, stream);
}

void orthogonalize_tall_cuda(double* matrices, int64_t batch, int64_t n, int64_t r,
                             void* workspace, void* stream) {
  launch(matrices, batch, n, r, workspace, stream);
}

}  // namespace fastddp::kernels
