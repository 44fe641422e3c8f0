// The used-bitmap and its allreduce (Note [unused parameters]).
#include "unused_parameters.h"

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <algorithm>

namespace fastddp {

UnusedParameters::UnusedParameters(size_t num_params, const at::Device& device) {
  const auto n = static_cast<int64_t>(num_params);
  map_ = at::zeros({n}, at::kInt);
  map_dev_ = at::zeros({n}, at::TensorOptions().dtype(at::kInt).device(device));
}

bool UnusedParameters::contains(size_t index) const {
  return std::binary_search(unused_.begin(), unused_.end(), index);
}

bool UnusedParameters::take_marking() {
  if (marked_) return false;
  marked_ = true;
  return true;
}

void UnusedParameters::note_used(size_t index) { map_.data_ptr<int32_t>()[index] = 1; }

void UnusedParameters::launch_allreduce(c10d::ProcessGroup& group) {
  if (map_dev_.is_cuda()) {
    // A pinned staging copy: the host map may change again before the
    // asynchronous upload runs.
    at::Tensor staging = at::empty_like(map_, map_.options().pinned_memory(true));
    staging.copy_(map_);
    map_dev_.copy_(staging, /*non_blocking=*/true);
  } else {
    map_dev_.copy_(map_);
  }
  std::vector<at::Tensor> tensors{map_dev_};
  work_ = group.allreduce(tensors);
  reduced_ = false;
}

bool UnusedParameters::globally_unused(size_t index) {
  if (map_.data_ptr<int32_t>()[index] != 0) return false;
  if (!reduced_ && work_) {
    // Only a locally unused parameter waits for the bitmap (host sync on
    // CUDA, as in torch); models that use every parameter never do.
    work_->wait();
    map_.copy_(map_dev_);
    reduced_ = true;
  }
  return map_.data_ptr<int32_t>()[index] == 0;
}

void UnusedParameters::wait() {
  if (work_ && !reduced_) work_->wait();
}

void UnusedParameters::reduce_zeros(c10d::ProcessGroup& group) {
  map_.zero_();
  launch_allreduce(group);
  work_->wait();
  reduced_ = true;
}

void UnusedParameters::zero(bool unread) {
  map_.zero_();
  if (unread) reduced_ = false;
}

}  // namespace fastddp
