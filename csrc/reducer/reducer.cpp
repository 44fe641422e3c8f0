#include "reducer.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <algorithm>

#include "../util/message.h"
#include "../util/profile_range.h"

namespace fastddp {

Reducer::Reducer(std::vector<at::Tensor> params, std::vector<std::string> names,
                 std::vector<std::vector<size_t>> plan,
                 c10::intrusive_ptr<c10d::ProcessGroup> group, std::shared_ptr<CommHook> hook,
                 ReducerOptions options)
    : params_(std::move(params)),
      names_(std::move(names)),
      group_(std::move(group)),
      hook_(std::move(hook)),
      options_(std::move(options)),
      grad_hooks_([this](size_t i) { on_grad_ready(i); }) {
  FASTDDP_CHECK(group_, "fastddp: Reducer needs a process group");
  FASTDDP_CHECK(hook_, "fastddp: Reducer needs a comm hook");
  FASTDDP_CHECK(!params_.empty(), "fastddp: Reducer needs at least one parameter");
  FASTDDP_CHECK(names_.size() == params_.size(), "fastddp: ", params_.size(), " parameters but ",
                names_.size(), " names");

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
  mixed_precision_ = MixedPrecision(params_, options_.mixed_precision, options_.param_dtype);
  views_ = BucketViews(options_.gradient_as_bucket_view, options_.lazy_bucket_allocation,
                       options_.align_bytes);
  buckets_ = make_buckets(params_, plan, options_.expect_sparse, options_.align_bytes,
                          options_.reduce_dtype, options_.lazy_bucket_allocation);
  check_hook_supports(*hook_);
  stats_ = StepStats(*group_, params_[0].device());
  reset_bucket_views();
  ready_.assign(params_.size(), false);
  unused_ = UnusedParameters(params_.size(), params_[0].device());
  static_graph_ = StaticGraph(params_.size());
  if (options_.check_for_nan_in_grad) {
    finite_ = FiniteChecks(true, rank(), world_size(), params_.size());
    hook_->set_nonfinite_guard(finite_.guard());
  }
  hook_->on_new_buckets(buckets_);
  install_hooks();
}

Reducer::~Reducer() {
  hook_->set_nonfinite_guard(nullptr);  // the hook may outlive us (Python holds it)
}  // grad_hooks_ removes the hooks, before the rest goes

void Reducer::install_hooks() {
  for (size_t i = 0; i < params_.size(); ++i) grad_hooks_.hook(i, params_[i], names_[i]);
}

bool Reducer::static_first_iteration() const {
  return options_.static_graph && num_iterations_ == 1;
}

bool Reducer::dynamic_find_unused() const {
  return options_.find_unused_parameters && !options_.static_graph;
}

bool Reducer::track_usage() const { return dynamic_find_unused() || static_first_iteration(); }

bool Reducer::should_rebuild() const {
  return (options_.static_graph || !options_.find_unused_parameters) && !ready_order_.rebuilt();
}

bool Reducer::before_forward(bool sync) {
  std::lock_guard<std::mutex> lock(mutex_);
  ensure_prior_reduction_finished();
  check_parameters_unchanged();
  if (sync) ++num_iterations_;
  if (should_rebuild() && ready_order_.recorded().size() == params_.size()) {
    rebuild_buckets();
    return true;
  }
  return false;
}

bool Reducer::needs_outputs() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return dynamic_find_unused() || (static_first_iteration() && !static_graph_.delayed_queued());
}

void Reducer::reset_iteration() {
  std::fill(ready_.begin(), ready_.end(), false);
  next_bucket_ = 0;
  finalize_queued_ = false;
  graph_retained_ = false;
  unused_.begin_step();
  ready_order_.begin_step();
  for (Bucket& bucket : buckets_) bucket.pending = bucket.params.size();
  skip_votes_.begin_step(buckets_.size());  // vote_on_skips() decides, after the unused search
  if (options_.static_graph) static_graph_.begin_step();
  // Note [fault-tolerant step]: a step armed over an unsettled one would
  // write its new state over the state that waits for its commit.
  FASTDDP_CHECK(!fault_.holding(), "fastddp: the previous step's commit was not settled "
                "(fastddp.integrations.torchft settles it before every forward)");
  const int64_t participants = fault_.participants(world_size());
  hook_->set_divisors({join_.divide_factor(static_cast<int>(participants)), participants});
  finite_.begin_step();  // Note [a bad step leaves no trace]: nothing collected yet
  stats_.begin_step(*group_);  // the cost and collectives from here on are this step's
  views_.note_grads(params_);  // Note [gradients handed out]: these stay the user's
}

void Reducer::set_divide_factor(int64_t factor) {
  std::lock_guard<std::mutex> lock(mutex_);
  FASTDDP_CHECK(factor > 0 && factor <= world_size(), "fastddp: divide factor ", factor,
                " is not between 1 and the world size ", world_size());
  join_.set_divide_factor(factor);
}

void Reducer::on_grad_ready(size_t index) {
  std::string failure;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    try {
      handle_grad_ready(index);
    } catch (...) {
      // The error reaches backward()'s caller; the next forward starts afresh
      // instead of reporting this iteration's parameters as never ready.
      fail_iteration(std::current_exception());
      if (!fault_.has_failure()) throw;
      // Note [fault-tolerant step]: backward goes on; the step is failed
      // (phase kIdle: the later hooks pass, nothing more is launched).
      failure = fault_.take_failure();
    }
  }
  report_failure(std::move(failure));
}

