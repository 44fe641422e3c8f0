#include "powersgd_batched.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <cmath>
#include <utility>

#include "../../util/profile_range.h"
#include "../../util/step_cost.h"
#include "../common/side_stream.h"
#include "powersgd_options.h"
#include "lowrank.h"
#include "../common/registry.h"
#include "../../util/message.h"

namespace fastddp {
namespace {

// torch's batched hook calls _orthogonalize(matrix) on a 2-D matrix: as a
// batch of one, with the default epsilon 0 (Note [batched powersgd]).
void orthogonalize(const at::Tensor& matrix) {
  at::Tensor batch = matrix.unsqueeze(0);
  powersgd_orthogonalize(batch, 0.0);
}

}  // namespace

int64_t batched_powersgd_side(int64_t numel) {
  auto side = static_cast<int64_t>(std::sqrt(static_cast<double>(numel)));
  while (side * side < numel) ++side;
  while (side > 0 && (side - 1) * (side - 1) >= numel) --side;
  return side;
}

// A compressed bucket between the P allreduce and the Q allreduce.
struct BatchedPowerSGDHook::BatchedStage : PipelinedHook::Stage {
  std::shared_ptr<BucketState> state;
  at::Tensor flat;        // the bucket's gradient: gets the result
  at::Tensor input_copy;  // M before compression (error feedback)
  c10::intrusive_ptr<c10::ivalue::Future> p_reduced;
  void wait_first() override { p_reduced->wait(); }
};

BatchedPowerSGDHook::BatchedPowerSGDHook(c10::intrusive_ptr<c10d::ProcessGroup> group,
                                         PowerSGDOptions options, NumpyRandomState rng)
    : PowerSGDBase(std::move(group), options, rng, "powersgd_batched") {}

int64_t BatchedPowerSGDHook::wire_bytes(const Bucket& bucket) const {
  if (iter_.load() < options_.start_powerSGD_iter) return bucket.bytes();
  return 2 * batched_powersgd_side(bucket.payload_numel()) * options_.matrix_approximation_rank *
         static_cast<int64_t>(bucket.flat.element_size());
}

std::shared_ptr<PipelinedHook::Stage> BatchedPowerSGDHook::start(
    Bucket& bucket, size_t index, bool is_last, c10::intrusive_ptr<c10::ivalue::Future>& done) {
  done = maybe_vanilla(bucket, is_last);
  if (done) {
    note_launch(index, "allreduce of the bucket (before start_powerSGD_iter)");
    return nullptr;
  }
  FASTDDP_PROFILE_RANGE("fastddp launch (powersgd_batched P)");
  auto stage = std::make_shared<BatchedStage>();
  stage->flat = bucket.flat;
  stage->result = make_result(bucket.flat);
  stage->state = bucket_state(bucket, index);
  BucketState& state = *stage->state;
  const int64_t rank = options_.matrix_approximation_rank;
  FASTDDP_CHECK_VALUE(rank <= state.side, "fastddp powersgd_batched: bucket ", index, " has ",
                      state.numel, " elements, a ", state.side, " x ", state.side,
                      " matrix: matrix_approximation_rank (", rank, ") must be at most ",
                      state.side, "; use larger buckets or a smaller rank");
  {
    std::lock_guard<std::mutex> lock(mutex_);
    const int64_t esize = static_cast<int64_t>(bucket.flat.element_size());
    const int64_t after = state.side * rank * 2;
    // torch's statistics, its report with the counter before this step's increment.
    stats_.add_bucket(state.numel, after, state.numel * esize, after * esize, index, is_last,
                      iter_.load());
  }

  pack_slots(state.flat_offsets, state.numels, bucket.flat, state.padded);
  // Counted in the square's bytes S: the pack (read, written: 2S), P = M Q (M read: S).
  const auto square_bytes = static_cast<int64_t>(state.padded.nbytes());
  cost::add(cost::kHook, 3 * square_bytes);
  state.padded.narrow(0, state.numel, state.side * state.side - state.numel).zero_();
  if (options_.use_error_feedback) {
    state.padded.add_(state.error);  // zeros on the first compressed step, as torch's
    state.copy.copy_(state.padded);  // a kept buffer: no page faults per step
    stage->input_copy = state.copy;
    // M plus the error read (3S), and M's copy, which receives the new error (2S).
    cost::add(cost::kHook, 5 * square_bytes);
  }
  // The step's Q: with warm start the spare (Note [double-buffered step
  // state]); last step's is only read, by the orthogonalization, which writes
  // the spare: no copy of the state.
  at::Tensor& q = options_.warm_start ? state.q_spare : state.q;
  if (!options_.warm_start || !state.q_ready) {
    draw_random_q({q});
    orthogonalize(q);
  } else {
    at::Tensor into = q.unsqueeze(0);  // a batch of one, as orthogonalize()
    powersgd_orthogonalize_from(state.q.unsqueeze(0), into, 0.0);
  }
  state.pending = true;
  at::Tensor p3 = state.p.unsqueeze(0);
  lowrank_project(state.padded.view({1, state.side, state.side}), q.unsqueeze(0), p3);
  stage->p_reduced = allreduce(state.p);
  if (is_last) ++iter_;
  return stage;
}

void BatchedPowerSGDHook::finish(Stage& base) {
  auto& stage = static_cast<BatchedStage&>(base);
  // Off the compute stream (Note [hook streams]): waiting for P is a stream wait.
  const SideStreamScope side(stage.flat.device());
  wait_for_p(*stage.p_reduced, stage.index);
  FASTDDP_PROFILE_RANGE("fastddp launch (powersgd_batched Q)");
  BucketState& state = *stage.state;
  const at::Tensor matrix = state.padded.view({state.side, state.side});
  orthogonalize(state.p);
  at::Tensor q = options_.warm_start ? state.q_spare : state.q;
  at::Tensor q3 = q.unsqueeze(0);
  lowrank_back_project(matrix.unsqueeze(0), state.p.unsqueeze(0), q3);
  // Q = M^T P reads M; then P Q^T written (with error feedback M's copy read and the
  // error written in the same pass) and unpacked into the bucket (read, written).
  cost::add(cost::kHook, (options_.use_error_feedback ? 6 : 4) *
                             static_cast<int64_t>(state.padded.nbytes()));
  record_current_stream({state.padded, state.p, q});
  auto q_reduced = allreduce(q);
  complete_on_side_stream(q_reduced, stage.result, "allreduce of Q",
                 [this, state = stage.state, flat = stage.flat, q,
                  input_copy = stage.input_copy]() mutable {
                   FASTDDP_PROFILE_RANGE("fastddp decompress (powersgd_batched)");
                   q.div_(divisor_);
                   const std::vector<int64_t> square{1, state->side, state->side};
                   at::Tensor m = state->padded.view(square);
                   if (options_.use_error_feedback) {
                     // error = M - P Q^T, same pass, into M's copy (settle_step
                     // swaps it in): the kernels read each element before they write it.
                     lowrank_expand(state->p.unsqueeze(0), q.unsqueeze(0), m,
                                    input_copy.view(square), input_copy.view(square));
                   } else {
                     lowrank_expand(state->p.unsqueeze(0), q.unsqueeze(0), m);
                   }
                   unpack_slots(state->flat_offsets, state->numels, state->padded, flat);
                   // Run on the side stream (complete_on_side_stream).
                   record_current_stream({state->padded, state->p, q, input_copy, flat});
                   return c10::IValue(flat);
                 });
}

namespace {

std::shared_ptr<CommHook> make_powersgd_batched(
    const c10::intrusive_ptr<c10d::ProcessGroup>& group, const HookOptions& o) {
  PowerSGDConfig config = parse_powersgd_options(o, "powersgd_batched");
  return std::make_shared<BatchedPowerSGDHook>(group, config.options, config.rng);
}

}  // namespace

FASTDDP_REGISTER_COMM_HOOK("powersgd_batched", make_powersgd_batched);

}  // namespace fastddp
