// The reducer's bucket layout: the one rebuild from the gradient-ready order,
// agreeing on rank 0's plan, what Python can read of the layout, and the
// check that the parameters still match it.
#include "layout.h"

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include "../util/message.h"
#include "reducer.h"

namespace fastddp {

std::vector<TensorSpec> Reducer::param_specs() const {
  std::vector<TensorSpec> specs;
  specs.reserve(params_.size());
  for (size_t i = 0; i < params_.size(); ++i) {
    TensorSpec spec = spec_of(params_[i], options_.expect_sparse[i]);
    // Planned by the full-precision sizes whatever dtype the parameter has now, as
    // torch's rebuild (before its forward's cast) plans them under mixed_precision.
    const c10::ScalarType dtype = mixed_precision_.master_dtype(i);
    spec.dtype = static_cast<int32_t>(dtype);
    spec.element_size = static_cast<int64_t>(c10::elementSize(dtype));
    specs.push_back(spec);
  }
  return specs;
}

void Reducer::rebuild_buckets() {
  const std::vector<TensorSpec> specs = param_specs();
  BucketPlan plan = plan_buckets_from_ready_order(specs, ready_order_.recorded(),
                                                  options_.rebuild_limits);
  lay_out_again(broadcast_plan(plan.buckets));
  // Armed already when a framework's prepare_for_backward came first.
  for (Bucket& bucket : buckets_) bucket.pending = bucket.params.size();
}

void Reducer::lay_out_again(const std::vector<std::vector<size_t>>& plan) {
  buckets_ = make_buckets(params_, plan, options_.expect_sparse, options_.align_bytes,
                          options_.reduce_dtype, options_.lazy_bucket_allocation,
                          options_.shards);
  join_.forget();
  reset_bucket_views();
  hook_->on_new_buckets(buckets_);
  ready_order_.note_rebuilt();
}

void Reducer::shard_buckets(int64_t shards, bool release) {
  std::lock_guard<std::mutex> lock(mutex_);
  FASTDDP_CHECK(shards >= 1, "fastddp: a bucket needs at least one shard, got ", shards);
  FASTDDP_CHECK(!reducing(), "fastddp: the buckets cannot be sharded while a backward is "
                "reducing");
  for (const Bucket& bucket : buckets_) {
    FASTDDP_CHECK(!bucket.sparse, "fastddp: parameter '", names_[bucket.params.front()],
                  "' gets sparse gradients, which sharded buckets do not hold");
  }
  options_.shards = shards;
  if (release) {  // ZeRO-2: Note [lazy bucket storage] from now on
    options_.lazy_bucket_allocation = true;
    views_ = BucketViews(options_.gradient_as_bucket_view, true, options_.align_bytes);
  }
  std::vector<std::vector<size_t>> plan;
  if (ready_order_.rebuilt()) {  // laid out by the gradients' order already: kept
    for (const Bucket& bucket : buckets_) plan.push_back(bucket.params);
  } else {
    // The first step's order is not known yet, and the layout must not change under the
    // optimizer's shards later: the buckets of the size limits in reverse parameter order
    // (torch's initial plan, its layout for find_unused_parameters), the same on every
    // rank, rather than the one bucket of the whole model that the first step reduces.
    plan = plan_initial_buckets(param_specs(), options_.rebuild_limits).buckets;
  }
  lay_out_again(plan);
}

std::vector<Reducer::SlotLayout> Reducer::bucket_layout() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<SlotLayout> layout;
  for (const Bucket& bucket : buckets_) {
    std::vector<std::vector<int64_t>> strides;
    strides.reserve(bucket.views.size());
    // views are meta tensors while a released bucket waits: their strides are the same
    for (const at::Tensor& view : bucket.views) strides.push_back(view.strides().vec());
    layout.emplace_back(bucket.params, bucket.offsets, bucket.numels, std::move(strides),
                        bucket.flat.numel());
  }
  return layout;
}

