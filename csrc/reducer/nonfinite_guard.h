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
#pragma once

#include <ATen/Tensor.h>
#include <c10/util/intrusive_ptr.h>

#include <cstdint>
#include <vector>

namespace c10d {
class ProcessGroup;
class Work;
}  // namespace c10d

namespace fastddp {

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

}  // namespace fastddp
