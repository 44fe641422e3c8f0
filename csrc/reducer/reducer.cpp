#include "reducer.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <functional>
#include <sstream>

#include "nvtx.h"

#if defined(FASTDDP_WITH_CUDA)
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "../kernels/multi_tensor_copy.h"
#endif

namespace fastddp {
namespace {

// Runs a callback after a parameter's gradient was accumulated. Holds no GIL
// and no Python object: it is plain C++ called by the autograd engine.
class GradReadyHook : public torch::autograd::FunctionPostHook {
 public:
  explicit GradReadyHook(std::function<void()> fn) : fn_(std::move(fn)) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list&) override {
    fn_();
    return outputs;
  }

 private:
  std::function<void()> fn_;
};

}  // namespace

Reducer::Reducer(std::vector<at::Tensor> params, std::vector<std::string> names,
                 std::vector<std::vector<size_t>> plan,
                 c10::intrusive_ptr<c10d::ProcessGroup> group, ReducerOptions options)
    : params_(std::move(params)),
      names_(std::move(names)),
      group_(std::move(group)),
      options_(options) {
  TORCH_CHECK(group_, "fastddp: Reducer needs a process group");
  TORCH_CHECK(names_.size() == params_.size(), "fastddp: ", params_.size(), " parameters but ",
              names_.size(), " names");
  rank_ = group_->getRank();
  world_size_ = group_->getSize();
  inv_world_size_ = at::scalar_tensor(1.0 / world_size_, at::kDouble);
  inv_world_size_.unsafeGetTensorImpl()->set_wrapped_number(true);

  std::vector<size_t> seen(params_.size(), 0);
  for (const auto& bucket : plan) {
    for (size_t index : bucket) {
      TORCH_CHECK(index < params_.size(), "fastddp: bucket plan names parameter ", index,
                  " of ", params_.size());
      ++seen[index];
    }
  }
  for (size_t i = 0; i < params_.size(); ++i) {
    TORCH_CHECK(seen[i] == 1, "fastddp: parameter '", names_[i], "' appears ", seen[i],
                " times in the bucket plan; every parameter must be in exactly one bucket");
    TORCH_CHECK(params_[i].requires_grad(), "fastddp: parameter '", names_[i],
                "' does not require grad and must not be given to the reducer");
  }
  buckets_ = make_buckets(params_, plan);
  reset_bucket_views();
  ready_.assign(params_.size(), false);
  install_hooks();
}

Reducer::~Reducer() {
  for (size_t i = 0; i < grad_accumulators_.size(); ++i) {
    grad_accumulators_[i]->del_post_hook(hook_keys_[i]);
  }
}

void Reducer::install_hooks() {
  for (size_t i = 0; i < params_.size(); ++i) {
    // `auto`: the pointer type changed in torch 2.13 (see GradAccumulatorPtr).
    auto accumulator = torch::autograd::impl::grad_accumulator(params_[i]);
    TORCH_CHECK(accumulator, "fastddp: parameter '", names_[i], "' has no grad accumulator");
    hook_keys_.push_back(accumulator->add_post_hook(
        std::make_unique<GradReadyHook>([this, i] { on_grad_ready(i); })));
    // The engine holds accumulators weakly; keeping them alive keeps our hooks.
    grad_accumulators_.push_back(std::move(accumulator));
  }
}

bool Reducer::before_forward() {
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_CHECK(phase_ != Phase::kExpecting || num_ready_ == 0,
              "Expected to have finished reduction in the prior iteration before starting a new "
              "one. This error indicates that your module has parameters that were not used in "
              "producing loss. You can enable unused parameter detection by passing the keyword "
              "argument `find_unused_parameters=True` to `torch.nn.parallel."
              "DistributedDataParallel`, and by making sure all `forward` function outputs "
              "participate in calculating loss. Parameters which did not receive grad for rank ",
              rank_, ": ", names_of_unready_params());
  if (!has_rebuilt_ && phase_ == Phase::kReduced && ready_order_.size() == params_.size()) {
    rebuild_buckets();
    return true;
  }
  return false;
}

void Reducer::after_forward(bool sync) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!sync) {
    phase_ = Phase::kIdle;
    return;
  }
  phase_ = Phase::kExpecting;
  std::fill(ready_.begin(), ready_.end(), false);
  num_ready_ = 0;
  next_bucket_ = 0;
  for (Bucket& bucket : buckets_) bucket.pending = bucket.params.size();
}

