// The reducer: averages gradients across a process group while backward runs.
//
// Note [reducer step]
// forward:  before_forward() checks the previous backward finished and
//           rebuilds the buckets once; after_forward() arms the gradient hooks
//           (or leaves them idle under no_sync()) and, when unused parameters
//           must be found, walks the autograd graph from the outputs.
// backward: a C++ post-hook on each parameter's grad accumulator hands the
//           gradient to the comm hook's copy_in; a bucket whose gradients are
//           all in is handed to the comm hook's run() at once, buckets
//           strictly in order, while backward keeps running.
// end:      once the last bucket is launched, an autograd-engine callback waits
//           for the futures and writes the results into param.grad, so the
//           grads are final when backward() returns.
//
// Note [static graph]
// With static_graph the first synchronized backward only counts how often
// each parameter's hook fires; a callback queued by the output sink (see
// after_forward) then reduces every bucket at the end of that backward. Later
// iterations mark a parameter ready when its hook has fired as often as in
// the first one, so parameters used several times (reentrant checkpointing)
// are reduced once, after their last contribution.
//
// Note [unused parameters]
// With find_unused_parameters, parameters whose grad accumulators the graph
// from the outputs does not reach are marked ready (as zeros) when the first
// hook fires. A used-bitmap is allreduced after the last bucket; a parameter
// unused on every rank keeps its .grad untouched (None stays None).
//
// Note [skipping unused buckets]
// torch's skip_all_reduce_unused_params: a bucket whose parameters are all in
// the unused set (the graph search above; under static_graph, the hooks that
// did not fire in the first iteration) is not handed to the comm hook, and
// its grads are not written back: None stays None. Its parameters are still
// marked ready, with torch's copy-in and its side effects, which show under
// gradient_as_bucket_view: a defined grad becomes (or stays) the bucket view,
// holding grad / world size when no comm hook is registered (torch divides
// while copying in, or in place, and nothing sums it back), grad itself when
// one is. The first static-graph iteration reduces every bucket (torch's
// delay_all_reduce does not skip). Comm hooks see the skipped bucket's index
// missing, and GradBucket.is_last() only on the real last bucket, as under
// torch; a pipelined hook is drained instead (CommHook::drain). torch counts
// the buckets it reduced per backward (num_buckets_reduced in its logging
// data; the delayed first static iteration counts none); so do we. The
// overlapped optimizer steps a skipped bucket's parameters at the end of
// backward with the .grad torch's optimizer.step() would see (Note [overlapped
// optimizer]); a lazy bucket is allocated and released as the others are.
// One difference, on purpose: torch's finalize waits on a skipped bucket's
// future from the last step that reduced it, and under gradient_as_bucket_view
// with a hook whose result is a new tensor copies that stale result into the
// grads (measured on torch 2.14.1); here a skipped bucket's grads are left as
// the copy-in made them.
// torch decides per rank, and a bucket unused on one rank but used on another
// mismatches the ranks' collectives (gloo aborts the process). Here every rank
// votes, in one small int32 allreduce launched at the end of each synchronized
// forward (a rank shadowing a step under join() takes part too): per bucket,
// how many ranks leave it unused and how many use it. A bucket is skipped only
// where no training rank uses it; a disputed one is reduced like any other,
// with zeros from the ranks that did not use it, so it gets the average torch
// computes without skipping. A rank reads the votes (waits) only if it has a
// candidate bucket, all of whose parameters it left unused, and only when that
// bucket's copy-in (under a registered hook) or launch needs the decision: a
// bucket this rank uses cannot be skipped, so a rank without candidates
// launches every bucket as usual and never waits. On an accelerator that read
// is a host sync, paid only by a rank with a candidate bucket, as torch's
// find_unused_parameters pays one for a locally unused parameter (its
// used-map read, UnusedParameters::globally_unused); launching the votes is none (pinned
// memory, copied without blocking). The votes' collective is issued by every
// rank in every such step, so the ranks' collectives stay in the same order.
//
// Note [mixed precision]
// torch DDP's mixed_precision (_MixedPrecision(param_dtype, reduce_dtype,
// buffer_dtype)). Python (fastddp/ddp/_mixed_precision.py) casts the
// parameters to param_dtype at each forward of the module (torch's
// _root_copy_hook: `param.data` swapped for a param_dtype copy, the fp32
// tensor kept as the master) and hands both lists to after_param_cast(). A
// parameter whose dtype changes gets a new grad accumulator, so the reducer
// moves its hooks there (torch re-registers them per forward in
// _module_wait_for_copy_hook). The buckets are in reduce_dtype; the comm hook
// is UpcastAllreduceHook (torch's _reducer_allreduce_and_upcast_hook): the
// param_dtype gradient is cast into the bucket as it is copied in, summed,
// divided by the world size in reduce_dtype, and cast up into a .grad of the
// master's dtype at the write-back. At the end of the synchronized backward
// the masters go back into the parameters, as torch's hook and end-of-backward
// callback put back `_fp_param`; under no_sync() nothing is reduced and the
// parameters and their gradients stay in param_dtype until the next
// synchronized backward, as in torch.
#pragma once

