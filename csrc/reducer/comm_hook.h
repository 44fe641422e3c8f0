// The communication-hook interface the reducer dispatches to.
//
// Note [comm hook contract]
// The reducer owns the buckets and the order of events; a CommHook owns what
// goes on the wire. Per synchronized backward, for every bucket:
//   copy_in(bucket, slot, grad)   once per parameter as its gradient is ready
//                                 (grad undefined: the parameter got no
//                                 gradient this step; write zeros),
//   run(bucket, index, is_last)   once all of the bucket's slots are in, in
//                                 bucket order on every rank; returns a future,
//   write_back(bucket, result, dsts)  after the future completed, from the
//                                 autograd-engine callback at the end of
//                                 backward: the averaged gradient of slot k
//                                 goes into dsts[k].
// dsts[k] is either the parameter's .grad or, under gradient_as_bucket_view,
// bucket.views[k] itself (check with is_same / data_ptr before copying); it
// is undefined for a parameter unused on every rank, whose grad stays as is.
// A rank that has joined (uneven inputs) runs copy_in with undefined grads and
// run() on every bucket, and waits, so its collectives match the others'.
//
// The interface lives beside the reducer, which calls it; the built-in hooks
// (csrc/hooks/) implement it and the bindings hand one to the reducer.
#pragma once

#include <ATen/Tensor.h>
#include <ATen/core/ivalue.h>
#include <c10/util/intrusive_ptr.h>

#include <cstdint>
#include <exception>
#include <string>
#include <vector>

#include "bucket.h"

namespace fastddp {

class NonFiniteGuard;

// Note [step divisors]: what one step's average divides the sum by. Two
// numbers, because torch's hooks answer two questions. `requested` is what
// the mean is asked to be over: the world size, or under
// join(divide_by_initial_world_size=False) the ranks still training.
// `participants` is how many ranks' gradients the sum holds: the group's
// size, or a fault-tolerant engine's participants this step (Note
// [fault-tolerant step]). torch's default hooks divide by the first; its
// PowerSGD hook by the group's size whatever join() asks, so fastddp's
// PowerSGD divides by the second. One call gives a hook both.
struct StepDivisors {
  int64_t requested;
  int64_t participants;
};

class CommHook {
 public:
  virtual ~CommHook() = default;

  // Short name for reports and errors ("allreduce", "bf16", ...).
  virtual std::string name() const = 0;

  // The bucket layout is new (construction or the one rebuild): per-bucket
  // state sized for the old layout must be dropped.
  virtual void on_new_buckets(const std::vector<Bucket>& buckets) { (void)buckets; }

  // Writes one parameter's gradient into the bucket. The default is a plain
  // copy, torch's contract for hooks: the hook sees the gradients unscaled
  // and divides by the world size itself.
  virtual void copy_in(Bucket& bucket, size_t slot, const at::Tensor& grad);

  // Starts reducing a full bucket. Only this hook's write_back reads the
  // future's value; for the default write_back it is the averaged flat
  // gradient (a tensor, or a list whose first element is that tensor, as c10d
  // Work futures give), of the bucket's numel and dtype.
  virtual c10::intrusive_ptr<c10::ivalue::Future> run(Bucket& bucket, size_t index,
                                                      bool is_last) = 0;

  // Writes the averaged gradients into dsts (one per slot). The default takes
  // the future's tensor and copies each slot's slice into dsts[k], skipping
  // slots where dsts[k] already is that memory.
  virtual void write_back(Bucket& bucket, const c10::IValue& result,
                          std::vector<at::Tensor>& dsts);

  // Before every step's first copy_in (at the forward, and for a joined
  // rank's shadow step): this step's divisors (Note [step divisors]). A hook
  // divides by the one its torch counterpart divides by; a hook that divides
  // by its group's size itself (torch's upcast hook) ignores both.
  virtual void set_divisors(StepDivisors divisors) { (void)divisors; }

  // Every bucket of this step has been run() or skipped, the last one skipped
  // (skip_all_reduce_unused_params, Note [skipping unused buckets]): no run()
  // was told is_last, so a hook that holds work back for the last bucket
  // (Note [pipelined hooks]) issues it now. Called on every rank alike, from
  // the same place in the sequence of collectives.
  virtual void drain() {}

  // The step failed after some buckets were run(): the reducer then waits for
  // their futures before the next step reuses their buffers, so a hook must
  // complete (or fail) every future it returned, also for work it will now
  // never start (a pipelined hook's second collective).
  virtual void abandon_step() {}

  // At the end of every synchronized backward, whether its step state was
  // kept: `kept` is the 0-dim bool on the buckets' device that settle_step()
  // returned, false after a failed step (its state discarded), undefined when
  // nothing was checked (the step stands). For a hook whose host-side choices
  // follow its state (ACP-SGD's turn, Note [acpsgd]): read it lazily, never
  // here, where a device read would synchronize.
  virtual void after_step(const at::Tensor& kept) { (void)kept; }

