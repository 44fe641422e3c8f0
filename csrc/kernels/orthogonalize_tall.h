// The tall-matrix path of the fused orthogonalization, for PowerSGD's P
// matrices of many rows (an embedding's, a wide layer's): the Gram-Schmidt
// kernel's one thread block per matrix leaves a GPU's other SMs idle on one
// tall matrix (issue 32).
//
// Note [tall orthogonalization]
// For r > 2 (the QR-like ranks, see Note [fused orthogonalization]) and
// n >= kTallRows, each matrix A is orthonormalized by CholeskyQR2 (Fukaya et
// al. 2014): twice, G = A^T A, R = chol(G), A <- A R^{-1}. The row-parallel
// parts (G and the product) split the rows into chunks: the partial Gram
// matrices of the chunks are computed independently and summed in chunk order,
// so results do not depend on how many threads or blocks ran them. Sums and
// products are in double (float products are exact there), the Cholesky step is
// cholesky_small.h's, the same on CPU and GPU. R has a positive diagonal, so
// the result is QR's Q up to column signs, as the Gram-Schmidt path's is. In
// double one pass already leaves A orthogonal to about cond(A)^2 * 1e-16 and
// the second makes it exact to rounding. Where a pivot says a column is nearly
// dependent on the earlier ones (kCholeskyPivotFloor), or the input is not
// finite, that matrix goes to the Gram-Schmidt path instead, which completes
// rank-deficient input and propagates NaN as before.
// The tall path is the GPU's: fused_orthogonalize takes it on CUDA only. Its
// CPU version below runs the same arithmetic (cholesky_small.h, per-chunk
// partial sums in chunk order) for the tests that hold it against torch's QR;
// on CPU the vectorized Gram-Schmidt is faster per core.
#pragma once

#include <cstdint>
#include <vector>

#include "orthogonalize.h"

namespace fastddp::kernels {

// Rows from which an r > 2 matrix takes the tall path (a shape-only rule, so
// CPU and GPU results never depend on the machine's thread or SM count).
constexpr int64_t kTallRows = 8192;
constexpr bool orthogonalize_tall(int64_t n, int64_t r) {
  return orthogonalize_like_qr(r) && n >= kTallRows;
}

// CPU row chunks: fixed, so that the partial sums are the same on any machine.
constexpr int64_t kTallChunkRowsCpu = 2048;
constexpr int64_t tall_chunks_cpu(int64_t n) {
  return (n + kTallChunkRowsCpu - 1) / kTallChunkRowsCpu;
}

// CPU pieces, one (matrix, chunk) each, so that the caller can thread them.
// gram: the upper triangle of the chunk's partial Gram matrix into `partial`
// (r * r doubles, lower triangle left as zero).
void tall_gram_cpu(const float* a, int64_t n, int64_t r, int64_t chunk, double* partial);
void tall_gram_cpu(const double* a, int64_t n, int64_t r, int64_t chunk, double* partial);
// factor: sums `chunks` partials in order and writes R^{-1} into `inv` (r * r
// doubles); false when the matrix must go to Gram-Schmidt (cholesky_inverse).
bool tall_factor_cpu(const double* partials, int64_t chunks, int64_t r, double* inv);
// apply: the chunk's rows times R^{-1}, rounded back to T.
void tall_apply_cpu(float* a, int64_t n, int64_t r, int64_t chunk, const double* inv);
void tall_apply_cpu(double* a, int64_t n, int64_t r, int64_t chunk, const double* inv);

// The whole CPU path for `batch` matrices of shape (n, r) with
// orthogonalize_tall(n, r). parallel_for(count, body) must call body(begin,
// end) over disjoint ranges covering [0, count), in any order or thread.
template <typename T, typename ParallelFor>
void orthogonalize_tall_cpu(T* matrices, int64_t batch, int64_t n, int64_t r,
                            ParallelFor&& parallel_for) {
  if (batch <= 0) return;
  const int64_t chunks = tall_chunks_cpu(n), rr = r * r;
  std::vector<double> partials(static_cast<size_t>(batch * chunks * rr));
  std::vector<double> inv(static_cast<size_t>(batch * rr));
  std::vector<char> gram_schmidt(static_cast<size_t>(batch), 0);
  // work(b, k) for k in [0, per_matrix) of each matrix b that Gram-Schmidt
  // takes (`refused`) or does not, threaded over all (b, k).
  auto each = [&](int64_t per_matrix, bool refused, const auto& work) {
    parallel_for(batch * per_matrix, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const int64_t b = t / per_matrix;
        if ((gram_schmidt[b] != 0) == refused) work(b, t % per_matrix);
      }
    });
  };
  for (int pass = 0; pass < 2; ++pass) {
    each(chunks, false, [&](int64_t b, int64_t chunk) {
      tall_gram_cpu(matrices + b * n * r, n, r, chunk, partials.data() + (b * chunks + chunk) * rr);
    });
    each(1, false, [&](int64_t b, int64_t) {
      gram_schmidt[b] =
          !tall_factor_cpu(partials.data() + b * chunks * rr, chunks, r, inv.data() + b * rr);
    });
    each(chunks, false, [&](int64_t b, int64_t chunk) {
      tall_apply_cpu(matrices + b * n * r, n, r, chunk, inv.data() + b * rr);
    });
  }
  // After a first pass the matrix holds its first-pass Q, whose columns span
  // the same nested subspaces as the input's: Gram-Schmidt of it is the same.
  each(1, true, [&](int64_t b, int64_t) {
    orthogonalize_cpu(matrices + b * n * r, 1, n, r, 0.0);
  });
}

// --- CUDA (built only with CUDA; `stream` is a cudaStream_t) ----------------------

// Bytes of device workspace orthogonalize_tall_cuda needs (partial Gram
// matrices, R^{-1} and a flag per matrix), 16-byte aligned by the caller.
int64_t tall_workspace_bytes_cuda(int64_t batch, int64_t n, int64_t r);

// The whole path on the GPU, asynchronous on `stream`: two passes of three
// kernels (Gram partials over (chunk, matrix) blocks, one Cholesky per matrix,
// the product over (row block, matrix) blocks), then the Gram-Schmidt kernel
// launched for every matrix, where the blocks of the matrices the Cholesky took
// return at once (no host sync decides it). r <= kOrthogonalizeCudaMaxRank.
void orthogonalize_tall_cuda(float* matrices, int64_t batch, int64_t n, int64_t r,
                             void* workspace, void* stream);
void orthogonalize_tall_cuda(double* matrices, int64_t batch, int64_t n, int64_t r,
                             void* workspace, void* stream);

// The Gram-Schmidt kernel (orthogonalize.cu) on the matrices b with only[b]
// != 0 (`only`: `batch` int32 flags on the device); r > 2.
void orthogonalize_cuda_where(float* matrices, int64_t batch, int64_t n, int64_t r,
                              const int32_t* only, void* stream);
void orthogonalize_cuda_where(double* matrices, int64_t batch, int64_t n, int64_t r,
                              const int32_t* only, void* stream);

}  // namespace fastddp::kernels
