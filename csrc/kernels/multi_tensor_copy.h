// Copies many (src, dst) byte ranges in one kernel launch.
//
// Used to write a reduced bucket back into the parameters' .grad tensors:
// one launch per bucket instead of one copy kernel per parameter. Torch-free
// and CUDA-header-free so that any layer may include it.
#pragma once

#include <cstdint>

namespace fastddp::kernels {

struct CopyRange {
  const void* src;
  void* dst;
  int64_t bytes;
};

// Enqueues the copies on `stream` (a cudaStream_t) and returns without
// waiting. Ranges must not overlap one another. Throws std::runtime_error
// when the launch fails.
void multi_tensor_copy_cuda(const CopyRange* ranges, int64_t count, void* stream);

}  // namespace fastddp::kernels
