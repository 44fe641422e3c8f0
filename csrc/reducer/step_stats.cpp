// The step's figures on the host's clock, and the device timeline behind them.
#include "step_stats.h"

#include <c10/core/impl/VirtualGuardImpl.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <algorithm>
#include <utility>

#include "../util/message.h"
#include "reducer.h"

namespace fastddp {

DeviceTimeline::DeviceTimeline(const c10::Device& device)
    : device_(device), active_(!device.is_cpu() && !device.is_meta()) {}

void DeviceTimeline::set_sample_rate(int64_t rate) {
  FASTDDP_CHECK_VALUE(rate >= 1,
                      "DDP runtime logging sample rate should be equal or greater than 1");
  sample_rate_ = rate;
}

bool DeviceTimeline::timed(int64_t iteration) const {
  // torch's Reducer::should_collect_runtime_stats.
  return every_step_ || (iteration > 0 && (iteration <= 10 || iteration % sample_rate_ == 0));
}

std::unique_ptr<c10::Event> DeviceTimeline::make_event() const {
  // BACKEND_DEFAULT: timing enabled (torch's default event disables it).
  return std::make_unique<c10::Event>(device_.type(), c10::EventFlag::BACKEND_DEFAULT);
}

void DeviceTimeline::record(c10::Event& event) const {
  const c10::impl::VirtualGuardImpl impl(device_.type());
  event.record(impl.getStream(device_));
}

void DeviceTimeline::resize(size_t buckets) {
  if (!active_) return;
  buckets_ = buckets;
  // Events of the old layout may still be pending: dropping them is safe (an
  // event destroyed before it completes is released when it does).
  recording_.reset();
  in_flight_.clear();
  spare_.clear();
  latest_.reset();
}

std::unique_ptr<DeviceTimeline::Slot> DeviceTimeline::take_slot() {
  std::unique_ptr<Slot> slot;
  if (!spare_.empty()) {
    slot = std::move(spare_.back());
    spare_.pop_back();
  } else if (in_flight_.size() >= kMaxInFlight) {
    // The device is that far behind: the oldest unread backward's figures go
    // (re-recording an event that has not completed is allowed; it then
    // stands for the new point only).
    slot = std::move(in_flight_.front());
    in_flight_.pop_front();
  } else {
    slot = std::make_unique<Slot>();
    slot->start = make_event();
    slot->end = make_event();
    for (size_t i = 0; i < 3 * buckets_; ++i) slot->points.push_back(make_event());
  }
  slot->marked.assign(3 * buckets_, false);
  return slot;
}

void DeviceTimeline::mark_start(int64_t iteration, int64_t host_start_ns) {
  if (!active_) return;
  harvest();
  // A backward that never reached mark_end (it failed) left its slot here.
  if (recording_) spare_.push_back(std::move(recording_));
  if (!timed(iteration)) return;
  recording_ = take_slot();
  recording_->iteration = iteration;
  recording_->host_start_ns = host_start_ns;
  record(*recording_->start);
}

void DeviceTimeline::mark(size_t bucket, Point point) {
  if (!recording_) return;
  const size_t i = 3 * bucket + static_cast<size_t>(point);
  if (i >= recording_->points.size()) return;
  record(*recording_->points[i]);
  recording_->marked[i] = true;
}

void DeviceTimeline::mark_end() {
  if (!recording_) return;
  record(*recording_->end);
  in_flight_.push_back(std::move(recording_));
}

bool DeviceTimeline::finished(const Slot& slot) const {
  // c10::Event::query is cudaEventQuery: it returns at once. All the events
  // are on the compute stream as a rule, so once the end event has completed
  // the others have; they are asked too in case a point ran on another stream.
  if (!slot.end->query()) return false;
  for (size_t i = 0; i < slot.points.size(); ++i) {
    if (slot.marked[i] && !slot.points[i]->query()) return false;
  }
  return true;
}

DeviceTimeline::Figures DeviceTimeline::figures_of(const Slot& slot) const {
  Figures f;
  f.iteration = slot.iteration;
  f.backward_start_ns = slot.host_start_ns;
  const size_t buckets = slot.points.size() / 3;
  f.timings.assign(buckets, BucketTiming{});
  // elapsedTime of two completed events reads their timestamps: no wait.
  auto since_start = [&](size_t i) {
    return slot.marked[i] ? slot.start->elapsedTime(*slot.points[i]) * 1e3 : 0.0;
  };
  double last_ready = 0;
  for (size_t b = 0; b < buckets; ++b) {
    f.timings[b].ready_us = since_start(3 * b + kReady);
    f.timings[b].launched_us = since_start(3 * b + kLaunched);
    f.timings[b].done_us = since_start(3 * b + kDone);
    last_ready = std::max(last_ready, f.timings[b].ready_us);
  }
  f.exposed_us = std::max(0.0, slot.start->elapsedTime(*slot.end) * 1e3 - last_ready);
  return f;
}

void DeviceTimeline::harvest() {
  if (!active_) return;
  // Oldest first: the compute stream runs them in that order.
  while (!in_flight_.empty() && finished(*in_flight_.front())) {
    latest_ = figures_of(*in_flight_.front());
    total_exposed_us_ += latest_->exposed_us;
    ++timed_steps_;
    spare_.push_back(std::move(in_flight_.front()));
    in_flight_.pop_front();
  }
}

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

std::string Reducer::last_error() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return stats_.last_error();
}

CommStats Reducer::comm_stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  CommStats stats = stats_.read();  // never waits for the device (Note [device timeline])
  for (const Bucket& bucket : buckets_) {
    stats.bucket_bytes.push_back(bucket.bytes());
    stats.wire_bytes.push_back(hook_->wire_bytes(bucket));
  }
  return stats;
}

void Reducer::set_timing_sample_rate(int64_t rate) {
  std::lock_guard<std::mutex> lock(mutex_);
  stats_.set_sample_rate(rate);
}

void Reducer::set_time_every_step(bool on) {
  std::lock_guard<std::mutex> lock(mutex_);
  stats_.set_time_every_step(on);
}

}  // namespace fastddp