void Reducer::on_grad_ready(size_t index) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (phase_ == Phase::kIdle) return;
  TORCH_CHECK(phase_ != Phase::kReduced, "fastddp: parameter '", names_[index],
              "' received a gradient after this iteration's gradients were already reduced. "
              "DistributedDataParallel reduces once per forward: a second backward through the "
              "same forward output is not supported. Run the forward again, or do the extra "
              "backward passes under no_sync().");
  TORCH_CHECK(!ready_[index],
              "Expected to mark a variable ready only once. This error is caused by one of the "
              "following reasons: 1) Use of a module parameter outside the `forward` function. "
              "2) Reused parameters in multiple reentrant backward passes (for example "
              "activation checkpointing with use_reentrant=True). Parameter '",
              names_[index], "' was marked ready twice on rank ", rank_, ".");
  ready_[index] = true;
  ++num_ready_;
  if (!has_rebuilt_) ready_order_.push_back(index);

  const auto [b, slot] = locator_[index];
  copy_grad_into_bucket(index, buckets_[b], slot);
  if (--buckets_[b].pending > 0) return;
  // Buckets launch strictly in order so that every rank issues the same
  // sequence of collectives, whatever order its gradients arrive in.
  while (next_bucket_ < buckets_.size() && buckets_[next_bucket_].pending == 0) {
    launch(buckets_[next_bucket_++]);
  }
  if (next_bucket_ == buckets_.size()) {
    torch::autograd::Engine::get_default_engine().queue_callback([this] { finalize_backward(); });
  }
}

void Reducer::copy_grad_into_bucket(size_t index, Bucket& bucket, size_t slot) {
  FASTDDP_NVTX_RANGE("fastddp copy-in");
  at::Tensor& grad = params_[index].mutable_grad();
  at::Tensor& view = bucket.views[slot];
  if (!grad.defined()) {
    view.zero_();
    return;
  }
  TORCH_CHECK_NOT_IMPLEMENTED(!grad.is_sparse(), "fastddp: parameter '", names_[index],
                              "' produced a sparse gradient; sparse gradients are not "
                              "supported yet (construct the module with sparse=False)");
  TORCH_CHECK(grad.scalar_type() == view.scalar_type() && grad.device() == view.device(),
              "fastddp: parameter '", names_[index], "' got a gradient of ", grad.scalar_type(),
              " on ", grad.device(), ", expected ", view.scalar_type(), " on ", view.device());
  if (grad.is_alias_of(view)) {
    // gradient_as_bucket_view: the gradient was accumulated in place.
    view.div_(world_size_);
    return;
  }
  // One pass: copy and divide by the world size (same arithmetic as torch).
  at::mul_out(view, grad, inv_world_size_);
  if (options_.gradient_as_bucket_view) grad = view;
}

void Reducer::launch(Bucket& bucket) {
  FASTDDP_NVTX_RANGE("fastddp launch");
  std::vector<at::Tensor> tensors{bucket.flat};
  bucket.work = group_->allreduce(tensors);
}

void Reducer::finalize_backward() {
  std::lock_guard<std::mutex> lock(mutex_);
  for (Bucket& bucket : buckets_) {
    {
      FASTDDP_NVTX_RANGE("fastddp wait");
      bucket.work->wait();
    }
    bucket.work.reset();
    write_back(bucket);
  }
  phase_ = Phase::kReduced;
  ++num_syncs_;
}

