// CUDA version of the fused copy and non-finite check (see nonfinite.h):
// bandwidth-bound, one grid-stride loop; a thread that saw a bad value stores
// 1 into the flag (every writer stores the same value: no atomics).
#include <cuda_runtime.h>

#include <algorithm>
#include <stdexcept>
#include <string>

#include "../nonfinite.h"

namespace fastddp::kernels {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxGridBlocks = 132 * 8;

int grid_for(int64_t work) {
  const int64_t blocks = (work + kThreads - 1) / kThreads;
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(blocks, kMaxGridBlocks)));
}

// No __restrict__: in place (gradient_as_bucket_view) src and dst alias.
template <typename T>
__global__ void scale_copy_check_kernel(const T* src, T* dst, T scale, int64_t n,
                                        int32_t* flag) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  int bad = 0;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    const T x = src[i];
    bad |= (x - x) != T(0);
    dst[i] = x * scale;
  }
  if (bad && flag != nullptr) *flag = 1;
}

template <typename T>
void launch(const T* src, T* dst, T scale, int64_t n, int32_t* flag, void* stream) {
  if (n == 0) return;
  scale_copy_check_kernel<T>
      <<<grid_for(n), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(src, dst, scale, n, flag);
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) {
    throw std::runtime_error(std::string("fastddp scale_copy_check_cuda launch: ") +
                             cudaGetErrorString(err));
  }
}

}  // namespace

void scale_copy_check_cuda(const float* src, float* dst, float scale, int64_t n, int32_t* flag,
                           void* stream) {
  launch(src, dst, scale, n, flag, stream);
}

void scale_copy_check_cuda(const double* src, double* dst, double scale, int64_t n,
                           int32_t* flag, void* stream) {
  launch(src, dst, scale, n, flag, stream);
}

}  // namespace fastddp::kernels
