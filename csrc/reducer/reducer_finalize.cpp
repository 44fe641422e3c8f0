// The end of a synchronized backward: waiting for each bucket's reduction,
// writing the averaged gradients back (and, for a hook with state, checking
// them: Note [a bad step leaves no trace]), and a failed step's clean-up.
#include "reducer.h"

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include "../util/message.h"
#include "optimizer_step.h"
#include "../util/profile_range.h"

namespace fastddp {

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
  grad_slot_.reset();
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
  grad_slot_.reset();
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
                        !mixed_precision_.on() && !grad_slot_.in_dist_autograd();
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
    grad_slot_.with_grad(params_[index], [&](at::Tensor& grad) {
      grad = reduced;
      return true;
    });
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
      mixed_precision_.full_precision_grad(grad_slot_, params_[index], index, unused);
    }
    if (unused) continue;  // .grad stays as it is
    at::Tensor& view = bucket.views[k];
    grad_slot_.with_grad(params_[index], [&](at::Tensor& grad) {
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
    grad_slot_.with_grad(params_[bucket.params[k]], [&](at::Tensor& grad) {
      grad = handed[k];
      return true;
    });
  }
  finite_.collect(dsts, hook_->settles_own_state());
}

}  // namespace fastddp
