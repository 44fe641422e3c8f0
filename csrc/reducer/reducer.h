// The reducer: averages gradients across a process group while backward runs.
//
// Note [reducer step]
// forward:  before_forward() finishes any bucket rebuild, after_forward(sync)
//           arms the gradient hooks (or leaves them idle under no_sync()).
// backward: a C++ post-hook on each parameter's grad accumulator copies the
//           gradient, scaled by 1/world_size, into its bucket; a bucket whose
//           gradients are all in launches its allreduce at once, buckets
//           strictly in order, while backward keeps running.
// end:      once the last bucket is launched, an autograd-engine callback waits
//           for the collectives and writes the results into param.grad, so the
//           grads are final when backward() returns.
#pragma once

#include <ATen/Tensor.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/csrc/autograd/variable.h>

#include <cstdint>
#include <mutex>
#include <utility>
#include <string>
#include <vector>

#include "bucket.h"

namespace c10d {
class ProcessGroup;
}

namespace fastddp {

// std::shared_ptr<Node> before torch 2.13, c10::intrusive_ptr<Node> from 2.13.
using GradAccumulatorPtr =
    decltype(torch::autograd::impl::grad_accumulator(std::declval<const at::Tensor&>()));

struct ReducerOptions {
  // param.grad become views into the buckets: no copy in or out.
  bool gradient_as_bucket_view = false;
  // Size limits for the one rebuild after the first iteration, as in
  // plan_buckets (torch's are {first_bucket_bytes, bucket_bytes_cap}).
  std::vector<size_t> rebuild_limits = {1024 * 1024, 25 * 1024 * 1024};
};

class Reducer {
 public:
  // `params` are the parameters that require grad, each once; `names` their
  // qualified names (for error messages); `plan` the initial buckets.
  Reducer(std::vector<at::Tensor> params, std::vector<std::string> names,
          std::vector<std::vector<size_t>> plan, c10::intrusive_ptr<c10d::ProcessGroup> group,
          ReducerOptions options);
  ~Reducer();
  Reducer(const Reducer&) = delete;
  Reducer& operator=(const Reducer&) = delete;

  // Called at the start of a forward with grad enabled. Raises if the previous
  // backward stopped half-way; rebuilds the buckets once after the first
  // synchronized iteration. Returns true when it rebuilt them.
  bool before_forward();
  // Called after a forward with grad enabled: `sync` arms the hooks for the
  // next backward, otherwise (no_sync) grads accumulate locally.
  void after_forward(bool sync);

  std::vector<std::vector<size_t>> bucket_plan() const;
  std::vector<int64_t> bucket_bytes() const;
  bool has_rebuilt_buckets() const { return has_rebuilt_; }
  int64_t num_backward_syncs() const { return num_syncs_; }

 private:
  enum class Phase {
    kIdle,       // no synchronized backward expected: hooks do nothing
    kExpecting,  // armed by after_forward(true)
    kReduced,    // this forward's backward is done; another one is an error
  };

  void install_hooks();
  void on_grad_ready(size_t index);
  void copy_grad_into_bucket(size_t index, Bucket& bucket, size_t slot);
  void launch(Bucket& bucket);
  void finalize_backward();
  void write_back(Bucket& bucket);
  void rebuild_buckets();
  std::vector<std::vector<size_t>> broadcast_plan(const std::vector<std::vector<size_t>>& plan);
  void reset_bucket_views();
  std::string names_of_unready_params() const;

  std::vector<at::Tensor> params_;
  std::vector<std::string> names_;
  c10::intrusive_ptr<c10d::ProcessGroup> group_;
  ReducerOptions options_;
  int rank_;
  int world_size_;
  at::Tensor inv_world_size_;  // wrapped-number scalar, as torch's reducer uses

  std::vector<Bucket> buckets_;
  // Where each parameter lives: bucket index and slot within the bucket.
  std::vector<std::pair<size_t, size_t>> locator_;

  std::vector<GradAccumulatorPtr> grad_accumulators_;
  std::vector<uintptr_t> hook_keys_;

  mutable std::mutex mutex_;
  Phase phase_ = Phase::kIdle;
  std::vector<bool> ready_;
  size_t num_ready_ = 0;
  size_t next_bucket_ = 0;
  int64_t num_syncs_ = 0;

  bool has_rebuilt_ = false;
  std::vector<size_t> ready_order_;  // recorded during the first synced backward
};

}  // namespace fastddp