#include <ATen/Tensor.h>
#include <c10/util/intrusive_ptr.h>

#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "bucket.h"
#include "comm_hook.h"
#include "fault_tolerance.h"
#include "finite_checks.h"
#include "grad_hooks.h"
#include "join.h"
#include "layout.h"
#include "mixed_precision.h"
#include "static_graph.h"
#include "step_stats.h"
#include "unused_parameters.h"

namespace c10d {
class ProcessGroup;
}  // namespace c10d

namespace fastddp {

class OptimizerStep;

struct ReducerOptions {
  // param.grad become views into the buckets: no copy in or out.
  bool gradient_as_bucket_view = false;
  // See Note [unused parameters].
  bool find_unused_parameters = false;
  // See Note [static graph]; set_static_graph() turns it on later.
  bool static_graph = false;
  // Per parameter: its gradients are sparse (a bucket of its own, see
  // Bucket::sparse). Empty: none is.
  std::vector<bool> expect_sparse;
  // _set_ddp_sink_clone: the output sink returns clones (Reducer::set_sink_clone).
  bool sink_clone = true;
  // Size limits for the one rebuild after the first iteration, as in
  // plan_buckets (torch's are {first_bucket_bytes, bucket_bytes_cap}).
  std::vector<size_t> rebuild_limits = {kDefaultFirstBucketBytes, kDefaultBucketCapBytes};
  // Raise on non-finite gradients, see Note [non-finite guard].
  bool check_for_nan_in_grad = false;
  // Slot alignment of the flat buffers in bytes, 0: packed (Note [aligned
  // flat buffer]).
  int64_t align_bytes = 0;
  // Buckets unused on every rank are not reduced: Note [skipping unused buckets].
  bool skip_all_reduce_unused_params = false;
  // DDP's mixed_precision, see Note [mixed precision]. param_dtype: the
  // parameters' dtype in forward and backward (nullopt: not cast);
  // reduce_dtype: the buckets' (nullopt: the parameters').
  bool mixed_precision = false;
  std::optional<c10::ScalarType> param_dtype;
  std::optional<c10::ScalarType> reduce_dtype;
  // torch 2.15's lazy_bucket_allocation: bucket buffers only while a backward
  // reduces (Note [lazy bucket storage] in bucket.h).
  bool lazy_bucket_allocation = false;
  // Every bucket in this many equal shards (Note [sharded buckets] in
  // bucket.h); set by shard_buckets().
  int64_t shards = 1;
};

class Reducer : public std::enable_shared_from_this<Reducer> {
 public:
  // `params` are the parameters that require grad, each once; `names` their
  // qualified names (for error messages); `plan` the initial buckets.
  Reducer(std::vector<at::Tensor> params, std::vector<std::string> names,
          std::vector<std::vector<size_t>> plan, c10::intrusive_ptr<c10d::ProcessGroup> group,
          std::shared_ptr<CommHook> hook, ReducerOptions options);
  ~Reducer();
  Reducer(const Reducer&) = delete;
  Reducer& operator=(const Reducer&) = delete;

