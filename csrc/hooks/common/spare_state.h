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

#include <utility>
#include <vector>

namespace fastddp {

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
