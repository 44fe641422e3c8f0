// What a step costs outside the collectives, counted where the work is
// launched, never timed (issue 43 item 7).
//
// Note [counted cost]
// ~~~~~~~~~~~~~~~~~~~
// Every pass the reducer or a hook makes over gradient-sized memory, and
// every host synchronization on a device, adds its bytes (or 1) here, at the
// line that launches it, from the sizes it is given: the same numbers on a CPU
// and on a GPU, on a loaded machine and an idle one. The reducer reads the
// totals at the start and the end of each synchronized backward and reports
// the difference (Reducer::last_step_cost). Tests assert them against a
// budget written next to each with its reason, so a change that adds a pass
// over the gradients fails a test instead of being found from outside.
// Counting is one relaxed atomic add per bucket or tensor list, not per
// element. The totals are per process: with two fastddp models stepping at
// once, a step's figures include the other's.
#pragma once

#include <array>
#include <cstdint>
#include <vector>

#include <ATen/Tensor.h>

namespace fastddp::cost {

enum Kind : int {
  kCopyIn,     // gradients into the buckets: bytes read plus bytes written
  kHook,       // a hook's local passes (compression, products, decompression, error feedback)
  kWriteBack,  // the averaged gradients into .grad (or the optimizer's step)
  kCheck,      // the finiteness checks of Note [a bad step leaves no trace]
  kStateCopy,  // hook state copied for overflow safety (snapshot, put back, a spare's input)
  kHostSync,   // host waits for a device (0 on the CPU: there is nothing to wait for)
  // Handed-out gradients still held elsewhere after .grad dropped them, copied to memory
  // of their own (Note [gradients handed out]): bytes read plus bytes written.
  kKeptGradCopy,
  kKinds,
};

// The names Python sees, in Kind's order.
const char* name(Kind kind);

void add(Kind kind, int64_t amount);
// The bytes of every defined tensor.
int64_t bytes(const std::vector<at::Tensor>& tensors);
// add(kHostSync, 1) where `device` is not the CPU.
void host_sync(const at::Tensor& on);

using Totals = std::array<int64_t, kKinds>;
Totals totals();

}  // namespace fastddp::cost
