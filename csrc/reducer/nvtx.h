// NVTX ranges around the reducer's phases, so nsys shows where a step's
// communication time goes. Compiled to nothing without CUDA: NVTX3 is
// header-only and comes with the CUDA toolkit.
#pragma once

#if defined(FASTDDP_WITH_NVTX)
#include <nvtx3/nvToolsExt.h>

namespace fastddp {

class NvtxRange {
 public:
  explicit NvtxRange(const char* name) { nvtxRangePushA(name); }
  ~NvtxRange() { nvtxRangePop(); }
  NvtxRange(const NvtxRange&) = delete;
  NvtxRange& operator=(const NvtxRange&) = delete;
};

}  // namespace fastddp

#define FASTDDP_NVTX_CONCAT_INNER(a, b) a##b
#define FASTDDP_NVTX_CONCAT(a, b) FASTDDP_NVTX_CONCAT_INNER(a, b)
#define FASTDDP_NVTX_RANGE(name) \
  ::fastddp::NvtxRange FASTDDP_NVTX_CONCAT(fastddp_nvtx_range_, __LINE__)(name)
#else
#define FASTDDP_NVTX_RANGE(name) \
  do {                           \
  } while (0)
#endif
