// Hierarchical reduction for multi-node jobs: the built-in hook behind
// fastddp.hooks.hierarchical().
//
// Note [hierarchical reduction]
// Ranks form a grid of nodes x local ranks. `intra` is this rank's node (its
// local ranks); `inter` holds the ranks with this rank's local index on every
// node. Per bucket of P elements (padded to a multiple of
// local_size * inter_size; the padding is zeros):
//   copy_in      grad * inter_size/factor -> the bucket (factor: the world
//                size, so grad/local_size): the inner hook divides by its own
//                group size, the number of nodes, so the result is the mean
//                over all ranks;
//   reduce_scatter  inside the node, in the bucket's dtype (full precision):
//                this rank's shard of P/local_size elements, summed over the node
//                (on the CPU an alltoall and a local sum in rank order: gloo's
//                reduce_scatter is slower than an allreduce);
//   inner hook   any registered CommHook (allreduce, bf16, int8, ...) built on
//                `inter`, run on a one-slot Bucket whose flat buffer is the
//                shard: copy_in(shard), run(), write_back() into the shard;
//   allgather    inside the node: the reduced shards back into the bucket.
// Only the inner hook's bytes cross the inter-node link: 1/local_size of the
// bucket (times the inner's compression) per rank, instead of a flat ring's
// whole bucket.
//
// Order (Note [pipelined hooks]: every collective is issued from run(), in
// bucket order, on every rank). run(bucket i) issues
//   reduce_scatter(i);
//   waits reduce_scatter(i-1) (issued one bucket earlier), inner copy_in +
//     inner run(shard i-1);
//   waits the inner future of i-2 (two buckets earlier, and the inner hook's
//     run(i-1) has finished it if the inner is itself pipelined), inner
//     write_back, allgather(i-2);
// and on the last bucket drains: inner run(last, is_last), then the
// remaining allgathers in order (drain(), when the last bucket is skipped:
// the same without is_last, and the inner hook's drain() in between). A
// bucket's future completes when its allgather has. On CUDA the waits are
// stream waits on the side stream (Note [hook streams]); on the CPU they
// block, one or two buckets after issue.
//
// A failed inner reduction (a node died) still gets its allgather, of a
// zeroed shard, and the bucket fails once that is done: the node's ranks see
// the failure at different buckets (each has its own peers on `inter`), and
// a rank that skipped an allgather would pair its next intra collective with
// a peer's allgather. So the intra collectives stay the same sequence on
// every rank of a node whatever fails between nodes, which a fault-tolerant
// step needs (Note [fault-tolerant step]: the replica group's ranks fail the
// step and go on) and which an ordinary failed step leaves clean too.
//
// Under torchft the node is the replica group and `inter` the quorum's group
// of this local index (fastddp/integrations/_torchft_hierarchical.py): the
// reducer runs on `inter` then, and its divide factors count nodes, not ranks
// (factor_counts_nodes).
#pragma once

#include <ATen/Tensor.h>
#include <ATen/core/ivalue.h>
#include <c10/util/intrusive_ptr.h>

#include <deque>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "../../reducer/comm_hook.h"

namespace c10d {
class ProcessGroup;
class Work;
}  // namespace c10d

namespace fastddp {

class HierarchicalHook : public CommHook {
 public:
  // `inner` reduces each shard over `inter` (it must have been built on it).
  // factor_counts_nodes: the reducer's group is `inter` (torchft), so the
  // divide factor it sets is a count of nodes, each of local_size ranks.
  HierarchicalHook(c10::intrusive_ptr<c10d::ProcessGroup> intra,
                   c10::intrusive_ptr<c10d::ProcessGroup> inter, std::shared_ptr<CommHook> inner,
                   bool factor_counts_nodes = false);

  std::string name() const override;
  void on_new_buckets(const std::vector<Bucket>& buckets) override;
  void copy_in(Bucket& bucket, size_t slot, const at::Tensor& grad) override;
  c10::intrusive_ptr<c10::ivalue::Future> run(Bucket& bucket, size_t index,
                                              bool is_last) override;
  void set_divisors(StepDivisors divisors) override { divide_by(divisors.requested); }
  void drain() override;
  void abandon_step() override;
  void after_step(const at::Tensor& kept) override { inner_->after_step(kept); }
  bool settles_own_state() const override { return inner_->settles_own_state(); }
  at::Tensor settle_step(const at::Tensor& finite) override { return inner_->settle_step(finite); }
  void discard_step() override { inner_->discard_step(); }
  // The inner hook's bytes for this rank's shard: what crosses the inter-node
  // link (the node's reduce_scatter and allgather are not counted).
  int64_t wire_bytes(const Bucket& bucket) const override;

  const std::shared_ptr<CommHook>& inner() const { return inner_; }
  int local_size() const { return local_size_; }
  int node_count() const { return node_count_; }

 private:
  void divide_by(int64_t factor);
  // Buffers of one bucket, kept across steps (keyed by Bucket::id).
  struct BucketState {
    // The bucket padded to a multiple of local*nodes; undefined when it needs
    // no padding (the run uses the flat buffer itself, which this must not
    // keep: Note [lazy bucket storage]).
    at::Tensor padded;
    at::Tensor shard;   // this rank's shard: reduce_scatter's output, the inner's bucket
    at::Tensor shards;  // CPU: the alltoall's output, local_size rows of a shard each
    Bucket shard_bucket;
  };
  // One bucket on its way through the three phases.
  struct Stage {
    size_t index = 0;
    int64_t numel = 0;
    std::shared_ptr<BucketState> state;
    at::Tensor padded;  // state->padded, or this step's flat buffer
    c10::intrusive_ptr<c10d::Work> reduce_scatter;
    c10::intrusive_ptr<c10::ivalue::Future> inner_future;
    c10::intrusive_ptr<c10::ivalue::Future> result;
  };

  int64_t padded_numel(int64_t numel) const;
  std::shared_ptr<BucketState> state_for(const Bucket& bucket);
  // The stages still in flight, in order (run() of the last bucket, or drain()).
  void drain_stages(bool is_last);
  // reduce_scatter done -> the inner hook's copy_in and run (is_last: its last bucket).
  void start_inner(Stage& stage, bool is_last);
  // The inner future done -> its write_back into the shard, the allgather
  // (also after a failure: see the Note's last paragraphs).
  void start_allgather(Stage& stage);

  c10::intrusive_ptr<c10d::ProcessGroup> intra_;
  c10::intrusive_ptr<c10d::ProcessGroup> inter_;
  std::shared_ptr<CommHook> inner_;
  int local_size_;
  int node_count_;
  bool factor_counts_nodes_;
  double scale_;
  std::unordered_map<uint64_t, std::shared_ptr<BucketState>> states_;
  // Touched by run() only (the autograd thread): no lock.
  std::deque<Stage> scattering_;  // reduce_scatter issued, inner not yet run (at most 1)
  std::deque<Stage> inner_running_;  // inner run, allgather not yet issued (at most 2)
};

}  // namespace fastddp
