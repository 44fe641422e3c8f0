// An optimizer stepped by the reducer, bucket by bucket, as soon as each
// bucket's averaged gradients are written (DistributedDataParallel's
// overlap_optimizer and _register_fused_optim).
//
// Note [overlapped optimizer]
// The reducer finishes a bucket (waits for its future, writes the averaged
// gradients into param.grad) and hands that bucket's parameters to the step
// at once, so the step of the first buckets overlaps the reduction of the
// later ones. On the CPU the reducer also finishes, during backward, every
// bucket whose reduction has already completed when a later bucket is
// launched (Future::completed() polls, it never blocks), so the step overlaps
// the rest of backward's compute too. On an accelerator it does not: a
// completed future there only means the collective is enqueued, and writing
// its result would make the compute stream wait for the communication before
// backward ends; there the steps are enqueued in the end-of-backward callback,
// bucket after bucket, each after its own reduction only.
//
// A step sees param.grad exactly as optimizer.step() would after torch DDP's
// backward (the averaged gradient, or the untouched .grad of a parameter
// unused on every rank), so restricting optimizer.step() to one bucket's
// parameters at a time gives torch's numbers: every torch.optim update is
// elementwise per parameter. Finishing early is off where the write-back must
// wait for the whole backward: find_unused_parameters and static_graph (the
// used-bitmap), check_for_nan_in_grad (nothing steps before the check).
#pragma once

#include <cstddef>
#include <vector>

namespace fastddp {

class OptimizerStep {
 public:
  virtual ~OptimizerStep() = default;
  // `params`: indices into the reducer's parameters, one bucket's, whose
  // .grad are final for this step.
  virtual void step_bucket(const std::vector<size_t>& params) = 0;
  // After the last bucket of a synchronized backward: step what no bucket
  // holds (parameters of the optimizer outside this model).
  virtual void end_of_backward() = 0;
};

}  // namespace fastddp
