// The reducer's post-hooks on the parameters' grad accumulators: plain C++
// called by the autograd engine (no GIL, no Python object), each telling the
// reducer that one parameter's gradient is ready.
#pragma once

#include <ATen/Tensor.h>
#include <torch/csrc/autograd/variable.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

namespace fastddp {

// std::shared_ptr<Node> before torch 2.13, c10::intrusive_ptr<Node> from 2.13.
using GradAccumulatorPtr =
    decltype(torch::autograd::impl::grad_accumulator(std::declval<const at::Tensor&>()));

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

 private:
  std::function<void(size_t)> on_ready_;
  // The engine holds accumulators weakly; keeping them alive keeps our hooks.
  std::vector<GradAccumulatorPtr> accumulators_;
  std::vector<uintptr_t> keys_;
};

}  // namespace fastddp
