// A parameter's gradient during a backward: the reducer's post-hooks on the
// parameters' grad accumulators (plain C++ called by the autograd engine, no
// GIL, no Python object), each telling the reducer that one parameter's
// gradient is ready, and where that gradient lives (GradSlot).
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
#include <torch/csrc/autograd/variable.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace torch::distributed::autograd {
class DistAutogradContext;
}  // namespace torch::distributed::autograd

namespace fastddp {

// std::shared_ptr<Node> before torch 2.13, c10::intrusive_ptr<Node> from 2.13.
using GradAccumulatorPtr =
    decltype(torch::autograd::impl::grad_accumulator(std::declval<const at::Tensor&>()));

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

class GradHooks {
 public:
  // `on_ready(i)` runs when parameter i's gradient has been accumulated.
  explicit GradHooks(std::function<void(size_t)> on_ready) : on_ready_(std::move(on_ready)) {}
  ~GradHooks();  // removes every hook
  GradHooks(const GradHooks&) = delete;
  GradHooks& operator=(const GradHooks&) = delete;

  // Puts the hook on parameter i's current grad accumulator, moving it from
  // the one it was on if that changed (a dtype change makes a new one).
  void hook(size_t i, const at::Tensor& param, const std::string& name);
  // Parameter i's accumulator, the node the unused-parameter search looks for.
  const torch::autograd::Node* accumulator(size_t i) const { return accumulators_[i].get(); }

  // Where the gradients of the backward in flight live (Note [distributed autograd]).
  GradSlot& slot() { return slot_; }
  const GradSlot& slot() const { return slot_; }

 private:
  GradSlot slot_;  // Note [distributed autograd]
  std::function<void(size_t)> on_ready_;
  // The engine holds accumulators weakly; keeping them alive keeps our hooks.
  std::vector<GradAccumulatorPtr> accumulators_;
  std::vector<uintptr_t> keys_;
};

}  // namespace fastddp