  // Note [double-buffered step state]: a hook with state carried from step to
  // step (error feedback, PowerSGD's memories) writes each step's new state
  // into spare buffers, leaving the state it read untouched, and settles it
  // itself: a finite step then costs no copy and no select (util/
  // step_cost.h counts it). settle_step() runs at the end of every synchronized
  // backward that reached the write-back, with `finite` (all_finite of the
  // averaged gradients; undefined: nothing was checked, the step stands); it keeps the
  // new state where `finite` is true or the state it read was already not
  // all finite (reducer/finite_checks.h), else the state it read, and returns
  // that choice as a 0-dim bool (a device tensor on a device: no host sync).
  // discard_step(): a failed step; the state it read stands.
  virtual bool settles_own_state() const { return false; }
  virtual at::Tensor settle_step(const at::Tensor& finite) { return finite; }
  virtual void discard_step() {}

  // Whether the averaged gradients go into .grad. False for the sharded
  // optimizer's reduce-scatter (Note [sharded buckets]): each rank holds its
  // shard of the average, none the whole, so the reducer sets every reduced
  // parameter's .grad to None instead of calling write_back, and a reader of
  // .grad finds no gradient rather than a partial one.
  virtual bool writes_grads() const { return true; }

  // Whether run() and write_back() accept sparse buckets (see Bucket::sparse):
  // copy_in then stores the gradient in bucket.sparse_grad, run() reduces it,
  // and the future's tensor becomes the parameter's .grad.
  virtual bool supports_sparse() const { return false; }

  // The tensor in a completed future's value (see hook_result_tensor).
  virtual at::Tensor result_tensor(const c10::IValue& result);

  // Bytes this hook puts on the wire for one bucket per step, for the
  // communication report (what one rank contributes to the collective).
  virtual int64_t wire_bytes(const Bucket& bucket) const { return bucket.bytes(); }

  // check_for_nan_in_grad: copy_in reports every gradient to `guard` (owned
  // by the reducer; nullptr: no check). See Note [non-finite guard].
  void set_nonfinite_guard(NonFiniteGuard* guard) { guard_ = guard; }

  // The collective run() issued for bucket `index` this step, when the future
  // it returned is that collective's own ("allreduce of the bucket"): the
  // reducer names it when the future fails, because a backend's own text
  // (gloo: "Connection closed by peer") names none. nullptr when the hook's
  // errors name their collective themselves (see collective_error) or when
  // it is not known (Python hooks). Costs a pointer store per bucket.
  const char* launched_collective(size_t index) const {
    return index < launched_.size() ? launched_[index] : nullptr;
  }

 protected:
  void note_launch(size_t index, const char* what) {
    if (launched_.size() <= index) launched_.resize(index + 1, nullptr);
    launched_[index] = what;
  }
  // grad -> bucket.views[slot], times `scale` (1: a copy); in place when grad
  // already is the view (gradient_as_bucket_view). With a guard, the check
  // rides on the same pass where it can (dense float32/float64 on the CPU).
  void scale_into_view(Bucket& bucket, size_t slot, const at::Tensor& grad, double scale);
  // Its fused loop alone: false (nothing written) where it does not apply.
  bool fused_scale_into_view(Bucket& bucket, size_t slot, const at::Tensor& grad, double scale);
  // Reports `grad` to the guard, if any, for a copy_in that wrote it elsewhere.
  void check_grad(const Bucket& bucket, size_t slot, const at::Tensor& grad);

  NonFiniteGuard* guard_ = nullptr;

 private:
  std::vector<const char*> launched_;  // string literals
};

// The flat tensor in a hook future's value: the tensor itself or the first
// element of a tensor list. Raises, naming the hook, for anything else.
at::Tensor hook_result_tensor(const c10::IValue& result, const std::string& hook_name);

// A sparse bucket's gradient for copy_in: `grad`, or a sparse zero tensor of
// the parameter's shape when it got none.
at::Tensor sparse_grad_or_zeros(const Bucket& bucket, const at::Tensor& grad);

// "<what> failed: <the future's error>", for a hook that completes its own
// future after a collective (`what` names it: "allreduce of Q").
std::exception_ptr collective_error(const std::string& what, c10::ivalue::Future& failed);

// Copies a flat result into the parameters' gradients, slot by slot (one
// multi-tensor launch on CUDA). Shared by the default write_back and hooks
// that decompress into the bucket first.
void copy_flat_to_grads(Bucket& bucket, const at::Tensor& flat, std::vector<at::Tensor>& dsts);

}  // namespace fastddp
