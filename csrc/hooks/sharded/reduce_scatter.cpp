#include "reduce_scatter.h"

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include "../../util/message.h"
#include "../../util/step_cost.h"
#include "../common/collectives.h"
#include "../common/side_stream.h"
#include "../half/half_ops.h"
#include "../quant8/quant8_ops.h"

namespace fastddp {

namespace {
// The 8-bit wire's block: the "int8" / "fp8" hooks' (Quant8Hook::kBlock).
constexpr int64_t kQuant8Block = 256;
}  // namespace

namespace {
constexpr const char* kWhat = "reduce-scatter of the bucket";
}  // namespace

struct ReduceScatterHook::ScatterStage : Stage {
  c10::intrusive_ptr<c10d::Work> work;
  Scratch scratch;  // views this bucket's collective and sum use (undefined on a device's fp32)
  at::Tensor shard;
  bool last = false;  // the backward's last bucket
  void wait_first() override { wait_collective(*work, kWhat); }
};

ReduceScatterHook::ReduceScatterHook(c10::intrusive_ptr<c10d::ProcessGroup> group,
                                     std::vector<at::Tensor> shards,
                                     std::optional<HalfKind> wire, bool release_scratch,
                                     std::optional<Quant8Format> wire8)
    : group_(group),
      copy_(group),
      wire_(wire),
      wire8_(wire8),
      release_scratch_(release_scratch) {
  FASTDDP_CHECK(!(wire && wire8), "fastddp: the sharded optimizer's reduce-scatter takes one "
                "wire, a 16-bit or an 8-bit one");
  world_size_ = group_->getSize();
  // The optimizer's shards, held as aliases of their memory: a device's reduce-scatter
  // writes into them, and its Work must not hold a tensor Python has seen (Note [no
  // Python tensor in a Work], collectives.h).
  shards_.reserve(shards.size());
  for (const at::Tensor& shard : shards) {
    FASTDDP_CHECK(shard.is_contiguous(), "fastddp: the sharded optimizer's gradient shards "
                  "must be contiguous");
    shards_.push_back(storage_alias(shard, 0, shard.numel()));
  }
}

std::string ReduceScatterHook::name() const {
  if (wire8_) return "reduce_scatter_" + quant8_format_name(*wire8_);
  if (!wire_) return "reduce_scatter";
  return *wire_ == HalfKind::kBFloat16 ? "reduce_scatter_bf16" : "reduce_scatter_fp16";
}

void ReduceScatterHook::on_new_buckets(const std::vector<Bucket>& buckets) {
  FASTDDP_CHECK(buckets.size() == shards_.size(), "fastddp: the sharded optimizer holds ",
                shards_.size(), " gradient shards but the model has ", buckets.size(),
                " buckets: its buckets were laid out again after the optimizer was built");
  for (size_t b = 0; b < buckets.size(); ++b) {
    const at::Tensor& flat = buckets[b].flat;  // meta while released: sizes only
    const at::Tensor& shard = shards_[b];
    // A float32 shard of a 16-bit bucket: the rows summed in float32 (main weights).
    const bool widens = !wire_ && !wire8_ && shard.scalar_type() == at::kFloat &&
                        (flat.scalar_type() == at::kBFloat16 || flat.scalar_type() == at::kHalf);
    FASTDDP_CHECK(!buckets[b].sparse && flat.numel() == shard.numel() * world_size_ &&
                      (shard.scalar_type() == flat.scalar_type() || widens) &&
                      shard.device() == buckets[b].device && shard.is_contiguous(),
                  "fastddp: bucket ", b, " (", flat.numel(), " elements of ", flat.scalar_type(),
                  ") does not split into ", world_size_, " shards of the sharded optimizer's ",
                  shard.numel(), " elements of ", shard.scalar_type(), " on ", shard.device());
    FASTDDP_CHECK_NOT_IMPLEMENTED((!wire_ && !wire8_) || flat.scalar_type() == at::kFloat,
                                  "fastddp: the ",
                                  name(), " wire carries float32 gradients; bucket ", b,
                                  " holds ", flat.scalar_type());
  }
}

void ReduceScatterHook::copy_in(Bucket& bucket, size_t slot, const at::Tensor& grad) {
  copy_.set_nonfinite_guard(guard_);  // a pointer store: the reducer sets ours
  copy_.copy_in(bucket, slot, grad);
}

ReduceScatterHook::Scratch ReduceScatterHook::scratch_for(const Bucket& bucket,
                                                           size_t index) {
  if (wire8_) {
    // Rows of codes and scales, sent and received, and one float32 row to dequantize into.
    // Per bucket (not kept in sets): their length is not the bucket's.
    const int64_t shard = bucket.flat.numel() / world_size_;
    const auto bytes = bucket.flat.options().dtype(at::kByte);
    return {at::empty({world_size_ * row8_bytes(shard)}, bytes),
            at::empty({world_size_ * row8_bytes(shard)}, bytes),
            world_size_ > 1 ? at::empty({shard}, bucket.flat.options()) : at::Tensor()};
  }
  const int64_t numel = bucket.flat.numel();
  const auto dtype = wire_ ? scalar_type_of(*wire_) : bucket.flat.scalar_type();
  const auto options = bucket.flat.options().dtype(dtype).device(bucket.device);
  if (!bucket.device.is_cpu()) {
    // Fresh from the caching allocator: on a device bucket i's sum (side stream) may still
    // read its buffers when bucket i + 2's cast and alltoall (compute and NCCL streams)
    // would write a reused set; record_current_stream keeps these until their work is done.
    if (!wire_) return {at::Tensor(), at::empty({numel}, options), at::Tensor()};
    return {at::empty({numel}, options), at::empty({numel}, options),
            at::empty({numel / world_size_}, options)};
  }
  // On the CPU every op has ended when finish() returns, before the next start() but one.
  Scratch& set = scratch_[index % 2];
  if (!set.recv.defined() || set.recv.scalar_type() != dtype || set.recv.numel() < numel) {
    // Once per run and set where the buckets share a dtype: the largest bucket's length.
    int64_t largest = numel;
    for (const at::Tensor& shard : shards_) {
      if (shard.scalar_type() == bucket.flat.scalar_type()) {
        largest = std::max(largest, shard.numel() * world_size_);
      }
    }
    set.recv = at::empty({largest}, options);
    if (wire_) {
      set.send = at::empty({largest}, options);
      set.reduced = at::empty({largest / world_size_}, options);
    }
  }
  Scratch views{at::Tensor(), set.recv.narrow(0, 0, numel), at::Tensor()};
  if (wire_) {
    views.send = set.send.narrow(0, 0, numel);
    views.reduced = set.reduced.narrow(0, 0, numel / world_size_);
  }
  return views;
}

int64_t ReduceScatterHook::row8_bytes(int64_t shard) const {
  return (shard + 3) / 4 * 4 + 4 * quant8_num_blocks(shard, kQuant8Block);
}

at::Tensor ReduceScatterHook::codes8_of(const at::Tensor& rows, int64_t r, int64_t shard) const {
  return rows.narrow(0, r * row8_bytes(shard), shard);
}

at::Tensor ReduceScatterHook::scales8_of(const at::Tensor& rows, int64_t r, int64_t shard) const {
  const int64_t codes = (shard + 3) / 4 * 4;  // a 4-byte boundary: the scales' float32
  return rows.narrow(0, r * row8_bytes(shard) + codes, row8_bytes(shard) - codes)
      .view(at::kFloat);
}

std::shared_ptr<PipelinedHook::Stage> ReduceScatterHook::start(
    Bucket& bucket, size_t index, bool is_last, c10::intrusive_ptr<c10::ivalue::Future>& done) {
  note_launch(index, kWhat);
  auto stage = std::make_shared<ScatterStage>();
  stage->shard = shards_[index];
  stage->last = is_last;
  if (wire8_) {
    // On the compute stream, after the copy-ins: each destination's row quantized once.
    stage->scratch = scratch_for(bucket, index);
    const int64_t shard = bucket.flat.numel() / world_size_;
    for (int64_t r = 0; r < world_size_; ++r) {
      quantize8_into(*wire8_, bucket.flat.narrow(0, r * shard, shard), kQuant8Block,
                     codes8_of(stage->scratch.send, r, shard),
                     scales8_of(stage->scratch.send, r, shard), nullptr);
    }
    // The bucket read, a byte a value written (the scales: a float per 256 values).
    cost::add(cost::kHook, static_cast<int64_t>(bucket.flat.nbytes()) + bucket.flat.numel());
    stage->work = all_to_all_even(*group_, stage->scratch.recv, stage->scratch.send);
  } else if (wire_) {
    // On the compute stream, after the copy-ins: one pass, float32 to the wire.
    stage->scratch = scratch_for(bucket, index);
    half_compress_into(*wire_, bucket.flat, 1.0, nullptr, nullptr, stage->scratch.send);
    cost::add(cost::kHook,
              static_cast<int64_t>(bucket.flat.nbytes() + stage->scratch.send.nbytes()));
    stage->work = all_to_all_even(*group_, stage->scratch.recv, stage->scratch.send);
  } else if (bucket.device.is_cpu() || stage->shard.scalar_type() != bucket.flat.scalar_type()) {
    // The CPU's reduce-scatter, and a device's into a wider shard (NCCL's reduce_scatter
    // writes the bucket's dtype): an alltoall, the sum in finish().
    stage->scratch = scratch_for(bucket, index);
    stage->work = all_to_all_even(*group_, stage->scratch.recv, bucket.flat);
  } else {
    stage->work = reduce_scatter_into(*group_, stage->shard, bucket.flat);
    if (work_has_future_.value_or(true)) {
      try {
        done = stage->work->getFuture();
        work_has_future_ = true;
        return nullptr;
      } catch (const c10::Error&) {  // a backend whose Work has none: waited for in finish()
        work_has_future_ = false;
      }
    }
  }
  stage->result = make_result(stage->shard);
  return stage;
}

void ReduceScatterHook::finish(Stage& stage) {
  auto& scatter = static_cast<ScatterStage&>(stage);
  const Scratch& s = scatter.scratch;
  at::Tensor& shard = scatter.shard;
  // Off the compute stream (Note [hook streams]): the wait is a stream wait on a device.
  const SideStreamScope side(shard.device());
  scatter.wait_first();
  if (wire8_) {
    // Each rank's row dequantized and added in float32, in rank order, into the shard.
    const int64_t n = shard.numel();
    for (int64_t r = 0; r < world_size_; ++r) {
      const at::Tensor& into = r == 0 ? shard : s.reduced;
      dequantize8_into(*wire8_, codes8_of(s.recv, r, n), scales8_of(s.recv, r, n),
                       kQuant8Block, into);
      if (r > 0) shard.add_(s.reduced);
    }
    // A byte a value read, a float a value written per row, and the adds.
    cost::add(cost::kHook, world_size_ * (n + 4 * n) + 2 * (world_size_ - 1) * 4 * n);
  } else if (wire_) {
    // Rows in rank order summed in float32, rounded once to the wire, widened: the shard.
    half_sum_shards_into(*wire_, s.recv, world_size_, s.reduced);
    half_decompress_many(*wire_, {s.reduced}, {shard});
    cost::add(cost::kHook, static_cast<int64_t>(s.recv.nbytes() + 2 * s.reduced.nbytes() +
                                                shard.nbytes()));
  } else if (s.recv.defined()) {
    // Each rank's row is already divided (copy_in).
    sum_rows_in_rank_order(shard, s.recv, world_size_);
    // Note [counted cost]: the sum reads the rows and writes the shard (on a device the
    // reduce-scatter sums inside the collective).
    cost::add(cost::kHook, static_cast<int64_t>(s.recv.nbytes() + shard.nbytes()));
  }
  record_current_stream({s.send, s.recv, s.reduced, shard});
  if (release_scratch_ && scatter.last) {
    // ZeRO-2: nothing gradient-sized held between backwards (the stage's views keep
    // what this bucket still uses).
    scratch_[0] = {};
    scratch_[1] = {};
  }
  scatter.result->markCompleted(c10::IValue(shard));
}

int64_t ReduceScatterHook::wire_bytes(const Bucket& bucket) const {
  if (wire8_) {
    return row8_bytes(bucket.flat.numel() / world_size_) * (world_size_ - 1);
  }
  const int64_t bytes = wire_ ? bucket.flat.numel() * 2 : bucket.bytes();
  return bytes / world_size_ * (world_size_ - 1);
}

}  // namespace fastddp
