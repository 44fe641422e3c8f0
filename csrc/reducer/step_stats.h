// The figures of each synchronized backward (Reducer::comm_stats and torch's
// logging data): when each bucket became ready, was launched and was done, on
// the host's clock and, on a GPU, on the device's (DeviceTimeline, Note
// [device timeline]); the step's collectives as c10d counts them; its counted
// cost (Note [counted cost]); and the last error. The reducer reports at the
// step's named points: begin_step, backward_started, bucket_ready,
// bucket_launched, bucket_done, end_step.
//
// The figures themselves are plain data (CommStats), read by the bindings.
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

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "../util/step_cost.h"

namespace c10d {
class ProcessGroup;
}  // namespace c10d

namespace fastddp {

// Timings of one bucket in the last synchronized backward, in microseconds
// since that backward's first gradient.
struct BucketTiming {
  double ready_us = 0;     // its last gradient was copied in
  double launched_us = 0;  // the comm hook's run() returned
  double done_us = 0;      // its future was waited on and the grads written
};

struct CommStats {
  int64_t steps = 0;  // synchronized backward passes
  // On a device (a GPU), timings, exposed_us, backward_start_ns and the totals
  // are those of the latest timed backward the device has finished, from CUDA
  // events read without a wait (Note [device timeline]); on the host's clock
  // those of the last synchronized backward.
  bool device_clock = false;
  // The iteration (synchronized forwards counted, Reducer::num_iterations) of
  // the backward the timings are from; 0: none yet (a device whose first
  // timed backward has not finished).
  int64_t timed_iteration = 0;
  std::vector<int64_t> bucket_bytes;
  std::vector<int64_t> wire_bytes;
  std::vector<BucketTiming> timings;
  std::vector<bool> skipped;  // last step: not reduced (Note [skipping unused buckets])
  int64_t backward_start_ns = 0;  // its first gradient, steady clock (CLOCK_MONOTONIC)
  double exposed_us = 0;        // its last gradient ready -> grads final
  double total_exposed_us = 0;  // over timed_steps steps
  int64_t timed_steps = 0;      // host clock: every step; device: the timed ones read
  // Last step: the collectives issued on the group from the end of its forward
  // to the end of its backward, counted by c10d itself (the group's sequence
  // number, not our own bookkeeping); -1 where the backend keeps no count.
  int64_t collectives = -1;
  // Last step: what the reducer and its hook moved outside the collectives,
  // counted (Note [counted cost], step_cost.h).
  cost::Totals cost{};
};

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

class StepStats {
 public:
  StepStats();
  // `group` tells whether its backend counts collectives; `device` the
  // parameters' (a GPU's backwards are timed on its clock too).
  StepStats(c10d::ProcessGroup& group, const c10::Device& device);
  StepStats(StepStats&&) noexcept;
  StepStats& operator=(StepStats&&) noexcept;
  ~StepStats();

  // A new bucket layout of `buckets` buckets.
  void resize(size_t buckets);
  // A synchronized backward is armed: the cost and collectives from here on are its.
  void begin_step(c10d::ProcessGroup& group);
  // Its first gradient (once per backward; later calls do nothing and
  // return false).
  bool backward_started(int64_t iteration);
  void bucket_ready(size_t b);
  void bucket_launched(size_t b);
  void bucket_done(size_t b);
  // The grads are final; `skipped` per bucket (Note [skipping unused buckets]).
  void end_step(c10d::ProcessGroup& group, const std::vector<bool>& skipped);

  // Synchronized backwards completed.
  int64_t steps() const { return stats_.steps; }
  // The last step's figures, bucket sizes left to the caller. Never waits for
  // the device; reading its events is what advances the timeline.
  CommStats read();
  void set_sample_rate(int64_t rate);
  void set_time_every_step(bool on);

  void set_error(std::string error) { last_error_ = std::move(error); }
  const std::string& last_error() const { return last_error_; }

 private:
  double elapsed_us() const;
  int64_t collective_count(c10d::ProcessGroup& group) const;

  CommStats stats_;
  std::unique_ptr<DeviceTimeline> timeline_;  // the same points on the device's clock
  bool counts_collectives_ = false;
  int64_t collectives_at_start_ = 0;
  cost::Totals cost_at_start_{};  // the process's totals when this step's backward was armed
  bool started_ = false;          // a hook fired in this backward
  std::chrono::steady_clock::time_point backward_start_;
  int64_t backward_iteration_ = 0;  // the iteration of the last backward started
  double last_ready_us_ = 0;
  std::string last_error_;
};

}  // namespace fastddp