  // Start of a forward with grad enabled. Raises if the previous backward
  // stopped half-way; rebuilds the buckets once. `sync`: this forward's
  // backward will be synchronized. Returns true when it rebuilt the buckets.
  bool before_forward(bool sync);
  // End of a forward with grad enabled: `sync` arms the hooks for the next
  // backward, otherwise (no_sync) grads accumulate locally. `outputs` are the
  // forward's output tensors that have a grad_fn; the result replaces them
  // (they pass through a sink node when unused parameters must be found).
  std::vector<at::Tensor> after_forward(bool sync, std::vector<at::Tensor> outputs);
  // torch's Reducer.prepare_for_backward(outputs), called by frameworks outside
  // DDP's forward (Lightning's manual optimization, Accelerate's
  // trigger_sync_in_backward): arms the next backward like after_forward(true)
  // but with no output sink, so the first static-graph iteration queues its
  // delayed reduction from the first gradient hook instead.
  void prepare_for_backward(const std::vector<at::Tensor>& outputs);
  // torch's Reducer._delay_all_reduce(): the first static-graph iteration's
  // reduction, now, unless it is queued already.
  void delay_all_reduce();
  // Whether after_forward needs the outputs this iteration.
  bool needs_outputs() const;

  void set_comm_hook(std::shared_ptr<CommHook> hook);
  // The optimizer stepped bucket by bucket after each synchronized backward's
  // write-back (Note [overlapped optimizer]); nullptr: none.
  void set_optimizer_step(std::shared_ptr<OptimizerStep> step);
  // torch's _set_ddp_sink_clone: whether the output sink returns clones
  // (default; in-place ops on outputs then work) or the outputs themselves.
  void set_sink_clone(bool clone);
  void set_static_graph();
  // For join(divide_by_initial_world_size=False): divide the next backward's
  // sum by `factor` (the ranks still training) instead of the world size.
  void set_divide_factor(int64_t factor);

  // Note [fault-tolerant step] (fault_tolerance.h), for fastddp.integrations.torchft:
  // a failed step is reported to `sink` instead of raised, and the hook's new
  // state waits for settle_pending().
  void set_fault_sink(FaultTolerance::Sink sink);
  // The next backward's mean divides by `count` (1..world size) participants;
  // `contributes` false: this rank sends zeros (a replica still healing).
  void set_participants(int64_t count, bool contributes);
  // The last finished step's hook state: kept if `commit`, else put back as
  // after an overflow step. No-op when nothing waits.
  void settle_pending(bool commit);
  // The buckets stay as they are (no rebuild from the first step's order), so
  // that a replica that joins later lays them out as the others did.
  void freeze_buckets();

  // join(): a rank without data runs the collectives of one backward with
  // zero gradients, in the same order as the ranks that still train.
  void shadow_backward();
  // join(): lets the one bucket rebuild happen on a rank that ran out of data
  // before its first backward, in parameter order (rank 0's plan wins).
  void record_default_ready_order();

  // The sharded optimizer (Note [sharded buckets]): the buckets laid out again
  // as `shards` equal shards each, and kept so (no later rebuild): the current
  // plan once rebuilt from the gradients' order, before that the size limits'
  // plan in reverse parameter order. Before a backward, never during one.
  // `release`: the buffers only while a backward reduces (ZeRO-2: Note [lazy
  // bucket storage]), the shards being where the averaged gradients stay.
  void shard_buckets(int64_t shards, bool release = false);
  // Per bucket: its parameter indices, their offsets and sizes in elements, each slot
  // view's strides (the parameter's own where it is dense, else contiguous: make_buckets
  // decides, and a caller that lays out a buffer like the bucket's uses these rather than
  // deciding again), and the bucket's length (padding included).
  using SlotLayout = std::tuple<std::vector<size_t>, std::vector<int64_t>, std::vector<int64_t>,
                                std::vector<std::vector<int64_t>>, int64_t>;
  std::vector<SlotLayout> bucket_layout() const;

