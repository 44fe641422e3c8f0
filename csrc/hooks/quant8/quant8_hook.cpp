#include "quant8_hook.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <algorithm>
#include <stdexcept>
#include <string>

#include "../../util/profile_range.h"
#include "../../util/step_cost.h"
#include "quant8_ops.h"
#include "../common/registry.h"
#include "../../util/message.h"

namespace fastddp {

namespace {

// The indices of [0, padded) that no slot of `bucket` covers, on its device.
at::Tensor uncovered_places(const Bucket& bucket, int64_t padded) {
  std::vector<char> covered(static_cast<size_t>(padded), 0);
  for (size_t k = 0; k < bucket.views.size(); ++k) {
    std::fill_n(covered.begin() + bucket.offsets[k], bucket.numels[k], 1);
  }
  std::vector<int64_t> places;
  for (int64_t i = 0; i < padded; ++i) {
    if (!covered[static_cast<size_t>(i)]) places.push_back(i);
  }
  if (places.empty()) return at::Tensor();
  return at::tensor(places, at::kLong).to(bucket.flat.device());
}

}  // namespace

Quant8Hook::Quant8Hook(c10::intrusive_ptr<c10d::ProcessGroup> group, Quant8Options options)
    : ShardSumHook(std::move(group), "8-bit"), options_(options) {
  check_group();
}

std::string Quant8Hook::name() const {
  std::string n = options_.format == Quant8Format::kInt8
                      ? "int8"
                      : "fp8(" + quant8_format_name(options_.format) + ")";
  if (!options_.error_feedback) n += "(error_feedback=False)";
  return n;
}

void Quant8Hook::on_new_buckets(const std::vector<Bucket>& buckets) {
  for (const Bucket& b : buckets) {
    FASTDDP_CHECK_NOT_IMPLEMENTED(
        b.sparse || b.flat.scalar_type() == at::kFloat, "fastddp: the ", name(),
        " comm hook compresses float32 gradients only; this model has a bucket of ",
        b.flat.scalar_type(), " (use the bf16 hook, or keep those parameters float32)");
  }
  states_.clear();  // buffers follow the layout; residuals are per parameter and stay
}

int64_t Quant8Hook::padded_numel(int64_t numel) const {
  const int64_t unit = world_size_ * kBlock;
  return (numel + unit - 1) / unit * unit;
}

std::shared_ptr<Quant8Hook::BucketState>& Quant8Hook::state_for(const Bucket& bucket) {
  std::shared_ptr<BucketState>& state = states_[bucket.id];
  FASTDDP_CHECK_NOT_IMPLEMENTED(!bucket.sparse, "fastddp: the ", name(),
                                " comm hook does not support sparse gradients");
  FASTDDP_CHECK_NOT_IMPLEMENTED(bucket.flat.scalar_type() == at::kFloat, "fastddp: the ", name(),
                                " comm hook compresses float32 gradients only, got a bucket of ",
                                bucket.flat.scalar_type());
  const int64_t padded = padded_numel(bucket.flat.numel());
  if (!state || state->staging.numel() != padded) {
    state = std::make_shared<BucketState>();
    BucketState& s = *state;
    s.shard = padded / world_size_;
    s.shard_bytes = s.shard + 4 * (s.shard / kBlock);
    // Zeros: the padding is quantized with the rest and must stay zero.
    s.staging = at::zeros({padded}, bucket.flat.options());
    const auto bytes = bucket.flat.options().dtype(at::kByte);
    s.wire = at::zeros({world_size_ * s.shard_bytes}, bytes);
    s.recv = at::empty({world_size_ * s.shard_bytes}, bytes);
    s.reduced = at::empty({s.shard_bytes}, bytes);
    s.has_grad.assign(bucket.views.size(), 0);
    s.uncovered = uncovered_places(bucket, padded);
  }
  return state;
}

at::Tensor Quant8Hook::codes_of(const at::Tensor& packed, int64_t r,
                                const BucketState& s) const {
  return packed.narrow(0, r * s.shard_bytes, s.shard);
}

at::Tensor Quant8Hook::scales_of(const at::Tensor& packed, int64_t r,
                                 const BucketState& s) const {
  // Byte offset r * shard_bytes + S is a multiple of 4 (S is a multiple of 256).
  return packed.narrow(0, r * s.shard_bytes + s.shard, s.shard_bytes - s.shard)
      .view(at::kFloat);
}

void Quant8Hook::copy_in(Bucket& bucket, size_t slot, const at::Tensor& grad) {
  FASTDDP_PROFILE_RANGE("fastddp copy-in (quant8)");
  BucketState& s = *state_for(bucket);
  const int64_t offset = bucket.offsets[slot];
  const int64_t numel = bucket.numels[slot];
  at::Tensor staged = s.staging.narrow(0, offset, numel);
  if (!grad.defined()) {
    staged.zero_();
    cost::add(cost::kCopyIn, static_cast<int64_t>(staged.nbytes()));
    s.has_grad[slot] = 0;
    return;
  }
  // The staging slot is laid out as the bucket slot (storage order), so a
  // grad with the view's strides is read straight; others go through the
  // (float32: state_for checked) view.
  const at::Tensor src = dense_source(bucket, slot, grad);
  const at::Tensor& view = bucket.views[slot];
  check_grad(bucket, slot, src);
  at::Tensor out = s.staging.as_strided(view.sizes(), view.strides(), offset);
  at::mul_out(out, src, at::scalar_to_tensor(at::Scalar(scale_)));
  if (options_.error_feedback) staged.add_(residual_for(bucket.params[slot], staged, numel));
  // The scaled copy, then the residual added in place: a second pass over the slot.
  cost::add(cost::kCopyIn, static_cast<int64_t>(src.nbytes() + staged.nbytes()) +
                               (options_.error_feedback ? 3 * static_cast<int64_t>(staged.nbytes())
                                                        : 0));
  s.has_grad[slot] = 1;
}

std::shared_ptr<PipelinedHook::Stage> Quant8Hook::start(
    Bucket& bucket, size_t index, bool is_last, c10::intrusive_ptr<c10::ivalue::Future>& done) {
  FASTDDP_PROFILE_RANGE("fastddp launch (quant8)");
  (void)index;
  (void)is_last;
  (void)done;
  std::shared_ptr<BucketState> state = state_for(bucket);
  BucketState& s = *state;
  // No copy-in writes the padding or the gaps between aligned slots, and a
  // block with a NaN quantizes (and its error feeds back) to NaN throughout:
  // zero them each step (one launch), or one bad step would poison every later one.
  if (s.uncovered.defined()) s.staging.index_fill_(0, s.uncovered, 0);
  for (int64_t r = 0; r < world_size_; ++r) {
    const at::Tensor shard = s.staging.narrow(0, r * s.shard, s.shard);
    quantize8_into(options_.format, shard, kBlock, codes_of(s.wire, r, s), scales_of(s.wire, r, s),
                   options_.error_feedback ? &shard : nullptr);
  }
  // Quantizing reads the staging once and writes the codes (one byte a value);
  // with error feedback it writes each value's error back into the staging.
  const auto staging_bytes = static_cast<int64_t>(s.staging.nbytes());
  cost::add(cost::kHook, staging_bytes + s.staging.numel() +
                             (options_.error_feedback ? staging_bytes : 0));
  if (options_.error_feedback) {
    // staging now holds the quantization error of every value.
    for (size_t k = 0; k < bucket.views.size(); ++k) {
      if (!s.has_grad[k]) continue;  // keeps its residual for a later step
      const int64_t numel = bucket.numels[k];
      const at::Tensor err = s.staging.narrow(0, bucket.offsets[k], numel);
      new_residual_for(bucket.params[k]).copy_(err);  // the read one stays (settle_step)
      cost::add(cost::kHook, 2 * static_cast<int64_t>(err.nbytes()));
    }
  }
  return start_exchange(std::move(state));
}

void Quant8Hook::sum_shards(ShardBuffers& buffers) {
  auto& s = static_cast<BucketState&>(buffers);
  sum_shards8_into(options_.format, s.recv, world_size_, s.shard, kBlock, codes_of(s.reduced, 0, s),
                   scales_of(s.reduced, 0, s));
}

void Quant8Hook::write_back(Bucket& bucket, const c10::IValue& result,
                            std::vector<at::Tensor>& dsts) {
  FASTDDP_PROFILE_RANGE("fastddp write-back (dequantize8)");
  const at::Tensor gathered = hook_result_tensor(result, name());
  const BucketState& s = *state_for(bucket);
  FASTDDP_CHECK(gathered.scalar_type() == at::kByte && gathered.is_contiguous() &&
                  gathered.numel() == s.wire.numel(),
                "fastddp: the ", name(), " comm hook's result is not its 8-bit wire buffer");
  FASTDDP_CHECK(dsts.size() == bucket.views.size(), "fastddp: ", dsts.size(),
                " write-back destinations for a bucket of ", bucket.views.size());
  const int64_t numel = bucket.flat.numel();
  for (int64_t r = 0; r < world_size_ && r * s.shard < numel; ++r) {
    const int64_t len = std::min(s.shard, numel - r * s.shard);
    dequantize8_into(options_.format, codes_of(gathered, r, s), scales_of(gathered, r, s), kBlock,
                     bucket.flat.narrow(0, r * s.shard, len));
  }
  // The codes read (a byte a value), the bucket written; then the bucket into the grads.
  cost::add(cost::kWriteBack, numel + static_cast<int64_t>(bucket.flat.nbytes()));
  copy_flat_to_grads(bucket, bucket.flat, dsts);
}

int64_t Quant8Hook::wire_bytes(const Bucket& bucket) const {
  const int64_t padded = padded_numel(bucket.flat.numel());
  return padded + 4 * (padded / kBlock);
}

namespace {

std::shared_ptr<CommHook> make_int8(const c10::intrusive_ptr<c10d::ProcessGroup>& group,
                                    const HookOptions& o) {
  o.check_known({"error_feedback"});
  Quant8Options options;
  options.format = Quant8Format::kInt8;
  options.error_feedback = o.get_bool("error_feedback", true);
  return std::make_shared<Quant8Hook>(group, options);
}

std::shared_ptr<CommHook> make_fp8(const c10::intrusive_ptr<c10d::ProcessGroup>& group,
                                   const HookOptions& o) {
  o.check_known({"format", "error_feedback"});
  Quant8Options options;
  options.format = quant8_format_from_name(o.get_choice("format", "e4m3", {"e4m3", "e5m2"}),
                                           "fp8 format");
  options.error_feedback = o.get_bool("error_feedback", true);
  return std::make_shared<Quant8Hook>(group, options);
}

}  // namespace

FASTDDP_REGISTER_COMM_HOOK("int8", make_int8);
FASTDDP_REGISTER_COMM_HOOK("fp8", make_fp8);

}  // namespace fastddp
