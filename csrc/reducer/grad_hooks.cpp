// The grad-accumulator post-hooks, the error compiled autograd gets, and the
// gradient's slot (Note [distributed autograd]).
#include "grad_hooks.h"

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/utils/lambda_post_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/csrc/distributed/autograd/context/context.h>

#include "../util/message.h"

namespace fastddp {

GradHooks::~GradHooks() {
  for (size_t i = 0; i < accumulators_.size(); ++i) {
    if (accumulators_[i]) accumulators_[i]->del_post_hook(keys_[i]);
  }
}

void GradHooks::hook(size_t i, const at::Tensor& param, const std::string& name) {
  if (i >= accumulators_.size()) {
    accumulators_.resize(i + 1);
    keys_.resize(i + 1);
  }
  // `auto`: the pointer type changed in torch 2.13 (see GradAccumulatorPtr).
  auto accumulator = torch::autograd::impl::grad_accumulator(param);
  FASTDDP_CHECK(accumulator, "fastddp: parameter '", name, "' has no grad accumulator");
  if (accumulator == accumulators_[i]) return;
  if (accumulators_[i]) accumulators_[i]->del_post_hook(keys_[i]);
  // Compiled autograd cannot trace this hook: it asks for compiled_args first,
  // which raises a message naming the setting rather than torch's generic
  // "compiled_args nyi" (torch's own C++ reducer does the same;
  // fastddp/ddp/_compile.py says why).
  keys_[i] =
      accumulator->add_post_hook(std::make_unique<torch::autograd::utils::LambdaPostHook>(
          [this, i](const torch::autograd::variable_list& outputs,
                    const torch::autograd::variable_list&) {
            on_ready_(i);
            return outputs;
          },
          [](auto&) {
            FASTDDP_CHECK_NOT_IMPLEMENTED(
                false,
                "fastddp.DistributedDataParallel: backward under compiled autograd is not "
                "supported: fastddp's reducer hooks are C++ autograd hooks that compiled "
                "autograd cannot trace; as with torch's DistributedDataParallel, build the "
                "model under torch._dynamo.config.optimize_ddp=\"python_reducer\" for "
                "compiled autograd, or compile the model with the default eager backward");
          }));
  accumulators_[i] = std::move(accumulator);
}

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
