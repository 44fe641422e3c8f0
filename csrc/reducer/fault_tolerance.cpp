// Note [fault-tolerant step] (fault_tolerance.h): the reducer's entry points
// for fastddp.integrations.torchft.
#include "fault_tolerance.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include "../util/message.h"
#include "reducer.h"

namespace fastddp {

void Reducer::set_fault_sink(FaultTolerance::Sink sink) {
  std::lock_guard<std::mutex> lock(mutex_);
  FASTDDP_CHECK(sink, "fastddp: set_fault_sink takes a callable");
  FASTDDP_CHECK(phase_ == Phase::kIdle, "fastddp: set_fault_sink between steps only");
  fault_.set_sink(std::move(sink));
}

void Reducer::set_participants(int64_t count, bool contributes) {
  std::lock_guard<std::mutex> lock(mutex_);
  FASTDDP_CHECK(count >= 1 && count <= world_size(), "fastddp: ", count,
                " participants is not between 1 and the group's ", world_size(), " ranks");
  fault_.set_participants(count, contributes);
}

void Reducer::settle_pending(bool commit) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!fault_.holding()) return;
  const at::NoGradGuard no_grad;
  const at::Tensor finite = fault_.release();
  if (commit) {
    hook_->after_step(hook_->settle_step(finite));
  } else {
    // As fail_iteration: the state read stands, and a hook whose host-side
    // choices follow its state (ACP-SGD's turn) sees the step as not kept.
    hook_->discard_step();
    hook_->after_step(at::zeros({}, at::kBool));
  }
}

void Reducer::freeze_buckets() {
  std::lock_guard<std::mutex> lock(mutex_);
  ready_order_.note_rebuilt();
}

void Reducer::report_failure(std::string failure) const {
  if (!failure.empty()) fault_.report(failure);
}

}  // namespace fastddp
