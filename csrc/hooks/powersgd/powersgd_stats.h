// torch's PowerSGD compression statistics (PowerSGDState's running totals
// and _report_compression_stats), and the bytes of the last compressed step.
// Not thread-safe: the owning hook holds its lock around every call.
#pragma once

#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

namespace fastddp {

// One compression-statistics log line, as torch's hook would log it.
struct PowerSGDStatsReport {
  int64_t iter, numel_before, numel_after;
};

class PowerSGDStats {
 public:
  explicit PowerSGDStats(int64_t logging_frequency) : frequency_(logging_frequency) {}

  // One compressed bucket: torch's element counts and the bytes in / on the
  // wire. On the step's last bucket, closes the step's byte count and, by
  // torch's rule (iter: the counter before this step's increment), queues a
  // report every `logging_frequency` steps.
  void add_bucket(int64_t numel_before, int64_t numel_after, int64_t bytes_in, int64_t bytes_out,
                  size_t index, bool is_last, int64_t iter);

  // torch's PowerSGDState.compression_stats(): (rate, numel before, numel after).
  std::vector<double> compression_stats() const;
  std::pair<int64_t, int64_t> last_step_bytes() const { return last_step_bytes_; }
  std::vector<PowerSGDStatsReport> take_reports();

  // The part of a checkpoint: torch's totals and the next report's step.
  int64_t numel_before = 0, numel_after = 0, next_report = 0;

 private:
  int64_t frequency_;
  int64_t step_bytes_in_ = 0, step_bytes_out_ = 0;
  std::pair<int64_t, int64_t> last_step_bytes_{0, 0};
  std::vector<PowerSGDStatsReport> reports_;
};

}  // namespace fastddp
