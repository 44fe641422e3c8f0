// The step's figures on the host's clock, and the device timeline behind them.
#include "step_stats.h"

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <algorithm>

#include "device_timeline.h"

namespace fastddp {

StepStats::StepStats() = default;
StepStats::StepStats(StepStats&&) noexcept = default;
StepStats& StepStats::operator=(StepStats&&) noexcept = default;
StepStats::~StepStats() = default;

StepStats::StepStats(c10d::ProcessGroup& group, const c10::Device& device)
    : timeline_(std::make_unique<DeviceTimeline>(device)) {
  try {  // gloo and NCCL keep the count; a backend without one raises
    (void)group.getSequenceNumberForGroup();
    counts_collectives_ = true;
  } catch (const std::exception&) {
    counts_collectives_ = false;
  }
}

void StepStats::resize(size_t buckets) {
  stats_.timings.assign(buckets, BucketTiming{});
  timeline_->resize(buckets);
}

int64_t StepStats::collective_count(c10d::ProcessGroup& group) const {
  if (!counts_collectives_) return -1;
  return static_cast<int64_t>(group.getSequenceNumberForGroup());
}

void StepStats::begin_step(c10d::ProcessGroup& group) {
  started_ = false;
  cost_at_start_ = cost::totals();
  collectives_at_start_ = collective_count(group);
}

bool StepStats::backward_started(int64_t iteration) {
  if (started_) return false;
  started_ = true;
  backward_start_ = std::chrono::steady_clock::now();
  backward_iteration_ = iteration;
  timeline_->mark_start(iteration, std::chrono::duration_cast<std::chrono::nanoseconds>(
                                       backward_start_.time_since_epoch())
                                       .count());
  return true;
}

double StepStats::elapsed_us() const {
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() -
                                                   backward_start_)
      .count();
}

void StepStats::bucket_ready(size_t b) {
  timeline_->mark(b, DeviceTimeline::kReady);
  last_ready_us_ = elapsed_us();
  if (b < stats_.timings.size()) stats_.timings[b].ready_us = last_ready_us_;
}

void StepStats::bucket_launched(size_t b) {
  stats_.timings[b].launched_us = elapsed_us();
  timeline_->mark(b, DeviceTimeline::kLaunched);
}

void StepStats::bucket_done(size_t b) {
  stats_.timings[b].done_us = elapsed_us();
  timeline_->mark(b, DeviceTimeline::kDone);
}

void StepStats::end_step(c10d::ProcessGroup& group, const std::vector<bool>& skipped) {
  timeline_->mark_end();
  ++stats_.steps;
  stats_.skipped = skipped;
  stats_.backward_start_ns = std::chrono::duration_cast<std::chrono::nanoseconds>(
                                 backward_start_.time_since_epoch())
                                 .count();
  stats_.exposed_us = std::max(0.0, elapsed_us() - last_ready_us_);
  stats_.total_exposed_us += stats_.exposed_us;
  stats_.collectives =
      counts_collectives_ ? collective_count(group) - collectives_at_start_ : -1;
  const cost::Totals now = cost::totals();
  for (int k = 0; k < cost::kKinds; ++k) stats_.cost[k] = now[k] - cost_at_start_[k];
}

CommStats StepStats::read() {
  CommStats stats = stats_;
  stats.timed_iteration = stats.steps > 0 ? backward_iteration_ : 0;
  stats.timed_steps = stats.steps;
  if (!timeline_->active()) return stats;
  // On a GPU the device's clock: the latest timed backward that has finished
  // there, found with event queries (Note [device timeline]).
  timeline_->harvest();
  stats.device_clock = true;
  const std::optional<DeviceTimeline::Figures>& latest = timeline_->latest();
  stats.timed_iteration = latest ? latest->iteration : 0;
  stats.timings = latest ? latest->timings : std::vector<BucketTiming>(stats_.timings.size());
  stats.exposed_us = latest ? latest->exposed_us : 0.0;
  stats.backward_start_ns = latest ? latest->backward_start_ns : 0;
  stats.total_exposed_us = timeline_->total_exposed_us();
  stats.timed_steps = timeline_->timed_steps();
  return stats;
}

void StepStats::set_sample_rate(int64_t rate) { timeline_->set_sample_rate(rate); }

void StepStats::set_time_every_step(bool on) { timeline_->set_time_every_step(on); }

}  // namespace fastddp
