// mixed_precision's reduction: torch DDP's _reducer_allreduce_and_upcast_hook
// (torch/distributed/algorithms/ddp_comm_hooks/mixed_precision_hooks.py), which
// torch registers itself when DDP is given a _MixedPrecision, with its casts
// fused into the reducer's copies (Note [mixed precision] in reducer/reducer.h):
//   copy_in     the param_dtype gradient into the reduce_dtype bucket (one
//               copy that casts; torch copies into a param_dtype bucket and
//               casts the bucket, the same rounding since the gradient is
//               exactly representable in param_dtype),
//   run         allreduce(SUM) of the bucket, undivided,
//   write_back  the sum divided by the group size in reduce_dtype (torch's
//               bucket.buffer().div_(process_group.size())), then copied, cast
//               up, into the full-precision .grad.
#pragma once

#include <c10/util/intrusive_ptr.h>

#include "../../reducer/comm_hook.h"

namespace c10d {
class ProcessGroup;
}

namespace fastddp {

class UpcastAllreduceHook : public CommHook {
 public:
  explicit UpcastAllreduceHook(c10::intrusive_ptr<c10d::ProcessGroup> group);

  // torch's hook function's name, which torch's logging data reports as comm_hook.
  std::string name() const override { return "_reducer_allreduce_and_upcast_hook"; }
  void copy_in(Bucket& bucket, size_t slot, const at::Tensor& grad) override;
  c10::intrusive_ptr<c10::ivalue::Future> run(Bucket& bucket, size_t index,
                                              bool is_last) override;
  // Divides by the group size whatever join() asks (set_divisors is not
  // overridden), as torch's hook does.
  void write_back(Bucket& bucket, const c10::IValue& result,
                  std::vector<at::Tensor>& dsts) override;

 private:
  c10::intrusive_ptr<c10d::ProcessGroup> group_;
};

}  // namespace fastddp
