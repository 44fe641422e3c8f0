// What the reducer tells of its last synchronized backward (Reducer::comm_stats,
// the DDP logger's figures): per bucket its bytes and timings, and the step's
// exposed time, collectives and counted cost. Plain data, read by the device
// timeline and the bindings alike.
#pragma once

#include <cstdint>
#include <vector>

#include "../util/step_cost.h"

namespace fastddp {

// Timings of one bucket in the last synchronized backward, in microseconds
// since that backward's first gradient.
struct BucketTiming {
  double ready_us = 0;     // its last gradient was copied in
  double launched_us = 0;  // the comm hook's run() returned
  double done_us = 0;      // its future was waited on and the grads written
};

struct CommStats {
  int64_t steps = 0;  // synchronized backward passes
  // On a device (a GPU), timings, exposed_us, backward_start_ns and the totals
  // are those of the latest timed backward the device has finished, from CUDA
  // events read without a wait (Note [device timeline]); on the host's clock
  // those of the last synchronized backward.
  bool device_clock = false;
  // The iteration (synchronized forwards counted, Reducer::num_iterations) of
  // the backward the timings are from; 0: none yet (a device whose first
  // timed backward has not finished).
  int64_t timed_iteration = 0;
  std::vector<int64_t> bucket_bytes;
  std::vector<int64_t> wire_bytes;
  std::vector<BucketTiming> timings;
  std::vector<bool> skipped;  // last step: not reduced (Note [skipping unused buckets])
  int64_t backward_start_ns = 0;  // its first gradient, steady clock (CLOCK_MONOTONIC)
  double exposed_us = 0;        // its last gradient ready -> grads final
  double total_exposed_us = 0;  // over timed_steps steps
  int64_t timed_steps = 0;      // host clock: every step; device: the timed ones read
  // Last step: the collectives issued on the group from the end of its forward
  // to the end of its backward, counted by c10d itself (the group's sequence
  // number, not our own bookkeeping); -1 where the backend keeps no count.
  int64_t collectives = -1;
  // Last step: what the reducer and its hook moved outside the collectives,
  // counted (Note [counted cost], step_cost.h).
  cost::Totals cost{};
};

}  // namespace fastddp