  std::vector<std::vector<size_t>> bucket_plan() const;
  std::vector<int64_t> bucket_bytes() const;
  // Bytes of bucket storage the reducer holds now (join()'s shadows included):
  // the whole layout, or with lazy_bucket_allocation 0 between backwards.
  int64_t held_bucket_bytes() const;
  bool has_rebuilt_buckets() const { return ready_order_.rebuilt(); }
  int64_t num_backward_syncs() const { return stats_.steps(); }
  int64_t num_iterations() const { return num_iterations_; }
  // Buckets the last synchronized backward reduced (Note [skipping unused buckets]).
  int64_t num_buckets_reduced() const;
  bool static_graph() const { return options_.static_graph; }
  std::string hook_name() const;
  std::vector<int64_t> last_ready_order() const;
  std::vector<int64_t> last_unused_parameters() const;
  // Never waits for the device (Note [device timeline]).
  CommStats comm_stats() const;
  // Which backwards record device timing events: torch's sampling at this
  // rate (the DDP logger's), or every one while `on` (Note [device timeline]).
  void set_timing_sample_rate(int64_t rate);
  void set_time_every_step(bool on);
  // The message of the last error raised in a backward ("" if none), for
  // torch's logging-data keys has_error / error.
  std::string last_error() const;
  // Whether each synchronized step checks its averaged gradients for NaN/Inf
  // even when the hook has no state (auto's tuning, which must not time a
  // step whose gradients overflowed), and that check's last result: nullopt
  // when it is off or no step finished since. Reading it waits for the device.
  void set_track_finite(bool on);
  std::optional<bool> last_step_finite() const;

  // Called by the output sink's backward (reducer_graph.cpp).
  void on_output_grad();

  // mixed_precision: `params` were just cast to param_dtype and `masters` hold
  // their full-precision data; see Note [mixed precision].
  void after_param_cast(std::vector<at::Tensor> params, std::vector<at::Tensor> masters);

 private:
  enum class Phase {
    kIdle,       // no synchronized backward expected: hooks do nothing
    kExpecting,  // armed by after_forward(true)
    kReduced,    // this forward's backward is done; see Note [a backward after the reduction]
  };

  // Puts the reducer's post-hooks on the parameters' current grad accumulators.
  void install_hooks();
  void on_grad_ready(size_t index);
  void handle_grad_ready(size_t index);  // on_grad_ready under the lock
  void mark_ready(size_t index);
  // A gradient into slot `slot` of bucket b, by the comm hook.
  void copy_in(size_t b, size_t slot, const at::Tensor& grad);
  // Raises unless `grad` is what parameter `index`'s slot `view` expects.
  void check_grad(size_t index, const at::Tensor& grad, const Bucket& bucket,
                  const at::Tensor& view) const;
  // A synchronized backward has marked gradients ready and not finished.
  bool reducing() const;
  int rank() const;
  int world_size() const;
  void launch_ready_buckets();
  void queue_finalize();
  void finalize_backward();
  // Waits for bucket b's reduction, writes its averaged gradients (a skipped
  // bucket: neither) and hands them to the overlapped optimizer, if any.
  void finish_bucket(size_t b);
  // Note [overlapped optimizer]: the launched buckets whose reductions have
  // completed, finished during backward, in order.
  void finish_completed_buckets();
  void reduce_all_delayed();  // the first static-graph iteration, see Note [static graph]
  void write_back(size_t b, const c10::IValue& result);
  void reset_iteration();
  // check_for_nan_in_grad: shares this step's findings and raises, on every
  // rank, if a gradient was not finite (Note [non-finite guard]).
  void check_finite_gradients();
  // Records the error for the logging data; the next forward starts afresh.
  // Under Note [fault-tolerant step] also notes it for the sink.
  void fail_iteration(const std::exception_ptr& error);
  // After the lock is released: hands a noted failure to the sink.
  void report_failure(std::string failure) const;