void Reducer::handle_grad_ready(size_t index) {
  grad_slot_.capture();
  if (track_usage()) {
    // Also under no_sync: a parameter used in any accumulated step is used.
    grad_slot_.with_grad(params_[index], [&](at::Tensor& grad) {
      if (grad.defined()) unused_.note_used(index);
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
  // Note [gradients handed out]: before this backward's first copy-in.
  if (stats_.backward_started(num_iterations_)) views_.guard_reuse(buckets_, params_);
  if (static_first_iteration()) {
    static_graph_.count_hook(index);
    if (static_graph_.delay_from_first_hook() && !static_graph_.delayed_queued()) {
      queue_delayed_reduce();
    }
    return;
  }
  ready_order_.note_hook(index);
  if (unused_.take_marking()) {
    for (size_t unused : unused_.list()) mark_ready(unused);
  }
  if (options_.static_graph && !static_graph_.last_hook(index, names_[index], rank())) return;
  if (should_rebuild()) ready_order_.record(index);
  mark_ready(index);
}

void Reducer::mark_ready(size_t index) {
  check_not_ready(index);
  ready_[index] = true;
  const auto [b, slot] = views_.locate(index);
  Bucket& bucket = buckets_[b];
  if (!bucket.allocated()) views_.allocate(buckets_);  // lazy buckets: this backward's first
  grad_slot_.with_grad(params_[index], [&](at::Tensor& grad) {
    check_grad(index, grad, bucket, bucket.views[slot]);
    // Note [fault-tolerant step]: a replica still healing sends zeros.
    copy_in(b, slot, fault_.contributes() ? grad : at::Tensor());
    return views_.adopt(grad, bucket.views[slot], bucket.sparse);  // gradient_as_bucket_view
  });
  if (--bucket.pending > 0) return;
  stats_.bucket_ready(b);
  launch_ready_buckets();
}

void Reducer::copy_in(size_t b, size_t slot, const at::Tensor& grad) {
  FASTDDP_PROFILE_RANGE("fastddp copy-in");
  Bucket& bucket = buckets_[b];
  // Note [skipping unused buckets]: under a registered hook a skipped
  // bucket's copy-in is torch's plain one (SkipVotes::plain_copy_in).
  const bool plain = !static_first_iteration() && skip_votes_.plain_copy_in(b);
  const auto copy = [&](const at::Tensor& value) {
    if (plain) {
      hook_->CommHook::copy_in(bucket, slot, value);
    } else {
      hook_->copy_in(bucket, slot, value);
    }
  };
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
    copy(grad.detach());
  } else {
    copy(grad);
  }
}

bool Reducer::reducing() const {
  return phase_ == Phase::kExpecting &&
         std::find(ready_.begin(), ready_.end(), true) != ready_.end();
}

int Reducer::rank() const { return group_->getRank(); }

int Reducer::world_size() const { return group_->getSize(); }

void Reducer::launch_ready_buckets() {
  // Buckets launch strictly in order so that every rank issues the same
  // sequence of collectives, whatever order its gradients arrive in.
  while (next_bucket_ < buckets_.size() && buckets_[next_bucket_].pending == 0) {
    FASTDDP_PROFILE_RANGE("fastddp launch");
    Bucket& bucket = buckets_[next_bucket_];
    const bool last = next_bucket_ + 1 == buckets_.size();
    // Note [skipping unused buckets]: not the delayed first static-graph
    // iteration, which reduces every bucket as torch's delay_all_reduce does.
    if (!static_first_iteration() && skip_votes_.skips(next_bucket_)) {
      skip_votes_.note_skipped(next_bucket_);
      stats_.bucket_launched(next_bucket_);
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
                    hook_->name(), "') failed on rank ", rank(), ": ", e.what_without_backtrace());
    } catch (const std::runtime_error& e) {
      FASTDDP_CHECK(false, "fastddp: the reduction of bucket ", next_bucket_, " (comm hook '",
                    hook_->name(), "') failed on rank ", rank(), ": ", e.what());
    }
    FASTDDP_CHECK(bucket.future, "fastddp: comm hook '", hook_->name(), "' returned no future");
    // torch's delayed reduction counts none.
    if (!static_first_iteration()) skip_votes_.note_reduced();
    stats_.bucket_launched(next_bucket_);
    ++next_bucket_;
  }
  finish_completed_buckets();
  if (next_bucket_ == buckets_.size() && !finalize_queued_) {
    if (dynamic_find_unused()) unused_.launch_allreduce(*group_);
    queue_finalize();
  }
}

void Reducer::queue_finalize() {
  finalize_queued_ = true;
  if (options_.static_graph && should_rebuild()) {
    for (size_t unused : unused_.list()) ready_order_.record(unused);
  }
  std::weak_ptr<Reducer> weak = weak_from_this();
  torch::autograd::Engine::get_default_engine().queue_callback([weak] {
    if (auto self = weak.lock()) {
      std::string failure;
      {
        std::lock_guard<std::mutex> lock(self->mutex_);
        // Not if the step failed meanwhile (fail_iteration: a hook changed
        // inside this backward).
        if (self->phase_ == Phase::kExpecting) self->finalize_backward();
        failure = self->fault_.take_failure();
      }
      self->report_failure(std::move(failure));
    }
  });
}

void Reducer::set_sink_clone(bool clone) {
  std::lock_guard<std::mutex> lock(mutex_);
  options_.sink_clone = clone;
}

}  // namespace fastddp
