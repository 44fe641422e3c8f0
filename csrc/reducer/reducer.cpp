// The reducer's synchronized step (Note [reducer step], reducer.h): the
// gradient hooks armed by a forward, each gradient copied into its bucket and
// the buckets launched in order while backward runs; at the end, waiting for
// each bucket's reduction and writing the averaged gradients back (and, for a
// hook with state, checking them: Note [a bad step leaves no trace]), and a
// failed step's clean-up. Also the comm hook, replaced between steps
// (fastddp.hooks.auto() does so while it tunes; inside a backward it fails
// that step), and the overlapped optimizer, the other thing a step hands the
// buckets to.
#include "reducer.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <algorithm>

#include "../optim/optimizer_step.h"
#include "../util/message.h"
#include "../util/profile_range.h"
#include "finite_checks.h"

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
  grad_hooks_.slot().capture();
  if (track_usage()) {
    // Also under no_sync: a parameter used in any accumulated step is used.
    grad_hooks_.slot().with_grad(params_[index], [&](at::Tensor& grad) {
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
  grad_hooks_.slot().with_grad(params_[index], [&](at::Tensor& grad) {
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

void Reducer::finalize_backward() {
  try {
    if (finite_.guard()) check_finite_gradients();
    for (size_t b = 0; b < buckets_.size(); ++b) {
      // Else finished during backward.
      if (skip_votes_.skipped(b) || buckets_[b].future) finish_bucket(b);
    }
    if (track_usage()) unused_.wait();
    if (mixed_precision_.on()) mixed_precision_.restore_masters();
    at::Tensor kept;  // undefined: nothing checked, the step stands
    bool held = false;
    {  // Note [a bad step leaves no trace]
      const at::NoGradGuard no_grad;
      at::Tensor finite = finite_.check();
      if (hook_->settles_own_state() && fault_.on()) {  // Note [fault-tolerant step]
        fault_.hold(std::move(finite));
        held = true;
      } else if (hook_->settles_own_state()) {  // Note [double-buffered step state]
        kept = hook_->settle_step(finite);
      }
    }
    if (!held) hook_->after_step(kept);
    if (optimizer_step_) {
      FASTDDP_PROFILE_RANGE("fastddp optimizer step");
      optimizer_step_->end_of_backward();
    }
  } catch (...) {
    fail_iteration(std::current_exception());
    if (fault_.has_failure()) return;  // Note [fault-tolerant step]: the caller reports it
    throw;
  }
  if (dynamic_find_unused()) unused_.zero(/*unread=*/true);
  phase_ = Phase::kReduced;
  join_.set_divide_factor(0);
  grad_hooks_.slot().reset();
  views_.release(buckets_);
  stats_.end_step(*group_, skip_votes_.skipped());
}

void Reducer::finish_bucket(size_t b) {
  Bucket& bucket = buckets_[b];
  // A skipped bucket (Note [skipping unused buckets]) was not reduced: its
  // grads stay as the copy-in left them, as torch's finalize passes it by.
  if (!skip_votes_.skipped(b)) {
    {
      FASTDDP_PROFILE_RANGE("fastddp wait");
      bucket.future->wait();
    }
    if (bucket.future->hasError()) {
      const char* what = hook_->launched_collective(b);
      FASTDDP_CHECK(false, "fastddp: the reduction of bucket ", b, " (comm hook '",
                    hook_->name(), "') failed on rank ", rank(), ": ", what ? what : "",
                    what ? " failed: " : "", bucket.future->tryRetrieveErrorMessage());
    }
    {
      FASTDDP_PROFILE_RANGE("fastddp write-back");
      write_back(b, bucket.future->value());
    }
    bucket.future.reset();
  }
  stats_.bucket_done(b);
  if (optimizer_step_) {
    // A skipped bucket's .grad are what optimizer.step() sees after torch's
    // backward (None stays None, and the step passes such a parameter by).
    FASTDDP_PROFILE_RANGE("fastddp optimizer step");
    optimizer_step_->step_bucket(bucket.params);
  }
}

void Reducer::finish_completed_buckets() {
  // Not where the write-back waits for the whole backward (Note [overlapped
  // optimizer]), nor on an accelerator, whose futures complete at enqueue.
  if (!optimizer_step_ || track_usage() || finite_.guard() || options_.mixed_precision ||
      !params_.front().device().is_cpu()) {
    return;
  }
  for (size_t b = 0; b < next_bucket_; ++b) {
    Bucket& bucket = buckets_[b];
    if (!bucket.future) continue;
    if (!bucket.future->completed()) return;  // in order: the later ones wait for it
    finish_bucket(b);
  }
}

void Reducer::fail_iteration(const std::exception_ptr& error) {
  try {
    std::rethrow_exception(error);
  } catch (const c10::Error& e) {
    stats_.set_error(e.what_without_backtrace());
  } catch (const std::exception& e) {
    stats_.set_error(e.what());
  } catch (...) {
    stats_.set_error("unknown error");
  }
  // check_for_nan_in_grad's finding is the user's to see, raised as without
  // torchft; any other failure fails the step (Note [fault-tolerant step]).
  const bool guard_failed = finite_.take_guard_failed();
  if (fault_.on() && !guard_failed) {
    fault_.note_failure(stats_.last_error().empty() ? "unknown error" : stats_.last_error());
  }
  // Collectives already issued finish (every rank issued them) before the next
  // step writes into their buffers; then the next forward starts afresh
  // instead of reporting unready parameters.
  hook_->abandon_step();
  skip_votes_.drop();
  for (Bucket& bucket : buckets_) {
    if (bucket.future) bucket.future->wait();  // its error, if any, is this step's
    bucket.future.reset();
  }
  views_.release(buckets_);  // nothing writes into them any more
  // A double-buffered hook's step wrote only its spare buffers: whatever the
  // failure, the state it read stands (Note [double-buffered step state]).
  if (hook_->settles_own_state()) hook_->discard_step();
  // check_for_nan_in_grad, or Note [fault-tolerant step] (as an overflow
  // step): discard_step kept the state read.
  if (guard_failed || fault_.on()) {
    hook_->after_step(at::zeros({}, at::kBool));
  } else {
    hook_->after_step(at::Tensor());
  }
  finite_.drop();
  phase_ = Phase::kIdle;
  join_.set_divide_factor(0);
  grad_hooks_.slot().reset();
  unused_.zero(/*unread=*/true);
}

void Reducer::write_back(size_t b, const c10::IValue& result) {
  Bucket& bucket = buckets_[b];
  const bool check_usage = options_.static_graph || options_.find_unused_parameters;
  // Note [gradients handed out]: not where .grad must stay as it is while its
  // slot is reduced (a parameter unused on every rank) or while a bad step is
  // found (check_for_nan_in_grad leaves the local gradients in .grad), nor in
  // another dtype or in distributed autograd's context.
  const bool hand_out = !check_usage && !options_.check_for_nan_in_grad &&
                        !mixed_precision_.on() && !grad_hooks_.slot().in_dist_autograd();
  if (bucket.sparse) {
    // The reduced sparse tensor becomes the gradient, as in torch's reducer.
    const size_t index = bucket.params[0];
    bucket.sparse_grad.reset();
    if (check_usage && unused_.globally_unused(index)) return;
    at::Tensor reduced = hook_->result_tensor(result);
    FASTDDP_CHECK(reduced.is_sparse() && reduced.sizes() == params_[index].sizes(),
                  "fastddp: comm hook '", hook_->name(), "' returned a ",
                  reduced.is_sparse() ? "sparse" : "dense", " tensor of shape ", reduced.sizes(),
                  " for the sparse gradient of parameter '", names_[index], "' (shape ",
                  params_[index].sizes(), ")");
    grad_hooks_.slot().with_grad(params_[index], [&](at::Tensor& grad) {
      grad = reduced;
      return true;
    });
    return;
  }
  if (!hook_->writes_grads()) {  // the sharded optimizer's: the shards are the gradients
    for (const size_t index : bucket.params) {
      if (check_usage && unused_.globally_unused(index)) continue;  // .grad stays as it is
      grad_hooks_.slot().with_grad(params_[index], [](at::Tensor& grad) {
        if (!grad.defined()) return false;
        grad = at::Tensor();
        return true;
      });
    }
    return;
  }
  std::vector<at::Tensor> dsts(bucket.params.size());
  std::vector<at::Tensor> handed(bucket.params.size());  // Note [gradients handed out]
  for (size_t k = 0; k < bucket.params.size(); ++k) {
    const size_t index = bucket.params[k];
    const bool unused = check_usage && unused_.globally_unused(index);
    // As torch's upcast hook: every gradient of the bucket back to the master's dtype,
    // keeping its values only where the reduction does not overwrite them.
    if (mixed_precision_.on()) {
      mixed_precision_.full_precision_grad(grad_hooks_.slot(), params_[index], index, unused);
    }
    if (unused) continue;  // .grad stays as it is
    at::Tensor& view = bucket.views[k];
    grad_hooks_.slot().with_grad(params_[index], [&](at::Tensor& grad) {
      bool replaced = false;
      if (options_.gradient_as_bucket_view) {
        if (!grad.defined()) {
          grad = view;
          replaced = true;
        }
        FASTDDP_CHECK(grad.is_alias_of(view), "fastddp: the gradient of parameter '",
                      names_[index],
                      "' is not its bucket view although gradient_as_bucket_view=True; it was "
                      "replaced during backward (by another hook?).");
        dsts[k] = view;
      } else {
        if (!grad.defined()) {
          // Of the parameter's dtype: the bucket's is reduce_dtype under mixed_precision.
          grad = at::empty_like(view, view.options().dtype(mixed_precision_.master_dtype(index)),
                                at::MemoryFormat::Preserve);
          replaced = true;
        } else if (hand_out) {
          handed[k] = views_.hand_out(grad, index, bucket, b, k);
        }
        // The grad (shares storage with the slot's tensor: written in place),
        // or the slot to hand out, where the result is already.
        dsts[k] = handed[k].defined() ? handed[k] : grad;
      }
      return replaced;
    });
  }
  {
    // Written without recording autograd history, also into grads that
    // require grad (create_graph=True).
    const at::NoGradGuard no_grad;
    hook_->write_back(bucket, result, dsts);
  }
  // Only once the result is there: a failed write-back leaves .grad as it was.
  for (size_t k = 0; k < handed.size(); ++k) {
    if (!handed[k].defined()) continue;
    grad_hooks_.slot().with_grad(params_[bucket.params[k]], [&](at::Tensor& grad) {
      grad = handed[k];
      return true;
    });
  }
  finite_.collect(dsts, hook_->settles_own_state());
}

void Reducer::set_comm_hook(std::shared_ptr<CommHook> hook) {
  std::lock_guard<std::mutex> lock(mutex_);
  FASTDDP_CHECK(hook, "fastddp: set_comm_hook needs a hook");
  if (reducing()) {
    // The backward in flight cannot finish reducing (this call comes from
    // inside it): fail it, so that the next forward starts afresh.
    try {
      FASTDDP_CHECK(false, "fastddp: a comm hook cannot be changed while a backward is reducing");
    } catch (...) {
      fail_iteration(std::current_exception());
      throw;
    }
  }
  check_hook_supports(*hook);
  hook_->set_nonfinite_guard(nullptr);
  hook_ = std::move(hook);
  skip_votes_.note_hook_registered();
  hook_->set_nonfinite_guard(finite_.guard());
  hook_->on_new_buckets(buckets_);
}

void Reducer::check_hook_supports(const CommHook& hook) const {
  if (hook.supports_sparse()) return;
  for (const Bucket& bucket : buckets_) {
    FASTDDP_CHECK_NOT_IMPLEMENTED(!bucket.sparse, "fastddp: the comm hook '", hook.name(),
                                  "' does not support sparse gradients, and parameter '",
                                  names_[bucket.params[0]],
                                  "' gets them (sparse=True); use the default allreduce or a "
                                  "Python hook, or construct the module with sparse=False");
  }
}

void Reducer::set_optimizer_step(std::shared_ptr<OptimizerStep> step) {
  std::lock_guard<std::mutex> lock(mutex_);
  FASTDDP_CHECK(!reducing(),
                "fastddp: the overlapped optimizer cannot be changed while a backward is reducing");
  optimizer_step_ = std::move(step);
}

std::string Reducer::hook_name() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return hook_->name();
}

}  // namespace fastddp
