#include "reducer.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/utils/lambda_post_hook.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include "device_timeline.h"
#include "nonfinite_guard.h"
#include "../util/profile_range.h"
#include "../util/message.h"

namespace fastddp {

Reducer::Reducer(std::vector<at::Tensor> params, std::vector<std::string> names,
                 std::vector<std::vector<size_t>> plan,
                 c10::intrusive_ptr<c10d::ProcessGroup> group, std::shared_ptr<CommHook> hook,
                 ReducerOptions options)
    : params_(std::move(params)),
      names_(std::move(names)),
      group_(std::move(group)),
      hook_(std::move(hook)),
      options_(std::move(options)) {
  FASTDDP_CHECK(group_, "fastddp: Reducer needs a process group");
  FASTDDP_CHECK(hook_, "fastddp: Reducer needs a comm hook");
  FASTDDP_CHECK(!params_.empty(), "fastddp: Reducer needs at least one parameter");
  FASTDDP_CHECK(names_.size() == params_.size(), "fastddp: ", params_.size(), " parameters but ",
                names_.size(), " names");
  rank_ = group_->getRank();
  world_size_ = group_->getSize();
  try {  // gloo and NCCL keep the count; a backend without one raises
    (void)group_->getSequenceNumberForGroup();
    counts_collectives_ = true;
  } catch (const std::exception&) {
    counts_collectives_ = false;
  }

  std::vector<size_t> seen(params_.size(), 0);
  for (const auto& bucket : plan) {
    for (size_t index : bucket) {
      FASTDDP_CHECK(index < params_.size(), "fastddp: bucket plan names parameter ", index,
                    " of ", params_.size());
      ++seen[index];
    }
  }
  for (size_t i = 0; i < params_.size(); ++i) {
    FASTDDP_CHECK(seen[i] == 1, "fastddp: parameter '", names_[i], "' appears ", seen[i],
                  " times in the bucket plan; every parameter must be in exactly one bucket");
    FASTDDP_CHECK(params_[i].requires_grad(), "fastddp: parameter '", names_[i],
                  "' does not require grad and must not be given to the reducer");
  }
  if (options_.expect_sparse.empty()) options_.expect_sparse.assign(params_.size(), false);
  FASTDDP_CHECK(options_.expect_sparse.size() == params_.size(), "fastddp: expect_sparse has ",
                options_.expect_sparse.size(), " entries for ", params_.size(), " parameters");
  for (const at::Tensor& p : params_) master_dtypes_.push_back(p.scalar_type());
  buckets_ = make_buckets(params_, plan, options_.expect_sparse, options_.align_bytes,
                          options_.reduce_dtype, options_.lazy_bucket_allocation);
  check_hook_supports(*hook_);
  timeline_ = std::make_unique<DeviceTimeline>(params_[0].device());
  reset_bucket_views();
  const auto n = static_cast<int64_t>(params_.size());
  ready_.assign(params_.size(), false);
  used_map_ = at::zeros({n}, at::kInt);
  used_map_dev_ = at::zeros({n}, at::TensorOptions().dtype(at::kInt).device(params_[0].device()));
  expected_hooks_.assign(params_.size(), 0);
  hooks_left_.assign(params_.size(), 0);
  if (options_.check_for_nan_in_grad) {
    nonfinite_ = std::make_unique<NonFiniteGuard>(rank_, world_size_, params_.size());
    hook_->set_nonfinite_guard(nonfinite_.get());
  }
  hook_->on_new_buckets(buckets_);
  install_hooks();
}

Reducer::~Reducer() {
  hook_->set_nonfinite_guard(nullptr);  // the hook may outlive us (Python holds it)
  for (size_t i = 0; i < grad_accumulators_.size(); ++i) {
    grad_accumulators_[i]->del_post_hook(hook_keys_[i]);
  }
}

void Reducer::install_hooks() {
  grad_accumulators_.resize(params_.size());
  hook_keys_.resize(params_.size());
  for (size_t i = 0; i < params_.size(); ++i) hook_accumulator(i);
}

void Reducer::hook_accumulator(size_t i) {
  // `auto`: the pointer type changed in torch 2.13 (see GradAccumulatorPtr).
  auto accumulator = torch::autograd::impl::grad_accumulator(params_[i]);
  FASTDDP_CHECK(accumulator, "fastddp: parameter '", names_[i], "' has no grad accumulator");
  if (accumulator == grad_accumulators_[i]) return;
  if (grad_accumulators_[i]) grad_accumulators_[i]->del_post_hook(hook_keys_[i]);
  // Plain C++ called by the autograd engine: no GIL, no Python object. Compiled
  // autograd cannot trace it: it asks for compiled_args first, which raises a
  // message naming the setting rather than torch's generic "compiled_args nyi"
  // (torch's own C++ reducer does the same; fastddp/ddp/_compile.py says why).
  hook_keys_[i] =
      accumulator->add_post_hook(std::make_unique<torch::autograd::utils::LambdaPostHook>(
          [this, i](const torch::autograd::variable_list& outputs,
                    const torch::autograd::variable_list&) {
            on_grad_ready(i);
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
  // The engine holds accumulators weakly; keeping them alive keeps our hooks.
  grad_accumulators_[i] = std::move(accumulator);
}

bool Reducer::static_first_iteration() const {
  return options_.static_graph && num_iterations_ == 1;
}

bool Reducer::dynamic_find_unused() const {
  return options_.find_unused_parameters && !options_.static_graph;
}

bool Reducer::track_usage() const { return dynamic_find_unused() || static_first_iteration(); }

bool Reducer::should_rebuild() const {
  return (options_.static_graph || !options_.find_unused_parameters) && !has_rebuilt_;
}

bool Reducer::before_forward(bool sync) {
  std::lock_guard<std::mutex> lock(mutex_);
  ensure_prior_reduction_finished();
  check_parameters_unchanged();
  if (sync) ++num_iterations_;
  if (should_rebuild() && ready_order_.size() == params_.size()) {
    rebuild_buckets();
    return true;
  }
  return false;
}

bool Reducer::needs_outputs() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return dynamic_find_unused() || (static_first_iteration() && !delayed_reduce_queued_);
}

void Reducer::reset_iteration() {
  std::fill(ready_.begin(), ready_.end(), false);
  num_ready_ = 0;
  next_bucket_ = 0;
  finalize_queued_ = false;
  hooks_seen_ = false;
  graph_retained_ = false;
  marked_unused_ = false;
  last_ready_order_.clear();
  for (Bucket& bucket : buckets_) bucket.pending = bucket.params.size();
  skip_.assign(buckets_.size(), false);  // vote_on_skips() decides, after the unused search
  skipped_.assign(buckets_.size(), false);
  buckets_reduced_ = 0;
  if (options_.static_graph) hooks_left_ = expected_hooks_;
  hook_->set_divide_factor(divide_factor_ > 0 ? divide_factor_ : world_size_);
  if (nonfinite_) nonfinite_->begin_step();
  // Note [a bad step leaves no trace]: the hook's state as it is before this step.
  reduced_.clear();
  last_finite_ = at::Tensor();
  cost_at_start_ = cost::totals();  // before the snapshot: its copy is this step's
  step_state_.snapshot(hook_->step_state());
  collectives_at_start_ = collective_count();
}

int64_t Reducer::collective_count() const {
  if (!counts_collectives_) return -1;
  return static_cast<int64_t>(group_->getSequenceNumberForGroup());
}

void Reducer::set_divide_factor(int64_t factor) {
  std::lock_guard<std::mutex> lock(mutex_);
  FASTDDP_CHECK(factor > 0 && factor <= world_size_, "fastddp: divide factor ", factor,
                " is not between 1 and the world size ", world_size_);
  divide_factor_ = factor;
}

void Reducer::on_grad_ready(size_t index) {
  std::lock_guard<std::mutex> lock(mutex_);
  try {
    handle_grad_ready(index);
  } catch (...) {
    // The error reaches backward()'s caller; the next forward starts afresh
    // instead of reporting this iteration's parameters as never ready.
    fail_iteration(std::current_exception());
    throw;
  }
}

void Reducer::handle_grad_ready(size_t index) {
  grad_slot_.capture();
  if (track_usage()) {
    // Also under no_sync: a parameter used in any accumulated step is used.
    grad_slot_.with_grad(params_[index], [&](at::Tensor& grad) {
      if (grad.defined()) used_map_.data_ptr<int32_t>()[index] = 1;
      return false;
    });
  }
  if (phase_ == Phase::kIdle) return;
  // Note [a backward after the reduction]: torch's reducer ignores every hook
  // between its finalize and the next forward, so a second backward through
  // one forward output (retain_graph=True) leaves unreduced gradients behind
  // without a word; fastddp raises for that one. Only a backward that retained
  // its graph can be followed by another through the same forward: autograd
  // frees the graph's saved tensors otherwise. Any other backward after the
  // reduction went through the bare module (model.module(x), as torch's
  // test_c10d_pypg does) or some other graph: its gradients stay local, as
  // under torch.
  if (phase_ == Phase::kReduced && !graph_retained_) return;
  FASTDDP_CHECK(phase_ != Phase::kReduced, "fastddp: parameter '", names_[index],
                "' received a gradient after this iteration's gradients were already reduced. "
                "DistributedDataParallel reduces once per forward: a second backward through the "
                "same forward output is not supported. Run the forward again, or do the extra "
                "backward passes under no_sync().");
  // A thread-local read (the engine's current graph task): true where there is none.
  graph_retained_ = graph_retained_ || torch::autograd::get_current_graph_task_keep_graph();
  note_backward_start();
  if (static_first_iteration()) {
    ++expected_hooks_[index];
    if (delay_from_first_hook_ && !delayed_reduce_queued_) queue_delayed_reduce();
    return;
  }
  last_ready_order_.push_back(static_cast<int64_t>(index));
  if (!marked_unused_) {
    marked_unused_ = true;
    for (size_t unused : unused_) mark_ready(unused);
  }
  if (options_.static_graph) {
    FASTDDP_CHECK(hooks_left_[index] > 0,
                  "Your training graph has changed in this iteration, e.g., one parameter is "
                  "unused in first iteration, but then got used in the second iteration. this is "
                  "not compatible with static_graph set to True. Parameter '",
                  names_[index], "' on rank ", rank_, ".");
    if (--hooks_left_[index] > 0) return;
  }
  if (should_rebuild()) ready_order_.push_back(index);
  mark_ready(index);
}

void Reducer::mark_ready(size_t index) {
  check_not_ready(index);
  ready_[index] = true;
  ++num_ready_;
  const auto [b, slot] = locator_[index];
  Bucket& bucket = buckets_[b];
  if (!bucket.allocated()) allocate_buckets();  // this backward's first gradient
  at::Tensor& view = bucket.views[slot];
  // A skipped bucket's copy-in is torch's, which divides by the world size
  // only when no comm hook is registered (our default hook does), else copies;
  // a registered hook's own copy-in may write elsewhere (its wire buffer) and
  // leave the view, which becomes the grad under gradient_as_bucket_view,
  // stale. Only then does the decision come before the copy-in (skips() waits
  // for the votes on a candidate bucket). Note [skipping unused buckets].
  const bool plain_copy_in = hook_registered_ && !static_first_iteration() && skips(b);
  const auto copy_in = [&](const at::Tensor& grad) {
    if (plain_copy_in) {
      hook_->CommHook::copy_in(bucket, slot, grad);
    } else {
      hook_->copy_in(bucket, slot, grad);
    }
  };
  grad_slot_.with_grad(params_[index], [&](at::Tensor& grad) {
    if (grad.defined()) {
      FASTDDP_CHECK(grad.is_sparse() == bucket.sparse, "fastddp: parameter '", names_[index],
                    "' produced a ", grad.is_sparse() ? "sparse" : "dense", " gradient, but ",
                    bucket.sparse ? "sparse" : "dense", " gradients were expected (they are "
                    "expected sparse for nn.Embedding / nn.EmbeddingBag with sparse=True)");
      // Under mixed_precision the gradient is of the parameter's (cast) dtype and
      // the copy-in casts it to the bucket's (Note [mixed precision]).
      const c10::ScalarType expected =
          options_.mixed_precision ? params_[index].scalar_type() : view.scalar_type();
      FASTDDP_CHECK(grad.scalar_type() == expected && grad.device() == view.device(),
                    "fastddp: parameter '", names_[index], "' got a gradient of ",
                    grad.scalar_type(), " on ", grad.device(), ", expected ", expected, " on ",
                    view.device());
    }
    FASTDDP_PROFILE_RANGE("fastddp copy-in");
    if (grad.defined() && grad.requires_grad()) {
      // backward(create_graph=True): torch's reducer reduces the values and
      // leaves the higher-order graph rank-local; so do we, with its warning.
      FASTDDP_WARN_ONCE(
          "Using DistributedDataParallel with create_graph=True  is not well-supported. The "
          "higher-order gradient will  not be synchronized across ranks, and backpropagation  "
          "through all_reduce operations will not occur. If you require  DDP to work with "
          "higher-order gradients for your use-case,  please ping "
          "https://github.com/pytorch/pytorch/issues/63929");
      const at::NoGradGuard no_grad;
      copy_in(grad.detach());
    } else {
      copy_in(grad);
    }
    if (options_.gradient_as_bucket_view && !bucket.sparse && grad.defined() &&
        !grad.is_alias_of(view)) {
      grad = view;
      return true;
    }
    return false;
  });
  if (--bucket.pending > 0) return;
  timeline_->mark(b, DeviceTimeline::kReady);
  last_ready_us_ = elapsed_us();
  if (b < stats_.timings.size()) stats_.timings[b].ready_us = last_ready_us_;
  launch_ready_buckets();
}

void Reducer::launch_ready_buckets() {
  // Buckets launch strictly in order so that every rank issues the same
  // sequence of collectives, whatever order its gradients arrive in.
  while (next_bucket_ < buckets_.size() && buckets_[next_bucket_].pending == 0) {
    FASTDDP_PROFILE_RANGE("fastddp launch");
    Bucket& bucket = buckets_[next_bucket_];
    const bool last = next_bucket_ + 1 == buckets_.size();
    // Note [skipping unused buckets]: not the delayed first static-graph
    // iteration, which reduces every bucket as torch's delay_all_reduce does.
    if (!static_first_iteration() && skips(next_bucket_)) {
      skipped_[next_bucket_] = true;
      stats_.timings[next_bucket_].launched_us = elapsed_us();
      timeline_->mark(next_bucket_, DeviceTimeline::kLaunched);
      // The last bucket run() was not told is_last: a pipelined hook still
      // holds its second collective back (issued here, on every rank alike).
      if (last) hook_->drain();
      ++next_bucket_;
      continue;
    }
    try {
      bucket.future = hook_->run(bucket, next_bucket_, last);
    } catch (const c10::Error& e) {
      // A collective refused at enqueue (a peer already gone): name the bucket.
      FASTDDP_CHECK(false, "fastddp: the reduction of bucket ", next_bucket_, " (comm hook '",
                    hook_->name(), "') failed on rank ", rank_, ": ", e.what_without_backtrace());
    } catch (const std::runtime_error& e) {
      FASTDDP_CHECK(false, "fastddp: the reduction of bucket ", next_bucket_, " (comm hook '",
                    hook_->name(), "') failed on rank ", rank_, ": ", e.what());
    }
    FASTDDP_CHECK(bucket.future, "fastddp: comm hook '", hook_->name(), "' returned no future");
    if (!static_first_iteration()) ++buckets_reduced_;  // torch's delayed reduction counts none
    stats_.timings[next_bucket_].launched_us = elapsed_us();
    timeline_->mark(next_bucket_, DeviceTimeline::kLaunched);
    ++next_bucket_;
  }
  finish_completed_buckets();
  if (next_bucket_ == buckets_.size() && !finalize_queued_) {
    if (dynamic_find_unused()) launch_used_map_allreduce();
    queue_finalize();
  }
}

void Reducer::queue_finalize() {
  finalize_queued_ = true;
  if (options_.static_graph && should_rebuild()) {
    for (size_t unused : unused_) ready_order_.push_back(unused);
  }
  std::weak_ptr<Reducer> weak = weak_from_this();
  torch::autograd::Engine::get_default_engine().queue_callback([weak] {
    if (auto self = weak.lock()) {
      std::lock_guard<std::mutex> lock(self->mutex_);
      // Not if the step failed meanwhile (fail_iteration: a hook changed
      // inside this backward).
      if (self->phase_ == Phase::kExpecting) self->finalize_backward();
    }
  });
}

void Reducer::launch_used_map_allreduce() {
  if (used_map_dev_.is_cuda()) {
    // A pinned staging copy: the host map may change again before the
    // asynchronous upload runs.
    at::Tensor staging = at::empty_like(used_map_, used_map_.options().pinned_memory(true));
    staging.copy_(used_map_);
    used_map_dev_.copy_(staging, /*non_blocking=*/true);
  } else {
    used_map_dev_.copy_(used_map_);
  }
  std::vector<at::Tensor> tensors{used_map_dev_};
  used_work_ = group_->allreduce(tensors);
  used_map_reduced_ = false;
}

bool Reducer::globally_unused(size_t index) {
  if (used_map_.data_ptr<int32_t>()[index] != 0) return false;
  if (!used_map_reduced_ && used_work_) {
    // Only a locally unused parameter waits for the bitmap (host sync on
    // CUDA, as in torch); models that use every parameter never do.
    used_work_->wait();
    used_map_.copy_(used_map_dev_);
    used_map_reduced_ = true;
  }
  return used_map_.data_ptr<int32_t>()[index] == 0;
}

void Reducer::note_backward_start() {
  if (hooks_seen_) return;
  hooks_seen_ = true;
  backward_start_ = std::chrono::steady_clock::now();
  backward_iteration_ = num_iterations_;
  timeline_->mark_start(num_iterations_, std::chrono::duration_cast<std::chrono::nanoseconds>(
                                             backward_start_.time_since_epoch())
                                             .count());
}

double Reducer::elapsed_us() const {
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() -
                                                   backward_start_)
      .count();
}

void Reducer::set_sink_clone(bool clone) {
  std::lock_guard<std::mutex> lock(mutex_);
  sink_clone_ = clone;
}

}  // namespace fastddp
