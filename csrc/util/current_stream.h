// The raw cudaStream_t (as void*: csrc/kernels is torch-free) of the current stream on a
// tensor's device, for the tensor ops that launch fastddp's CUDA kernels.
#pragma once

#if defined(FASTDDP_WITH_CUDA)
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAStream.h>

namespace fastddp {

inline void* current_cuda_stream(const at::Tensor& t) {
  return c10::cuda::getCurrentCUDAStream(t.device().index()).stream();
}

}  // namespace fastddp
#endif
