// The step's finiteness: check_for_nan_in_grad's guard over the gradients
// copied in (NonFiniteGuard, Note [non-finite guard]), and the check of the
// averaged gradients the write-backs produced (Note [a bad step leaves no
// trace]), which a hook with state settles by and the tuner reads
// (set_track_finite); FiniteChecks holds both for the reducer.
//
// check_for_nan_in_grad: every rank learns, once per step, whether any rank's
// gradients held a NaN or an infinity, and which parameter, before the
// averaged gradients are written into param.grad.
//
// Note [non-finite guard]
// copy_in notes each gradient as it is copied into its bucket: the check is
// fused into that copy (kernels/nonfinite.h, and the 16-bit compression in
// kernels/half_cast.h), on the host a returned bool, on CUDA a per-parameter
// flag in device memory (no host sync); gradients no fused loop takes (other
// dtypes, odd strides) get a separate device-side reduction. At the end of backward each rank
// contributes (1 + index of its first non-finite parameter, its step) to one
// small allreduce, issued after the buckets' collectives on every rank; the
// reducer reads it once (the step's only host sync on CUDA) and raises, on
// every rank, before any averaged gradient reaches param.grad.
//
// Note [a bad step leaves no trace]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Error feedback and PowerSGD update state from every step's gradients (a
// residual err = v - q(v), the memories P, Q and M - P Q^T). One step whose
// gradients overflow (fp16 under GradScaler, which skips that optimizer step
// and goes on) would leave NaN or Inf there for good: every later step then
// reduces to non-finite values, the scaler skips them all, and the run stops
// learning without a word. So every stateful hook writes a step's new state
// beside the state it read (Note [double-buffered step state], comm_hook.h),
// and after the write-back the reducer checks the averaged gradients of every
// bucket (all_finite below): where one holds a NaN or an infinity, the state
// read stands (a tensor this step created: zeros, as if never made). The
// reduced result is the same on every rank, so every rank decides alike. On a
// device the check and the choice are device ops (a max-norm over the
// gradients, a launch that returns at once on a finite step), never a host
// synchronization; on the CPU the choice is a branch. Under
// check_for_nan_in_grad the failed step keeps the state read the same way
// (CommHook::discard_step). Hooks without state (allreduce, bf16 without
// error feedback) cost nothing here.
//
// A state that was already non-finite before the step is kept as the step
// leaves it, as torch's hooks keep theirs: torch's powerSGD_hook
// orthogonalizes a zero matrix (a parameter unused under
// find_unused_parameters, at rank <= 2) to NaN and carries that in its error
// feedback for good, and putting back every later step where that parameter
// is used would freeze every other parameter's state too (issue 43: the
// trunk's gradient then left torch's from the third compressed step). So a
// step is put back only when it would turn a finite state non-finite. On the
// CPU the state read is looked at for that only after a non-finite step; on a
// device a small witness of it (PowerSGD's Q) is one more max-norm.
#pragma once

#include <ATen/Tensor.h>
#include <c10/util/intrusive_ptr.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

namespace c10d {
class ProcessGroup;
class Work;
}  // namespace c10d

namespace fastddp {

// A 0-dim bool on the tensors' device: every element of every tensor finite.
at::Tensor all_finite(const std::vector<at::Tensor>& tensors);

// Whether a CPU tensor holds only finite values, on the host: fastddp's
// branch-free loop (kernels/nonfinite.h) over dense float32/float64 memory,
// threaded in chunks; ATen otherwise. Shared by all_finite and
// check_for_nan_in_grad's copy-in check (CommHook::check_grad).
bool cpu_all_finite(const at::Tensor& t);

class NonFiniteGuard {
 public:
  NonFiniteGuard(int rank, int world_size, size_t num_params);

  // A new backward: forget the previous step's findings.
  void begin_step();
  // copy_in checked parameter `param` on the host.
  void note(size_t param, bool nonfinite);
  // For a copy-in kernel on an accelerator: parameter `param`'s int32 flag
  // in device memory (zero at the start of the step), which the kernel sets
  // to 1 when the gradient is not finite.
  int32_t* device_flag(size_t param, const at::Tensor& like);
  // copy_in could not fuse the check: reduce `grad` on its device instead.
  void note_tensor(size_t param, const at::Tensor& grad);
  // Starts the allreduce of every rank's finding; `step` names this step in
  // errors. No-op if launched already this step.
  void launch(c10d::ProcessGroup& group, const at::Device& device, int64_t step);

  struct Finding {
    int rank;
    size_t param;
    int64_t step;
  };
  // Waits for the allreduce: the ranks whose gradients were not finite.
  std::vector<Finding> wait();

 private:
  int rank_;
  int world_size_;
  size_t num_params_;
  int64_t host_first_ = 0;  // 1 + parameter index, 0: all finite so far
  at::Tensor flags_;        // int32 per parameter, on the gradients' device
  bool flags_armed_ = false;  // flags_ zeroed for this step
  at::Tensor shared_;        // [2 * world]: per rank (1 + param or 0, step)
  c10::intrusive_ptr<c10d::Work> work_;
};

class FiniteChecks {
 public:
  FiniteChecks();
  // `guard`: check_for_nan_in_grad, among `world_size` ranks over `num_params`.
  FiniteChecks(bool guard, int rank, int world_size, size_t num_params);
  FiniteChecks(FiniteChecks&&) noexcept;
  FiniteChecks& operator=(FiniteChecks&&) noexcept;
  ~FiniteChecks();

  // check_for_nan_in_grad's guard, nullptr without it.
  NonFiniteGuard* guard() const { return guard_.get(); }
  // The guard found a non-finite gradient: the failing step tells the hook.
  void note_guard_failed() { guard_failed_ = true; }
  bool take_guard_failed();

  // A new synchronized backward: nothing collected, nothing found yet.
  void begin_step();
  // The write-back's averaged gradients, checked at the end of the step when
  // someone reads the result: the tuner, or a hook that settles its state.
  void collect(const std::vector<at::Tensor>& reduced, bool hook_settles);
  // The end of the step: a 0-dim bool, all collected gradients finite
  // (undefined: nothing was collected). No host sync.
  at::Tensor check();
  // A failed step: the collected gradients are dropped unchecked.
  void drop() { reduced_.clear(); }

  // Whether each step's check is kept for last_step_finite(), and its result:
  // nullopt when off or no step finished since. Reading it waits for the device.
  void set_tracking(bool on);
  std::optional<bool> last_step_finite() const;

 private:
  std::unique_ptr<NonFiniteGuard> guard_;  // check_for_nan_in_grad only
  bool guard_failed_ = false;  // the failing step was non-finite: after_step(false)
  std::vector<at::Tensor> reduced_;  // this step's averaged gradients
  bool track_ = false;
  at::Tensor last_;  // 0-dim bool, the last step's check (tracking only)
};

}  // namespace fastddp
