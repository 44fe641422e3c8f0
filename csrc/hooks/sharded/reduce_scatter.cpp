#include "reduce_scatter.h"

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include "../../util/message.h"
#include "../common/collectives.h"

namespace fastddp {

namespace {
constexpr const char* kWhat = "reduce-scatter of the bucket";
}  // namespace

struct ReduceScatterHook::ScatterStage : Stage {
  c10::intrusive_ptr<c10d::Work> work;
  at::Tensor shard;
  void wait_first() override { wait_collective(*work, kWhat); }
};

ReduceScatterHook::ReduceScatterHook(c10::intrusive_ptr<c10d::ProcessGroup> group,
                                     std::vector<at::Tensor> shards)
    : group_(group), copy_(group), shards_(std::move(shards)) {
  world_size_ = group_->getSize();
  gloo_ = group_->getBackendName() == "gloo";
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

std::shared_ptr<PipelinedHook::Stage> ReduceScatterHook::start(
    Bucket& bucket, size_t index, bool, c10::intrusive_ptr<c10::ivalue::Future>& done) {
  note_launch(index, kWhat);
  c10::intrusive_ptr<c10d::Work> work;
  if (gloo_) {
    // gloo's single-tensor reduce-scatter costs more than its allreduce (26 ms against
    // 18 ms for 12 MB on 2 ranks, torch 2.14.1); its list form runs gloo's own
    // reduce-scatter (12.5 ms). The chunks are views of the bucket: no copy here.
    std::vector<at::Tensor> out{shards_[index]};
    std::vector<std::vector<at::Tensor>> in(1);
    const int64_t size = shards_[index].numel();  // also 0: chunk() would give fewer
    for (int r = 0; r < world_size_; ++r) in[0].push_back(bucket.flat.narrow(0, r * size, size));
    work = group_->reduce_scatter(out, in);
  } else {
    work = reduce_scatter_into(*group_, shards_[index], bucket.flat);
  }
  if (work_has_future_.value_or(true)) {
    try {
      done = work->getFuture();
      work_has_future_ = true;
      return nullptr;
    } catch (const c10::Error&) {  // gloo: "Work::getFuture not implemented"
      work_has_future_ = false;
    }
  }
  auto stage = std::make_shared<ScatterStage>();
  stage->work = std::move(work);
  stage->shard = shards_[index];
  stage->result = make_result(stage->shard);
  return stage;
}

void ReduceScatterHook::finish(Stage& stage) {
  auto& scatter = static_cast<ScatterStage&>(stage);
  scatter.wait_first();
  scatter.result->markCompleted(c10::IValue(scatter.shard));
}

int64_t ReduceScatterHook::wire_bytes(const Bucket& bucket) const {
  return bucket.bytes() / world_size_ * (world_size_ - 1);
}

}  // namespace fastddp
