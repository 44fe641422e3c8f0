// The step's finiteness checks (Note [non-finite guard], Note [a bad step
// leaves no trace]).
#include "finite_checks.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>  // the guard's c10d::Work

#include "nonfinite_guard.h"
#include "step_state.h"

namespace fastddp {

FiniteChecks::FiniteChecks() = default;
FiniteChecks::FiniteChecks(FiniteChecks&&) noexcept = default;
FiniteChecks& FiniteChecks::operator=(FiniteChecks&&) noexcept = default;
FiniteChecks::~FiniteChecks() = default;

FiniteChecks::FiniteChecks(bool guard, int rank, int world_size, size_t num_params) {
  if (guard) guard_ = std::make_unique<NonFiniteGuard>(rank, world_size, num_params);
}

bool FiniteChecks::take_guard_failed() {
  const bool failed = guard_failed_;
  guard_failed_ = false;
  return failed;
}

void FiniteChecks::begin_step() {
  if (guard_) guard_->begin_step();
  reduced_.clear();
  last_ = at::Tensor();
}

void FiniteChecks::collect(const std::vector<at::Tensor>& reduced, bool hook_settles) {
  if (!track_ && !hook_settles) return;
  for (const at::Tensor& t : reduced) {
    if (t.defined()) reduced_.push_back(t);  // checked once all are in
  }
}

at::Tensor FiniteChecks::check() {
  if (reduced_.empty()) return at::Tensor();
  const at::NoGradGuard no_grad;
  at::Tensor finite = all_finite(reduced_);
  if (track_) last_ = finite;
  reduced_.clear();
  return finite;
}

void FiniteChecks::set_tracking(bool on) {
  track_ = on;
  last_ = at::Tensor();
}

std::optional<bool> FiniteChecks::last_step_finite() const {
  if (!last_.defined()) return std::nullopt;
  return last_.item<bool>();
}

}  // namespace fastddp
