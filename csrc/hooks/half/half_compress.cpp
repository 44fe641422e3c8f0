#include "half_compress.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <stdexcept>
#include <string>

#include "../../reducer/finite_checks.h"
#include "../../util/profile_range.h"
#include "../../util/step_cost.h"
#include "half_ops.h"
#include "../common/registry.h"
#include "../../util/message.h"

namespace fastddp {

HalfCompressHook::HalfCompressHook(c10::intrusive_ptr<c10d::ProcessGroup> group,
                                   HalfCompressOptions options)
    : ShardSumHook(std::move(group), "16-bit"), options_(options) {
  check_group();
}

std::string HalfCompressHook::name() const {
  std::string n = options_.kind == HalfKind::kBFloat16 ? "bf16" : "fp16";
  if (options_.fp32_accumulate) n += "(accumulate=fp32)";
  if (options_.error_feedback) n += "+error_feedback";
  return n;
}

void HalfCompressHook::on_new_buckets(const std::vector<Bucket>& buckets) {
  // Buffers follow the layout; residuals are per parameter and stay.
  (void)buckets;
  states_.clear();
}

std::shared_ptr<ShardSumHook::ShardBuffers>& HalfCompressHook::state_for(const Bucket& bucket) {
  std::shared_ptr<ShardBuffers>& state = states_[bucket.id];
  const int64_t numel = bucket.flat.numel();
  const int64_t padded = (numel + world_size_ - 1) / world_size_ * world_size_;
  if (!state || state->wire.numel() != padded) {
    state = std::make_shared<ShardBuffers>();
    // Zeros: the padding takes part in the collectives and must stay finite.
    state->wire = at::zeros({padded}, bucket.flat.options().dtype(scalar_type_of(options_.kind)));
    for (size_t k = 0; k < bucket.offsets.size(); ++k) {
      state->slots.push_back(state->wire.narrow(0, bucket.offsets[k], bucket.numels[k]));
    }
  }
  return state;
}

void HalfCompressHook::copy_in(Bucket& bucket, size_t slot, const at::Tensor& grad) {
  FASTDDP_PROFILE_RANGE("fastddp copy-in (compress)");
  ShardBuffers& s = *state_for(bucket);
  const int64_t offset = bucket.offsets[slot];
  const int64_t numel = bucket.numels[slot];
  at::Tensor& wire = s.slots[slot];
  if (!grad.defined()) {
    wire.zero_();
    cost::add(cost::kCopyIn, static_cast<int64_t>(wire.nbytes()));
    return;
  }
  const at::Tensor src = dense_source(bucket, slot, grad);
  const at::Tensor& view = bucket.views[slot];
  // Note [torch's half rounding]: the plain hooks round as torch's, the others once.
  const bool torch_rounding = !options_.fp32_accumulate && !options_.error_feedback;
  if (src.scalar_type() == at::kFloat) {
    at::Tensor* residual =
        options_.error_feedback ? &residual_for(bucket.params[slot], src, numel) : nullptr;
    at::Tensor* new_residual =
        residual != nullptr ? &new_residual_for(bucket.params[slot]) : nullptr;
    // One pass: the gradient and the residual read, the wire and the new residual written.
    cost::add(cost::kCopyIn, static_cast<int64_t>(src.nbytes() + wire.nbytes()) +
                                 (residual != nullptr ? 2 * static_cast<int64_t>(src.nbytes()) : 0));
    bool bad = false;
    bool* host_bad = guard_ != nullptr && src.is_cpu() ? &bad : nullptr;
    int32_t* device_flag = guard_ != nullptr && !src.is_cpu()
                               ? guard_->device_flag(bucket.params[slot], src)
                               : nullptr;
    if (torch_rounding) {
      half_cast_divide_into(options_.kind, src, divisor_, wire, host_bad, device_flag);
    } else {
      half_compress_into(options_.kind, src, scale_, residual, new_residual, wire, host_bad,
                         device_flag);
    }
    if (host_bad != nullptr) guard_->note(bucket.params[slot], bad);
    return;
  }
  check_grad(bucket, slot, src);  // other dtypes: a separate read
  // Other dtypes (float64, a bfloat16 model): the same arithmetic as ATen ops
  // on the bucket's slice.
  if (!same_elements(src, view)) bucket.views[slot].copy_(src);
  const at::Tensor slice = bucket.flat.narrow(0, offset, numel);
  if (torch_rounding) {  // torch's buffer.to(dtype).div_(world_size), by ATen itself
    wire.copy_(slice);
    wire.div_(divisor_);
    return;
  }
  at::Tensor v = slice.mul(scale_);
  if (options_.error_feedback) {
    v.add_(residual_for(bucket.params[slot], v, numel));
    wire.copy_(v);
    at::sub_out(new_residual_for(bucket.params[slot]), v, wire.to(v.scalar_type()));
  } else {
    wire.copy_(v);
  }
}

std::shared_ptr<PipelinedHook::Stage> HalfCompressHook::start(
    Bucket& bucket, size_t index, bool is_last, c10::intrusive_ptr<c10::ivalue::Future>& done) {
  FASTDDP_PROFILE_RANGE("fastddp launch (half)");
  (void)is_last;
  std::shared_ptr<ShardBuffers> state = state_for(bucket);
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
  if (!state->recv.defined()) {
    state->recv = at::empty_like(state->wire);
    state->reduced = at::empty({state->wire.numel() / world_size_}, state->wire.options());
  }
  return start_exchange(std::move(state));
}

void HalfCompressHook::sum_shards(ShardBuffers& s) {
  half_sum_shards_into(options_.kind, s.recv, world_size_, s.reduced);
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
  // The result is the state's wire (the allreduce's, or the allgather's output):
  // its slot views are kept.
  const auto state = states_.find(bucket.id);
  const std::vector<at::Tensor>* kept =
      state != states_.end() && state->second->wire.data_ptr() == reduced.data_ptr()
          ? &state->second->slots
          : nullptr;
  std::vector<at::Tensor> srcs, outs;
  for (size_t k = 0; k < dsts.size(); ++k) {
    const at::Tensor src =
        kept ? (*kept)[k] : reduced.narrow(0, bucket.offsets[k], bucket.numels[k]);
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
    if (!same_elements(dst, view)) dst.copy_(view);
  }
  // Each 16-bit value read, each float32 gradient written.
  cost::add(cost::kWriteBack, cost::bytes(srcs) + cost::bytes(outs));
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
