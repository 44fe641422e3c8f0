#include "hierarchical.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <exception>
#include <stdexcept>
#include <utility>

#include "../../util/profile_range.h"
#include "../common/pipelined_hook.h"
#include "../common/side_stream.h"
#include "../../util/message.h"
#include "../common/collectives.h"

namespace fastddp {
namespace {

// Completes `result` with `value` once `collective` is done (or with its error).
// No device work: torch runs the callback with a pool stream current that it
// made wait for the collective, so `result` records its events after it.
void complete_with(const c10::intrusive_ptr<c10::ivalue::Future>& collective,
                   const c10::intrusive_ptr<c10::ivalue::Future>& result, std::string what,
                   at::Tensor value) {
  collective->addCallback([result, what = std::move(what),
                           value = std::move(value)](c10::ivalue::Future& fut) {
    if (fut.hasError()) {
      result->setErrorIfNeeded(collective_error(what, fut));
    } else {
      result->markCompleted(c10::IValue(value));
    }
  });
}

// Fails `result` with `error` once `collective` is done: the bucket's buffers
// are free again when the reducer sees the failure.
void fail_after(const c10::intrusive_ptr<c10::ivalue::Future>& collective,
                const c10::intrusive_ptr<c10::ivalue::Future>& result, std::exception_ptr error) {
  collective->addCallback([result, error = std::move(error)](c10::ivalue::Future&) {
    result->setErrorIfNeeded(error);
  });
}

}  // namespace

HierarchicalHook::HierarchicalHook(c10::intrusive_ptr<c10d::ProcessGroup> intra,
                                   c10::intrusive_ptr<c10d::ProcessGroup> inter,
                                   std::shared_ptr<CommHook> inner, bool factor_counts_nodes)
    : intra_(std::move(intra)),
      inter_(std::move(inter)),
      inner_(std::move(inner)),
      factor_counts_nodes_(factor_counts_nodes) {
  FASTDDP_CHECK(intra_ && inter_, "fastddp: the hierarchical comm hook needs an intra-node and an "
                                "inter-node process group");
  FASTDDP_CHECK(inner_, "fastddp: the hierarchical comm hook needs an inner (inter-node) hook");
  local_size_ = intra_->getSize();
  node_count_ = inter_->getSize();
  FASTDDP_CHECK(local_size_ >= 1 && node_count_ >= 1,
                "fastddp: the hierarchical comm hook got empty groups");
  divide_by(static_cast<int64_t>(local_size_) * node_count_);
}

std::string HierarchicalHook::name() const { return "hierarchical(" + inner_->name() + ")"; }

void HierarchicalHook::divide_by(int64_t factor) {
  FASTDDP_CHECK(factor > 0, "fastddp: the divide factor must be positive, got ", factor);
  // The inner hook divides by the node count itself.
  const double ranks = static_cast<double>(factor) * (factor_counts_nodes_ ? local_size_ : 1);
  scale_ = static_cast<double>(node_count_) / ranks;
}

void HierarchicalHook::on_new_buckets(const std::vector<Bucket>& buckets) {
  states_.clear();
  // The inner hook's buckets are the shards: it sees the new layout too, so
  // that it checks them (dtype, ...) now rather than in the first backward.
  // Its per-"parameter" state (error-feedback residuals) is keyed by bucket
  // index, which a rebuild reassigns: a shard whose size changed restarts
  // from zero.
  std::vector<Bucket> shards;
  for (size_t i = 0; i < buckets.size(); ++i) {
    if (buckets[i].sparse) continue;  // copy_in refuses it
    Bucket& shard = state_for(buckets[i])->shard_bucket;
    shard.params[0] = i;
    shards.push_back(shard);
  }
  inner_->on_new_buckets(shards);
}

int64_t HierarchicalHook::padded_numel(int64_t numel) const {
  const int64_t unit = static_cast<int64_t>(local_size_) * node_count_;
  return (numel + unit - 1) / unit * unit;
}

std::shared_ptr<HierarchicalHook::BucketState> HierarchicalHook::state_for(
    const Bucket& bucket) {
  std::shared_ptr<BucketState>& state = states_[bucket.id];
  const int64_t numel = bucket.flat.numel();
  const int64_t padded = padded_numel(numel);
  if (state && state->shard.numel() * local_size_ == padded) return state;
  state = std::make_shared<BucketState>();
  // The bucket's device: its flat buffer may be released (meta) when the layout is announced.
  const auto options = bucket.flat.options().device(bucket.device);
  // Zeros: the padding takes part in every collective and must stay finite.
  if (padded != numel) state->padded = at::zeros({padded}, options);
  state->shard = at::empty({padded / local_size_}, options);
  // gloo's reduce_scatter costs more than an allreduce of the whole bucket (2.5x an
  // alltoall of the same bytes on a 2-core VM, 4 ranks); on the CPU the reduce-scatter is
  // an alltoall and a local sum in rank order instead (the same bytes on the link).
  if (bucket.device.is_cpu()) state->shards = at::empty({padded}, options);
  Bucket& s = state->shard_bucket;
  s.flat = state->shard;
  s.views = {state->shard};
  s.offsets = {0};
  s.numels = {state->shard.numel()};
  s.params = {0};  // set per run to the bucket index (the inner's per-slot state key)
  s.pending = 0;
  return state;
}

void HierarchicalHook::copy_in(Bucket& bucket, size_t slot, const at::Tensor& grad) {
  FASTDDP_CHECK_NOT_IMPLEMENTED(!bucket.sparse && !(grad.defined() && grad.is_sparse()),
                                "fastddp: the ", name(),
                                " comm hook does not support sparse gradients");
  if (!grad.defined()) {
    bucket.views[slot].zero_();
    return;
  }
  scale_into_view(bucket, slot, grad, scale_);
}

c10::intrusive_ptr<c10::ivalue::Future> HierarchicalHook::run(Bucket& bucket, size_t index,
                                                              bool is_last) {
  FASTDDP_PROFILE_RANGE("fastddp launch (hierarchical)");
  if (index == 0 && (!scattering_.empty() || !inner_running_.empty())) {
    // Left over from a step that failed without the reducer noticing: its
    // later collectives must not be issued now.
    abandon_step();
  }
  Stage stage;
  stage.index = index;
  stage.numel = bucket.flat.numel();
  stage.state = state_for(bucket);
  stage.result = make_result(bucket.flat);
  BucketState& s = *stage.state;
  stage.padded = s.padded.defined() ? s.padded : bucket.flat;
  if (s.padded.defined()) s.padded.narrow(0, 0, stage.numel).copy_(bucket.flat);
  if (s.shards.defined()) {
    stage.reduce_scatter = all_to_all_even(*intra_, s.shards, stage.padded);
  } else {
    stage.reduce_scatter = reduce_scatter_into(*intra_, s.shard, stage.padded);
  }
  note_launch(index, nullptr);  // errors name their collective themselves
  c10::intrusive_ptr<c10::ivalue::Future> done = stage.result;
  scattering_.push_back(std::move(stage));

  // Bucket i-1: its reduce_scatter was issued one bucket earlier.
  if (scattering_.size() > 1) {
    Stage previous = std::move(scattering_.front());
    scattering_.pop_front();
    start_inner(previous, false);
  }
  // Bucket i-2: its inner reduction is done or nearly (a pipelined inner hook
  // finished it in the run() just above).
  if (inner_running_.size() > 1) {
    Stage oldest = std::move(inner_running_.front());
    inner_running_.pop_front();
    start_allgather(oldest);
  }
  if (is_last) drain_stages(true);
  return done;
}

void HierarchicalHook::drain() { drain_stages(false); }

void HierarchicalHook::drain_stages(bool is_last) {
  while (!scattering_.empty()) {
    Stage last = std::move(scattering_.front());
    scattering_.pop_front();
    start_inner(last, is_last && scattering_.empty());
  }
  // Not told is_last (the real last bucket was skipped): a pipelined inner
  // hook still holds its last shard's second collective.
  if (!is_last) inner_->drain();
  while (!inner_running_.empty()) {
    Stage next = std::move(inner_running_.front());
    inner_running_.pop_front();
    start_allgather(next);
  }
}

void HierarchicalHook::start_inner(Stage& stage, bool is_last) {
  BucketState& s = *stage.state;
  const SideStreamScope side(s.shard.device());  // Note [hook streams]
  try {
    wait_collective(*stage.reduce_scatter, "reduce_scatter of the bucket inside the node");
    stage.reduce_scatter.reset();
    if (s.shards.defined()) {
      // Row r: this rank's shard of local rank r's bucket.
      sum_rows_in_rank_order(s.shard, s.shards, local_size_);
    }
    record_current_stream({s.shard, stage.padded});
    s.shard_bucket.params[0] = stage.index;
    inner_->copy_in(s.shard_bucket, 0, s.shard);
    stage.inner_future = inner_->run(s.shard_bucket, stage.index, is_last);
  } catch (...) {
    // The reducer reports it from backward(), naming the bucket and hook,
    // after the allgather every rank of the node issues (the Note).
    stage.inner_future = make_result(s.shard);
    stage.inner_future->setError(std::current_exception());
  }
  inner_running_.push_back(std::move(stage));
}

void HierarchicalHook::start_allgather(Stage& stage) {
  BucketState& s = *stage.state;
  const SideStreamScope side(s.shard.device());
  std::exception_ptr failed;  // the inner reduction's: the allgather is issued all the same
  try {
    // A host wait on the CPU; on CUDA the side stream waits for the inner's work.
    stage.inner_future->wait();
    if (stage.inner_future->hasError()) {
      std::rethrow_exception(stage.inner_future->exception_ptr());
    }
    std::vector<at::Tensor> dsts{s.shard_bucket.views[0]};
    try {
      inner_->write_back(s.shard_bucket, stage.inner_future->value(), dsts);
    } catch (const std::exception& e) {
      throw collective_failure("the inter-node hook " + inner_->name() + "'s write-back", e);
    }
  } catch (...) {
    failed = std::current_exception();
    s.shard.zero_();  // what the node's peers gather from this rank: finite, unused
  }
  try {
    record_current_stream({s.shard, stage.padded});
    c10::intrusive_ptr<c10d::Work> work = all_gather_into(*intra_, stage.padded, s.shard);
    if (failed) {
      fail_after(work->getFuture(), stage.result, failed);
      return;
    }
    const at::Tensor out = stage.padded.narrow(0, 0, stage.numel);
    complete_with(work->getFuture(), stage.result,
                  "allgather of the reduced shards inside the node", out);
  } catch (...) {
    stage.result->setErrorIfNeeded(failed ? failed : std::current_exception());
  }
}

void HierarchicalHook::abandon_step() {
  const auto abandoned = std::make_exception_ptr(
      std::runtime_error("fastddp: comm hook '" + name() + "': the step was abandoned"));
  for (Stage& stage : scattering_) {
    try {
      stage.reduce_scatter->wait();  // its buffers are reused by the next step
    } catch (...) {
      // Its error is the step's, which has failed already.
    }
    stage.result->setErrorIfNeeded(abandoned);
  }
  scattering_.clear();
  // The inner hook completes (or fails) the futures it returned, then nothing
  // of it still writes into a shard.
  inner_->abandon_step();
  for (Stage& stage : inner_running_) {
    try {
      stage.inner_future->wait();
    } catch (...) {
    }
    stage.result->setErrorIfNeeded(abandoned);
  }
  inner_running_.clear();
}

int64_t HierarchicalHook::wire_bytes(const Bucket& bucket) const {
  // A stand-in shard on the meta device: the inner hook sizes its wire from it.
  Bucket shard;
  shard.flat = at::empty({padded_numel(bucket.flat.numel()) / local_size_},
                         bucket.flat.options().device(at::kMeta));
  shard.views = {shard.flat};
  shard.offsets = {0};
  shard.numels = {shard.flat.numel()};
  shard.params = {0};
  return inner_->wire_bytes(shard);
}

}  // namespace fastddp
