// Unused parameters: the used-bitmap and its allreduce (Note [unused
// parameters]); skip_all_reduce_unused_params' votes, their collective and
// decision (Note [skipping unused buckets]), and the reducer's side: whether
// the step votes and which buckets are this rank's candidates. The copy-in,
// the launch loop and the end of backward (reducer.cpp) and join's shadow
// (join.cpp) act on its decision.
#include "unused_parameters.h"

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <algorithm>

#include "../util/message.h"
#include "../util/profile_range.h"
#include "../util/step_cost.h"
#include "reducer.h"

namespace fastddp {

UnusedParameters::UnusedParameters(size_t num_params, const at::Device& device) {
  const auto n = static_cast<int64_t>(num_params);
  map_ = at::zeros({n}, at::kInt);
  map_dev_ = at::zeros({n}, at::TensorOptions().dtype(at::kInt).device(device));
}

bool UnusedParameters::contains(size_t index) const {
  return std::binary_search(unused_.begin(), unused_.end(), index);
}

bool UnusedParameters::take_marking() {
  if (marked_) return false;
  marked_ = true;
  return true;
}

void UnusedParameters::note_used(size_t index) { map_.data_ptr<int32_t>()[index] = 1; }

void UnusedParameters::launch_allreduce(c10d::ProcessGroup& group) {
  if (map_dev_.is_cuda()) {
    // A pinned staging copy: the host map may change again before the
    // asynchronous upload runs.
    at::Tensor staging = at::empty_like(map_, map_.options().pinned_memory(true));
    staging.copy_(map_);
    map_dev_.copy_(staging, /*non_blocking=*/true);
  } else {
    map_dev_.copy_(map_);
  }
  std::vector<at::Tensor> tensors{map_dev_};
  work_ = group.allreduce(tensors);
  reduced_ = false;
}

bool UnusedParameters::globally_unused(size_t index) {
  if (map_.data_ptr<int32_t>()[index] != 0) return false;
  if (!reduced_ && work_) {
    // Only a locally unused parameter waits for the bitmap (host sync on
    // CUDA, as in torch); models that use every parameter never do.
    work_->wait();
    map_.copy_(map_dev_);
    reduced_ = true;
  }
  return map_.data_ptr<int32_t>()[index] == 0;
}

void UnusedParameters::wait() {
  if (work_ && !reduced_) work_->wait();
}

void UnusedParameters::reduce_zeros(c10d::ProcessGroup& group) {
  map_.zero_();
  launch_allreduce(group);
  work_->wait();
  reduced_ = true;
}

void UnusedParameters::zero(bool unread) {
  map_.zero_();
  if (unread) reduced_ = false;
}

void SkipVotes::begin_step(size_t buckets) {
  skip_.assign(buckets, false);  // vote() decides, after the unused search
  skipped_.assign(buckets, false);
  reduced_ = 0;
}

void SkipVotes::abstain(size_t buckets) {
  skip_.assign(buckets, false);
  my_votes_.clear();
  drop();
}

void SkipVotes::drop() {
  // Never waited for: a rank without a candidate bucket does not read the
  // result, and the next step's votes go into a tensor of their own. The
  // process group keeps what the collective still uses; its error, if any,
  // surfaces in the collectives that follow it.
  pending_ = false;
  work_.reset();
  votes_ = at::Tensor();
}

void SkipVotes::vote(const std::vector<bool>& candidates, c10d::ProcessGroup& group,
                     const at::Device& device) {
  const size_t n = candidates.size();
  abstain(n);
  // On an accelerator the votes leave pinned memory without blocking: the
  // caching host allocator keeps the block until the copy is done, so the
  // launch is no host sync either (a pageable copy would be one).
  const bool pinned = !device.is_cpu();
  at::Tensor votes = at::zeros({static_cast<int64_t>(2 * n)},
                               at::TensorOptions().dtype(at::kInt).pinned_memory(pinned));
  auto* v = votes.data_ptr<int32_t>();
  // In the first static-graph iteration the unused set is still empty: every
  // vote is "reduce", as torch's delayed reduction reduces every bucket.
  my_votes_ = candidates;
  for (size_t b = 0; b < n; ++b) v[my_votes_[b] ? b : n + b] = 1;
  rank_ = group.getRank();
  if (group.getSize() == 1) {
    decide(v);
    return;
  }
  // NCCL reduces device tensors only; on the CPU this is the same tensor.
  votes_ = votes.to(device, /*non_blocking=*/pinned);
  std::vector<at::Tensor> tensors{votes_};
  work_ = group.allreduce(tensors);
  pending_ = true;
}

void SkipVotes::vote_as_shadow(size_t buckets, c10d::ProcessGroup& group,
                               const at::Device& device) {
  abstain(buckets);
  votes_ = at::zeros({static_cast<int64_t>(2 * buckets)},
                     at::TensorOptions().dtype(at::kInt).device(device));
  std::vector<at::Tensor> tensors{votes_};
  if (group.getSize() > 1) group.allreduce(tensors)->wait();
  cost::host_sync(votes_);
  const at::Tensor votes = votes_.cpu();
  decide(votes.data_ptr<int32_t>());
}

bool SkipVotes::skips(size_t b) {
  // A bucket this rank reduces is reduced by every rank: the vote cannot skip
  // it, so only a candidate (all its parameters unused here) waits for it.
  if (b >= my_votes_.size() || !my_votes_[b]) return false;
  if (pending_) read();
  return skip_[b];
}

void SkipVotes::read() {
  pending_ = false;
  try {
    work_->wait();
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
  cost::host_sync(votes_);
  const at::Tensor votes = votes_.cpu();
  work_.reset();
  votes_ = at::Tensor();
  decide(votes.data_ptr<int32_t>());
}

void SkipVotes::decide(const int32_t* votes) {
  const size_t n = skip_.size();
  for (size_t b = 0; b < n; ++b) {
    // Skipped where every rank that trains left it unused (a rank shadowing
    // the step under join() votes neither way). A disputed bucket is reduced:
    // the ranks that use it launch it without reading the votes.
    skip_[b] = votes[b] > 0 && votes[n + b] == 0;
  }
}

bool Reducer::skip_votes_needed() const {
  // Only where torch has an unused set to skip by. Every rank, and a rank
  // shadowing a step under join(), computes the same answer from the same
  // options, so the votes' allreduce is issued everywhere or nowhere.
  return options_.skip_all_reduce_unused_params &&
         (options_.find_unused_parameters || options_.static_graph);
}

bool Reducer::skippable(size_t b) const {
  for (size_t index : buckets_[b].params) {
    if (!unused_.contains(index)) return false;
  }
  return true;
}

void Reducer::vote_on_skips() {
  if (!skip_votes_needed()) {
    skip_votes_.abstain(buckets_.size());
    return;
  }
  std::vector<bool> candidates(buckets_.size());
  for (size_t b = 0; b < buckets_.size(); ++b) candidates[b] = skippable(b);
  skip_votes_.vote(candidates, *group_, params_[0].device());
}

int64_t Reducer::num_buckets_reduced() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return skip_votes_.reduced();
}

std::vector<int64_t> Reducer::last_unused_parameters() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return std::vector<int64_t>(unused_.list().begin(), unused_.list().end());
}

}  // namespace fastddp
