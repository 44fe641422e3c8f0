// The overlapped optimizer's native step for torch.optim.SGD, Adam and AdamW
// built with fused=True: torch's own fused kernels (at::_fused_sgd_,
// at::_fused_adam_, at::_fused_adamw_), called per bucket from C++ with no
// Python and no GIL once each parameter's state exists (Note [overlapped
// optimizer]; fastddp/ddp/_overlap_optimizer.py decides when it applies).
//
// Note [fused step, as torch's]
// It repeats what torch's _fused_sgd / _fused_adam do for one call, narrowed
// to a bucket's parameters that have a .grad: Adam's steps += 1
// (_foreach_add_) then the kernel; SGD's kernel with is_first_step when the
// call's momentum buffers were all just made (torch makes them empty_like the
// gradient and lets the kernel copy it in). The kernels are elementwise per
// tensor, so a bucket at a time gives the numbers of torch's one call. The
// state tensors are the optimizer's own (optimizer.state[p]), made by
// Python exactly as torch's _init_group makes them, on a parameter's first
// step only; the hyperparameters are read from its param_groups before each
// backward.
#pragma once

#include <ATen/Tensor.h>

#include <cstdint>
#include <functional>
#include <utility>
#include <vector>

#include "optimizer_step.h"

namespace fastddp {

struct FusedGroup {
  double lr = 0;
  double weight_decay = 0;
  // SGD
  double momentum = 0;
  double dampening = 0;
  bool nesterov = false;
  // Adam / AdamW
  double beta1 = 0;
  double beta2 = 0;
  double eps = 0;
  bool amsgrad = false;
  bool decoupled_weight_decay = false;  // AdamW
  bool maximize = false;
};

class FusedStep final : public OptimizerStep {
 public:
  enum class Kind { kSgd, kAdam };
  // Finds, or makes torch's way, the state of the given parameters: per
  // parameter, SGD [momentum_buffer] ([] without momentum), Adam [step,
  // exp_avg, exp_avg_sq(, max_exp_avg_sq)]; and whether each was just made
  // (a new momentum buffer is filled by the kernel's first step).
  using InitState = std::function<
      std::pair<std::vector<std::vector<at::Tensor>>, std::vector<bool>>(std::vector<size_t>)>;

  // `params`: the reducer's parameters; `group_of[i]`: parameter i's param
  // group in the optimizer, -1 if the optimizer does not hold it.
  FusedStep(Kind kind, std::vector<at::Tensor> params, std::vector<int64_t> group_of,
            InitState init_state);

  // Before each synchronized backward: the param groups' hyperparameters.
  void set_groups(std::vector<FusedGroup> groups) { groups_ = std::move(groups); }

  void step_bucket(const std::vector<size_t>& params) override;
  void end_of_backward() override {}

 private:
  void step_group(const FusedGroup& group, const std::vector<size_t>& params);

  Kind kind_;
  std::vector<at::Tensor> params_;
  std::vector<int64_t> group_of_;
  InitState init_state_;
  std::vector<FusedGroup> groups_;
  std::vector<std::vector<at::Tensor>> state_;  // per parameter ([] for SGD without momentum)
  std::vector<bool> known_;  // state_ holds the parameter's state (from its first step on)
  std::vector<bool> fresh_;  // SGD: its momentum buffer was just made, not yet filled
};

}  // namespace fastddp
