// static_graph's bookkeeping (Note [static graph] in reducer.h): how often
// each parameter's hook fires, learned in the first synchronized backward,
// the hooks still to come in this one, and whether the first iteration's
// delayed reduction is queued. The reducer asks at its named points: a hook
// fired (count_hook in the first iteration, last_hook later), the step begins
// (begin_step), and which parameters the first iteration left unused.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace fastddp {

class StaticGraph {
 public:
  StaticGraph() = default;
  explicit StaticGraph(size_t num_params) : expected_(num_params, 0), left_(num_params, 0) {}

  // A new synchronized backward expects each hook as often as the first one.
  void begin_step() { left_ = expected_; }
  // The first iteration: parameter `index`'s hook fired once more.
  void count_hook(size_t index) { ++expected_[index]; }
  // A later iteration: whether this was parameter `index`'s last hook of the
  // backward. Raises, as torch does, for a hook the first iteration never saw.
  bool last_hook(size_t index, const std::string& name, int rank);
  // The parameters whose hooks did not fire in the first iteration.
  std::vector<size_t> unused() const;

  // The first iteration's delayed reduction: queued (it runs once), and
  // whether the first gradient hook queues it (no output sink to do it).
  bool delayed_queued() const { return delayed_queued_; }
  void mark_delayed_queued() { delayed_queued_ = true; }
  bool delay_from_first_hook() const { return delay_from_first_hook_; }
  void set_delay_from_first_hook(bool on) { delay_from_first_hook_ = on; }

 private:
  std::vector<int64_t> expected_;  // learned in the first iteration
  std::vector<int64_t> left_;      // this iteration
  bool delayed_queued_ = false;
  bool delay_from_first_hook_ = false;  // armed by prepare_for_backward: no sink
};

}  // namespace fastddp
