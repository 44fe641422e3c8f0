// The skip votes' collective and decision (Note [skipping unused buckets]).
#include "skip_votes.h"

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include "../util/message.h"
#include "../util/profile_range.h"
#include "../util/step_cost.h"

namespace fastddp {

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

}  // namespace fastddp
