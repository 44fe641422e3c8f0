#include "grad_slot.h"

#include <torch/csrc/autograd/variable.h>
#include <torch/csrc/distributed/autograd/context/context.h>

namespace fastddp {

void GradSlot::capture() {
  context_ = torch::distributed::autograd::ThreadLocalDistAutogradContext::getContextPtr();
}

void GradSlot::with_grad(const at::Tensor& param,
                         const std::function<bool(at::Tensor&)>& fn) const {
  if (!context_) {
    fn(const_cast<at::Tensor&>(param).mutable_grad());
    return;
  }
  // torch's DistAutogradContext stores the tensor back only when fn says so.
  context_->runGradCallbackForVariable(param, fn);
}

}  // namespace fastddp