  bool should_rebuild() const;
  bool static_first_iteration() const;
  bool dynamic_find_unused() const;
  bool track_usage() const;
  void rebuild_buckets();
  // What the planner knows of each parameter (its full-precision dtype).
  std::vector<TensorSpec> param_specs() const;
  // New buckets of `plan` under the current options, and no rebuild after.
  void lay_out_again(const std::vector<std::vector<size_t>>& plan);
  std::vector<std::vector<size_t>> broadcast_plan(const std::vector<std::vector<size_t>>& plan);
  void reset_bucket_views();

  void ensure_prior_reduction_finished() const;
  // Raises if a parameter changed dtype, device or shape since wrapping.
  void check_parameters_unchanged() const;
  void check_hook_supports(const CommHook& hook) const;  // sparse buckets
  void check_not_ready(size_t index) const;
  std::string unready_params() const;
  std::vector<size_t> search_unused_parameters(const std::vector<at::Tensor>& outputs) const;

  // Note [skipping unused buckets]: whether this step votes, on which candidates.
  bool skip_votes_needed() const;
  void vote_on_skips();  // after the forward: launches the votes
  bool skippable(size_t bucket) const;  // all its parameters are unused
  void queue_delayed_reduce();  // Note [static graph]

  // The core: the parameters, the buckets, the hook and the step's order.
  std::vector<at::Tensor> params_;
  std::vector<std::string> names_;
  c10::intrusive_ptr<c10d::ProcessGroup> group_;
  std::shared_ptr<CommHook> hook_;
  std::shared_ptr<OptimizerStep> optimizer_step_;
  ReducerOptions options_;
  std::vector<Bucket> buckets_;
  mutable std::mutex mutex_;
  Phase phase_ = Phase::kIdle;
  int64_t num_iterations_ = 0;  // synchronized forwards
  std::vector<bool> ready_;
  size_t next_bucket_ = 0;
  bool finalize_queued_ = false;
  // Whether a backward that fired this iteration's hooks retained its graph
  // (retain_graph=True). Note [a backward after the reduction].
  bool graph_retained_ = false;

  // The features, each owning its state. The step calls them at its named
  // points: armed (reset_iteration, after_forward), a gradient ready
  // (handle_grad_ready, mark_ready), a bucket launched (launch_ready_buckets),
  // the end (finalize_backward, finish_bucket, write_back) and a failure
  // (fail_iteration).
  BucketViews views_;  // where each parameter lives; bucket views, lazy buffers
  SkipVotes skip_votes_;  // Note [skipping unused buckets]
  UnusedParameters unused_;  // Note [unused parameters]
  StaticGraph static_graph_;  // Note [static graph]
  MixedPrecision mixed_precision_;  // Note [mixed precision]
  JoinShadow join_;  // join()'s zero buckets and divisor
  ReadyOrder ready_order_;  // for the one rebuild, and the last backward's
  // The step's figures and the device timeline. Reading them (comm_stats)
  // advances the timeline: the reducer's own state, guarded by mutex_ like
  // the rest, hence mutable.
  mutable StepStats stats_;
  FiniteChecks finite_;  // Note [non-finite guard], Note [a bad step leaves no trace]
  FaultTolerance fault_;  // Note [fault-tolerant step]

  // The post-hooks on the grad accumulators, calling on_grad_ready. Declared
  // last: destroyed first, so no hook outlives the state it reaches.
  GradHooks grad_hooks_;
};

}  // namespace fastddp
