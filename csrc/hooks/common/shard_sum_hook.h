// Base of the hooks that reduce a bucket as world_size shards of a compressed
// wire format, summed in float32: bf16/fp16 with accumulate="fp32"
// (half/half_compress.h) and int8/fp8 (quant8/quant8_hook.h).
//
// Note [shard-sum hooks]
// A bucket's wire buffer holds world_size equal shards in the hook's wire
// format (16-bit values; 8-bit codes with their block scales). Per bucket:
//   copy_in, start  the family compresses the gradients into `wire`, then
//                   start_exchange(): alltoall wire -> recv, so that recv
//                   holds every rank's copy of this rank's shard;
//   finish          (Note [pipelined hooks]: one bucket later, never from a
//                   callback) on the side stream (Note [hook streams]): waits
//                   for the alltoall; sum_shards(), the family's wire
//                   operation: recv's world_size shards, decompressed, summed
//                   in float32 in rank order and compressed once into
//                   `reduced`; allgather reduced -> wire; the bucket's future
//                   completes with `wire` once the allgather has;
//   write_back      the family decompresses `wire` into the grads.
// The same bytes cross the wire as in a ring allreduce of the format (2 (n-1)/n
// of the buffer), with one rounding of the sum instead of n-1. A failed
// collective is named with the format: "alltoall of the 16-bit shards failed:
// ...", "allgather of the summed 8-bit shards failed: ...".
// The class also holds what the two families share around the exchange: the
// group, the divide factor, the copy-in's checks of a gradient and the
// error-feedback residuals (per parameter), double-buffered (Note
// [double-buffered step state]): a step reads each residual and writes the
// new one into its spare, and settle_step() swaps them in when the step
// stands. On a device no residual is read to settle: from zeros, a residual
// turns non-finite only in a step whose wire value, and so whose averaged
// gradient, is non-finite, and such a step is put back.
#pragma once

#include <ATen/Tensor.h>
#include <c10/util/intrusive_ptr.h>

#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "pipelined_hook.h"

namespace c10d {
class ProcessGroup;
}  // namespace c10d

namespace fastddp {

class ShardSumHook : public PipelinedHook {
 public:
  // join(divide_by_initial_world_size=False): divide by the ranks still training.
  void set_divisors(StepDivisors divisors) override { divide_by(divisors.requested); }
  bool settles_own_state() const override { return has_residuals(); }
  at::Tensor settle_step(const at::Tensor& finite) override;
  void discard_step() override;

 protected:
  // One bucket's exchange buffers; a family's per-bucket state derives from it.
  struct ShardBuffers {
    virtual ~ShardBuffers() = default;
    at::Tensor wire;     // world_size shards: the alltoall's input, the allgather's output
    at::Tensor recv;     // world_size shards: the alltoall's output
    at::Tensor reduced;  // one shard: this rank's sum, the allgather's input
    // wire's view of each bucket slot, for hooks that keep them (made once:
    // a view per gradient per step is a dispatched op, host time).
    std::vector<at::Tensor> slots;
  };

  // `wire_format` names the shards in errors: "16-bit", "8-bit".
  ShardSumHook(c10::intrusive_ptr<c10d::ProcessGroup> group, const std::string& wire_format);
  // For the derived constructor's body, where name() is the hook's: raises
  // without a group, then divides by its size.
  void check_group();

  // Issues the alltoall of `buffers`' wire; finish() takes the stage.
  std::shared_ptr<Stage> start_exchange(std::shared_ptr<ShardBuffers> buffers);
  // recv's world_size shards -> reduced (the stage's own buffers, on the side stream).
  virtual void sum_shards(ShardBuffers& buffers) = 0;

  // What copy_in reads the gradient of `slot` from: `grad` itself when it is
  // laid out as the slot (always under gradient_as_bucket_view), else the
  // slot's view after a copy. Raises, naming the hook, for a sparse gradient
  // or one of another size or device.
  at::Tensor dense_source(Bucket& bucket, size_t slot, const at::Tensor& grad);
  // Parameter `param`'s error-feedback residual as the step reads it, zeros
  // when new or resized; and where the step writes its new one (after
  // residual_for: the same size).
  at::Tensor& residual_for(size_t param, const at::Tensor& like, int64_t numel);
  at::Tensor& new_residual_for(size_t param);
  // Whether the hook keeps residuals (error feedback).
  virtual bool has_residuals() const = 0;

  c10::intrusive_ptr<c10d::ProcessGroup> group_;
  int world_size_ = 0;
  int64_t divisor_ = 1;  // world size, or join's divide factor
  double scale_ = 1.0;   // 1 / divisor_

 private:
  void divide_by(int64_t factor);
  struct ExchangeStage;
  void finish(Stage& stage) final;

  std::string alltoall_what_;   // "alltoall of the <format> shards"
  std::string allgather_what_;  // "allgather of the summed <format> shards"
  struct Residual {
    at::Tensor live, spare;
    bool written = false;  // this step wrote spare
  };
  std::unordered_map<size_t, Residual> residuals_;  // by parameter index
};

}  // namespace fastddp
