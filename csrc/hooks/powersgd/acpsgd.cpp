#include "acpsgd.h"

#include <ATen/ATen.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <utility>

#include "../../util/message.h"
#include "../../util/profile_range.h"
#include "../../util/step_cost.h"
#include "../common/registry.h"
#include "../common/side_stream.h"
#include "lowrank.h"
#include "powersgd_options.h"

namespace fastddp {

AcpSgdHook::AcpSgdHook(c10::intrusive_ptr<c10d::ProcessGroup> group, PowerSGDOptions options,
                       NumpyRandomState rng)
    : PowerSGDBase(std::move(group), options, rng, "acpsgd") {
  // The factors are views of one matrix's stacked P and Q per slot: batching
  // same-shape matrices would stack copies (Note [powersgd]) for no gain here.
  FASTDDP_CHECK_VALUE(!options_.batch_tensors_with_same_shape,
                      "fastddp acpsgd: batch_tensors_with_same_shape is not supported");
  FASTDDP_CHECK_VALUE(options_.use_error_feedback && options_.warm_start,
                      "fastddp acpsgd: error feedback and warm start are the algorithm's own "
                      "(use_error_feedback and warm_start must stay True)");
}

bool AcpSgdHook::even_step() const {
  return (iter_.load() - options_.start_powerSGD_iter) % 2 == 0;
}

int64_t AcpSgdHook::wire_bytes(const Bucket& bucket) const {
  if (iter_.load() < options_.start_powerSGD_iter) return bucket.bytes();
  const PowerSGDPlan plan = plan_powersgd(bucket, options_);
  return (plan.uncompressed_numel + (even_step() ? plan.p_numel : plan.q_numel)) *
         static_cast<int64_t>(bucket.flat.element_size());
}

std::shared_ptr<PipelinedHook::Stage> AcpSgdHook::start(
    Bucket& bucket, size_t index, bool is_last, c10::intrusive_ptr<c10::ivalue::Future>& done) {
  if (!step_open_) {
    settle_last_step();
    step_open_ = true;
    iter_at_open_ = iter_.load();
  }
  done = maybe_vanilla(bucket, is_last);
  if (done) {
    note_launch(index, "allreduce of the bucket (before start_powerSGD_iter)");
    return nullptr;
  }
  FASTDDP_PROFILE_RANGE("fastddp launch (acpsgd)");
  const PowerSGDPlan plan = plan_powersgd(bucket, options_);
  bool randomize = false;
  std::shared_ptr<BucketState> state = bucket_state(bucket, index, plan, randomize);
  BucketState& s = *state;
  const bool p_turn = !s.has_factors || even_step();
  s.fresh = !s.has_factors;
  s.has_factors = true;
  {
    const int64_t size = bucket.flat.element_size();
    const int64_t after = plan.uncompressed_numel + (p_turn ? plan.p_numel : plan.q_numel);
    std::lock_guard<std::mutex> lock(mutex_);
    stats_.add_bucket(plan.numel_before, after, plan.numel_before * size, after * size, index,
                      is_last, iter_.load());
  }
  const at::Tensor input = bucket.flat;
  at::add_out(s.source, input, s.error);  // M = gradient + error; the new error in its place
  cost::add(cost::kHook, 3 * static_cast<int64_t>(input.nbytes()));
  // The step's factors are the spares (Note [double-buffered step state]):
  // the state's factor is only read, by the orthogonalization, which writes
  // its spare; the other spare gets the product. No copy of the state.
  if (!s.p_spare.defined()) {
    s.p_spare = at::empty_like(s.wire_p);
    s.q_spare = at::empty_like(s.wire_q);
  }
  const int64_t head = plan.uncompressed_numel;
  at::Tensor p_memory = s.p_spare.narrow(0, head, plan.p_numel);
  at::Tensor q_memory = s.q_spare.narrow(0, head, plan.q_numel);
  at::Tensor p_read, q_read;  // the state's factors (none on the first step: Q is drawn)
  if (!s.fresh) {
    p_read = s.wire_p.narrow(0, head, plan.p_numel);
    q_read = s.wire_q.narrow(0, head, plan.q_numel);
  }
  s.pending = true;
  PowerSGDWork work = s.views.get(plan, options_, bucket.offsets, bucket.numels, s.source, input,
                                 p_memory, q_memory, s.source, p_read, q_read,
                                 /*keep=*/!s.fresh);
  if (randomize) {
    std::vector<at::Tensor> qs;
    for (PowerSGDBatch& b : work.batches) qs.push_back(b.q);
    draw_random_q(qs);
  }
  const double eps = options_.orthogonalization_epsilon;
  // The factor this turn orthogonalizes: read from the state, or the drawn one in place.
  auto orthogonalize = [&](std::vector<at::Tensor>& groups, const std::vector<at::Tensor>& read) {
    for (size_t g = 0; g < groups.size(); ++g) {
      if (s.fresh) {
        powersgd_orthogonalize(groups[g], eps);
      } else {
        powersgd_orthogonalize_from(read[g], groups[g], eps);
      }
    }
  };
  if (p_turn) {
    orthogonalize(work.q_groups, work.q_read_groups);
    for (PowerSGDBatch& b : work.batches) lowrank_project(b.matrices, b.q, b.p);  // P = M Q
  } else {
    orthogonalize(work.p_groups, work.p_read_groups);
    for (PowerSGDBatch& b : work.batches) lowrank_back_project(b.matrices, b.p, b.q);  // Q = M^T P
  }
  // error = M - P Q^T with this rank's factor, in one pass, in place of M (the
  // kernels read each element before they write it); P Q^T lands in the
  // bucket, which the reduced factor overwrites in decompress().
  for (PowerSGDBatch& b : work.batches) lowrank_expand(b.p, b.q, b.out, b.matrices, b.error);
  const at::Tensor wire = p_turn ? s.p_spare : s.q_spare;
  pack_uncompressed(work.uncompressed_source, wire.narrow(0, 0, plan.uncompressed_numel));
  // The uncompressed slots keep no error: their part of M, packed above, becomes zeros.
  if (!work.uncompressed_error.empty()) at::_foreach_zero_(work.uncompressed_error);
  // One product reads M; P Q^T written with the error (3 passes); the pack and the zeros.
  cost::add(cost::kHook, 4 * static_cast<int64_t>(input.nbytes()) +
                             3 * plan.uncompressed_numel * input.element_size());
  note_launch(index, p_turn ? "allreduce of ACP-SGD's P" : "allreduce of ACP-SGD's Q");
  auto reduced = allreduce(wire);
  if (is_last) ++iter_;
  done = make_result(input);
  complete_on_side_stream(reduced, done, p_turn ? "allreduce of P" : "allreduce of Q",
                          [this, state, work = std::move(work), input, wire,
                           head = plan.uncompressed_numel]() mutable {
                            return decompress(*state, work, input, wire, head);
                          });
  return nullptr;
}

void AcpSgdHook::after_step(const at::Tensor& kept) {
  if (!step_open_) {  // a second word on a step (a failure after the end of backward)
    if (kept.defined() && kept.is_cpu()) {  // it overrides the first, settled or not
      last_kept_ = kept.clone();
      kept_ready_.reset();
      settle_pending_ = true;
      settle_last_step();
    } else if (kept.defined() && settle_pending_) {
      last_kept_ = kept.cpu();
    }
    return;
  }
  step_open_ = false;
  settle_pending_ = true;
  last_iter_at_open_ = iter_at_open_;
  last_created_ = std::move(created_);
  created_.clear();
  kept_ready_.reset();
  if (!kept.defined() || kept.is_cpu()) {
    last_kept_ = kept.defined() ? kept.clone() : at::Tensor();
    // On the host the choice is known now: taken back at once, so that a
    // state_dict() before the next step (a checkpoint, or a peer's recovery
    // under torchft, Note [fault-tolerant step]) holds the steps kept only.
    settle_last_step();
    return;
  }
  // Queued behind the choice on the compute stream; read at the next step.
  last_kept_ = at::empty({}, kept.options().device(at::kCPU).pinned_memory(true));
  last_kept_.copy_(kept, /*non_blocking=*/true);
  kept_ready_.emplace(kept.device().type());
  const c10::impl::VirtualGuardImpl impl(kept.device().type());
  kept_ready_->record(impl.getStream(kept.device()));
}

void AcpSgdHook::settle_last_step() {
  if (!settle_pending_) return;
  settle_pending_ = false;
  if (!last_kept_.defined()) return;
  // Copied at the end of the last backward: a forward and part of this
  // backward were queued since, so the copy has normally landed, which a
  // query says without waiting. Only a device still behind that copy makes
  // the host wait here (Note [acpsgd]: the turn must be known on the host).
  if (kept_ready_ && !kept_ready_->query()) {
    cost::add(cost::kHostSync, 1);  // counted only when it waits (Note [counted cost])
    kept_ready_->synchronize();
  }
  if (last_kept_.item<bool>()) return;
  // Put back: as if the step had not been (its turn, and the buckets it created).
  iter_.store(last_iter_at_open_);
  std::lock_guard<std::mutex> lock(mutex_);
  for (size_t b : last_created_) states_.erase(b);
}

void AcpSgdHook::finish(Stage& stage) {
  (void)stage;
  FASTDDP_CHECK(false, "fastddp acpsgd: a bucket has one collective, no second stage");
}

c10::IValue AcpSgdHook::decompress(BucketState& state, PowerSGDWork& work,
                                   const at::Tensor& input, const at::Tensor& wire,
                                   int64_t uncompressed_numel) {
  FASTDDP_PROFILE_RANGE("fastddp decompress (acpsgd)");
  unpack_uncompressed(wire.narrow(0, 0, uncompressed_numel), divisor_, work.uncompressed_dest);
  std::vector<PowerSGDBatch>& batches = work.batches;
  // The reduced factor is a sum: the mean gradient is P Q^T / world size (the
  // factor itself stays a sum, as the next step orthogonalizes it).
  for (PowerSGDBatch& b : batches) {
    lowrank_expand(b.p, b.q, b.out);
    b.out.div_(divisor_);
  }
  // This callback's kernels run on the side stream (complete_on_side_stream).
  record_current_stream({wire, input, state.source, state.error, state.p_spare, state.q_spare});
  return c10::IValue(input);
}

namespace {

std::shared_ptr<CommHook> make_acpsgd(const c10::intrusive_ptr<c10d::ProcessGroup>& group,
                                      const HookOptions& o) {
  PowerSGDConfig config = parse_powersgd_options(o, "acpsgd");
  return std::make_shared<AcpSgdHook>(group, config.options, config.rng);
}

}  // namespace

FASTDDP_REGISTER_COMM_HOOK("acpsgd", make_acpsgd);

}  // namespace fastddp
