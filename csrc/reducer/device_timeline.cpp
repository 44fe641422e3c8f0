#include "device_timeline.h"

#include <c10/core/impl/VirtualGuardImpl.h>

#include <algorithm>

namespace fastddp {

DeviceTimeline::DeviceTimeline(const c10::Device& device)
    : device_(device), active_(!device.is_cpu() && !device.is_meta()) {}

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
  complete_ = false;
  events_.clear();
  for (size_t i = 0; i < 3 * buckets; ++i) events_.push_back(make_event());
  start_ = make_event();
  end_ = make_event();
}

void DeviceTimeline::mark_start() {
  if (!active_ || !start_) return;
  if (complete_ && end_->query()) {  // the last backward is done on the device
    total_exposed_us_ += exposed_since_start();
    ++timed_steps_;
  }
  complete_ = false;
  record(*start_);
}

void DeviceTimeline::mark(size_t bucket, Point point) {
  const size_t i = 3 * bucket + static_cast<size_t>(point);
  if (!active_ || i >= events_.size()) return;
  record(*events_[i]);
}

void DeviceTimeline::mark_end() {
  if (!active_ || !end_) return;
  record(*end_);
  complete_ = true;
}

double DeviceTimeline::exposed_since_start() const {
  double last_ready = 0;
  for (size_t i = kReady; i < events_.size(); i += 3) {
    last_ready = std::max(last_ready, start_->elapsedTime(*events_[i]) * 1e3);
  }
  return std::max(0.0, start_->elapsedTime(*end_) * 1e3 - last_ready);
}

bool DeviceTimeline::read(std::vector<BucketTiming>& timings, double& exposed_us) const {
  if (!active_ || !complete_) return false;
  end_->synchronize();  // comm_stats() runs between steps, not on the step path
  const size_t buckets = events_.size() / 3;
  timings.assign(buckets, BucketTiming{});
  auto since_start = [this](const c10::Event& e) { return start_->elapsedTime(e) * 1e3; };
  for (size_t b = 0; b < buckets; ++b) {
    timings[b].ready_us = since_start(*events_[3 * b + kReady]);
    timings[b].launched_us = since_start(*events_[3 * b + kLaunched]);
    timings[b].done_us = since_start(*events_[3 * b + kDone]);
  }
  exposed_us = exposed_since_start();
  return true;
}

}  // namespace fastddp
