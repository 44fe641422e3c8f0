#include "reduce_scatter.h"

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include "../../util/message.h"
#include "../../util/step_cost.h"
#include "../common/collectives.h"

namespace fastddp {

namespace {
constexpr const char* kWhat = "reduce-scatter of the bucket";
}  // namespace

struct ReduceScatterHook::ScatterStage : Stage {
  c10::intrusive_ptr<c10d::Work> work;
  at::Tensor rows;  // world_size rows: every rank's copy of this rank's shard
  at::Tensor shard;
  void wait_first() override { wait_collective(*work, kWhat); }
};

ReduceScatterHook::ReduceScatterHook(c10::intrusive_ptr<c10d::ProcessGroup> group,
                                     std::vector<at::Tensor> shards)
    : group_(group), copy_(group), shards_(std::move(shards)) {
  world_size_ = group_->getSize();
}

void ReduceScatterHook::on_new_buckets(const std::vector<Bucket>& buckets) {
  FASTDDP_CHECK(buckets.size() == shards_.size(), "fastddp: the sharded optimizer holds ",
                shards_.size(), " gradient shards but the model has ", buckets.size(),
                " buckets: its buckets were laid out again after the optimizer was built");
  for (size_t b = 0; b < buckets.size(); ++b) {
    const at::Tensor& flat = buckets[b].flat;  // meta while released: sizes only
    const at::Tensor& shard = shards_[b];
    FASTDDP_CHECK(!buckets[b].sparse && flat.numel() == shard.numel() * world_size_ &&
                      shard.scalar_type() == flat.scalar_type() &&
                      shard.device() == buckets[b].device && shard.is_contiguous(),
                  "fastddp: bucket ", b, " (", flat.numel(), " elements of ", flat.scalar_type(),
                  ") does not split into ", world_size_, " shards of the sharded optimizer's ",
                  shard.numel(), " elements of ", shard.scalar_type(), " on ", shard.device());
  }
}

void ReduceScatterHook::copy_in(Bucket& bucket, size_t slot, const at::Tensor& grad) {
  copy_.set_nonfinite_guard(guard_);  // a pointer store: the reducer sets ours
  copy_.copy_in(bucket, slot, grad);
}

at::Tensor ReduceScatterHook::scratch_for(const Bucket& bucket, size_t index) {
  const int64_t numel = bucket.flat.numel();
  at::Tensor& scratch = scratch_[index % 2];
  if (!scratch.defined() || scratch.scalar_type() != bucket.flat.scalar_type() ||
      scratch.numel() < numel) {
    // Once per run and buffer where the buckets share a dtype: the largest bucket's length.
    int64_t largest = numel;
    for (const at::Tensor& shard : shards_) {
      if (shard.scalar_type() == bucket.flat.scalar_type()) {
        largest = std::max(largest, shard.numel() * world_size_);
      }
    }
    scratch = at::empty({largest}, bucket.flat.options().device(bucket.device));
  }
  return scratch.narrow(0, 0, numel);
}

std::shared_ptr<PipelinedHook::Stage> ReduceScatterHook::start(
    Bucket& bucket, size_t index, bool, c10::intrusive_ptr<c10::ivalue::Future>& done) {
  note_launch(index, kWhat);
  auto stage = std::make_shared<ScatterStage>();
  stage->shard = shards_[index];
  if (bucket.device.is_cpu()) {
    stage->rows = scratch_for(bucket, index);
    stage->work = all_to_all_even(*group_, stage->rows, bucket.flat);
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
  scatter.wait_first();
  if (!scatter.rows.defined()) {  // a device's reduce-scatter, without a future
    scatter.result->markCompleted(c10::IValue(scatter.shard));
    return;
  }
  // Row r: rank r's copy of this rank's shard, already divided (copy_in); summed in rank
  // order, the same order on every rank.
  const at::Tensor rows = scatter.rows.view({world_size_, scatter.shard.numel()});
  if (world_size_ == 1) {
    scatter.shard.copy_(rows[0]);
  } else {
    at::add_out(scatter.shard, rows[0], rows[1]);
    for (int r = 2; r < world_size_; ++r) scatter.shard.add_(rows[r]);
  }
  // Note [counted cost]: the sum reads the rows and writes the shard (on a device the
  // reduce-scatter sums inside the collective).
  cost::add(cost::kHook, static_cast<int64_t>(rows.nbytes() + scatter.shard.nbytes()));
  scatter.result->markCompleted(c10::IValue(scatter.shard));
}

int64_t ReduceScatterHook::wire_bytes(const Bucket& bucket) const {
  return bucket.bytes() / world_size_ * (world_size_ - 1);
}

}  // namespace fastddp
