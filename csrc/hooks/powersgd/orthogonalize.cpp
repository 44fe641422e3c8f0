#include "orthogonalize.h"

#include <ATen/Parallel.h>

#include <algorithm>

#include "../../kernels/orthogonalize.h"
#include "../../reducer/profile_range.h"

#if defined(FASTDDP_WITH_CUDA)
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace fastddp {
namespace {

// The CPU kernel's column-major scratch copy of one matrix stays in L2 up to
// about this rank for PowerSGD's n; beyond it LAPACK's blocked QR wins.
constexpr int64_t kCpuMaxRank = 64;
// Below about this many elements of work a CPU task is not worth a thread.
constexpr int64_t kGrain = 1 << 16;

template <typename T>
void run_cpu(T* data, int64_t batch, int64_t n, int64_t r, double epsilon) {
  // Work per matrix grows as n r^2 (r column passes of n r elements).
  const int64_t per_matrix = std::max<int64_t>(1, n * r * r);
  const int64_t grain = std::max<int64_t>(1, kGrain / per_matrix);
  at::parallel_for(0, batch, grain, [&](int64_t begin, int64_t end) {
    kernels::orthogonalize_cpu(data + begin * n * r, end - begin, n, r, epsilon);
  });
}

}  // namespace

bool fused_orthogonalize(at::Tensor& matrices, double epsilon) {
  if (!matrices.defined() || matrices.dim() != 3 || !matrices.is_contiguous()) return false;
  const auto dtype = matrices.scalar_type();
  if (dtype != at::kFloat && dtype != at::kDouble) return false;
  const int64_t batch = matrices.size(0), n = matrices.size(1), r = matrices.size(2);
  if (r < 1 || r > n) return false;
  if (matrices.is_cpu()) {
    if (r > kCpuMaxRank) return false;
    FASTDDP_PROFILE_RANGE("fastddp orthogonalize");
    if (dtype == at::kFloat) {
      run_cpu(matrices.data_ptr<float>(), batch, n, r, epsilon);
    } else {
      run_cpu(matrices.data_ptr<double>(), batch, n, r, epsilon);
    }
    return true;
  }
#if defined(FASTDDP_WITH_CUDA)
  if (matrices.is_cuda()) {
    if (r > kernels::kOrthogonalizeCudaMaxRank) return false;
    FASTDDP_PROFILE_RANGE("fastddp orthogonalize");
    const c10::cuda::CUDAGuard guard(matrices.device());
    void* stream = c10::cuda::getCurrentCUDAStream(matrices.device().index()).stream();
    if (dtype == at::kFloat) {
      kernels::orthogonalize_cuda(matrices.data_ptr<float>(), batch, n, r, epsilon, stream);
    } else {
      kernels::orthogonalize_cuda(matrices.data_ptr<double>(), batch, n, r, epsilon, stream);
    }
    return true;
  }
#endif
  return false;
}

}  // namespace fastddp
