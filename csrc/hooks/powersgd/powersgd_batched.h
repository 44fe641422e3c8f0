// Batched PowerSGD (torch's `batched_powerSGD_hook`): the whole bucket as one
// square matrix, numerically torch's hook with the same PowerSGDState.
//
// Note [batched powersgd]
// Per step, for every bucket (torch's algorithm, step for step):
//   iter < start_iter: divide by the world size, one allreduce (torch's
//     vanilla phase); the iteration counter moves on the last bucket.
//   otherwise, with numel the bucket's size (its parameters' elements: an
//     aligned bucket's padding is left out, Note [aligned flat buffer]) and
//     side = ceil(sqrt(numel)):
//     M = the flat gradient (unscaled) zero-padded to side * side, viewed as
//       (side, side), in a work buffer of the hook (torch resizes the
//       bucket's buffer, which ours cannot be);
//     error feedback: M += error[bucket] over the padded length (so the
//       padding's error is carried too); keep a copy of M;
//     Q (side x r): warm start reuses last step's; otherwise randn on CPU
//       from a generator seeded with the numpy RandomState's
//       randint(1_000_000_000), one draw per bucket, in the order buckets
//       run; then orthogonalized;
//     P = M Q; allreduce P (a sum, not divided); orthogonalize P;
//     Q = M^T P; allreduce Q; Q /= world size; M = P Q^T;
//     error feedback: error[bucket] = copy - M; the bucket gets M's first
//       numel elements.
// Unlike "powersgd", every element is compressed (min_compression_rate and
// batch_tensors_with_same_shape are accepted and unused, as in torch), and
// orthogonalization runs with epsilon 0: torch's batched hook never passes
// orthogonalization_epsilon on.
// torch 2.14's own batched_powerSGD_hook cannot run: it hands a 2-D Q to an
// _orthogonalize that asserts a 3-D batch (since torch PR #75157). This hook
// is that code with Q and P orthogonalized as a batch of one.
//
// State across a bucket rebuild and in a checkpoint: the error feedback per
// parameter (its slice of the padded error); Q and the padding's error per
// bucket, keyed by the bucket's first parameter index (torch keys all three
// by bucket index). A rebuild hands Q and the padding's error on only to a
// bucket with the same first parameter and numel; a loaded checkpoint's go
// to the bucket with that first parameter if their shapes fit. Otherwise Q
// is drawn again and the padding's error restarts at zero. Note that the
// numbers depend on the layout (a bucket is one matrix): a run resumed in
// another bucket layout is not the uninterrupted run, under torch either.
// Collectives are issued as Note [pipelined hooks] says, so any number of
// buckets works on gloo too (torch's hook issues the Q allreduce from a
// callback).
#pragma once

#include <ATen/Tensor.h>
#include <c10/util/intrusive_ptr.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "powersgd_base.h"

namespace fastddp {

class BatchedPowerSGDHook : public PowerSGDBase {
 public:
  BatchedPowerSGDHook(c10::intrusive_ptr<c10d::ProcessGroup> group, PowerSGDOptions options,
                      NumpyRandomState rng);

  std::string name() const override { return "powersgd_batched"; }
  // Double-buffered (Note [double-buffered step state]): the new error goes
  // into M's copy, in the pass that computes it, the step's Q into a spare.
  bool settles_own_state() const override { return true; }
  at::Tensor settle_step(const at::Tensor& finite) override;
  void discard_step() override;
  void on_new_buckets(const std::vector<Bucket>& buckets) override;
  // The bucket's bytes before compression starts; then P and Q (side x r each).
  int64_t wire_bytes(const Bucket& bucket) const override;

 protected:
  std::shared_ptr<Stage> start(Bucket& bucket, size_t index, bool is_last,
                               c10::intrusive_ptr<c10::ivalue::Future>& done) override;
  void finish(Stage& stage) override;

 private:
  struct BucketState {
    // The layout, to carry state per parameter: offsets in M (packed),
    // flat_offsets in the bucket (padded when aligned).
    std::vector<int64_t> params, offsets, flat_offsets, numels;
    int64_t numel = 0, side = 0;
    at::Tensor padded;  // M: the gradient zero-padded to side * side
    at::Tensor error;   // side * side, with use_error_feedback
    at::Tensor p, q;    // side x r
    bool q_ready = false;  // q holds last step's Q (warm start)
    at::Tensor q_spare;  // this step's Q, with warm start (q is then only read)
    at::Tensor copy;    // M before compression, then the new error, with use_error_feedback
    bool pending = false;  // this step wrote copy and q_spare: settle_step decides
  };
  struct BatchedStage;

  std::shared_ptr<BucketState> bucket_state(const Bucket& bucket, size_t index);
  void adopt_carried(BucketState& state);
  // Adds a bucket's state to the per-parameter / per-bucket maps.
  void carry(const BucketState& state, PowerSGDCheckpoint& into) const;
  // errors: per parameter; bucket_qs (warm start only) and
  // bucket_error_tails: per bucket, keyed by its first parameter index.
  void carry_buckets(PowerSGDCheckpoint& into) const override;
  void drop_buckets() override { states_.clear(); }
  // A "powersgd" checkpoint (per-parameter Qs) is not this hook's.
  void check_checkpoint(const PowerSGDCheckpoint& checkpoint) const override;

  // Guarded by mutex_.
  std::map<size_t, std::shared_ptr<BucketState>> states_;
};

// ceil(sqrt(numel)) in integers (torch: math.ceil(math.sqrt(numel)), equal
// for any bucket that fits in memory).
int64_t batched_powersgd_side(int64_t numel);

}  // namespace fastddp
