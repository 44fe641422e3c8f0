#include "step_state.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <limits>

#include "../kernels/nonfinite.h"
#include "../util/step_cost.h"

namespace fastddp {

// Whether a CPU tensor holds only finite values: fastddp's branch-free loop
// (kernels/nonfinite.h) over dense float32/float64 memory, threaded in chunks;
// ATen otherwise. Ours because ATen's CPU max-norm (_foreach_norm falls back
// to one linalg_vector_norm per tensor there) ran at a fraction of memory
// speed: 53 ms of a 182 ms PowerSGD step on 20M gradients (benchmarks/
// powersgd.py --parts b, issue 43).
bool cpu_all_finite(const at::Tensor& t) {
  const bool dense = t.is_non_overlapping_and_dense();
  if (dense && (t.scalar_type() == at::kFloat || t.scalar_type() == at::kDouble)) {
    std::atomic<bool> bad{false};
    const bool is_float = t.scalar_type() == at::kFloat;
    at::parallel_for(0, t.numel(), 1 << 16, [&](int64_t begin, int64_t end) {
      if (bad.load(std::memory_order_relaxed)) return;
      const bool found =
          is_float ? kernels::any_nonfinite_cpu(t.const_data_ptr<float>() + begin, end - begin)
                   : kernels::any_nonfinite_cpu(t.const_data_ptr<double>() + begin, end - begin);
      if (found) bad = true;
    });
    return !bad.load();
  }
  return at::isfinite(t).all().item<bool>();
}

at::Tensor all_finite(const std::vector<at::Tensor>& tensors) {
  // Empty tensors hold nothing non-finite, and have no infinity norm.
  std::vector<at::Tensor> held;
  held.reserve(tensors.size());
  for (const at::Tensor& t : tensors) {
    if (t.numel() > 0) held.push_back(t);
  }
  if (held.empty()) {
    const auto where = tensors.empty() ? at::TensorOptions() : tensors.front().options();
    return at::ones({}, where.dtype(at::kBool));
  }
  cost::add(cost::kCheck, cost::bytes(held));
  if (std::all_of(held.begin(), held.end(), [](const at::Tensor& t) { return t.is_cpu(); })) {
    // Stops at the first tensor with a NaN or an infinity.
    const bool finite = std::all_of(held.begin(), held.end(), cpu_all_finite);
    return at::scalar_tensor(finite, at::kBool);
  }
  // The largest magnitude of each tensor (one fused launch per dtype and
  // device on CUDA): NaN or Inf if it holds one, finite otherwise (no sum of
  // squares to overflow on large finite values).
  const std::vector<at::Tensor> maxima =
      at::_foreach_norm(held, std::numeric_limits<double>::infinity());
  return at::stack(maxima).isfinite().all();
}

}  // namespace fastddp
