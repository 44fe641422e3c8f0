// PowerSGD gradient compression (Vogels et al., 2019), numerically torch's
// `powerSGD_hook` with the same `PowerSGDState` arguments.
//
// Note [powersgd]
// Per step, for every bucket (torch's algorithm, step for step):
//   iter < start_iter: divide by the world size, one allreduce (torch's
//     vanilla phase); the iteration counter moves on the last bucket.
//   otherwise, on the bucket's flat gradient M (unscaled, as torch's hooks get it):
//     error feedback: M += error[bucket]; keep a copy of M;
//     each slot viewed as an (n, m) matrix (n = its first dimension) is
//       compressed when (n + m) r * min_compression_rate < n m, with
//       r = min(n, m, rank); the others are concatenated and allreduced as
//       one flat buffer, then divided by the world size;
//     matrices are grouped by (n, m) in order of first appearance (this order
//       lays out the P and Q memories and draws the random Q), and batched per
//       group when batch_tensors_with_same_shape;
//     Q: warm start reuses last step's (orthogonalized again); otherwise
//       randn on CPU from a generator seeded with numpy's
//       RandomState(random_seed).randint(1_000_000_000), one draw per bucket
//       initialization, in the order buckets are run; then orthogonalized;
//     P = M Q; allreduce P (a sum); orthogonalize P; Q = M^T P; allreduce Q;
//       Q /= world size; M = P Q^T in place;
//     error feedback: error[bucket] = copy - M.
// Orthogonalization is torch's: Gram-Schmidt (with epsilon) for r <= 2 or
// 16-bit dtypes, linalg.qr otherwise.
// State is keyed by bucket index, as torch's; the bucket rebuild drops it
// (torch requires start_iter > 1 with error feedback or warm start, so the
// rebuild after the first step comes before any state exists).
//
// Collectives are issued from run() only, never from a completion callback,
// so every rank issues them in the same order (gloo pairs collectives by
// issue order): run() issues the uncompressed and P allreduces, waits for P,
// computes Q and issues its allreduce; the decompression (local work only)
// runs in that allreduce's then() callback.
#pragma once

#include <ATen/Tensor.h>
#include <c10/util/intrusive_ptr.h>

#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "../core/numpy_random.h"
#include "../reducer/comm_hook.h"

namespace c10d {
class ProcessGroup;
}

namespace fastddp {

struct PowerSGDOptions {
  int64_t matrix_approximation_rank = 1;
  int64_t start_powerSGD_iter = 1000;
  double min_compression_rate = 2.0;
  bool use_error_feedback = true;
  bool warm_start = true;
  double orthogonalization_epsilon = 0.0;
  bool batch_tensors_with_same_shape = false;
  int64_t iter = 0;  // the step to start counting from (a resumed PowerSGDState's iter)
};

// torch's _orthogonalize on a batch of (n, r) matrices, in place.
void powersgd_orthogonalize(at::Tensor& matrices, double epsilon);

class PowerSGDHook : public CommHook {
 public:
  PowerSGDHook(c10::intrusive_ptr<c10d::ProcessGroup> group, PowerSGDOptions options,
               NumpyRandomState rng);

  std::string name() const override { return "powersgd"; }
  void on_new_buckets(const std::vector<Bucket>& buckets) override;
  c10::intrusive_ptr<c10::ivalue::Future> run(Bucket& bucket, size_t index,
                                              bool is_last) override;
  // The bucket's bytes before compression starts; then the uncompressed
  // slots plus the P and Q memories.
  int64_t wire_bytes(const Bucket& bucket) const override;

  int64_t iter() const { return iter_.load(); }
  // torch's PowerSGDState.compression_stats(): (rate, numel before, numel after).
  std::vector<double> compression_stats() const;

 private:
  struct BucketState {
    at::Tensor error;                // error feedback, the bucket's numel
    at::Tensor p_memory, q_memory;   // flat, all P (Q) matrices of the bucket
  };

  c10::intrusive_ptr<c10::ivalue::Future> run_compressed(Bucket& bucket, size_t index,
                                                         bool is_last);

  c10::intrusive_ptr<c10d::ProcessGroup> group_;
  PowerSGDOptions options_;
  NumpyRandomState rng_;
  int world_size_;
  std::atomic<int64_t> iter_;
  // Guards states_ and the statistics: decompression callbacks run on the
  // process group's threads while run() goes on with the next bucket.
  mutable std::mutex mutex_;
  std::map<size_t, std::shared_ptr<BucketState>> states_;
  int64_t numel_before_ = 0, numel_after_ = 0;
};

}  // namespace fastddp
