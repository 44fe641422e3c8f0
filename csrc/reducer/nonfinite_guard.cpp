#include "nonfinite_guard.h"

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include "../util/message.h"
#include "../util/step_cost.h"

namespace fastddp {

NonFiniteGuard::NonFiniteGuard(int rank, int world_size, size_t num_params)
    : rank_(rank), world_size_(world_size), num_params_(num_params) {}

void NonFiniteGuard::begin_step() {
  host_first_ = 0;
  flags_armed_ = false;  // zeroed on first use: a CPU model never allocates them
  work_.reset();
}

void NonFiniteGuard::note(size_t param, bool nonfinite) {
  if (nonfinite && host_first_ == 0) host_first_ = static_cast<int64_t>(param) + 1;
}

int32_t* NonFiniteGuard::device_flag(size_t param, const at::Tensor& like) {
  FASTDDP_CHECK(param < num_params_, "fastddp: parameter index ", param, " out of range");
  if (!flags_.defined() || flags_.device() != like.device()) {
    flags_ = at::zeros({static_cast<int64_t>(num_params_)},
                       like.options().dtype(at::kInt));
  } else if (!flags_armed_) {
    flags_.zero_();  // asynchronous, on the current stream, as the kernels
  }
  flags_armed_ = true;
  return flags_.data_ptr<int32_t>() + param;
}

void NonFiniteGuard::note_tensor(size_t param, const at::Tensor& grad) {
  if (grad.is_cpu()) {
    note(param, !at::isfinite(grad).all().item<bool>());
    return;
  }
  const at::NoGradGuard no_grad;
  device_flag(param, grad);
  at::Tensor bad = at::logical_not(at::isfinite(grad)).any().to(at::kInt);
  flags_.narrow(0, static_cast<int64_t>(param), 1).bitwise_or_(bad);
}

void NonFiniteGuard::launch(c10d::ProcessGroup& group, const at::Device& device, int64_t step) {
  if (work_) return;
  shared_ = at::zeros({2 * world_size_}, at::TensorOptions().dtype(at::kLong).device(device));
  at::Tensor mine = shared_.narrow(0, 2 * rank_, 2);
  at::Tensor first = at::full({}, host_first_, mine.options());
  if (flags_armed_) {
    // The first flagged parameter (argmax takes the first of equal maxima),
    // on the device: no host sync here.
    const at::Tensor flagged = flags_.max().gt(0).to(device);
    const at::Tensor index = flags_.argmax().to(at::kLong).add(1).to(device);
    first = at::where(first.eq(0).logical_and(flagged), index, first);
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
  cost::host_sync(shared_);
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
