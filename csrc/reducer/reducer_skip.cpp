// skip_all_reduce_unused_params: the vote on which buckets every rank leaves
// unused this backward, read only by a rank with a candidate bucket (Note
// [skipping unused buckets]). The copy-in and launch loop (reducer.cpp), the
// end of backward (reducer_finalize.cpp) and join's shadow (reducer_join.cpp)
// act on the decision.
#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <algorithm>

#include "../util/message.h"
#include "../util/profile_range.h"
#include "reducer.h"
#include "../util/step_cost.h"

namespace fastddp {

bool Reducer::skip_votes_needed() const {
  // Only where torch has an unused set to skip by. Every rank, and a rank
  // shadowing a step under join(), computes the same answer from the same
  // options, so the votes' allreduce is issued everywhere or nowhere.
  return options_.skip_all_reduce_unused_params &&
         (options_.find_unused_parameters || options_.static_graph);
}

bool Reducer::skippable(size_t b) const {
  const Bucket& bucket = buckets_[b];
  for (size_t index : bucket.params) {
    if (!std::binary_search(unused_.begin(), unused_.end(), index)) return false;
  }
  return true;
}

void Reducer::drop_skip_votes() {
  // Never waited for: a rank without a candidate bucket does not read the
  // result, and the next step's votes go into a tensor of their own. The
  // process group keeps what the collective still uses; its error, if any,
  // surfaces in the collectives that follow it.
  skip_pending_ = false;
  skip_work_.reset();
  skip_votes_ = at::Tensor();
}

void Reducer::vote_on_skips() {
  skip_.assign(buckets_.size(), false);
  my_votes_.clear();
  drop_skip_votes();
  if (!skip_votes_needed()) return;
  const size_t n = buckets_.size();
  const at::Device device = params_[0].device();
  // On an accelerator the votes leave pinned memory without blocking: the
  // caching host allocator keeps the block until the copy is done, so the
  // launch is no host sync either (a pageable copy would be one).
  const bool pinned = !device.is_cpu();
  at::Tensor votes = at::zeros({static_cast<int64_t>(2 * n)},
                               at::TensorOptions().dtype(at::kInt).pinned_memory(pinned));
  auto* v = votes.data_ptr<int32_t>();
  // In the first static-graph iteration unused_ is still empty: every vote is
  // "reduce", as torch's delayed reduction reduces every bucket.
  my_votes_.assign(n, false);
  for (size_t b = 0; b < n; ++b) {
    my_votes_[b] = skippable(b);
    v[my_votes_[b] ? b : n + b] = 1;
  }
  if (world_size_ == 1) {
    decide_skips(v);
    return;
  }
  // NCCL reduces device tensors only; on the CPU this is the same tensor.
  skip_votes_ = votes.to(device, /*non_blocking=*/pinned);
  std::vector<at::Tensor> tensors{skip_votes_};
  skip_work_ = group_->allreduce(tensors);
  skip_pending_ = true;
}

bool Reducer::skips(size_t b) {
  // A bucket this rank reduces is reduced by every rank: the vote cannot skip
  // it, so only a candidate (all its parameters unused here) waits for it.
  if (b >= my_votes_.size() || !my_votes_[b]) return false;
  if (skip_pending_) read_skip_votes();
  return skip_[b];
}

void Reducer::read_skip_votes() {
  skip_pending_ = false;
  try {
    skip_work_->wait();
  } catch (const std::exception& e) {
    // A dead or stuck peer: gloo's text names neither the collective nor its purpose.
    const auto* error = dynamic_cast<const c10::Error*>(&e);
    FASTDDP_CHECK(false, "fastddp: the allreduce of the ranks' votes on which buckets to skip "
                  "(skip_all_reduce_unused_params=True) failed on rank ", rank_, ": ",
                  error ? error->what_without_backtrace() : e.what());
  }
  FASTDDP_PROFILE_RANGE("fastddp skip votes");
  // The host decides: on an accelerator a host sync, paid only here (Note
  // [skipping unused buckets]); a no-op on the CPU.
  cost::host_sync(skip_votes_);
  const at::Tensor votes = skip_votes_.cpu();
  skip_work_.reset();
  skip_votes_ = at::Tensor();
  decide_skips(votes.data_ptr<int32_t>());
}

void Reducer::decide_skips(const int32_t* votes) {
  const size_t n = buckets_.size();
  skip_.assign(n, false);
  for (size_t b = 0; b < n; ++b) {
    // Skipped where every rank that trains left it unused (a rank shadowing
    // the step under join() votes neither way). A disputed bucket is reduced:
    // the ranks that use it launch it without reading the votes.
    skip_[b] = votes[b] > 0 && votes[n + b] == 0;
  }
}

int64_t Reducer::num_buckets_reduced() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return buckets_reduced_;
}

}  // namespace fastddp
