// skip_all_reduce_unused_params, the reducer's side: whether the step votes
// and which buckets are this rank's candidates (Note [skipping unused
// buckets]). The votes themselves are SkipVotes' (skip_votes.h); the copy-in
// and launch loop (reducer.cpp), the end of backward (reducer_finalize.cpp)
// and join's shadow (reducer_join.cpp) act on its decision.
#include "reducer.h"

namespace fastddp {

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

}  // namespace fastddp
