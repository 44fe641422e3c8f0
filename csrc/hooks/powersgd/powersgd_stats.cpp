#include "powersgd_stats.h"

namespace fastddp {

void PowerSGDStats::add_bucket(int64_t numel_before_bucket, int64_t numel_after_bucket,
                               int64_t bytes_in, int64_t bytes_out, size_t index, bool is_last,
                               int64_t iter) {
  numel_before += numel_before_bucket;
  numel_after += numel_after_bucket;
  if (index == 0) step_bytes_in_ = step_bytes_out_ = 0;
  step_bytes_in_ += bytes_in;
  step_bytes_out_ += bytes_out;
  if (!is_last) return;
  last_step_bytes_ = {step_bytes_in_, step_bytes_out_};
  if (iter >= next_report) {
    reports_.push_back({iter, numel_before, numel_after});
    next_report = iter + frequency_;
  }
}

std::vector<double> PowerSGDStats::compression_stats() const {
  const double rate = numel_after > 0 ? static_cast<double>(numel_before) / numel_after : 0.0;
  return {rate, static_cast<double>(numel_before), static_cast<double>(numel_after)};
}

std::vector<PowerSGDStatsReport> PowerSGDStats::take_reports() {
  std::vector<PowerSGDStatsReport> out;
  out.swap(reports_);
  return out;
}

}  // namespace fastddp
