// The sharded optimizer's reduction (fastddp.optim.ShardedOptimizer, Note
// [sharded buckets] in reducer/bucket.h): torch DDP's copy-in (AllreduceHook's:
// divide by the world size in the same pass), then one reduce-scatter(SUM) of
// the bucket into this rank's shard, a tensor of the optimizer's. The reduce-
// scatter moves half an allreduce's bytes; the optimizer's all-gather of the
// updated parameters moves the other half.
//
// Nothing is written back: each rank holds the average of its shard only, so
// the reducer leaves .grad None (CommHook::writes_grads) and the optimizer
// steps on the shards. Sparse buckets are refused (Reducer::shard_buckets).
//
// On the CPU (gloo) the reduce-scatter is an alltoall of the bucket and a sum
// of the world_size received rows in rank order, as the hierarchical hook's:
// gloo's reduce_scatter, list form included, costs more than its alltoall of
// the same bytes and the sum together (16.8 MB on 2 ranks: 35 ms against
// 23 ms, benchmarks/results/sharded_step.md). That sum is local work after the
// collective, so the hook is pipelined (Note [pipelined hooks]): bucket i's
// alltoall is waited for and summed when bucket i + 1 is run, or at the last.
// On a device (NCCL) one reduce_scatter_single, whose future is the bucket's:
// nothing waits before the end of backward.
//
// A 16-bit wire (`wire`: bf16 or fp16, float32 buckets only) halves the bytes,
// on every device: after torch's copy-in (divided in float32) the bucket is
// cast to the wire once, alltoall'ed, and the rows summed in float32 in rank
// order and rounded once (the shard-sum hooks' sum, Note [shard-sum hooks]),
// then widened into the float32 shard. On 2 ranks that is the average torch's
// bf16_compress_hook / fp16_compress_hook give (one rounding of each rank's
// half, a sum of two rounded once), bit for bit; on more ranks a sum of n
// rounded once rather than n - 1 times.
//
// An 8-bit wire (`wire8`: int8, fp8 e4m3 or e5m2, block-scaled as the "int8" / "fp8"
// hooks' wire, Note [8-bit wire formats] in quant8/quant8_hook.h; float32 buckets only):
// each rank quantizes, per destination, its divided bucket's shard-long row once (codes and
// block scales, about a quarter of the bytes), alltoall's them, and the receiver
// dequantizes the world rows and sums them in float32 in rank order into its shard. Each
// rank's contribution is rounded once and the sum not at all: nothing is re-quantized, as
// the allreducing 8-bit hooks must before their all-gather.
//
// A float32 shard of a bf16 or fp16 bucket (the optimizer's float32 main weights, no
// wire): the bucket's own rows are alltoall'ed, on every device, and summed in float32
// in rank order straight into the shard, never rounded to 16 bits (Megatron's float32
// gradient accumulation for 16-bit parameters).
//
// The alltoall receives (and a 16-bit wire sends) in scratch buffers: on the
// CPU two sets of the largest bucket's length, alternating (at most two
// buckets are in flight, and a finish() has ended its work when it returns),
// kept between backwards unless release_scratch (ZeRO-2) frees them; on
// a device fresh ones per bucket from the caching allocator. A 16-bit wire's
// sum runs on the side stream (Note [hook streams]).
#pragma once

#include <ATen/Tensor.h>
#include <c10/util/intrusive_ptr.h>

#include <memory>
#include <optional>
#include <vector>

#include "../../core/half_rounding.h"
#include "../../core/quant8_codes.h"
#include "../common/allreduce.h"
#include "../common/pipelined_hook.h"

namespace fastddp {

class ReduceScatterHook final : public PipelinedHook {
 public:
  // shards[b]: bucket b's shard, 1/world of its length, of its dtype and device.
  // wire: a 16-bit format for the float32 buckets, or none (the bucket's dtype).
  // release_scratch (ZeRO-2): the CPU's scratch freed at the end of each backward.
  // wire8: an 8-bit block-scaled format for the float32 buckets instead (not with wire).
  ReduceScatterHook(c10::intrusive_ptr<c10d::ProcessGroup> group, std::vector<at::Tensor> shards,
                    std::optional<HalfKind> wire = std::nullopt, bool release_scratch = false,
                    std::optional<Quant8Format> wire8 = std::nullopt);

  std::string name() const override;
  // Raises unless every bucket is `shards`' bucket, in the same order and size.
  void on_new_buckets(const std::vector<Bucket>& buckets) override;
  // torch DDP's copy-in, the default hook's (the same numbers in the bucket).
  void copy_in(Bucket& bucket, size_t slot, const at::Tensor& grad) override;
  void set_divisors(StepDivisors divisors) override { copy_.set_divisors(divisors); }
  bool writes_grads() const override { return false; }
  bool supports_sparse() const override { return false; }
  // What a ring reduce-scatter sends per rank: (n - 1) / n of the bucket (of the wire's
  // width), half an allreduce.
  int64_t wire_bytes(const Bucket& bucket) const override;

 private:
  struct ScatterStage;
  std::shared_ptr<Stage> start(Bucket& bucket, size_t index, bool is_last,
                               c10::intrusive_ptr<c10::ivalue::Future>& done) override;
  void finish(Stage& stage) override;

  // An alltoall's buffers: `recv` the bucket's length, and for a 16-bit wire `send`
  // (the same) and `reduced` (a shard).
  struct Scratch {
    at::Tensor send, recv, reduced;
  };
  // Bucket `index`'s scratch, views of the set of its parity.
  Scratch scratch_for(const Bucket& bucket, size_t index);
  // The 8-bit wire's row for one destination rank: a shard's codes, padded to 4 bytes,
  // then its block scales (float32).
  int64_t row8_bytes(int64_t shard) const;
  at::Tensor codes8_of(const at::Tensor& rows, int64_t r, int64_t shard) const;
  at::Tensor scales8_of(const at::Tensor& rows, int64_t r, int64_t shard) const;

  c10::intrusive_ptr<c10d::ProcessGroup> group_;
  AllreduceHook copy_;  // its copy-in and divisor
  std::vector<at::Tensor> shards_;
  int world_size_;
  std::optional<HalfKind> wire_;
  std::optional<Quant8Format> wire8_;
  Scratch scratch_[2];  // the CPU's, by bucket index parity
  bool release_scratch_;
  std::optional<bool> work_has_future_;  // a device's reduce-scatter: learnt from the first
};

}  // namespace fastddp
