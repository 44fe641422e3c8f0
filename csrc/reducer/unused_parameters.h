// Parameters a backward leaves unused, and the buckets no rank needs to reduce.
//
// find_unused_parameters' accounting (Note [unused parameters] in reducer.h):
// which parameters this rank's graph leaves unused, a used-bitmap of the
// gradients that arrived, and its allreduce, read only by a rank that has a
// locally unused parameter.
//
// skip_all_reduce_unused_params: the ranks' vote on which buckets every rank
// leaves unused this backward, and what the step did with it (Note [skipping
// unused buckets] in reducer.h). The reducer says which buckets are this
// rank's candidates; the copy-in, the launch loop, the end of backward and
// join's shadow step read the decision here.
#pragma once

#include <ATen/Tensor.h>
#include <c10/core/Device.h>
#include <c10/util/intrusive_ptr.h>

#include <cstddef>
#include <cstdint>
#include <vector>

namespace c10d {
class ProcessGroup;
class Work;
}  // namespace c10d

namespace fastddp {

class UnusedParameters {
 public:
  UnusedParameters() = default;
  UnusedParameters(size_t num_params, const at::Device& device);

  // A new backward: its unused parameters are not marked ready yet.
  void begin_step() { marked_ = false; }
  // This iteration's unused parameters, in increasing order.
  void set(std::vector<size_t> unused) { unused_ = std::move(unused); }
  void clear() { unused_.clear(); }
  const std::vector<size_t>& list() const { return unused_; }
  bool contains(size_t index) const;
  // True once per backward, at its first hook: the moment to mark the unused
  // parameters ready.
  bool take_marking();

  // A gradient arrived for parameter `index` (no_sync steps included).
  void note_used(size_t index);
  // Starts the allreduce of the used-bitmap. Never waits.
  void launch_allreduce(c10d::ProcessGroup& group);
  // No training rank used parameter `index`: only a locally unused parameter
  // waits for the bitmap (a host sync on CUDA, as in torch).
  bool globally_unused(size_t index);
  // The end of backward: the bitmap's allreduce is done.
  void wait();
  // join(): a shadow step's all-zero bitmap, reduced at once.
  void reduce_zeros(c10d::ProcessGroup& group);
  // Forget the gradients seen; `unread`: the next read waits for a new allreduce.
  void zero(bool unread);

 private:
  std::vector<size_t> unused_;
  bool marked_ = false;
  at::Tensor map_;      // int32 on the CPU: 1 where a grad arrived
  at::Tensor map_dev_;  // its copy on the parameters' device, allreduced
  c10::intrusive_ptr<c10d::Work> work_;
  bool reduced_ = false;  // map_ holds the allreduced bitmap
};

class SkipVotes {
 public:
  // A new backward over `buckets` buckets: none skipped, none reduced yet.
  void begin_step(size_t buckets);
  // No vote this step (the option is off): nothing is skipped, and unread
  // votes of an earlier step are forgotten.
  void abstain(size_t buckets);
  // After the forward: launches this rank's votes, `candidates[b]` where all of
  // bucket b's parameters are unused here. Never waits.
  void vote(const std::vector<bool>& candidates, c10d::ProcessGroup& group,
            const at::Device& device);
  // join(): a rank shadowing the step takes part without a vote of its own
  // and waits for the result, to skip exactly what every training rank skips.
  void vote_as_shadow(size_t buckets, c10d::ProcessGroup& group, const at::Device& device);
  // Whether bucket b is skipped this backward; a candidate's first call waits
  // for the votes (the host sync only such a rank pays).
  bool skips(size_t b);
  // A skipped bucket's copy-in is torch's, which divides by the world size
  // only when no comm hook is registered (our default hook does), else copies;
  // a registered hook's own copy-in may write elsewhere (its wire buffer) and
  // leave the view, which becomes the grad under gradient_as_bucket_view,
  // stale. So once set_comm_hook() was called, the decision comes before the
  // copy-in: whether bucket b's copy-in must be the plain one (a candidate
  // waits for the votes here).
  void note_hook_registered() { hook_registered_ = true; }
  bool plain_copy_in(size_t b) { return hook_registered_ && skips(b); }
  // The decision as read, without waiting (join's shadow step, after its vote).
  bool decided(size_t b) const { return b < skip_.size() && skip_[b]; }
  // Forgets unread votes, without waiting (a failed step).
  void drop();

  // What this backward did: bucket b was skipped, or handed to the hook.
  void note_skipped(size_t b) { skipped_[b] = true; }
  void note_reduced() { ++reduced_; }
  bool skipped(size_t b) const { return skipped_[b]; }
  const std::vector<bool>& skipped() const { return skipped_; }
  // This backward's hook runs (torch's num_buckets_reduced_).
  int64_t reduced() const { return reduced_; }

 private:
  void read();  // waits for the votes, decides
  void decide(const int32_t* votes);

  int rank_ = 0;  // the voting group's, for errors
  std::vector<bool> skip_;      // per bucket, once the votes are read: every rank skips it
  std::vector<bool> skipped_;   // per bucket, this backward: was skipped
  std::vector<bool> my_votes_;  // per bucket: this rank voted to skip (empty: shadowing)
  at::Tensor votes_;            // int32 [2 * buckets]: skip votes, then reduce votes
  c10::intrusive_ptr<c10d::Work> work_;  // their allreduce
  bool pending_ = false;        // launched, not yet read
  int64_t reduced_ = 0;
  bool hook_registered_ = false;  // set_comm_hook() was called: not torch's default reduction
};

}  // namespace fastddp
