// join() (uneven inputs): a rank without data runs the collectives of one
// backward with zero gradients, in the others' order, on its shadow buckets.
#include "join.h"

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include "../util/message.h"
#include "finite_checks.h"
#include "reducer.h"

namespace fastddp {

std::vector<Bucket>& JoinShadow::buckets_for(const std::vector<Bucket>& buckets, bool lazy,
                                             int64_t align_bytes) {
  if (shadows_.size() != buckets.size()) {
    shadows_.clear();
    for (const Bucket& bucket : buckets) shadows_.push_back(bucket.zeros_like());
  }
  if (lazy && !all_allocated(shadows_)) allocate_flat(shadows_, align_bytes);
  return shadows_;
}

void Reducer::shadow_backward() {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<c10::intrusive_ptr<c10::ivalue::Future>> futures;
  const bool lazy = options_.lazy_bucket_allocation;
  std::vector<Bucket>& shadows = join_.buckets_for(buckets_, lazy, options_.align_bytes);
  // Lazy buckets: the shadows' buffers go when this returns or raises (the
  // collectives still in flight hold their own references).
  struct Release {
    JoinShadow* join;
    ~Release() {
      if (join != nullptr) join->release();
    }
  } release{lazy ? &join_ : nullptr};
  hook_->set_divisors({world_size(), fault_.participants(world_size())});
  // The training ranks vote at the end of their forward (Note [skipping
  // unused buckets]); this rank takes part without a vote of its own.
  if (skip_votes_needed()) {
    skip_votes_.vote_as_shadow(buckets_.size(), *group_, params_[0].device());
  } else {
    skip_votes_.abstain(buckets_.size());
  }
  std::vector<size_t> launched;
  for (size_t b = 0; b < buckets_.size(); ++b) {
    const bool last = b + 1 == buckets_.size();
    if (skip_votes_.decided(b)) {
      if (last) hook_->drain();  // as launch_ready_buckets does
      continue;
    }
    Bucket& shadow = shadows[b];
    shadow.flat.zero_();
    // Hooks may keep their own per-bucket buffers: fill them with zeros too.
    for (size_t k = 0; k < shadow.params.size(); ++k) hook_->copy_in(shadow, k, at::Tensor());
    futures.push_back(hook_->run(shadow, b, last));
    launched.push_back(b);
  }
  if (track_usage()) {
    unused_.reduce_zeros(*group_);
  }
  if (finite_.guard()) finite_.guard()->begin_step();  // the training ranks' guard collective
  for (size_t k = 0; k < futures.size(); ++k) {
    futures[k]->wait();
    FASTDDP_CHECK(!futures[k]->hasError(), "fastddp: join: the shadow reduction of bucket ",
                  launched[k], " failed on rank ", rank(), ": ",
                  futures[k]->tryRetrieveErrorMessage());
  }
  if (finite_.guard()) check_finite_gradients();
  if (dynamic_find_unused()) unused_.zero(/*unread=*/false);
  // The shadow step stands, as torch's joined rank's hook state moves on with
  // its zero buckets: a double-buffered hook takes its new state (Note
  // [double-buffered step state]).
  if (hook_->settles_own_state()) hook_->settle_step(at::Tensor());
}

void Reducer::record_default_ready_order() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (should_rebuild()) ready_order_.record_default(params_.size());
}

}  // namespace fastddp
