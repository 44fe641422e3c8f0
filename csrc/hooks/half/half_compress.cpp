#include "half_compress.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <stdexcept>
#include <string>

#include "../../reducer/nonfinite_guard.h"
#include "../../reducer/profile_range.h"
#include "half_ops.h"
#include "../common/side_stream.h"
#include "../common/registry.h"
#include "../../reducer/message.h"
#include "../common/collectives.h"

namespace fastddp {

HalfCompressHook::HalfCompressHook(c10::intrusive_ptr<c10d::ProcessGroup> group,
                                   HalfCompressOptions options)
    : group_(std::move(group)), options_(options) {
  FASTDDP_CHECK(group_, "fastddp: the ", name(), " comm hook needs a process group");
  world_size_ = group_->getSize();
  set_divide_factor(world_size_);
}

std::string HalfCompressHook::name() const {
  std::string n = options_.kind == HalfKind::kBFloat16 ? "bf16" : "fp16";
  if (options_.fp32_accumulate) n += "(accumulate=fp32)";
  if (options_.error_feedback) n += "+error_feedback";
  return n;
}

void HalfCompressHook::set_divide_factor(int64_t factor) {
  FASTDDP_CHECK(factor > 0, "fastddp: the divide factor must be positive, got ", factor);
  divisor_ = factor;
  scale_ = 1.0 / static_cast<double>(factor);
}

void HalfCompressHook::on_new_buckets(const std::vector<Bucket>& buckets) {
  // Buffers follow the layout; residuals are per parameter and stay.
  (void)buckets;
  states_.clear();
}

HalfCompressHook::BucketState& HalfCompressHook::state_for(const Bucket& bucket) {
  std::shared_ptr<BucketState>& state = states_[bucket.flat.unsafeGetTensorImpl()];
  const int64_t numel = bucket.flat.numel();
  const int64_t padded = (numel + world_size_ - 1) / world_size_ * world_size_;
  if (!state || state->wire.numel() != padded) {
    state = std::make_shared<BucketState>();
    // Zeros: the padding takes part in the collectives and must stay finite.
    state->wire = at::zeros({padded}, bucket.flat.options().dtype(scalar_type_of(options_.kind)));
  }
  return *state;
}

at::Tensor& HalfCompressHook::residual_for(size_t param, const at::Tensor& like, int64_t numel) {
  at::Tensor& r = residuals_[param];
  if (!r.defined() || r.numel() != numel || r.scalar_type() != like.scalar_type() ||
      r.device() != like.device()) {
    r = at::zeros({numel}, like.options());
  }
  return r;
}

std::vector<at::Tensor> HalfCompressHook::step_state() {
  std::vector<at::Tensor> tensors;
  for (const auto& [param, residual] : residuals_) tensors.push_back(residual);
  return tensors;
}

void HalfCompressHook::copy_in(Bucket& bucket, size_t slot, const at::Tensor& grad) {
  FASTDDP_PROFILE_RANGE("fastddp copy-in (compress)");
  BucketState& s = state_for(bucket);
  const int64_t offset = bucket.offsets[slot];
  const int64_t numel = bucket.numels[slot];
  at::Tensor wire = s.wire.narrow(0, offset, numel);
  if (!grad.defined()) {
    wire.zero_();
    return;
  }
  FASTDDP_CHECK_NOT_IMPLEMENTED(!grad.is_sparse(), "fastddp: the ", name(),
                                " comm hook does not support sparse gradients");
  const at::Tensor& view = bucket.views[slot];
  FASTDDP_CHECK(grad.numel() == numel && grad.device() == view.device(), "fastddp: the ", name(),
                " comm hook got a gradient of ", grad.numel(), " elements on ", grad.device(),
                " for a bucket slot of ", numel, " on ", view.device());
  // The fast path reads the grad in storage order, which is the slot's order
  // when the grad has the view's strides (always under gradient_as_bucket_view).
  at::Tensor src = grad;
  if (!(grad.scalar_type() == view.scalar_type() && grad.is_non_overlapping_and_dense() &&
        grad.strides() == view.strides())) {
    bucket.views[slot].copy_(grad);
    src = view;
  }
  // Note [torch's half rounding]: the plain hooks round as torch's, the others once.
  const bool torch_rounding = !options_.fp32_accumulate && !options_.error_feedback;
  if (src.scalar_type() == at::kFloat) {
    at::Tensor* residual =
        options_.error_feedback ? &residual_for(bucket.params[slot], src, numel) : nullptr;
    bool bad = false;
    bool* host_bad = guard_ != nullptr && src.is_cpu() ? &bad : nullptr;
    int32_t* device_flag = guard_ != nullptr && !src.is_cpu()
                               ? guard_->device_flag(bucket.params[slot], src)
                               : nullptr;
    if (torch_rounding) {
      half_cast_divide_into(options_.kind, src, divisor_, wire, host_bad, device_flag);
    } else {
      half_compress_into(options_.kind, src, scale_, residual, wire, host_bad, device_flag);
    }
    if (host_bad != nullptr) guard_->note(bucket.params[slot], bad);
    return;
  }
  check_grad(bucket, slot, src);  // other dtypes: a separate read
  // Other dtypes (float64, a bfloat16 model): the same arithmetic as ATen ops
  // on the bucket's slice.
  if (!src.is_same(view)) bucket.views[slot].copy_(src);
  const at::Tensor slice = bucket.flat.narrow(0, offset, numel);
  if (torch_rounding) {  // torch's buffer.to(dtype).div_(world_size), by ATen itself
    wire.copy_(slice);
    wire.div_(divisor_);
    return;
  }
  at::Tensor v = slice.mul(scale_);
  if (options_.error_feedback) {
    at::Tensor& r = residual_for(bucket.params[slot], v, numel);
    v.add_(r);
    wire.copy_(v);
    r.copy_(v - wire.to(v.scalar_type()));
  } else {
    wire.copy_(v);
  }
}

struct HalfCompressHook::HalfStage : Stage {
  std::shared_ptr<BucketState> state;
  c10::intrusive_ptr<c10d::Work> alltoall;
  void wait_first() override {
    if (alltoall) alltoall->wait();
  }
};

std::shared_ptr<PipelinedHook::Stage> HalfCompressHook::start(
    Bucket& bucket, size_t index, bool is_last, c10::intrusive_ptr<c10::ivalue::Future>& done) {
  FASTDDP_PROFILE_RANGE("fastddp launch (half)");
  (void)is_last;
  state_for(bucket);
  std::shared_ptr<BucketState> state = states_[bucket.flat.unsafeGetTensorImpl()];
  if (!options_.fp32_accumulate && !half_allreduce_unsupported_) {
    std::vector<at::Tensor> tensors{state->wire};
    try {
      done = group_->allreduce(tensors)->getFuture();
      note_launch(index, "allreduce of the 16-bit bucket");
      return nullptr;
    } catch (const c10::Error& e) {
      // A backend without 16-bit sums (old gloo) refuses at enqueue, on every
      // rank alike: from now on use the float32-accumulation algorithm.
      if (!state->wire.is_cpu()) throw;
      FASTDDP_WARN("fastddp: the process group has no ", state->wire.scalar_type(),
                   " allreduce (", e.what_without_backtrace(), "); the ", name(),
                   " comm hook sends the same 16-bit payload with float32 sums instead");
      half_allreduce_unsupported_ = true;
    }
  }
  BucketState& s = *state;
  if (!s.recv.defined()) {
    s.recv = at::empty_like(s.wire);
    s.shard_sum = at::empty({s.wire.numel() / world_size_}, s.wire.options());
  }
  auto stage = std::make_shared<HalfStage>();
  stage->state = state;
  stage->alltoall = all_to_all_even(*group_, s.recv, s.wire);
  stage->result = make_result(s.wire);
  return stage;
}

void HalfCompressHook::finish(Stage& base) {
  auto& stage = static_cast<HalfStage&>(base);
  BucketState& s = *stage.state;
  // Off the compute stream (Note [hook streams]): the wait is a stream wait.
  const SideStreamScope side(s.wire.device());
  wait_collective(*stage.alltoall, "alltoall of the 16-bit shards");
  stage.alltoall.reset();
  half_sum_shards_into(options_.kind, s.recv, world_size_, s.shard_sum);
  record_current_stream({s.wire, s.recv, s.shard_sum});
  c10::intrusive_ptr<c10d::Work> work = all_gather_into(*group_, s.wire, s.shard_sum);
  at::Tensor wire = s.wire;
  complete_after(work->getFuture(), stage.result, "allgather of the summed 16-bit shards",
                 [wire]() { return c10::IValue(wire); });
}

void HalfCompressHook::write_back(Bucket& bucket, const c10::IValue& result,
                                  std::vector<at::Tensor>& dsts) {
  FASTDDP_PROFILE_RANGE("fastddp write-back (decompress)");
  const at::Tensor reduced = hook_result_tensor(result, name());
  FASTDDP_CHECK(reduced.scalar_type() == scalar_type_of(options_.kind) &&
                  reduced.numel() >= bucket.flat.numel() && reduced.is_contiguous(),
                "fastddp: the ", name(), " comm hook's result is not its 16-bit wire buffer");
  FASTDDP_CHECK(dsts.size() == bucket.views.size(), "fastddp: ", dsts.size(),
                " write-back destinations for a bucket of ", bucket.views.size());
  std::vector<at::Tensor> srcs, outs;
  for (size_t k = 0; k < dsts.size(); ++k) {
    const at::Tensor src = reduced.narrow(0, bucket.offsets[k], bucket.numels[k]);
    const at::Tensor& view = bucket.views[k];
    at::Tensor& dst = dsts[k];
    if (!dst.defined()) continue;  // unused on every rank: its grad stays as it is
    if (dst.scalar_type() == at::kFloat && dst.device() == view.device() &&
        dst.is_non_overlapping_and_dense() && dst.strides() == view.strides()) {
      srcs.push_back(src);
      outs.push_back(dst);
      continue;
    }
    // Another dtype or layout: through the bucket slot (the cast is exact).
    bucket.flat.narrow(0, bucket.offsets[k], bucket.numels[k]).copy_(src);
    if (!dst.is_same(view)) dst.copy_(view);
  }
  half_decompress_many(options_.kind, srcs, outs);
}

int64_t HalfCompressHook::wire_bytes(const Bucket& bucket) const {
  const int64_t numel = bucket.flat.numel();
  return (numel + world_size_ - 1) / world_size_ * world_size_ * 2;
}

namespace {

std::shared_ptr<CommHook> make_half_hook(HalfKind kind,
                                         const c10::intrusive_ptr<c10d::ProcessGroup>& group,
                                         const HookOptions& o) {
  const std::string half = kind == HalfKind::kBFloat16 ? "bf16" : "fp16";
  o.check_known({"accumulate", "error_feedback"});
  HalfCompressOptions options;
  options.kind = kind;
  options.fp32_accumulate = o.get_choice("accumulate", half, {half, "fp32"}) == "fp32";
  options.error_feedback = o.get_bool("error_feedback", false);
  return std::make_shared<HalfCompressHook>(group, options);
}

}  // namespace

FASTDDP_REGISTER_COMM_HOOK("bf16", [](const auto& group, const HookOptions& o) {
  return make_half_hook(HalfKind::kBFloat16, group, o);
});
FASTDDP_REGISTER_COMM_HOOK("fp16", [](const auto& group, const HookOptions& o) {
  return make_half_hook(HalfKind::kFloat16, group, o);
});

}  // namespace fastddp
