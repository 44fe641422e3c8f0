#include "orthogonalize.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>

#include "../../kernels/orthogonalize.h"
#include "../../kernels/orthogonalize_tall.h"
#include "../../util/current_stream.h"
#include "../../util/profile_range.h"
#include "../../util/step_cost.h"

#if defined(FASTDDP_WITH_CUDA)
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace fastddp {
namespace {

// Below about this many elements of work a CPU task is not worth a thread.
constexpr int64_t kGrain = 1 << 16;

template <typename T>
void run_cpu(const T* src, T* data, int64_t batch, int64_t n, int64_t r, double epsilon) {
  // Work per matrix grows as n r^2 (r column passes of n r elements).
  const int64_t per_matrix = std::max<int64_t>(1, n * r * r);
  const int64_t grain = std::max<int64_t>(1, kGrain / per_matrix);
  at::parallel_for(0, batch, grain, [&](int64_t begin, int64_t end) {
    kernels::orthogonalize_cpu(src + begin * n * r, data + begin * n * r, end - begin, n, r,
                               epsilon);
  });
}

template <typename T>
void run_cpu_tall(T* data, int64_t batch, int64_t n, int64_t r) {
  // One task is a chunk of kTallChunkRowsCpu rows (r^2 / 2 multiply-adds a row).
  const int64_t grain = std::max<int64_t>(1, kGrain / (kernels::kTallChunkRowsCpu * r * r));
  kernels::orthogonalize_tall_cpu(data, batch, n, r, [&](int64_t count, const auto& body) {
    at::parallel_for(0, count, grain, body);
  });
}

}  // namespace

bool fused_orthogonalize(at::Tensor& matrices, double epsilon, const at::Tensor& src) {
  if (!matrices.defined() || matrices.dim() != 3 || !matrices.is_contiguous()) return false;
  const auto dtype = matrices.scalar_type();
  if (dtype != at::kFloat && dtype != at::kDouble) return false;
  const int64_t batch = matrices.size(0), n = matrices.size(1), r = matrices.size(2);
  if (r < 1 || r > n) return false;
  const at::Tensor& from = src.defined() ? src : matrices;
  if (from.sizes() != matrices.sizes() || from.scalar_type() != dtype ||
      from.device() != matrices.device() || !from.is_contiguous()) {
    return false;
  }
  if (matrices.is_cpu()) {
    // Gram-Schmidt at every n: per core it is several times faster than the tall
    // path's CPU version (vectorized unit-stride columns against r^2 scalar
    // products per row).
    if (r > kernels::kOrthogonalizeCpuMaxRank) return false;
    FASTDDP_PROFILE_RANGE("fastddp orthogonalize");
    if (dtype == at::kFloat) {
      run_cpu(from.const_data_ptr<float>(), matrices.data_ptr<float>(), batch, n, r, epsilon);
    } else {
      run_cpu(from.const_data_ptr<double>(), matrices.data_ptr<double>(), batch, n, r, epsilon);
    }
    return true;
  }
#if defined(FASTDDP_WITH_CUDA)
  if (matrices.is_cuda()) {
    if (r > kernels::kOrthogonalizeCudaMaxRank) return false;
    const c10::cuda::CUDAGuard guard(matrices.device());
    void* stream = current_cuda_stream(matrices);
    if (kernels::orthogonalize_tall(n, r)) {
      FASTDDP_PROFILE_RANGE("fastddp orthogonalize tall");
      if (from.const_data_ptr() != matrices.const_data_ptr()) {
        matrices.copy_(from);
        cost::add(cost::kStateCopy, 2 * static_cast<int64_t>(matrices.nbytes()));
      }
      // From the caching allocator on the current stream: reused by later work
      // on this stream only after these kernels, without a host sync.
      const at::Tensor workspace =
          at::empty({kernels::tall_workspace_bytes_cuda(batch, n, r)},
                    matrices.options().dtype(at::kByte));
      if (dtype == at::kFloat) {
        kernels::orthogonalize_tall_cuda(matrices.data_ptr<float>(), batch, n, r,
                                         workspace.data_ptr(), stream);
      } else {
        kernels::orthogonalize_tall_cuda(matrices.data_ptr<double>(), batch, n, r,
                                         workspace.data_ptr(), stream);
      }
      return true;
    }
    FASTDDP_PROFILE_RANGE("fastddp orthogonalize");
    if (dtype == at::kFloat) {
      kernels::orthogonalize_cuda(matrices.data_ptr<float>(), batch, n, r, epsilon, stream,
                                  from.const_data_ptr<float>());
    } else {
      kernels::orthogonalize_cuda(matrices.data_ptr<double>(), batch, n, r, epsilon, stream,
                                  from.const_data_ptr<double>());
    }
    return true;
  }
#endif
  return false;
}

bool tall_orthogonalize_cpu(at::Tensor& matrices) {
  if (!matrices.defined() || matrices.dim() != 3 || !matrices.is_contiguous() ||
      !matrices.is_cpu()) {
    return false;
  }
  const auto dtype = matrices.scalar_type();
  const int64_t batch = matrices.size(0), n = matrices.size(1), r = matrices.size(2);
  if ((dtype != at::kFloat && dtype != at::kDouble) || !kernels::orthogonalize_tall(n, r) ||
      r > kernels::kOrthogonalizeCpuMaxRank) {
    return false;
  }
  if (dtype == at::kFloat) {
    run_cpu_tall(matrices.data_ptr<float>(), batch, n, r);
  } else {
    run_cpu_tall(matrices.data_ptr<double>(), batch, n, r);
  }
  return true;
}

}  // namespace fastddp
