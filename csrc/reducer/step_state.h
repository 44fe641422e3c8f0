// What a comm hook carries from step to step, put back after a bad step.
//
// Note [a bad step leaves no trace]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Error feedback and PowerSGD update state from every step's gradients (a
// residual err = v - q(v), the memories P, Q and M - P Q^T). One step whose
// gradients overflow (fp16 under GradScaler, which skips that optimizer step
// and goes on) would leave NaN or Inf there for good: every later step then
// reduces to non-finite values, the scaler skips them all, and the run stops
// learning without a word. So the reducer copies the hook's step state
// (CommHook::step_state) before a synchronized backward's first copy-in, and
// after the write-back checks the averaged gradients of every bucket: where
// one holds a NaN or an infinity, every state tensor takes back its value from
// before the step (a tensor this step created: zeros, as if never made). The
// reduced result is the same on every rank, so every rank decides alike. The
// check and the choice are device ops (a max-norm over the gradients, a
// select), never a host synchronization; on the CPU the choice is a branch.
// Under check_for_nan_in_grad the failed step puts the state back the same
// way. Hooks without state (allreduce, bf16 without error feedback) cost
// nothing here.
//
// A state that was already non-finite before the step is kept as the step
// leaves it, as torch's hooks keep theirs: torch's powerSGD_hook
// orthogonalizes a zero matrix (a parameter unused under
// find_unused_parameters, at rank <= 2) to NaN and carries that in its error
// feedback for good, and putting back every later step where that parameter
// is used would freeze every other parameter's state too (issue 43: the
// trunk's gradient then left torch's from the third compressed step). So a
// step is put back only when it would turn a finite state non-finite. On the
// CPU the snapshot is read for that only after a non-finite step; on a device
// it is one more max-norm over the snapshot.
#pragma once

#include <ATen/Tensor.h>

#include <vector>

namespace fastddp {

class StepState {
 public:
  // Before the step: copies of `tensors` (buffers kept from step to step).
  void snapshot(const std::vector<at::Tensor>& tensors);
  // Whether the last snapshot had anything to protect.
  bool empty() const { return saved_.empty(); }
  // After the write-back: `tensors` (the hook's state now) keep this step's
  // values where `finite` (all_finite of the averaged gradients) is true or
  // the snapshot was not all finite, else take back the snapshot's. Returns
  // whether the step's state stands (a 0-dim bool on `finite`'s device).
  at::Tensor keep_if_finite(const std::vector<at::Tensor>& tensors, const at::Tensor& finite);
  // After a failed step (check_for_nan_in_grad): the snapshot's values back.
  void restore(const std::vector<at::Tensor>& tensors);

 private:
  struct Saved {
    at::Tensor live;  // held, so that its memory is not another tensor's by the check
    at::Tensor copy;
  };
  // Where `keep` (a 0-dim bool on the tensors' device) is false, the state
  // before the step.
  void select(const std::vector<at::Tensor>& tensors, const at::Tensor& keep);

  std::vector<Saved> saved_;
};

// A 0-dim bool on the tensors' device: every element of every tensor finite.
at::Tensor all_finite(const std::vector<at::Tensor>& tensors);

}  // namespace fastddp
