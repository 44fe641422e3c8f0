// The reducer's comm hook: replacing it between steps (fastddp.hooks.auto()
// does so while it tunes; inside a backward it fails that step), the check
// that it can take the buckets' gradients, and its name. Also the overlapped
// optimizer, the other thing a step hands the buckets to.
#include "nonfinite_guard.h"
#include "reducer.h"
#include "../util/message.h"
#include "optimizer_step.h"

namespace fastddp {

void Reducer::set_comm_hook(std::shared_ptr<CommHook> hook) {
  std::lock_guard<std::mutex> lock(mutex_);
  FASTDDP_CHECK(hook, "fastddp: set_comm_hook needs a hook");
  if (reducing()) {
    // The backward in flight cannot finish reducing (this call comes from
    // inside it): fail it, so that the next forward starts afresh.
    try {
      FASTDDP_CHECK(false, "fastddp: a comm hook cannot be changed while a backward is reducing");
    } catch (...) {
      fail_iteration(std::current_exception());
      throw;
    }
  }
  check_hook_supports(*hook);
  hook_->set_nonfinite_guard(nullptr);
  hook_ = std::move(hook);
  skip_votes_.note_hook_registered();
  hook_->set_nonfinite_guard(finite_.guard());
  hook_->on_new_buckets(buckets_);
}

void Reducer::check_hook_supports(const CommHook& hook) const {
  if (hook.supports_sparse()) return;
  for (const Bucket& bucket : buckets_) {
    FASTDDP_CHECK_NOT_IMPLEMENTED(!bucket.sparse, "fastddp: the comm hook '", hook.name(),
                                  "' does not support sparse gradients, and parameter '",
                                  names_[bucket.params[0]],
                                  "' gets them (sparse=True); use the default allreduce or a "
                                  "Python hook, or construct the module with sparse=False");
  }
}

void Reducer::set_optimizer_step(std::shared_ptr<OptimizerStep> step) {
  std::lock_guard<std::mutex> lock(mutex_);
  FASTDDP_CHECK(!reducing(),
                "fastddp: the overlapped optimizer cannot be changed while a backward is reducing");
  optimizer_step_ = std::move(step);
}

std::string Reducer::hook_name() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return hook_->name();
}

}  // namespace fastddp
