// What a comm hook carries from step to step, kept only from good steps; and
// the finiteness checks that decide it.
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

#include <vector>

namespace fastddp {

// A 0-dim bool on the tensors' device: every element of every tensor finite.
at::Tensor all_finite(const std::vector<at::Tensor>& tensors);

// Whether a CPU tensor holds only finite values, on the host: fastddp's
// branch-free loop (kernels/nonfinite.h) over dense float32/float64 memory,
// threaded in chunks; ATen otherwise. Shared by all_finite and
// check_for_nan_in_grad's copy-in check (CommHook::check_grad).
bool cpu_all_finite(const at::Tensor& t);

}  // namespace fastddp
