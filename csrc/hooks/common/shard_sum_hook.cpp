#include "shard_sum_hook.h"

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <utility>

#include "../../util/message.h"
#include "collectives.h"
#include "side_stream.h"
#include "spare_state.h"

namespace fastddp {

struct ShardSumHook::ExchangeStage : Stage {
  std::shared_ptr<ShardBuffers> buffers;
  c10::intrusive_ptr<c10d::Work> alltoall;
  void wait_first() override {
    if (alltoall) alltoall->wait();
  }
};

ShardSumHook::ShardSumHook(c10::intrusive_ptr<c10d::ProcessGroup> group,
                           const std::string& wire_format)
    : group_(std::move(group)),
      alltoall_what_("alltoall of the " + wire_format + " shards"),
      allgather_what_("allgather of the summed " + wire_format + " shards") {}

void ShardSumHook::check_group() {
  FASTDDP_CHECK(group_, "fastddp: the ", name(), " comm hook needs a process group");
  world_size_ = group_->getSize();
  divide_by(world_size_);
}

void ShardSumHook::divide_by(int64_t factor) {
  FASTDDP_CHECK(factor > 0, "fastddp: the divide factor must be positive, got ", factor);
  divisor_ = factor;
  scale_ = 1.0 / static_cast<double>(factor);
}

at::Tensor& ShardSumHook::residual_for(size_t param, const at::Tensor& like, int64_t numel) {
  Residual& r = residuals_[param];
  if (!r.live.defined() || r.live.numel() != numel || r.live.scalar_type() != like.scalar_type() ||
      r.live.device() != like.device()) {
    r.live = at::zeros({numel}, like.options());
    r.spare = at::Tensor();
  }
  return r.live;
}

at::Tensor& ShardSumHook::new_residual_for(size_t param) {
  Residual& r = residuals_.at(param);
  if (!r.spare.defined()) r.spare = at::empty_like(r.live);
  r.written = true;
  return r.spare;
}

at::Tensor ShardSumHook::settle_step(const at::Tensor& finite) {
  std::vector<Spare> written;
  for (auto& [param, r] : residuals_) {
    if (r.written) written.push_back({&r.live, &r.spare});
    r.written = false;
  }
  if (written.empty()) return finite;
  // No witness: a residual is a rounding error, finite whenever its step's
  // gradients were (every step put back otherwise).
  return settle_spares(written, finite, [this](bool witness) {
    std::vector<at::Tensor> read;
    if (witness) return read;
    for (auto& [param, r] : residuals_) read.push_back(r.live);
    return read;
  });
}

void ShardSumHook::discard_step() {
  for (auto& [param, r] : residuals_) r.written = false;
}

at::Tensor ShardSumHook::dense_source(Bucket& bucket, size_t slot, const at::Tensor& grad) {
  FASTDDP_CHECK_NOT_IMPLEMENTED(!grad.is_sparse(), "fastddp: the ", name(),
                                " comm hook does not support sparse gradients");
  const at::Tensor& view = bucket.views[slot];
  const int64_t numel = bucket.numels[slot];
  FASTDDP_CHECK(grad.numel() == numel && grad.device() == view.device(), "fastddp: the ", name(),
                " comm hook got a gradient of ", grad.numel(), " elements on ", grad.device(),
                " for a bucket slot of ", numel, " on ", view.device());
  // The fast path reads the grad in storage order, which is the slot's order
  // when the grad has the view's strides.
  if (grad.scalar_type() == view.scalar_type() && grad.is_non_overlapping_and_dense() &&
      grad.strides() == view.strides()) {
    return grad;
  }
  bucket.views[slot].copy_(grad);
  return view;
}

std::shared_ptr<PipelinedHook::Stage> ShardSumHook::start_exchange(
    std::shared_ptr<ShardBuffers> buffers) {
  auto stage = std::make_shared<ExchangeStage>();
  stage->alltoall = all_to_all_even(*group_, buffers->recv, buffers->wire);
  stage->result = make_result(buffers->wire);
  stage->buffers = std::move(buffers);
  return stage;
}

void ShardSumHook::finish(Stage& base) {
  auto& stage = static_cast<ExchangeStage&>(base);
  ShardBuffers& b = *stage.buffers;
  // Off the compute stream (Note [hook streams]): the wait is a stream wait.
  const SideStreamScope side(b.wire.device());
  wait_collective(*stage.alltoall, alltoall_what_);
  stage.alltoall.reset();
  sum_shards(b);
  record_current_stream({b.wire, b.recv, b.reduced});
  c10::intrusive_ptr<c10d::Work> work = all_gather_into(*group_, b.wire, b.reduced);
  at::Tensor wire = b.wire;
  complete_after(work->getFuture(), stage.result, allgather_what_,
                 [wire]() { return c10::IValue(wire); });
}

}  // namespace fastddp
