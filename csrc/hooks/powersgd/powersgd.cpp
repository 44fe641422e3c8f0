#include "powersgd.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <algorithm>
#include <utility>

#include "../../util/profile_range.h"
#include "../../util/step_cost.h"
#include "../common/side_stream.h"
#include "lowrank.h"
#include "powersgd_options.h"
#include "../common/registry.h"

namespace fastddp {

// A compressed bucket between the P allreduce and the Q allreduce.
struct PowerSGDHook::PowerSGDStage : PipelinedHook::Stage {
  std::shared_ptr<BucketState> state;
  PowerSGDPlan plan;
  PowerSGDWork work;
  at::Tensor input;       // the bucket's flat gradient: the result, in place
  at::Tensor input_copy;  // M = gradient + error (error feedback)
  at::Tensor wire;
  c10::intrusive_ptr<c10::ivalue::Future> p_reduced;
  void wait_first() override { p_reduced->wait(); }
};

PowerSGDHook::PowerSGDHook(c10::intrusive_ptr<c10d::ProcessGroup> group, PowerSGDOptions options,
                           NumpyRandomState rng)
    : PowerSGDBase(std::move(group), options, rng, "powersgd") {}

namespace {

// `flat`'s elements laid out as bucket slot `slot` (flat: a buffer of the bucket's numel).
at::Tensor as_slot(const at::Tensor& flat, const Bucket& bucket, size_t slot) {
  const at::Tensor& view = bucket.views[slot];
  return flat.as_strided(view.sizes(), view.strides(), flat.storage_offset() + bucket.offsets[slot]);
}

}  // namespace

// Note [error feedback in the copy-in]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// With error feedback the compressed step reads M = gradient + error, never
// the gradient alone: the bucket itself is only written, by the
// decompression (P Q^T) and the uncompressed slots' average. So on a step
// that compresses, a gradient goes straight into M (`source`, the error's
// spare: Note [double-buffered step state]) as it arrives: the gradient and
// the error read, M written, in one pass, where the copy into the bucket and
// then M = bucket + error took two (2G + 3G instead of 3G). A bucket's first
// compressed step (no state yet), a check_for_nan_in_grad run (whose check
// rides on the plain copy-in), an undefined gradient (zeros: a joined or
// healing rank) and another dtype take the plain copy-in, and start() adds
// the error to those slots.
void PowerSGDHook::copy_in(Bucket& bucket, size_t slot, const at::Tensor& grad) {
  std::shared_ptr<BucketState> state;
  if (options_.use_error_feedback && !bucket.sparse &&
      iter_.load() >= options_.start_powerSGD_iter) {
    state = existing_state(bucket);
  }
  const bool fuse = state && state->source.defined() && guard_ == nullptr && grad.defined() &&
                    grad.scalar_type() == bucket.flat.scalar_type() &&
                    grad.device() == bucket.device && grad.sizes() == bucket.views[slot].sizes();
  // Set on every copy-in, so that no flag outlives a step that failed before start().
  if (state) state->fed[slot] = fuse;
  if (!fuse) {
    CommHook::copy_in(bucket, slot, grad);
    return;
  }
  at::Tensor m = as_slot(state->source, bucket, slot);
  at::add_out(m, grad, as_slot(state->error, bucket, slot));
  // The gradient and the error read, M written.
  cost::add(cost::kCopyIn, 3 * static_cast<int64_t>(m.nbytes()));
}

void PowerSGDHook::add_error_feedback(BucketState& state, const Bucket& bucket) const {
  const at::Tensor& input = bucket.flat;
  if (std::none_of(state.fed.begin(), state.fed.end(), [](bool fed) { return fed; })) {
    // M = gradient + error, out of place: M is also the copy the new error
    // is taken from, and then the new error itself (Note [double-buffered
    // step state]); the bucket receives P Q^T. state.error is only read.
    at::add_out(state.source, input, state.error);  // a kept buffer: no page faults per step
    cost::add(cost::kHook, 3 * static_cast<int64_t>(input.nbytes()));
    return;
  }
  for (size_t k = 0; k < state.fed.size(); ++k) {
    if (state.fed[k]) continue;
    at::Tensor m = as_slot(state.source, bucket, k);
    at::add_out(m, bucket.views[k], as_slot(state.error, bucket, k));
    cost::add(cost::kHook, 3 * static_cast<int64_t>(m.nbytes()));
  }
}

int64_t PowerSGDHook::wire_bytes(const Bucket& bucket) const {
  if (iter_.load() < options_.start_powerSGD_iter) return bucket.bytes();
  const PowerSGDPlan plan = plan_powersgd(bucket, options_);
  return (plan.uncompressed_numel + plan.p_numel + plan.q_numel) *
         static_cast<int64_t>(bucket.flat.element_size());
}

std::shared_ptr<PipelinedHook::Stage> PowerSGDHook::start(
    Bucket& bucket, size_t index, bool is_last, c10::intrusive_ptr<c10::ivalue::Future>& done) {
  done = maybe_vanilla(bucket, is_last);
  if (done) {
    note_launch(index, "allreduce of the bucket (before start_powerSGD_iter)");
    return nullptr;
  }
  FASTDDP_PROFILE_RANGE("fastddp launch (powersgd P)");
  auto stage = std::make_shared<PowerSGDStage>();
  stage->input = bucket.flat;
  stage->result = make_result(stage->input);
  bool randomize = false;
  PowerSGDPlan plan = plan_powersgd(bucket, options_);
  count(plan, index, is_last, bucket.flat.element_size());
  stage->state = bucket_state(bucket, index, plan, randomize);
  BucketState& state = *stage->state;

  const at::Tensor& input = stage->input;
  at::Tensor source = input;
  if (options_.use_error_feedback) {
    add_error_feedback(state, bucket);  // Note [error feedback in the copy-in]
    std::fill(state.fed.begin(), state.fed.end(), false);
    stage->input_copy = state.source;
    source = stage->input_copy;
  }
  // The step's Q is the spare: last step's Q (the state) is only read, by the
  // orthogonalization, which writes the spare (no copy of the state: Note
  // [double-buffered step state]). A drawn Q (the first step, or no warm start)
  // is drawn into the spare and orthogonalized there.
  // (None yet where a resumed checkpoint supplies every Q: qs_after_draw below.)
  const bool reads_q = !randomize && state.q_memory.defined();
  state.pending = true;
  // Stacked after the error feedback: torch stacks views of the corrected buffer.
  at::Tensor p_memory = state.wire.narrow(0, plan.uncompressed_numel, plan.p_numel);
  stage->work = state.views.get(plan, options_, bucket.offsets, bucket.numels, source, input,
                                p_memory, state.q_spare,
                                options_.use_error_feedback ? state.source : at::Tensor(),
                                at::Tensor(), reads_q ? state.q_memory : at::Tensor(),
                                /*keep=*/reads_q || !options_.warm_start);
  PowerSGDWork& work = stage->work;
  if (randomize) {
    std::vector<at::Tensor> qs;
    for (PowerSGDBatch& b : work.batches) qs.push_back(b.q);
    draw_random_q(qs);
  }
  for (const auto& carried : state.qs_after_draw) {
    state.q_spare.narrow(0, carried.first, carried.second.numel())
        .copy_(carried.second.reshape(-1));
  }
  state.qs_after_draw.clear();
  // Orthogonalization is per matrix: one call per same-shape group.
  const double eps = options_.orthogonalization_epsilon;
  for (size_t g = 0; g < work.q_groups.size(); ++g) {
    if (reads_q) {
      powersgd_orthogonalize_from(work.q_read_groups[g], work.q_groups[g], eps);
    } else {
      powersgd_orthogonalize(work.q_groups[g], eps);
    }
  }
  for (PowerSGDBatch& b : work.batches) lowrank_project(b.matrices, b.q, b.p);
  // P = M Q reads every matrix once; the uncompressed slots are packed (read, written).
  const int64_t packed = 2 * plan.uncompressed_numel * input.element_size();
  cost::add(cost::kHook, static_cast<int64_t>(input.nbytes()) + packed);
  pack_uncompressed(work.uncompressed_source, state.wire.narrow(0, 0, plan.uncompressed_numel));
  stage->plan = std::move(plan);
  stage->wire = state.wire;
  stage->p_reduced = allreduce(state.wire);
  if (is_last) ++iter_;
  return stage;
}

void PowerSGDHook::finish(Stage& base) {
  auto& stage = static_cast<PowerSGDStage&>(base);
  // Off the compute stream (Note [hook streams]): waiting for P is a stream wait.
  const SideStreamScope side(stage.wire.device());
  wait_for_p(*stage.p_reduced, stage.index);
  FASTDDP_PROFILE_RANGE("fastddp launch (powersgd Q)");
  const PowerSGDPlan& plan = stage.plan;
  BucketState& state = *stage.state;
  // The reverse of start()'s pack: one multi-tensor copy (one launch on CUDA).
  PowerSGDWork& work = stage.work;
  unpack_uncompressed(stage.wire.narrow(0, 0, plan.uncompressed_numel), divisor_,
                      work.uncompressed_dest);
  for (at::Tensor& p : work.p_groups) powersgd_orthogonalize(p, options_.orthogonalization_epsilon);
  for (PowerSGDBatch& b : work.batches) lowrank_back_project(b.matrices, b.p, b.q);
  // The unpack (read, written) and Q = M^T P, which reads every matrix once more.
  cost::add(cost::kHook, 2 * plan.uncompressed_numel * stage.input.element_size() +
                             static_cast<int64_t>(stage.input.nbytes()));
  record_current_stream({stage.wire, stage.input, stage.input_copy, state.source,
                         state.q_spare});
  for (const PowerSGDBatch& b : work.batches) record_current_stream({b.matrices, b.out});
  auto q_reduced = allreduce(state.q_spare);
  complete_on_side_stream(q_reduced, stage.result, "allreduce of Q",
                          [this, state = stage.state, work = std::move(work), input = stage.input,
                           input_copy = stage.input_copy]() mutable {
                            return decompress(*state, work, input, input_copy);
                          });
}

c10::IValue PowerSGDHook::decompress(BucketState& state, PowerSGDWork& work,
                                     const at::Tensor& input, const at::Tensor& input_copy) {
  std::vector<PowerSGDBatch>& batches = work.batches;
  FASTDDP_PROFILE_RANGE("fastddp decompress (powersgd)");
  state.q_spare.div_(divisor_);
  const bool error_feedback = options_.use_error_feedback;
  // The new error (M - P Q^T) in the same pass as P Q^T where the result
  // goes straight into the bucket, in place of M (b.error views M: the
  // kernels read each element before they write it); stacked batches take
  // one sub over all.
  const bool fuse_error =
      error_feedback && std::all_of(batches.begin(), batches.end(),
                                    [](const PowerSGDBatch& b) { return b.unstack.empty(); });
  for (PowerSGDBatch& b : batches) {
    if (fuse_error) {
      // b.out views the bucket, b.matrices the same slot of M, b.error of the error.
      lowrank_expand(b.p, b.q, b.out, b.matrices, b.error);
      continue;
    }
    lowrank_expand(b.p, b.q, b.out);
    for (size_t i = 0; i < b.unstack.size(); ++i) {
      b.unstack[i].copy_(b.out[static_cast<int64_t>(i)]);
    }
  }
  // P Q^T written into the bucket; with error feedback M read and the error
  // written in the same pass (or a sub over the bucket: the same bytes).
  cost::add(cost::kHook, (error_feedback ? 3 : 1) * static_cast<int64_t>(input.nbytes()));
  if (fuse_error && !work.uncompressed_error.empty()) {
    // The uncompressed slots' error, M - the average, in place of M: one
    // multi-tensor op (one launch on CUDA, not one per slot).
    at::_foreach_sub_(work.uncompressed_error, work.uncompressed_dest);
  } else if (error_feedback && !fuse_error) {
    at::Tensor error = input_copy;  // M's buffer, state.source
    error.sub_(input);
  }
  // This callback's kernels run on the side stream (complete_on_side_stream).
  record_current_stream({state.q_spare, input, input_copy});
  for (const PowerSGDBatch& b : batches) record_current_stream({b.p, b.matrices, b.out});
  return c10::IValue(input);
}

namespace {

std::shared_ptr<CommHook> make_powersgd(const c10::intrusive_ptr<c10d::ProcessGroup>& group,
                                        const HookOptions& o) {
  PowerSGDConfig config = parse_powersgd_options(o, "powersgd");
  return std::make_shared<PowerSGDHook>(group, config.options, config.rng);
}

}  // namespace

FASTDDP_REGISTER_COMM_HOOK("powersgd", make_powersgd);

}  // namespace fastddp
