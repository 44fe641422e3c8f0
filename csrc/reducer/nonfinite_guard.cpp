#include "nonfinite_guard.h"

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

namespace fastddp {

NonFiniteGuard::NonFiniteGuard(int rank, int world_size) : rank_(rank), world_size_(world_size) {}

void NonFiniteGuard::begin_step() {
  host_first_ = 0;
  device_first_ = at::Tensor();
  work_.reset();
}

void NonFiniteGuard::note(size_t param, bool nonfinite) {
  if (nonfinite && host_first_ == 0) host_first_ = static_cast<int64_t>(param) + 1;
}

void NonFiniteGuard::note_tensor(size_t param, const at::Tensor& grad) {
  if (grad.is_cpu()) {
    note(param, !at::isfinite(grad).all().item<bool>());
    return;
  }
  const at::NoGradGuard no_grad;
  at::Tensor bad = at::logical_not(at::isfinite(grad)).any();
  if (!device_first_.defined()) {
    device_first_ = at::zeros({}, grad.options().dtype(at::kLong));
  }
  // Keeps the first non-finite parameter: where nothing was found yet.
  device_first_ = at::where(bad.logical_and(device_first_.eq(0)),
                            static_cast<int64_t>(param) + 1, device_first_);
}

void NonFiniteGuard::launch(c10d::ProcessGroup& group, const at::Device& device, int64_t step) {
  if (work_) return;
  shared_ = at::zeros({2 * world_size_}, at::TensorOptions().dtype(at::kLong).device(device));
  at::Tensor mine = shared_.narrow(0, 2 * rank_, 2);
  at::Tensor first = at::full({}, host_first_, mine.options());
  if (device_first_.defined()) {
    first = at::where(first.eq(0), device_first_.to(device), first);
  }
  mine.select(0, 0).copy_(first);
  mine.select(0, 1).fill_(step);
  std::vector<at::Tensor> tensors{shared_};
  work_ = group.allreduce(tensors);
}

std::vector<NonFiniteGuard::Finding> NonFiniteGuard::wait() {
  std::vector<Finding> found;
  if (!work_) return found;
  work_->wait();
  work_.reset();
  const at::Tensor host = shared_.cpu();  // the step's one host sync on CUDA
  const int64_t* values = host.data_ptr<int64_t>();
  for (int r = 0; r < world_size_; ++r) {
    if (values[2 * r] != 0) {
      found.push_back({r, static_cast<size_t>(values[2 * r] - 1), values[2 * r + 1]});
    }
  }
  return found;
}

}  // namespace fastddp
