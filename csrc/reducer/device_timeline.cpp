#include "device_timeline.h"

#include <c10/core/impl/VirtualGuardImpl.h>

#include <algorithm>
#include <utility>

#include "../util/message.h"

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

}  // namespace fastddp
