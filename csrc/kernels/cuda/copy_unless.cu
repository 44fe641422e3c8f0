// CUDA version of the put-back of a double-buffered state (see copy_unless.h):
// one grid-stride loop over 4-byte words where both ends are aligned, bytes
// otherwise; a put-back step is rare, so the loop is plain.
#include <cuda_runtime.h>

#include <algorithm>
#include <stdexcept>
#include <string>

#include "../copy_unless.h"

namespace fastddp::kernels {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxGridBlocks = 132 * 4;

template <typename T>
__global__ void copy_unless_kernel(const T* src, T* dst, int64_t n, const bool* keep) {
  if (*keep) return;  // the step stands: nothing to put back
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    dst[i] = src != nullptr ? src[i] : T(0);
  }
}

template <typename T>
void launch(const void* src, void* dst, int64_t n, const bool* keep, cudaStream_t stream) {
  const int64_t blocks = std::max<int64_t>(1, std::min<int64_t>((n + kThreads - 1) / kThreads,
                                                                 kMaxGridBlocks));
  copy_unless_kernel<T><<<static_cast<int>(blocks), kThreads, 0, stream>>>(
      static_cast<const T*>(src), static_cast<T*>(dst), n, keep);
}

}  // namespace

void copy_unless_cuda(const void* src, void* dst, int64_t bytes, const bool* keep, void* stream) {
  if (bytes == 0) return;
  const auto s = static_cast<cudaStream_t>(stream);
  const bool words = bytes % 4 == 0 && reinterpret_cast<uintptr_t>(dst) % 4 == 0 &&
                     reinterpret_cast<uintptr_t>(src) % 4 == 0;
  if (words) {
    launch<uint32_t>(src, dst, bytes / 4, keep, s);
  } else {
    launch<uint8_t>(src, dst, bytes, keep, s);
  }
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) {
    throw std::runtime_error(std::string("fastddp copy_unless_cuda launch: ") +
                             cudaGetErrorString(err));
  }
}

}  // namespace fastddp::kernels
