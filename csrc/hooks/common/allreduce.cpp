#include "allreduce.h"

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include "../../util/message.h"
#include "../../util/step_cost.h"

namespace fastddp {

AllreduceHook::AllreduceHook(c10::intrusive_ptr<c10d::ProcessGroup> group)
    : group_(std::move(group)) {
  FASTDDP_CHECK(group_, "fastddp: AllreduceHook needs a process group");
  divide_by(group_->getSize());
}

void AllreduceHook::divide_by(int64_t factor) {
  FASTDDP_CHECK(factor > 0, "fastddp: the divide factor must be positive, got ", factor);
  if (factor == factor_ && inverse_.defined()) return;  // set every step: no op when unchanged
  factor_ = factor;
  inverse_ = at::scalar_tensor(1.0 / static_cast<double>(factor), at::kDouble);
  inverse_.unsafeGetTensorImpl()->set_wrapped_number(true);
}

void AllreduceHook::copy_in(Bucket& bucket, size_t slot, const at::Tensor& grad) {
  if (bucket.sparse) {  // a new tensor: the parameter's own .grad is not scaled
    bucket.sparse_grad = sparse_grad_or_zeros(bucket, grad).div(static_cast<double>(factor_));
    return;
  }
  at::Tensor& view = bucket.views[slot];
  if (!grad.defined()) {
    view.zero_();
    cost::add(cost::kCopyIn, static_cast<int64_t>(view.nbytes()));
  } else if (grad.is_alias_of(view) && same_elements(grad, view)) {
    cost::add(cost::kCopyIn, 2 * static_cast<int64_t>(view.nbytes()));
    // gradient_as_bucket_view: autograd accumulated into the bucket already, and torch's
    // reducer (is_alias_of) divides it in place. A kept handed-out gradient (Note
    // [gradients handed out]) is in its slot too, but with a storage of its own: it takes
    // the multiply below, torch's copy-in without gradient_as_bucket_view (x * (1/n) and
    // x / n differ in the last bit for n = 3).
    view.div_(factor_);
    check_grad(bucket, slot, view);  // x / factor is finite exactly when x is
  } else if (!fused_scale_into_view(bucket, slot, grad, 1.0 / static_cast<double>(factor_))) {
    at::mul_out(view, grad, inverse_);  // torch's copy-in, for the layouts the loop does not take
    cost::add(cost::kCopyIn, 2 * static_cast<int64_t>(view.nbytes()));
    check_grad(bucket, slot, view);
  }
}

c10::intrusive_ptr<c10::ivalue::Future> AllreduceHook::run(Bucket& bucket, size_t index, bool) {
  std::vector<at::Tensor> tensors{bucket.sparse ? bucket.sparse_grad : bucket.flat};
  note_launch(index, "allreduce of the bucket");
  return group_->allreduce(tensors)->getFuture();
}

}  // namespace fastddp
