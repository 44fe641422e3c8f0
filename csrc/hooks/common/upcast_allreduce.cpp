#include "upcast_allreduce.h"

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include "../../util/message.h"

namespace fastddp {

UpcastAllreduceHook::UpcastAllreduceHook(c10::intrusive_ptr<c10d::ProcessGroup> group)
    : group_(std::move(group)) {
  FASTDDP_CHECK(group_, "fastddp: UpcastAllreduceHook needs a process group");
}

void UpcastAllreduceHook::copy_in(Bucket& bucket, size_t slot, const at::Tensor& grad) {
  // fastddp refuses mixed_precision with sparse gradients at construction.
  FASTDDP_INTERNAL_ASSERT(!bucket.sparse, "mixed precision bucket is sparse");
  if (!grad.defined()) {
    bucket.views[slot].zero_();
    return;
  }
  scale_into_view(bucket, slot, grad, 1.0);  // copy_: the cast to reduce_dtype rides on it
}

c10::intrusive_ptr<c10::ivalue::Future> UpcastAllreduceHook::run(Bucket& bucket, size_t index,
                                                                 bool) {
  std::vector<at::Tensor> tensors{bucket.flat};
  note_launch(index, "allreduce of the bucket");
  return group_->allreduce(tensors)->getFuture();  // SUM: torch's _run_allreduce_hook
}

void UpcastAllreduceHook::write_back(Bucket& bucket, const c10::IValue& result,
                                     std::vector<at::Tensor>& dsts) {
  at::Tensor sum = result_tensor(result);
  // In reduce_dtype, after the sum: torch's order, so a 16-bit reduce_dtype rounds the
  // sum and then the quotient exactly as torch does (an integer Scalar, as Python's
  // div_(int) passes it).
  sum.div_(static_cast<int64_t>(group_->getSize()));
  copy_flat_to_grads(bucket, sum, dsts);  // copy_ into the fp32 .grad: the upcast
}

}  // namespace fastddp
