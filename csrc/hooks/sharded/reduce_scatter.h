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
// The alltoall receives into one of two scratch buffers of the largest bucket,
// alternating (at most two buckets are in flight). On a device (NCCL) one
// reduce_scatter_single, whose future is the bucket's: nothing waits before
// the end of backward.
#pragma once

#include <ATen/Tensor.h>
#include <c10/util/intrusive_ptr.h>

#include <memory>
#include <optional>
#include <vector>

#include "../common/allreduce.h"
#include "../common/pipelined_hook.h"

namespace fastddp {

class ReduceScatterHook final : public PipelinedHook {
 public:
  // shards[b]: bucket b's shard, 1/world of its length, of its dtype and device.
  ReduceScatterHook(c10::intrusive_ptr<c10d::ProcessGroup> group, std::vector<at::Tensor> shards);

  std::string name() const override { return "reduce_scatter"; }
  // Raises unless every bucket is `shards`' bucket, in the same order and size.
  void on_new_buckets(const std::vector<Bucket>& buckets) override;
  // torch DDP's copy-in, the default hook's (the same numbers in the bucket).
  void copy_in(Bucket& bucket, size_t slot, const at::Tensor& grad) override;
  void set_divisors(StepDivisors divisors) override { copy_.set_divisors(divisors); }
  bool writes_grads() const override { return false; }
  bool supports_sparse() const override { return false; }
  // What a ring reduce-scatter sends per rank: (n - 1) / n of the bucket, half an allreduce.
  int64_t wire_bytes(const Bucket& bucket) const override;

 private:
  struct ScatterStage;
  std::shared_ptr<Stage> start(Bucket& bucket, size_t index, bool is_last,
                               c10::intrusive_ptr<c10::ivalue::Future>& done) override;
  void finish(Stage& stage) override;

  // A receive buffer for bucket `index`'s alltoall, of its dtype and length (the CPU path).
  at::Tensor scratch_for(const Bucket& bucket, size_t index);

  c10::intrusive_ptr<c10d::ProcessGroup> group_;
  AllreduceHook copy_;  // its copy-in and divisor
  std::vector<at::Tensor> shards_;
  int world_size_;
  at::Tensor scratch_[2];  // the CPU path's receive buffers, by bucket index parity
  std::optional<bool> work_has_future_;  // a device's reduce-scatter: learnt from the first
};

}  // namespace fastddp
