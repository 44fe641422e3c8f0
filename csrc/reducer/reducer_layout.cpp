// The reducer's bucket layout: the one rebuild from the gradient-ready order,
// agreeing on rank 0's plan, what Python can read of the layout, and the
// check that the parameters still match it.
#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include "device_timeline.h"
#include "reducer.h"
#include "../util/message.h"
#include "../util/profile_range.h"

namespace fastddp {

void Reducer::rebuild_buckets() {
  std::vector<TensorSpec> specs;
  specs.reserve(params_.size());
  for (size_t i = 0; i < params_.size(); ++i) {
    TensorSpec spec = spec_of(params_[i], options_.expect_sparse[i]);
    // Planned by the full-precision sizes whatever dtype the parameter has now, as
    // torch's rebuild (before its forward's cast) plans them under mixed_precision.
    spec.dtype = static_cast<int32_t>(master_dtypes_[i]);
    spec.element_size = static_cast<int64_t>(c10::elementSize(master_dtypes_[i]));
    specs.push_back(spec);
  }
  BucketPlan plan = plan_buckets_from_ready_order(specs, ready_order_, options_.rebuild_limits);
  buckets_ = make_buckets(params_, broadcast_plan(plan.buckets), options_.expect_sparse,
                          options_.align_bytes, options_.reduce_dtype,
                          options_.lazy_bucket_allocation);
  shadow_buckets_.clear();
  reset_bucket_views();
  // Armed already when a framework's prepare_for_backward came first.
  for (Bucket& bucket : buckets_) bucket.pending = bucket.params.size();
  hook_->on_new_buckets(buckets_);
  ready_order_.clear();
  has_rebuilt_ = true;
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
                  hook_->name(), "') failed on rank ", rank_, ": ",
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
  locator_.assign(params_.size(), {0, 0});
  stats_.timings.assign(buckets_.size(), BucketTiming{});
  timeline_->resize(buckets_.size());
  for (size_t b = 0; b < buckets_.size(); ++b) {
    Bucket& bucket = buckets_[b];
    for (size_t k = 0; k < bucket.params.size(); ++k) {
      locator_[bucket.params[k]] = {b, k};
      if (!options_.gradient_as_bucket_view || !bucket.allocated() || bucket.sparse) continue;
      // Existing grads move into the (new) buckets, as torch's reducer does
      // (lazily allocated buckets: the first backward's copy_in moves them).
      at::Tensor& grad = params_[bucket.params[k]].mutable_grad();
      if (grad.defined() && !grad.is_alias_of(bucket.views[k])) {
        bucket.views[k].copy_(grad);
        grad = bucket.views[k];
      }
    }
  }
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
  return held_bytes(buckets_) + held_bytes(shadow_buckets_);
}

void Reducer::allocate_buckets() {
  FASTDDP_PROFILE_RANGE("fastddp allocate buckets");
  allocate_flat(buckets_, options_.align_bytes);
}

void Reducer::release_buckets() {
  // After the write-back: the gradients are in .grad (under
  // gradient_as_bucket_view the views keep their buffer alive themselves).
  if (options_.lazy_bucket_allocation) release_flat(buckets_);
}

std::vector<int64_t> Reducer::last_ready_order() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return last_ready_order_;
}

std::vector<int64_t> Reducer::last_unused_parameters() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return std::vector<int64_t>(unused_.begin(), unused_.end());
}

void Reducer::set_track_finite(bool on) {
  std::lock_guard<std::mutex> lock(mutex_);
  track_finite_ = on;
  last_finite_ = at::Tensor();
}

std::optional<bool> Reducer::last_step_finite() const {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!last_finite_.defined()) return std::nullopt;
  return last_finite_.item<bool>();
}

std::string Reducer::last_error() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return last_error_;
}

CommStats Reducer::comm_stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  CommStats stats = stats_;
  for (const Bucket& bucket : buckets_) {
    stats.bucket_bytes.push_back(bucket.bytes());
    stats.wire_bytes.push_back(hook_->wire_bytes(bucket));
  }
  stats.timed_iteration = stats.steps > 0 ? backward_iteration_ : 0;
  stats.timed_steps = stats.steps;
  if (!timeline_->active()) return stats;
  // On a GPU the device's clock: the latest timed backward that has finished
  // there, found with event queries (Note [device timeline]). The timeline is
  // the reducer's own state, guarded by mutex_ like the rest: reading it is
  // what advances it, hence the call through the pointer in a const method.
  timeline_->harvest();
  stats.device_clock = true;
  const std::optional<DeviceTimeline::Figures>& latest = timeline_->latest();
  stats.timed_iteration = latest ? latest->iteration : 0;
  stats.timings = latest ? latest->timings : std::vector<BucketTiming>(buckets_.size());
  stats.exposed_us = latest ? latest->exposed_us : 0.0;
  stats.backward_start_ns = latest ? latest->backward_start_ns : 0;
  stats.total_exposed_us = timeline_->total_exposed_us();
  stats.timed_steps = timeline_->timed_steps();
  return stats;
}

void Reducer::set_timing_sample_rate(int64_t rate) {
  std::lock_guard<std::mutex> lock(mutex_);
  timeline_->set_sample_rate(rate);
}

void Reducer::set_time_every_step(bool on) {
  std::lock_guard<std::mutex> lock(mutex_);
  timeline_->set_time_every_step(on);
}

void Reducer::check_parameters_unchanged() const {
  // A parameter converted after wrapping (module.double(), .to(device) on the
  // inner module) keeps its name but loses the gradient hook the reducer
  // relies on: its gradients would silently stop being averaged.
  for (size_t i = 0; i < params_.size(); ++i) {
    const auto [b, slot] = locator_[i];
    const at::Tensor& view = buckets_[b].views[slot];  // meta while released: sizes only
    const c10::Device device = buckets_[b].device;
    const at::Tensor& p = params_[i];
    FASTDDP_CHECK(expected_dtype(i, p.scalar_type()) && p.device() == device &&
                    p.sizes() == view.sizes(),
                  "fastddp: parameter '", names_[i], "' is now ", p.scalar_type(), " on ",
                  p.device(), " of shape ", p.sizes(),
                  ", but DistributedDataParallel was built for it ", master_dtypes_[i], " on ",
                  device, " of shape ", view.sizes(),
                  " (rank ", rank_, "): after wrapping, its gradients would no longer be averaged. "
                  "Convert or move the module before wrapping it.");
  }
}

}  // namespace fastddp
