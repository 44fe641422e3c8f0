// The figures of each synchronized backward (Reducer::comm_stats and torch's
// logging data): when each bucket became ready, was launched and was done, on
// the host's clock and, on a GPU, on the device's (DeviceTimeline, Note
// [device timeline]); the step's collectives as c10d counts them; its counted
// cost (Note [counted cost]); and the last error. The reducer reports at the
// step's named points: begin_step, backward_started, bucket_ready,
// bucket_launched, bucket_done, end_step.
#pragma once

#include <c10/core/Device.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "comm_stats.h"
#include "../util/step_cost.h"

namespace c10d {
class ProcessGroup;
}  // namespace c10d

namespace fastddp {

class DeviceTimeline;

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
