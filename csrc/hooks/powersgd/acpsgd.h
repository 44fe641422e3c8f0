// ACP-SGD (Zhang et al., ICDCS 2023): PowerSGD's low-rank compression with one
// collective per bucket per step, alternating between P and Q.
//
// Note [acpsgd]
// PowerSGD sends P, orthogonalizes it, computes Q from it and sends Q: two
// dependent collectives per bucket with local work between them. ACP-SGD
// sends one factor per step and keeps the other from the step before, so a
// bucket costs one allreduce of the usual size, which pipelines like plain
// allreduce. Per bucket, on M = gradient + error (error feedback, always on),
// for each matrix worth compressing (PowerSGD's plan: an (n, m) view of a
// slot, rank r = min(n, m, rank), min_compression_rate) while `iter` counts
// steps from start_powerSGD_iter:
//   P step (even):  Q <- orth(Q)  (last Q step's reduced sum; random at first)
//                   P = M Q;      error = M - P Q^T (this rank's P)
//                   allreduce [uncompressed slots | P] (sums)
//                   gradient = P Q^T / world size
//   Q step (odd):   P <- orth(P)  (last P step's reduced sum)
//                   Q = M^T P;    error = M - P Q^T (this rank's Q)
//                   allreduce [uncompressed slots | Q]
//                   gradient = P Q^T / world size
// Uncompressed slots are sent as they are (their error stays zero) and
// divided by the world size. Before start_powerSGD_iter: plain allreduce of
// the mean, as PowerSGD's vanilla phase. The first Q is drawn as PowerSGD's
// (numpy's RandomState(random_seed), one draw per bucket). The algorithm is
// the authors' (github.com/lzhangbv/powersgd, acpsgd.py); orthogonalization
// is torch's PowerSGD's (powersgd_orthogonalize).
//
// State per bucket: the error, both factors. It is handed on per parameter
// across a bucket rebuild and in a checkpoint (P too: unlike PowerSGD's, it
// is state here), double-buffered (Note [double-buffered step state]) and
// settled by the hook (Note [a bad step leaves no trace]).
//
// The turn follows the steps taken: `iter` (the checkpoint's) counts only the
// steps whose state was kept, so that after a step put back (an overflow
// under GradScaler) the run goes on exactly as if that step had not been.
// The reducer says after each backward whether its state was kept
// (after_step); the hook reads that at its next step's first bucket, from a
// copy queued at the end of the last backward (on CUDA: into pinned memory,
// with an event, queried first: the host waits only if the device has not
// reached that copy yet). The turn cannot be decided on the device: P and Q
// differ in size, so the host must know which one the allreduce carries.
// A bucket whose state that step created starts again (and draws a new Q). A
// bucket with no state to go on from sends P whatever the turn.
#pragma once

#include <ATen/Tensor.h>
#include <c10/util/intrusive_ptr.h>

#include <c10/core/Event.h>

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "powersgd_base.h"

namespace fastddp {

class AcpSgdHook : public PowerSGDBase {
 public:
  AcpSgdHook(c10::intrusive_ptr<c10d::ProcessGroup> group, PowerSGDOptions options,
             NumpyRandomState rng);

  std::string name() const override { return "acpsgd"; }
  void on_new_buckets(const std::vector<Bucket>& buckets) override;
  void after_step(const at::Tensor& kept) override;
  // The bucket's bytes before compression starts; then its uncompressed
  // slots and this step's factor (P or Q).
  int64_t wire_bytes(const Bucket& bucket) const override;

 protected:
  // One collective: the stage is always nullptr and `done` the bucket's future.
  std::shared_ptr<Stage> start(Bucket& bucket, size_t index, bool is_last,
                               c10::intrusive_ptr<c10::ivalue::Future>& done) override;
  void finish(Stage& stage) override;

 private:
  struct BucketState {
    std::vector<int64_t> params, offsets, numels;
    // Per slot, where its P (n x r) and Q (m x r) are in the wires (-1: not compressed).
    std::vector<int64_t> p_offsets, q_offsets, rows, cols, ranks;
    at::Tensor error;   // the bucket's numel; zero on uncompressed slots
    at::Tensor source;  // M = gradient + error; then the new error (settle_step)
    at::Tensor wire_p;  // [uncompressed | P]
    at::Tensor wire_q;  // [uncompressed | Q]
    // The step's wires: the factors are read from wire_p and wire_q once,
    // copied in, and the step works on these (Note [double-buffered step state]).
    at::Tensor p_spare, q_spare;
    bool pending = false;  // this step wrote source and the spares: settle_step decides
    bool fresh = false;    // this step made the factors (nothing was read)
    int64_t head = 0;      // the wires' uncompressed part (scratch, not state)
    // Its factors came from a compressed step or a carried state: it can take
    // either turn (else it sends P, from a drawn Q).
    bool has_factors = false;
    PowerSGDWorkCache views;  // the step's views of the tensors above and the bucket
  };

  bool even_step() const;  // iter - start_powerSGD_iter is even: P's turn
  // At a step's first bucket: takes back the last step's turn if its state
  // was put back (see after_step).
  void settle_last_step();
  std::shared_ptr<BucketState> bucket_state(const Bucket& bucket, size_t index,
                                            const PowerSGDPlan& plan, bool& randomize);
  void adopt_carried(BucketState& state, bool& randomize);
  c10::IValue decompress(BucketState& state, PowerSGDWork& work, const at::Tensor& input,
                         const at::Tensor& wire, int64_t uncompressed_numel);
  bool ps_are_state() const override { return true; }
  bool settles_own_state() const override { return true; }
  at::Tensor settle_step(const at::Tensor& finite) override;
  void discard_step() override;
  void loaded() override;
  void carry_buckets(PowerSGDCheckpoint& into) const override;
  void drop_buckets() override { states_.clear(); }

  // Guarded by mutex_.
  std::map<size_t, std::shared_ptr<BucketState>> states_;
  // The step's bookkeeping, touched by run() and after_step() (the autograd
  // thread) only.
  bool step_open_ = false;       // a bucket of this step has run
  int64_t iter_at_open_ = 0;     // iter when it did
  std::vector<size_t> created_;  // buckets whose state this step created
  bool settle_pending_ = false;
  at::Tensor last_kept_;                 // CPU bool; undefined: the step stands
  std::optional<c10::Event> kept_ready_;  // the copy into last_kept_, on a device
  int64_t last_iter_at_open_ = 0;
  std::vector<size_t> last_created_;
};

}  // namespace fastddp
