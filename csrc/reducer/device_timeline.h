// Device-side times of sampled backwards' buckets (CUDA events), for comm_stats().
//
// Note [device timeline]
// On a GPU the host's clock only says when work was enqueued: with NCCL a
// future's wait() returns once the stream wait is queued, so host "done" and
// "exposed" times measure launch latency. Events recorded on the compute
// stream at the same points (first gradient, bucket ready, hook launched,
// bucket's result waited for, grads final) give the device's times instead.
//
// Which backwards: only those the DDP logger samples, as torch's reducer
// records its timer events only when should_collect_runtime_stats() holds:
// iterations 1 to 10, then every sample_rate-th (100 unless
// _set_ddp_runtime_logging_sample_rate changed it), where the iteration is the
// count of synchronized forwards (Reducer::num_iterations). Other backwards
// record no event at all. set_time_every_step() times every one while a
// caller needs each step's figures (the tuner, --advise).
//
// Reading never waits: a timed backward's events are looked at with a query
// (cudaEventQuery) when a later backward starts and when comm_stats() is
// called, and its figures are computed (cudaEventElapsedTime, which does not
// block on completed events) only once its last event has completed. Until
// then the figures of an earlier timed backward stand, so comm_stats()
// reports the latest timed backward the device has finished and names its
// iteration (Figures::iteration); on a busy GPU that is a step or more behind
// the host. At most kMaxInFlight timed backwards wait to be read: one more
// re-records the oldest one's events, whose figures are then lost (a host far
// ahead of its device loses samples, it never waits for them).
#pragma once

#include <c10/core/Device.h>
#include <c10/core/Event.h>

#include <deque>
#include <memory>
#include <optional>
#include <vector>

#include "comm_stats.h"

namespace fastddp {

class DeviceTimeline {
 public:
  enum Point { kReady = 0, kLaunched = 1, kDone = 2 };

  // One finished timed backward, in microseconds since its first gradient.
  struct Figures {
    int64_t iteration = 0;          // its synchronized forward's count
    int64_t backward_start_ns = 0;  // its first gradient on the host's steady clock
    std::vector<BucketTiming> timings;
    double exposed_us = 0;  // last bucket ready -> grads final
  };

  // Inactive (every call a no-op, nothing ever read) for CPU devices.
  explicit DeviceTimeline(const c10::Device& device);
  bool active() const { return active_; }

  // torch's kDDPRuntimeLoggingSampleRate by default; >= 1.
  void set_sample_rate(int64_t rate);
  void set_time_every_step(bool on) { every_step_ = on; }
  // Whether the backward of `iteration` records events (see the Note).
  bool timed(int64_t iteration) const;

  // A new bucket layout: drops the events and the figures of the old one.
  void resize(size_t buckets);
  // The backward of `iteration` starts (its first gradient, at host_start_ns).
  // Reads what finished; records the start event if the iteration is timed.
  void mark_start(int64_t iteration, int64_t host_start_ns);
  void mark(size_t bucket, Point point);
  void mark_end();  // grads final

  // Computes the figures of every timed backward whose events have completed
  // (a query each, never a wait).
  void harvest();
  // The latest finished timed backward's figures; nullopt before the first.
  const std::optional<Figures>& latest() const { return latest_; }
  // Exposed time summed over every timed backward read so far, and their count.
  double total_exposed_us() const { return total_exposed_us_; }
  int64_t timed_steps() const { return timed_steps_; }

 private:
  static constexpr size_t kMaxInFlight = 4;
  struct Slot {
    int64_t iteration = 0;
    int64_t host_start_ns = 0;
    std::unique_ptr<c10::Event> start, end;
    std::vector<std::unique_ptr<c10::Event>> points;  // 3 per bucket, by Point
    std::vector<bool> marked;  // points this backward recorded (a failed one stops early)
  };

  std::unique_ptr<Slot> take_slot();
  std::unique_ptr<c10::Event> make_event() const;
  void record(c10::Event& event) const;
  bool finished(const Slot& slot) const;
  Figures figures_of(const Slot& slot) const;

  c10::Device device_;
  bool active_;
  int64_t sample_rate_ = 100;
  bool every_step_ = false;
  size_t buckets_ = 0;
  std::unique_ptr<Slot> recording_;        // this backward's, until mark_end
  std::deque<std::unique_ptr<Slot>> in_flight_;  // recorded, not read yet; oldest first
  std::vector<std::unique_ptr<Slot>> spare_;    // read: their events are reused
  std::optional<Figures> latest_;
  double total_exposed_us_ = 0;
  int64_t timed_steps_ = 0;
};

}  // namespace fastddp
