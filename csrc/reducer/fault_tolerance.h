// The reducer under a fault-tolerant engine (torchft): a failed collective
// fails the step instead of the backward, the hook state waits for the
// step's commit, and the step's contributors are the quorum's.
//
// Note [fault-tolerant step]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~
// torchft (python/fastddp/integrations/torchft.py) forms a quorum of replica
// groups every step and commits a step only where every participant's
// collectives succeeded (Manager.should_commit). Three things differ from a
// torchrun job, all switched on by that integration only:
//  - A collective that fails (a replica died mid-step) must not raise out of
//    backward: the step is failed as fail_iteration fails it (the hook's
//    state read stands, Note [double-buffered step state]), the error goes to
//    the sink (the manager's report_error, one Python call, only on a failure)
//    and backward returns; no later bucket of the step is launched.
//    check_for_nan_in_grad's finding still raises: it is about the user's
//    gradients, not the replicas.
//  - The hook's new state is kept only if the step is committed, which is
//    decided after backward, by every replica: settle_step() waits for
//    settle_pending(commit), called before the next step (or before the state
//    is read or replaced), and discard_step() runs for an uncommitted step,
//    as for an overflow step.
//  - The mean divides by the step's participants, which may be fewer than the
//    group's ranks (a replica that is healing is in the group and sends zeros,
//    as torchft's allreduce does): set_participants().
#pragma once

#include <ATen/Tensor.h>

#include <cstdint>
#include <functional>
#include <string>
#include <utility>

namespace fastddp {

class FaultTolerance {
 public:
  using Sink = std::function<void(const std::string&)>;

  // A sink switches the whole mode on (failed steps reported, settles deferred).
  void set_sink(Sink sink) { sink_ = std::move(sink); }
  bool on() const { return static_cast<bool>(sink_); }
  // A failed step's text, noted under the reducer's lock and reported after
  // it is released (the sink calls Python, which takes the GIL).
  void note_failure(std::string what) { failure_ = std::move(what); }
  bool has_failure() const { return !failure_.empty(); }
  std::string take_failure() { return std::exchange(failure_, std::string()); }
  void report(const std::string& what) const { sink_(what); }

  // The step's participants (0: the group's size) and whether this rank is one.
  void set_participants(int64_t count, bool contributes) {
    participants_ = count;
    contributes_ = contributes;
  }
  int64_t participants(int world_size) const {
    return participants_ > 0 ? participants_ : world_size;
  }
  bool contributes() const { return contributes_; }

  // The finished step's settle, held until its commit is known.
  void hold(at::Tensor finite) {
    held_finite_ = std::move(finite);
    holding_ = true;
  }
  bool holding() const { return holding_; }
  at::Tensor release() {
    holding_ = false;
    return std::move(held_finite_);
  }

 private:
  Sink sink_;
  std::string failure_;
  int64_t participants_ = 0;
  bool contributes_ = true;
  bool holding_ = false;
  at::Tensor held_finite_;
};

}  // namespace fastddp
