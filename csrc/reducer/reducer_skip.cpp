// skip_all_reduce_unused_params: the vote on which buckets no rank reduces
// this backward, and the error when the ranks disagree (Note [skipping unused
// buckets]). The launch loop (reducer.cpp), the write-back (reducer_finalize.cpp)
// and join's shadow (reducer_join.cpp) act on the decision.
#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <algorithm>

#include "reducer.h"
#include "message.h"

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

void Reducer::vote_on_skips() {
  skip_.assign(buckets_.size(), false);
  my_votes_.clear();
  if (!skip_votes_needed()) return;
  if (skip_pending_) {
    // A synchronized forward whose backward never ran: its votes are stale,
    // but the buffer must be free before it is reused.
    skip_work_->wait();
    skip_pending_ = false;
  }
  const size_t n = buckets_.size();
  at::Tensor votes = at::zeros({static_cast<int64_t>(2 * n)}, at::kInt);
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
  skip_votes_ = votes.to(params_[0].device());
  std::vector<at::Tensor> tensors{skip_votes_};
  skip_work_ = group_->allreduce(tensors);
  skip_pending_ = true;
}

void Reducer::read_skip_votes() {
  if (!skip_pending_) return;
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
  const at::Tensor votes = skip_votes_.cpu();  // the host decides; a no-op on the CPU
  decide_skips(votes.data_ptr<int32_t>());
}

void Reducer::decide_skips(const int32_t* votes) {
  const size_t n = buckets_.size();
  skip_.assign(n, false);
  std::vector<size_t> disputed;
  for (size_t b = 0; b < n; ++b) {
    const int32_t skip = votes[b];
    const int32_t reduce = votes[n + b];
    // A rank shadowing the step under join() votes neither way: a bucket is
    // skipped where every rank that trains skips it.
    skip_[b] = skip > 0 && reduce == 0;
    if (skip > 0 && reduce > 0) disputed.push_back(b);
  }
  if (disputed.empty()) return;
  const size_t b = disputed.front();
  std::vector<std::string> names;
  for (size_t index : buckets_[b].params) names.push_back("'" + names_[index] + "'");
  std::vector<std::string> others;
  for (size_t k = 1; k < disputed.size(); ++k) others.push_back(cat(disputed[k]));
  // The same votes reach every rank, so every rank raises here, before its
  // first collective of this backward: none is left waiting.
  FASTDDP_CHECK(false, "fastddp: skip_all_reduce_unused_params=True needs the same buckets "
                "unused on every rank, but bucket ", b, " (", join(names, ", "), ") is unused "
                "on ", votes[b], " rank(s) and used on ", votes[n + b],
                others.empty() ? "" : " (also disputed: buckets ", join(others, ", "),
                others.empty() ? "" : ")", "; on rank ", rank_, " it is ",
                b >= my_votes_.size() ? "not voted on (joined)" : my_votes_[b] ? "unused" : "used",
                ". torch's DDP would skip its allreduce on some ranks only and mismatch the "
                "ranks' collectives (gloo aborts the process); nothing was reduced in this "
                "backward. Use the same parameters on every rank in each step, or pass "
                "skip_all_reduce_unused_params=False.");
}

int64_t Reducer::num_buckets_reduced() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return buckets_reduced_;
}

}  // namespace fastddp
