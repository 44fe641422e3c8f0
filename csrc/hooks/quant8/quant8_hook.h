// 8-bit gradient compression with float32 accumulation: the built-in hooks
// "int8" and "fp8" (option format = "e4m3" | "e5m2").
//
// Note [8-bit wire formats]
// Codes  Block-scaled: one float32 scale per block of kBlock = 256 values.
//        int8: symmetric, scale = absmax / 127, code = round-half-even(x /
//        scale) clamped to [-127, 127] (-128 is never used, so the format is
//        symmetric). fp8: scale = absmax / 448 (e4m3fn) or / 57344 (e5m2),
//        code = c10's Float8_e4m3fn / Float8_e5m2 rounding of x / scale
//        clamped to +-max (the clamp only matters when the scale itself was
//        rounded down, e.g. a subnormal absmax). value = float(code) * scale.
//        A zero block has scale 0 and codes 0 (exact zeros back); a block
//        holding a NaN or an infinity has scale NaN and codes 0, so every
//        value of it dequantizes to NaN: non-finite gradients stay visible
//        (check_for_nan_in_grad, users), never turn into finite junk.
// Block  256: the scale costs 4/256 = 1.6% over the 1-byte codes (so the wire
//        is 0.254x float32, 0.508x bf16); an outlier spoils the resolution of
//        256 neighbours only; 256 is one CUDA thread block with one value per
//        thread, and a multiple of every SIMD width.
// Wire   The bucket (float32 only) is zero-padded to a multiple of world_size
//        * 256 and split in world_size shards of S values; a shard is packed
//        as one uint8 buffer [S codes | S/256 float32 scales], so each step is
//        ONE alltoall and ONE allgather of world_size * (S + S/64) bytes.
// Step   copy_in   staging (float32) = grad * 1/world_size [+ residual].
//        run       start: quantize the staging buffer shard by shard into the
//                  wire buffer (error feedback: the quantization error
//                  becomes each parameter's residual), alltoall.
//                  finish (Note [shard-sum hooks]: one bucket later, on the
//                  side stream): dequantize the world_size received shards
//                  and sum them in float32 in rank order, re-quantize the sum,
//                  allgather it into the wire buffer.
//        write_back dequantize the gathered shards into the bucket and copy
//                  them into the grads.
// error_feedback (on by default) keeps per parameter the float32 error
//        input - dequantize(quantize(input)) of the first quantization and adds
//        it to the next step's scaled gradient; keyed by parameter index, so it
//        survives the bucket rebuild; a parameter without a gradient this step
//        keeps its residual; they are the hook's step_state (Note [a bad
//        step leaves no trace]). The staging buffer's padding and the gaps
//        between aligned slots are zeroed before each quantization: a block
//        holding a NaN quantizes to NaN throughout, and those places are
//        written by no copy-in.
//        The second quantization's error is not fed back (it is shared by all
//        ranks and would need a second residual per shard).
#pragma once

#include <ATen/Tensor.h>
#include <c10/util/intrusive_ptr.h>

#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "../../core/quant8_codes.h"
#include "../common/shard_sum_hook.h"

namespace c10d {
class ProcessGroup;
}  // namespace c10d

namespace fastddp {

struct Quant8Options {
  Quant8Format format = Quant8Format::kInt8;
  bool error_feedback = true;
};

class Quant8Hook : public ShardSumHook {
 public:
  static constexpr int64_t kBlock = 256;

  Quant8Hook(c10::intrusive_ptr<c10d::ProcessGroup> group, Quant8Options options);

  std::string name() const override;
  void on_new_buckets(const std::vector<Bucket>& buckets) override;
  void copy_in(Bucket& bucket, size_t slot, const at::Tensor& grad) override;
  void write_back(Bucket& bucket, const c10::IValue& result,
                  std::vector<at::Tensor>& dsts) override;
  int64_t wire_bytes(const Bucket& bucket) const override;

  const Quant8Options& options() const { return options_; }
  bool has_residuals() const override { return options_.error_feedback; }

 protected:
  std::shared_ptr<Stage> start(Bucket& bucket, size_t index, bool is_last,
                               c10::intrusive_ptr<c10::ivalue::Future>& done) override;
  // Its buffers are a BucketState's: the only ones start() exchanges.
  void sum_shards(ShardBuffers& buffers) override;

 private:
  // wire and recv: uint8, world * shard_bytes; reduced: uint8, shard_bytes.
  struct BucketState : ShardBuffers {
    int64_t shard = 0;        // S: values per shard, a multiple of kBlock
    int64_t shard_bytes = 0;  // S codes + S / kBlock float32 scales
    at::Tensor staging;       // float32, world * S: the scaled grads, then their error
    std::vector<char> has_grad;  // per slot: copy_in got a gradient this step
    // The staging places no slot covers (padding, gaps between aligned slots),
    // zeroed before each quantization; undefined when there are none.
    at::Tensor uncovered;
  };

  std::shared_ptr<BucketState>& state_for(const Bucket& bucket);
  // Codes and scales of packed shard `r` of a wire-layout buffer.
  at::Tensor codes_of(const at::Tensor& packed, int64_t r, const BucketState& s) const;
  at::Tensor scales_of(const at::Tensor& packed, int64_t r, const BucketState& s) const;
  int64_t padded_numel(int64_t numel) const;

  Quant8Options options_;
  // Keyed by Bucket::id: the reducer may move Bucket objects, and with
  // lazy_bucket_allocation each backward has new flat buffers.
  std::unordered_map<uint64_t, std::shared_ptr<BucketState>> states_;
};

}  // namespace fastddp
