// Settling a double-buffered hook state (Note [double-buffered step state],
// reducer/comm_hook.h): the helpers every such hook shares.
//
// A hook keeps each state tensor twice: the state it reads (live) and a spare
// that the step writes. At the end of the step, on the CPU the host knows
// whether the step stands, and swaps live and spare only then: nothing is
// copied either way. On a device the host must not wait for that answer, so it
// swaps always, and put_back_unless() copies the old state back (from the
// spare it now is) in a launch that returns at once when the step stands.
#pragma once

#include <ATen/Tensor.h>

#include <functional>
#include <utility>
#include <vector>

namespace fastddp {

// A state tensor this step replaced: `live` (what the step read) and `spare`
// (what it wrote). `made` (or an undefined live): the step made it, nothing
// was read.
struct Spare {
  at::Tensor* live;
  at::Tensor* spare;
  bool made = false;
};

// The state a step read, asked for only when needed (made on request: the
// lists cost ops the common step need not pay): with `witness` false every
// state tensor as the step found it; with `witness` true a smaller set that
// is not all finite whenever that state was not (possibly empty: nothing can
// have been non-finite).
using StateRead = std::function<std::vector<at::Tensor>(bool witness)>;

// Settles a step: keeps its state (each live swapped with its spare) where
// `finite` is undefined or true, or where the state read was already not all
// finite (reducer/finite_checks.h); else the state the step read stands (a
// tensor it made: zeros on a device). On the CPU the state read is asked for
// only after a non-finite step. On a device the host swaps always and
// put_back_unless() restores; the witness stands for the state read there,
// asked for and read every step.
// Returns the choice, a 0-dim bool on the state's device.
at::Tensor settle_spares(const std::vector<Spare>& written, const at::Tensor& finite,
                         const StateRead& state_read);

// Where the 0-dim bool `keep` (on the tensors' device) is false: each pair's
// first tensor takes the second's values (an undefined second: zeros). On the
// CPU a branch; on CUDA one launch per pair, on the current stream, that
// reads `keep` there and does nothing when it is true.
void put_back_unless(const std::vector<std::pair<at::Tensor, at::Tensor>>& pairs,
                     const at::Tensor& keep);

// Whether settling takes the device path (swap always, then put_back_unless)
// for CPU tensors too: the tests run that path where there is no GPU.
bool settle_as_on_device();
void set_settle_as_on_device(bool on);

}  // namespace fastddp
