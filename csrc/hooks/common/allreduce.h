// The default reduction, torch DDP's own: the copy-in divides by the world
// size in the same pass (at::mul_out, as torch's reducer does), then one
// allreduce(SUM) of the bucket in place.
#pragma once

#include <c10/util/intrusive_ptr.h>

#include "../../reducer/comm_hook.h"

namespace c10d {
class ProcessGroup;
}

namespace fastddp {

class AllreduceHook : public CommHook {
 public:
  explicit AllreduceHook(c10::intrusive_ptr<c10d::ProcessGroup> group);

  std::string name() const override { return "allreduce"; }
  void copy_in(Bucket& bucket, size_t slot, const at::Tensor& grad) override;
  c10::intrusive_ptr<c10::ivalue::Future> run(Bucket& bucket, size_t index,
                                              bool is_last) override;
  // join(divide_by_initial_world_size=False): divide by the ranks still training.
  void set_divisors(StepDivisors divisors) override { divide_by(divisors.requested); }
  bool supports_sparse() const override { return true; }  // gloo's sparse allreduce

 private:
  void divide_by(int64_t factor);

  c10::intrusive_ptr<c10d::ProcessGroup> group_;
  int64_t factor_ = 0;
  at::Tensor inverse_;  // wrapped-number scalar 1/factor, as torch's reducer uses
};

}  // namespace fastddp
