// PowerSGD gradient compression (Vogels et al., 2019), numerically torch's
// `powerSGD_hook` with the same `PowerSGDState` arguments.
//
// Note [powersgd]
// Per step, for every bucket (torch's algorithm, step for step):
//   iter < start_iter: divide by the world size, one allreduce (torch's
//     vanilla phase); the iteration counter moves on the last bucket.
//   otherwise, on the bucket's flat gradient M (unscaled, as torch's hooks get it):
//     error feedback: M += error[bucket]; keep a copy of M;
//     each slot viewed as an (n, m) matrix (n = its first dimension) is
//       compressed when (n + m) r * min_compression_rate < n m, with
//       r = min(n, m, rank); the others are allreduced as they are, then
//       divided by the world size;
//     matrices are grouped by (n, m) in order of first appearance (this order
//       lays out the P and Q memories and draws the random Q), and batched per
//       group when batch_tensors_with_same_shape;
//     Q: warm start reuses last step's (orthogonalized again); otherwise
//       randn on CPU from a generator seeded with numpy's
//       RandomState(random_seed).randint(1_000_000_000), one draw per bucket
//       initialization, in the order buckets are run; then orthogonalized;
//     P = M Q; allreduce P (a sum); orthogonalize P; Q = M^T P; allreduce Q;
//       Q /= world size; M = P Q^T in place;
//     error feedback: error[bucket] = copy - M.
// Orthogonalization is torch's: Gram-Schmidt (with epsilon) for r <= 2 or
// 16-bit dtypes, linalg.qr otherwise.
//
// Where fastddp differs from torch (not in the numbers):
//   - the uncompressed slots and P go out in one allreduce (one buffer,
//     [uncompressed | P]); torch sends two, one after the other;
//   - Q's allreduce is pipelined with the next bucket (Note [pipelined
//     hooks]), so any bucket size works, on gloo too;
//   - state (error, Q) is per parameter across a bucket rebuild and in a
//     checkpoint (powersgd_state.cpp), where torch keys it by bucket index;
//   - the state is double-buffered (Note [double-buffered step state]): the
//     new error goes into M's buffer, in the pass that computes it, and the
//     step's Q into a spare; settle_step() swaps them in when the step
//     stands. The one copy per step is Q's (m r per matrix), into the spare,
//     because the orthogonalization works in place.
#pragma once

#include <ATen/Tensor.h>
#include <c10/util/intrusive_ptr.h>

#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "powersgd_base.h"

namespace fastddp {

class PowerSGDHook : public PowerSGDBase {
 public:
  PowerSGDHook(c10::intrusive_ptr<c10d::ProcessGroup> group, PowerSGDOptions options,
               NumpyRandomState rng);

  std::string name() const override { return "powersgd"; }
  // Note [error feedback in the copy-in]
  void copy_in(Bucket& bucket, size_t slot, const at::Tensor& grad) override;
  void on_new_buckets(const std::vector<Bucket>& buckets) override;
  // The bucket's bytes before compression starts; then the uncompressed
  // slots plus the P and Q memories.
  int64_t wire_bytes(const Bucket& bucket) const override;
  bool settles_own_state() const override { return true; }
  at::Tensor settle_step(const at::Tensor& finite) override;
  void discard_step() override;

 protected:
  std::shared_ptr<Stage> start(Bucket& bucket, size_t index, bool is_last,
                               c10::intrusive_ptr<c10::ivalue::Future>& done) override;
  void finish(Stage& stage) override;

 private:
  struct BucketState {
    // The layout it was made for, to hand its state on per parameter.
    std::vector<int64_t> params, offsets, numels;
    std::vector<int64_t> q_offsets, q_rows, q_cols;  // per compressed slot; -1 offset: none
    // Where each compressed slot's P (p_rows x q_cols) is in `wire` (-1: none).
    std::vector<int64_t> p_offsets, p_rows;
    at::Tensor error;     // error feedback, the bucket's numel
    at::Tensor source;    // M = gradient + error, with error feedback; then the new error
    at::Tensor wire;      // [uncompressed | P]: one allreduce
    at::Tensor q_memory;  // every Q of the bucket, flat (the state: warm start)
    at::Tensor q_spare;   // this step's Q: the second allreduce
    bool pending = false;  // this step wrote source and q_spare: settle_step decides
    uint64_t bucket_id = 0;  // Bucket::id of the bucket it was made for
    // Per slot: this step's copy-in wrote M = gradient + error into `source`
    // (Note [error feedback in the copy-in]); start() adds the others.
    std::vector<bool> fed;
    // Carried Qs (q_offset, Q) to put in place once Q is initialized.
    std::vector<std::pair<int64_t, at::Tensor>> qs_after_draw;
    PowerSGDWorkCache views;  // the step's views of the tensors above and the bucket
  };
  struct PowerSGDStage;

  std::shared_ptr<BucketState> bucket_state(const Bucket& bucket, size_t index,
                                            const PowerSGDPlan& plan, bool& randomize);
  // The state made for `bucket` at an earlier compressed step, or none.
  std::shared_ptr<BucketState> existing_state(const Bucket& bucket) const;
  // M = gradient + error into `source` for the slots the copy-in did not feed.
  void add_error_feedback(BucketState& state, const Bucket& bucket) const;
  void adopt_carried(BucketState& state, const PowerSGDPlan& plan, bool& randomize);
  void count(const PowerSGDPlan& plan, size_t index, bool is_last, int64_t element_size);
  // The completion of the Q allreduce: M = P Q^T into the bucket, the new
  // error. Local work only (it runs in a completion callback).
  c10::IValue decompress(BucketState& state, PowerSGDWork& work, const at::Tensor& input,
                         const at::Tensor& input_copy);
  // A bucket's state into `into`'s errors and qs, per parameter (views).
  void carry(const BucketState& state, PowerSGDCheckpoint& into) const;
  void carry_buckets(PowerSGDCheckpoint& into) const override;
  void drop_buckets() override { states_.clear(); }

  // Guarded by mutex_.
  std::map<size_t, std::shared_ptr<BucketState>> states_;
};

}  // namespace fastddp
