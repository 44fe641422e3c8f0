#include "step_state.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <limits>
#include <unordered_map>

#include "../kernels/nonfinite.h"
#include "../util/step_cost.h"

namespace fastddp {

void StepState::snapshot(const std::vector<at::Tensor>& tensors) {
  std::vector<Saved> next;
  next.reserve(tensors.size());
  // Reuse last step's copies of the same tensors: no allocation per step.
  std::unordered_map<const c10::TensorImpl*, at::Tensor> old;
  for (Saved& s : saved_) old.emplace(s.live.unsafeGetTensorImpl(), std::move(s.copy));
  for (const at::Tensor& t : tensors) {
    if (!t.defined()) continue;
    auto it = old.find(t.unsafeGetTensorImpl());
    at::Tensor copy = it != old.end() ? it->second : at::Tensor();
    if (!copy.defined() || copy.sizes() != t.sizes() || copy.strides() != t.strides() ||
        copy.scalar_type() != t.scalar_type() || copy.device() != t.device()) {
      copy = at::empty_like(t, at::MemoryFormat::Preserve);
    }
    copy.copy_(t);
    cost::add(cost::kStateCopy, 2 * static_cast<int64_t>(t.nbytes()));
    next.push_back({t, copy});
  }
  saved_ = std::move(next);
}

namespace {

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

}  // namespace

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

at::Tensor StepState::keep_if_finite(const std::vector<at::Tensor>& tensors,
                                     const at::Tensor& finite) {
  if (tensors.empty() || saved_.empty()) return finite;
  std::vector<at::Tensor> copies;
  copies.reserve(saved_.size());
  for (const Saved& s : saved_) copies.push_back(s.copy);
  if (finite.is_cpu()) {  // no device: branches cost nothing, and a finite step reads no copy
    if (finite.item<bool>() || !all_finite(copies).item<bool>()) {
      return at::ones({}, finite.options());
    }
    select(tensors, finite);
    return finite;
  }
  const at::Tensor keep = finite.logical_or(all_finite(copies).to(finite.device()).logical_not());
  select(tensors, keep);
  return keep;
}

void StepState::restore(const std::vector<at::Tensor>& tensors) {
  if (tensors.empty()) return;
  select(tensors, at::zeros({}, tensors.front().options().dtype(at::kBool)));
}

void StepState::select(const std::vector<at::Tensor>& tensors, const at::Tensor& keep) {
  std::unordered_map<const c10::TensorImpl*, const at::Tensor*> copies;
  for (const Saved& s : saved_) copies.emplace(s.live.unsafeGetTensorImpl(), &s.copy);
  for (const at::Tensor& t : tensors) {
    if (!t.defined()) continue;
    const at::Tensor flag = keep.to(t.device());
    cost::add(cost::kStateCopy, 3 * static_cast<int64_t>(t.nbytes()));  // reads both, writes one
    auto it = copies.find(t.unsafeGetTensorImpl());
    if (it != copies.end()) {
      at::Tensor out = t;  // the same tensor, written in place
      at::where_out(out, flag, t, *it->second);
    } else {
      t.masked_fill_(flag.logical_not(), 0);  // made this step: as if never made
    }
  }
}

}  // namespace fastddp
