// Bf16 / fp16 gradient compression: the built-in hooks "bf16" and "fp16".
//
// Note [half compression]
// copy_in   grad -> wire slice in one pass (the fp32 bucket is not touched on the
//           fast path): as torch's hooks for plain bf16/fp16 (Note [torch's half
//           rounding]); half(grad * 1/world_size [+ residual]), one rounding, for
//           accumulate="fp32" and error feedback, which torch has no hook for.
// run       accumulate="half": one allreduce of the 16-bit wire buffer; the
//           sums are done in 16-bit arithmetic by the backend.
//           accumulate="fp32": alltoall of 16-bit shards, a local float32 sum
//           of the world_size shards (rank order), one rounding, allgather of
//           the 16-bit result (Note [shard-sum hooks]): the same bytes on the
//           wire as a 16-bit ring allreduce (2 (n-1)/n of the buffer), one
//           rounding instead of n-1. The two collectives are a PipelinedHook's
//           (Note [pipelined hooks]): alltoall(i) ... alltoall(i+1),
//           allgather(i), never from a completion callback, and a step
//           abandoned after a failure is dropped, not finished, at the next
//           step. The shard sum runs on the side stream (Note [hook streams]).
// write_back the 16-bit result -> every grad in one fused pass (one launch on CUDA).
// error_feedback keeps, per parameter, the float32 rounding residual of its
//           compressed (scaled) gradient and adds it to the next step's; it
//           survives the bucket rebuild because it is keyed by parameter.
// If the backend has no 16-bit allreduce, accumulate="half" falls back to the
// float32-accumulation algorithm (same payload).
//
// Note [torch's half rounding]
// torch's fp16_compress_hook / bf16_compress_hook (default_hooks._compress_hook) run
// buffer.to(dtype).div_(world_size): the gradient is rounded to 16 bits, then divided
// in 16 bits, which ATen does in float and rounds again: float(a) / b on the CPU
// (div_true_kernel in cpu/BinaryOpsKernel.cpp), but float(a) * (1.0f / b) on CUDA,
// where a CPU scalar divisor becomes a multiply by its reciprocal
// (cuda/BinaryDivTrueKernel.cu). Two roundings differ from one rounding of
// grad / world_size in the last bit (at 3 ranks; at 2 where the result is a float16
// subnormal), so the plain hooks copy in with kernels::cast_divide_{cpu,cuda}, each
// as its device's ATen kernel, and fastddp's bf16()/fp16() give torch's bits (torch's
// own hooks run natively lose nothing). The two devices' roundings agree for every
// bfloat16 value and divisor below 5000, but not for float16 (at 14, 26, 28, 30, ...
// ranks some values differ; tests/python/hooks/test_kernels.py). The sums are the backend's
// 16-bit allreduce in both.
#pragma once

#include <ATen/Tensor.h>
#include <c10/util/intrusive_ptr.h>

#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "../../core/half_rounding.h"
#include "../common/shard_sum_hook.h"

namespace c10d {
class ProcessGroup;
}  // namespace c10d

namespace fastddp {

struct HalfCompressOptions {
  HalfKind kind = HalfKind::kBFloat16;
  bool fp32_accumulate = false;  // accumulate="fp32"
  bool error_feedback = false;
};

class HalfCompressHook : public ShardSumHook {
 public:
  HalfCompressHook(c10::intrusive_ptr<c10d::ProcessGroup> group, HalfCompressOptions options);

  std::string name() const override;
  void on_new_buckets(const std::vector<Bucket>& buckets) override;
  void copy_in(Bucket& bucket, size_t slot, const at::Tensor& grad) override;
  void write_back(Bucket& bucket, const c10::IValue& result,
                  std::vector<at::Tensor>& dsts) override;
  int64_t wire_bytes(const Bucket& bucket) const override;

  const HalfCompressOptions& options() const { return options_; }
  bool has_residuals() const override { return options_.error_feedback; }

 protected:
  // accumulate="half": the allreduce, no stage. accumulate="fp32": the
  // alltoall of the shard-sum exchange.
  std::shared_ptr<Stage> start(Bucket& bucket, size_t index, bool is_last,
                               c10::intrusive_ptr<c10::ivalue::Future>& done) override;
  void sum_shards(ShardBuffers& buffers) override;

 private:
  // The bucket's buffers: wire is 16-bit, the bucket's numel rounded up to a
  // multiple of world size; recv and reduced are made on first use, for
  // accumulate="fp32" only.
  std::shared_ptr<ShardBuffers>& state_for(const Bucket& bucket);

  HalfCompressOptions options_;
  bool half_allreduce_unsupported_ = false;
  // Keyed by Bucket::id: the reducer may move Bucket objects, and with
  // lazy_bucket_allocation each backward has new flat buffers.
  std::unordered_map<uint64_t, std::shared_ptr<ShardBuffers>> states_;
};

}  // namespace fastddp
