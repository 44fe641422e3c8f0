// Device-side times of one backward's buckets (CUDA events), for comm_stats().
//
// On a GPU the host's clock only says when work was enqueued: with NCCL a
// future's wait() returns once the stream wait is queued, so host "done" and
// "exposed" times measure launch latency. Events recorded on the compute
// stream at the same points (first gradient, bucket ready, hook launched,
// bucket's result waited for, grads final) give the device's times instead.
// Recording costs no host sync; reading (comm_stats(), between steps) waits
// for the step's last event.
#pragma once

#include <c10/core/Device.h>
#include <c10/core/Event.h>

#include <memory>
#include <vector>

#include "reducer.h"

namespace fastddp {

class DeviceTimeline {
 public:
  enum Point { kReady = 0, kLaunched = 1, kDone = 2 };

  // Inactive (every call a no-op) for CPU devices.
  explicit DeviceTimeline(const c10::Device& device);
  bool active() const { return active_; }

  void resize(size_t buckets);
  void mark_start();  // the backward's first gradient
  void mark(size_t bucket, Point point);
  void mark_end();  // grads final

  // The last completed backward's times in microseconds since its first
  // gradient, into timings (one per bucket) and exposed_us (last bucket
  // ready -> grads final). False when no backward completed since a resize.
  bool read(std::vector<BucketTiming>& timings, double& exposed_us) const;

  // Exposed time summed over the backwards whose events had completed when
  // the next one started (harvested then, with a query: never a wait), and
  // their count, for the mean. A backward the device had not finished by
  // then is left out rather than waited for.
  double total_exposed_us() const { return total_exposed_us_; }
  int64_t timed_steps() const { return timed_steps_; }

 private:
  std::unique_ptr<c10::Event> make_event() const;
  double exposed_since_start() const;  // the recorded backward's; its events complete
  void record(c10::Event& event) const;

  c10::Device device_;
  bool active_;
  bool complete_ = false;
  double total_exposed_us_ = 0;
  int64_t timed_steps_ = 0;
  std::unique_ptr<c10::Event> start_, end_;
  std::vector<std::unique_ptr<c10::Event>> events_;  // 3 per bucket, by Point
};

}  // namespace fastddp
