// The reducer's side of join() (uneven inputs): a rank without data runs the
// collectives of one backward with zero gradients, in the others' order.
#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include "nonfinite_guard.h"
#include "reducer.h"
#include "../util/step_cost.h"
#include "../util/message.h"

namespace fastddp {

void Reducer::shadow_backward() {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<c10::intrusive_ptr<c10::ivalue::Future>> futures;
  // Kept across join iterations: hooks key per-bucket state by Bucket::id.
  if (shadow_buckets_.size() != buckets_.size()) {
    shadow_buckets_.clear();
    for (const Bucket& bucket : buckets_) shadow_buckets_.push_back(bucket.zeros_like());
  }
  const bool lazy = options_.lazy_bucket_allocation;
  if (lazy && !all_allocated(shadow_buckets_)) allocate_flat(shadow_buckets_, options_.align_bytes);
  // Lazy buckets: the shadows' buffers go when this returns or raises (the
  // collectives still in flight hold their own references).
  struct Release {
    std::vector<Bucket>* shadows;
    ~Release() {
      if (shadows != nullptr) release_flat(*shadows);
    }
  } release{lazy ? &shadow_buckets_ : nullptr};
  hook_->set_divide_factor(world_size_);
  skip_.assign(buckets_.size(), false);
  if (skip_votes_needed()) {
    // The training ranks vote at the end of their forward (Note [skipping
    // unused buckets]); this rank takes part without a vote of its own and
    // waits for the result, to skip exactly what every training rank skips.
    drop_skip_votes();
    my_votes_.clear();
    skip_votes_ = at::zeros({static_cast<int64_t>(2 * buckets_.size())},
                            at::TensorOptions().dtype(at::kInt).device(params_[0].device()));
    std::vector<at::Tensor> tensors{skip_votes_};
    if (world_size_ > 1) group_->allreduce(tensors)->wait();
    cost::host_sync(skip_votes_);
    const at::Tensor votes = skip_votes_.cpu();
    decide_skips(votes.data_ptr<int32_t>());
  }
  std::vector<size_t> launched;
  for (size_t b = 0; b < buckets_.size(); ++b) {
    const bool last = b + 1 == buckets_.size();
    if (skip_[b]) {
      if (last) hook_->drain();  // as launch_ready_buckets does
      continue;
    }
    Bucket& shadow = shadow_buckets_[b];
    shadow.flat.zero_();
    // Hooks may keep their own per-bucket buffers: fill them with zeros too.
    for (size_t k = 0; k < shadow.params.size(); ++k) hook_->copy_in(shadow, k, at::Tensor());
    futures.push_back(hook_->run(shadow, b, last));
    launched.push_back(b);
  }
  if (track_usage()) {
    used_map_.zero_();
    launch_used_map_allreduce();
    used_work_->wait();
    used_map_reduced_ = true;
  }
  if (nonfinite_) nonfinite_->begin_step();  // the training ranks' guard collective
  for (size_t k = 0; k < futures.size(); ++k) {
    futures[k]->wait();
    FASTDDP_CHECK(!futures[k]->hasError(), "fastddp: join: the shadow reduction of bucket ",
                  launched[k], " failed on rank ", rank_, ": ",
                  futures[k]->tryRetrieveErrorMessage());
  }
  if (nonfinite_) check_finite_gradients();
  if (dynamic_find_unused()) used_map_.zero_();
  // The shadow step stands, as torch's joined rank's hook state moves on with
  // its zero buckets: a double-buffered hook takes its new state (Note
  // [double-buffered step state]).
  if (hook_->settles_own_state()) hook_->settle_step(at::Tensor());
}

void Reducer::record_default_ready_order() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!should_rebuild() || !ready_order_.empty()) return;
  for (size_t i = 0; i < params_.size(); ++i) ready_order_.push_back(i);
}

}  // namespace fastddp
