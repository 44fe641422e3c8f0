// Where a parameter's gradient lives during a backward.
//
// Note [distributed autograd]
// Under RPC distributed autograd (`with dist_autograd.context() as id:
// dist_autograd.backward(id, ...)`) the engine does not write param.grad: it
// keeps the gradients in the dist-autograd context and still runs the grad
// accumulators' post-hooks, with that context installed thread-locally. Like
// torch's reducer, fastddp captures the context in the first hook of a
// backward and then reads and writes every gradient through it, so the
// averaged gradients land where `dist_autograd.get_gradients(id)` finds them.
#pragma once

#include <ATen/Tensor.h>

#include <functional>
#include <memory>

namespace torch::distributed::autograd {
class DistAutogradContext;
}  // namespace torch::distributed::autograd

namespace fastddp {

class GradSlot {
 public:
  // Reads the calling thread's dist-autograd context (none outside one).
  // Called from a grad hook, which runs on that backward's thread.
  void capture();
  // Back to param.grad, at the end of a backward.
  void reset() { context_.reset(); }
  bool in_dist_autograd() const { return context_ != nullptr; }

  // Runs fn on the gradient of `param`; fn returns true when it assigned a
  // new tensor to its argument (in-place writes need not say so).
  void with_grad(const at::Tensor& param, const std::function<bool(at::Tensor&)>& fn) const;

 private:
  std::shared_ptr<torch::distributed::autograd::DistAutogradContext> context_;
};

}  // namespace fastddp
