#include "step_cost.h"

#include <atomic>

namespace fastddp::cost {
namespace {
std::array<std::atomic<int64_t>, kKinds> counters{};
}  // namespace

const char* name(Kind kind) {
  static constexpr const char* kNames[kKinds] = {
      "copy_in_bytes", "hook_bytes", "write_back_bytes", "check_bytes", "state_copy_bytes",
      "host_syncs", "kept_grad_copy_bytes"};
  return kNames[kind];
}

void add(Kind kind, int64_t amount) { counters[kind].fetch_add(amount, std::memory_order_relaxed); }

int64_t bytes(const std::vector<at::Tensor>& tensors) {
  int64_t total = 0;
  for (const at::Tensor& t : tensors) {
    if (t.defined()) total += static_cast<int64_t>(t.nbytes());
  }
  return total;
}

void host_sync(const at::Tensor& on) {
  if (on.defined() && !on.is_cpu()) add(kHostSync, 1);
}

Totals totals() {
  Totals out{};
  for (int k = 0; k < kKinds; ++k) out[k] = counters[k].load(std::memory_order_relaxed);
  return out;
}

}  // namespace fastddp::cost
