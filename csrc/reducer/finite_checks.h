// The step's finiteness checks: check_for_nan_in_grad's guard over the
// gradients copied in (Note [non-finite guard]), and the check of the averaged
// gradients the write-backs produced (Note [a bad step leaves no trace]), which
// a hook with state settles by and the tuner reads (set_track_finite).
#pragma once

#include <ATen/Tensor.h>

#include <cstddef>
#include <memory>
#include <optional>
#include <vector>

namespace fastddp {

class NonFiniteGuard;

class FiniteChecks {
 public:
  FiniteChecks();
  // `guard`: check_for_nan_in_grad, among `world_size` ranks over `num_params`.
  FiniteChecks(bool guard, int rank, int world_size, size_t num_params);
  FiniteChecks(FiniteChecks&&) noexcept;
  FiniteChecks& operator=(FiniteChecks&&) noexcept;
  ~FiniteChecks();

  // check_for_nan_in_grad's guard, nullptr without it.
  NonFiniteGuard* guard() const { return guard_.get(); }
  // The guard found a non-finite gradient: the failing step tells the hook.
  void note_guard_failed() { guard_failed_ = true; }
  bool take_guard_failed();

  // A new synchronized backward: nothing collected, nothing found yet.
  void begin_step();
  // The write-back's averaged gradients, checked at the end of the step when
  // someone reads the result: the tuner, or a hook that settles its state.
  void collect(const std::vector<at::Tensor>& reduced, bool hook_settles);
  // The end of the step: a 0-dim bool, all collected gradients finite
  // (undefined: nothing was collected). No host sync.
  at::Tensor check();
  // A failed step: the collected gradients are dropped unchecked.
  void drop() { reduced_.clear(); }

  // Whether each step's check is kept for last_step_finite(), and its result:
  // nullopt when off or no step finished since. Reading it waits for the device.
  void set_tracking(bool on);
  std::optional<bool> last_step_finite() const;

 private:
  std::unique_ptr<NonFiniteGuard> guard_;  // check_for_nan_in_grad only
  bool guard_failed_ = false;  // the failing step was non-finite: after_step(false)
  std::vector<at::Tensor> reduced_;  // this step's averaged gradients
  bool track_ = false;
  at::Tensor last_;  // 0-dim bool, the last step's check (tracking only)
};

}  // namespace fastddp