std::vector<std::vector<size_t>> Reducer::broadcast_plan(
    const std::vector<std::vector<size_t>>& plan) {
  // Ranks may observe different ready orders; rank 0's plan wins so that all
  // ranks issue identical collectives. Layout: [num_buckets, sizes..., indices...].
  const int64_t n = static_cast<int64_t>(params_.size());
  at::Tensor packed = at::zeros({1 + 2 * n}, at::kLong);
  auto* p = packed.data_ptr<int64_t>();
  p[0] = static_cast<int64_t>(plan.size());
  int64_t pos = 1 + n;
  for (size_t b = 0; b < plan.size(); ++b) {
    p[1 + b] = static_cast<int64_t>(plan[b].size());
    for (size_t index : plan[b]) p[pos++] = static_cast<int64_t>(index);
  }
  std::vector<at::Tensor> tensors{packed.to(params_.front().device())};
  c10d::BroadcastOptions opts;
  opts.rootRank = 0;
  try {
    group_->broadcast(tensors, opts)->wait();
  } catch (const std::exception& e) {
    // A dead or stuck peer: say which collective of the forward failed.
    const auto* error = dynamic_cast<const c10::Error*>(&e);
    FASTDDP_CHECK(false, "fastddp: the broadcast of rank 0's bucket plan (comm hook '",
                  hook_->name(), "') failed on rank ", rank(), ": ",
                  error ? error->what_without_backtrace() : e.what());
  }
  packed = tensors[0].cpu();  // once per run: the rebuild is not on the step path
  p = packed.data_ptr<int64_t>();

  std::vector<std::vector<size_t>> result(static_cast<size_t>(p[0]));
  pos = 1 + n;
  for (size_t b = 0; b < result.size(); ++b) {
    for (int64_t k = 0; k < p[1 + b]; ++k) result[b].push_back(static_cast<size_t>(p[pos++]));
  }
  return result;
}

void Reducer::reset_bucket_views() {
  views_.reset(buckets_, params_);
  stats_.resize(buckets_.size());
}

std::vector<std::vector<size_t>> Reducer::bucket_plan() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<std::vector<size_t>> plan;
  for (const Bucket& bucket : buckets_) plan.push_back(bucket.params);
  return plan;
}

std::vector<int64_t> Reducer::bucket_bytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<int64_t> bytes;
  for (const Bucket& bucket : buckets_) bytes.push_back(bucket.bytes());
  return bytes;
}

int64_t Reducer::held_bucket_bytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return held_bytes(buckets_) + join_.held_bytes();
}

std::vector<int64_t> Reducer::last_ready_order() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return ready_order_.last();
}

void Reducer::check_parameters_unchanged() const {
  // A parameter converted after wrapping (module.double(), .to(device) on the
  // inner module) keeps its name but loses the gradient hook the reducer
  // relies on: its gradients would silently stop being averaged.
  for (size_t i = 0; i < params_.size(); ++i) {
    const auto [b, slot] = views_.locate(i);
    const at::Tensor& view = buckets_[b].views[slot];  // meta while released: sizes only
    const c10::Device device = buckets_[b].device;
    const at::Tensor& p = params_[i];
    FASTDDP_CHECK(mixed_precision_.expected_dtype(i, p.scalar_type()) && p.device() == device &&
                    p.sizes() == view.sizes(),
                  "fastddp: parameter '", names_[i], "' is now ", p.scalar_type(), " on ",
                  p.device(), " of shape ", p.sizes(),
                  ", but DistributedDataParallel was built for it ",
                  mixed_precision_.master_dtype(i), " on ",
                  device, " of shape ", view.sizes(),
                  " (rank ", rank(),
                  "): after wrapping, its gradients would no longer be averaged. "
                  "Convert or move the module before wrapping it.");
  }
}

void Reducer::check_grad(size_t index, const at::Tensor& grad, const Bucket& bucket,
                         const at::Tensor& view) const {
  if (!grad.defined()) return;
  FASTDDP_CHECK(grad.is_sparse() == bucket.sparse, "fastddp: parameter '", names_[index],
                "' produced a ", grad.is_sparse() ? "sparse" : "dense", " gradient, but ",
                bucket.sparse ? "sparse" : "dense", " gradients were expected (they are "
                "expected sparse for nn.Embedding / nn.EmbeddingBag with sparse=True)");
  // Under mixed_precision the gradient is of the parameter's (cast) dtype and
  // the copy-in casts it to the bucket's (Note [mixed precision]).
  const c10::ScalarType expected =
      options_.mixed_precision ? params_[index].scalar_type() : view.scalar_type();
  FASTDDP_CHECK(grad.scalar_type() == expected && grad.device() == view.device(),
                "fastddp: parameter '", names_[index], "' got a gradient of ",
                grad.scalar_type(), " on ", grad.device(), ", expected ", expected, " on ",
                view.device());
  // The .grad setter refuses another shape, but a tensor that is .grad already can
  // change underneath (`g.data = ...`); torch's reducer stops at an internal assert.
  FASTDDP_CHECK(bucket.sparse || grad.sizes() == view.sizes(), "fastddp: parameter '",
                names_[index], "' got a gradient of shape ", grad.sizes(), ", expected ",
                view.sizes(), " (the parameter's shape); was its .grad changed in place?");
}

}  // namespace fastddp
