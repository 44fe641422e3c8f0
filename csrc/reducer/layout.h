// The bucket layout (its planner is csrc/core/bucket_plan.h; the reducer's side
// is layout.cpp): the order in which gradients become ready, recorded once, for
// the one bucket rebuild after the first iteration (Reducer::rebuild_buckets,
// plan_buckets_from_ready_order), and per backward, for introspection
// (last_ready_order).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace fastddp {

class ReadyOrder {
 public:
  // The rebuild is done: nothing more is recorded for it.
  bool rebuilt() const { return rebuilt_; }
  void note_rebuilt() {
    order_.clear();
    rebuilt_ = true;
  }
  // For the rebuild: parameter `index` became ready.
  void record(size_t index) { order_.push_back(index); }
  // join(): a rank without data before its first backward records parameter
  // order, so that the rebuild happens on it too (rank 0's plan wins).
  void record_default(size_t num_params) {
    if (!order_.empty()) return;
    for (size_t i = 0; i < num_params; ++i) order_.push_back(i);
  }
  const std::vector<size_t>& recorded() const { return order_; }

  // Per backward: the hooks' order, for last_ready_order().
  void begin_step() { last_.clear(); }
  void note_hook(size_t index) { last_.push_back(static_cast<int64_t>(index)); }
  const std::vector<int64_t>& last() const { return last_; }

 private:
  std::vector<size_t> order_;  // for the rebuild
  bool rebuilt_ = false;
  std::vector<int64_t> last_;  // the last backward's
};

}  // namespace fastddp