void Reducer::write_back(Bucket& bucket) {
  FASTDDP_NVTX_RANGE("fastddp write-back");
  if (options_.gradient_as_bucket_view) {
    for (size_t k = 0; k < bucket.params.size(); ++k) {
      at::Tensor& grad = params_[bucket.params[k]].mutable_grad();
      if (!grad.defined()) grad = bucket.views[k];
    }
    return;
  }
#if defined(FASTDDP_WITH_CUDA)
  std::vector<kernels::CopyRange> ranges;
#endif
  for (size_t k = 0; k < bucket.params.size(); ++k) {
    at::Tensor& grad = params_[bucket.params[k]].mutable_grad();
    const at::Tensor& view = bucket.views[k];
    if (!grad.defined()) {
      grad = view.clone(at::MemoryFormat::Preserve);
      continue;
    }
#if defined(FASTDDP_WITH_CUDA)
    if (grad.is_cuda() && grad.scalar_type() == view.scalar_type() &&
        grad.is_non_overlapping_and_dense() && grad.strides() == view.strides()) {
      ranges.push_back({view.data_ptr(), grad.data_ptr(),
                        grad.numel() * static_cast<int64_t>(grad.element_size())});
      continue;
    }
#endif
    grad.copy_(view);
  }
#if defined(FASTDDP_WITH_CUDA)
  if (!ranges.empty()) {
    const c10::cuda::CUDAGuard guard(bucket.flat.device());
    kernels::multi_tensor_copy_cuda(ranges.data(), static_cast<int64_t>(ranges.size()),
                                    c10::cuda::getCurrentCUDAStream().stream());
  }
#endif
}

void Reducer::rebuild_buckets() {
  std::vector<TensorSpec> specs;
  specs.reserve(params_.size());
  for (const at::Tensor& p : params_) specs.push_back(spec_of(p, /*expect_sparse=*/false));
  BucketPlan plan = plan_buckets_from_ready_order(specs, ready_order_, options_.rebuild_limits);
  buckets_ = make_buckets(params_, broadcast_plan(plan.buckets));
  reset_bucket_views();
  ready_order_.clear();
  has_rebuilt_ = true;
}

std::vector<std::vector<size_t>> Reducer::broadcast_plan(
    const std::vector<std::vector<size_t>>& plan) {
  // Ranks may observe different ready orders; rank 0's plan wins so that all
  // ranks issue identical collectives. Layout: [num_buckets, sizes..., indices...].
  const int64_t n = static_cast<int64_t>(params_.size());
  at::Tensor packed = at::zeros({1 + 2 * n}, at::kLong);
  auto* p = packed.data_ptr<int64_t>();
  p[0] = static_cast<int64_t>(plan.size());
  int64_t pos = 1 + n;
  for (size_t b = 0; b < plan.size(); ++b) {
    p[1 + b] = static_cast<int64_t>(plan[b].size());
    for (size_t index : plan[b]) p[pos++] = static_cast<int64_t>(index);
  }
  std::vector<at::Tensor> tensors{packed.to(params_.front().device())};
  c10d::BroadcastOptions opts;
  opts.rootRank = 0;
  group_->broadcast(tensors, opts)->wait();
  packed = tensors[0].cpu();  // once per run: the rebuild is not on the step path
  p = packed.data_ptr<int64_t>();

  std::vector<std::vector<size_t>> result(static_cast<size_t>(p[0]));
  pos = 1 + n;
  for (size_t b = 0; b < result.size(); ++b) {
    for (int64_t k = 0; k < p[1 + b]; ++k) result[b].push_back(static_cast<size_t>(p[pos++]));
  }
  return result;
}

void Reducer::reset_bucket_views() {
  locator_.assign(params_.size(), {0, 0});
  for (size_t b = 0; b < buckets_.size(); ++b) {
    Bucket& bucket = buckets_[b];
    for (size_t k = 0; k < bucket.params.size(); ++k) {
      locator_[bucket.params[k]] = {b, k};
      if (!options_.gradient_as_bucket_view) continue;
      // Existing grads move into the (new) buckets, as torch's reducer does.
      at::Tensor& grad = params_[bucket.params[k]].mutable_grad();
      if (grad.defined() && !grad.is_alias_of(bucket.views[k])) {
        bucket.views[k].copy_(grad);
        grad = bucket.views[k];
      }
    }
  }
}

std::string Reducer::names_of_unready_params() const {
  std::ostringstream out;
  bool first = true;
  for (size_t i = 0; i < params_.size(); ++i) {
    if (ready_[i]) continue;
    out << (first ? "" : ", ") << names_[i];
    first = false;
  }
  return out.str();
}

std::vector<std::vector<size_t>> Reducer::bucket_plan() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<std::vector<size_t>> plan;
  for (const Bucket& bucket : buckets_) plan.push_back(bucket.params);
  return plan;
}

std::vector<int64_t> Reducer::bucket_bytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<int64_t> bytes;
  for (const Bucket& bucket : buckets_) bytes.push_back(bucket.bytes());
  return bytes;
}

}  // namespace fastddp
