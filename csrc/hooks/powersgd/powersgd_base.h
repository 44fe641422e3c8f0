// What both PowerSGD hooks ("powersgd", "powersgd_batched") share: torch's
// PowerSGDState settings, its step counter and generator, the vanilla phase,
// the statistics, and the checkpoint's scalars. The hooks add their own
// bucket state (per matrix, or one square per bucket).
#pragma once

#include <ATen/Tensor.h>
#include <c10/util/intrusive_ptr.h>

#include <atomic>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "../../core/numpy_random.h"
#include "../common/pipelined_hook.h"
#include "powersgd_plan.h"
#include "powersgd_stats.h"

namespace c10d {
class ProcessGroup;
}

namespace fastddp {

// The hook's state apart from the bucket layout: what a checkpoint holds.
struct PowerSGDCheckpoint {
  int64_t iter = 0;
  std::string rng_state;  // numpy RandomState: "pos key0 ... key623"
  int64_t numel_before = 0, numel_after = 0;  // torch's running totals
  int64_t next_stats_report = 0;
  // By parameter index (the reducer's): the error feedback (the parameter's
  // numel, flat) and the warm-start Q (m x r) of compressed parameters.
  std::map<int64_t, at::Tensor> errors;
  std::map<int64_t, at::Tensor> qs;
  // Batched PowerSGD only, by a bucket's first parameter index: the warm-start
  // Q (side x r) of the bucket, and the error of its zero padding.
  std::map<int64_t, at::Tensor> bucket_qs, bucket_error_tails;
  // Read only, not state: P as the last compressed step left it (summed over
  // the ranks and orthogonalized: torch's p_memory_dict), per compressed
  // parameter (n x r) and, batched, per bucket (side x r). Both hooks
  // overwrite P before reading it, so only state_dict() fills these (with
  // warm start, where torch keeps P), load_state_dict ignores them and a
  // rebuild does not carry them.
  std::map<int64_t, at::Tensor> ps, bucket_ps;
};

// numpy RandomState.get_state()'s position and key as "pos key0 ... key623",
// and back (raises ValueError for anything else).
std::string numpy_rng_state(const NumpyRandomState& rng);
void set_numpy_rng_state(NumpyRandomState& rng, const std::string& state);

class PowerSGDBase : public PipelinedHook {
 public:
  ~PowerSGDBase() override;  // here ProcessGroup is incomplete

  const PowerSGDOptions& options() const { return options_; }
  // torch's hook divides by the group's size whatever join() asks; under a
  // fault-tolerant engine, by the step's participants (Note [step divisors]).
  void set_divisors(StepDivisors divisors) override { divisor_ = divisors.participants; }
  int64_t iter() const { return iter_.load(); }
  // torch's PowerSGDState.compression_stats(): (rate, numel before, numel after).
  std::vector<double> compression_stats() const;
  // Bytes of the last compressed step: gradients in, and what went on the wire.
  std::pair<int64_t, int64_t> last_step_bytes() const;
  // The log lines due since the last call (every
  // compression_stats_logging_frequency steps); Python logs them.
  std::vector<PowerSGDStatsReport> take_stats_reports();

  // Call between steps (no backward in flight). The state by parameter
  // (carried_ plus every bucket's), tensors copied: it does not change as
  // training goes on.
  PowerSGDCheckpoint state_dict() const;
  // Drops the bucket state; the buckets adopt the checkpoint's at their next
  // compressed step.
  void load_state_dict(const PowerSGDCheckpoint& checkpoint);

 protected:
  PowerSGDBase(c10::intrusive_ptr<c10d::ProcessGroup> group, PowerSGDOptions options,
               NumpyRandomState rng, const std::string& hook_name);

  // Before start_powerSGD_iter, torch's vanilla phase (default._allreduce_fut:
  // divide first, then sum): the bucket's future; the counter moves on the
  // last bucket. Undefined once compressing.
  c10::intrusive_ptr<c10::ivalue::Future> maybe_vanilla(Bucket& bucket, bool is_last);
  c10::intrusive_ptr<c10::ivalue::Future> allreduce(at::Tensor tensor);
  // torch: fork_rng; manual_seed(rng.randint(1e9)); then randn(q.shape) on
  // the CPU copied into each q in turn: one generator draw for them all.
  void draw_random_q(const std::vector<at::Tensor>& qs);
  // Waits for a bucket's P allreduce; raises, naming the hook and bucket.
  void wait_for_p(c10::ivalue::Future& p_reduced, size_t index);
  // With mutex_ held: every bucket's state into `into` (views), and dropping it.
  virtual void carry_buckets(PowerSGDCheckpoint& into) const = 0;
  virtual void drop_buckets() = 0;
  // Raises ValueError for a checkpoint this hook cannot take.
  virtual void check_checkpoint(const PowerSGDCheckpoint& checkpoint) const { (void)checkpoint; }
  // Whether P is state (ACP-SGD: kept from step to step) rather than read-only.
  virtual bool ps_are_state() const { return false; }
  // After load_state_dict, with mutex_ held: the hook's own bookkeeping restarts.
  virtual void loaded() {}

  c10::intrusive_ptr<c10d::ProcessGroup> group_;
  PowerSGDOptions options_;
  NumpyRandomState rng_;
  // The group's size, or the step's participants (Note [step divisors]).
  int64_t divisor_;
  std::atomic<int64_t> iter_;
  // Guards the statistics and the hooks' bucket state: decompression
  // callbacks run on the process group's threads while run() goes on with
  // the next bucket, and Python reads statistics meanwhile.
  mutable std::mutex mutex_;
  PowerSGDStats stats_;
  // Waiting for a bucket's next compressed step: loaded from a checkpoint,
  // or left by a bucket rebuild. Only its maps are used.
  PowerSGDCheckpoint carried_;
  // carried_ held warm-start Qs when it was loaded or carried over a rebuild:
  // torch's q_memory_dict then knows every bucket, also those with nothing
  // to compress, and draws no new Q for them.
  bool carried_has_qs_ = false;
};

}  // namespace fastddp
