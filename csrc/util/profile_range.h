// Named ranges around the reducer's and the hooks' phases, so that both
// torch.profiler (RECORD_USER_SCOPE, torch's own mechanism: nothing to add to
// a user's profiling set-up) and nsys (NVTX3, header-only, comes with the CUDA
// toolkit) show where a step's communication time goes. RecordFunction costs
// one thread-local check when no profiler is active.
#pragma once

#include <ATen/record_function.h>

#if defined(FASTDDP_WITH_NVTX)
#include <nvtx3/nvToolsExt.h>
#endif

namespace fastddp {

// A scope of its own (not RECORD_USER_SCOPE, whose variable is named `guard`
// and would clash with a CUDAGuard or a second range in the same scope).
class ProfileRange {
 public:
  explicit ProfileRange(const char* name) : record_(at::RecordScope::USER_SCOPE) {
    if (record_.isActive()) record_.before(name, c10::ArrayRef<const c10::IValue>{});
#if defined(FASTDDP_WITH_NVTX)
    nvtxRangePushA(name);
#endif
  }
  ~ProfileRange() {
#if defined(FASTDDP_WITH_NVTX)
    nvtxRangePop();
#endif
  }
  ProfileRange(const ProfileRange&) = delete;
  ProfileRange& operator=(const ProfileRange&) = delete;

 private:
  at::RecordFunction record_;
};

}  // namespace fastddp

#define FASTDDP_RANGE_CONCAT_INNER(a, b) a##b
#define FASTDDP_RANGE_CONCAT(a, b) FASTDDP_RANGE_CONCAT_INNER(a, b)
// `name` is a string literal ("fastddp copy-in").
#define FASTDDP_PROFILE_RANGE(name) \
  ::fastddp::ProfileRange FASTDDP_RANGE_CONCAT(fastddp_profile_range_, __LINE__)(name)
