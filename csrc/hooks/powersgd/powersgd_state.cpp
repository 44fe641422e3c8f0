// The PowerSGD hook's state: per bucket while training, per parameter across
// a bucket rebuild and in a checkpoint; its statistics.
#include <ATen/ATen.h>

#include <algorithm>
#include <c10/util/Exception.h>

#include "powersgd.h"

#include "../common/spare_state.h"
#include "../../util/message.h"

namespace fastddp {

std::shared_ptr<PowerSGDHook::BucketState> PowerSGDHook::bucket_state(const Bucket& bucket,
                                                                      size_t index,
                                                                      const PowerSGDPlan& plan,
                                                                      bool& randomize) {
  std::lock_guard<std::mutex> lock(mutex_);
  std::shared_ptr<BucketState>& slot = states_[index];
  const bool fresh = !slot;
  if (fresh) {
    slot = std::make_shared<BucketState>();
    BucketState& s = *slot;
    s.params.assign(bucket.params.begin(), bucket.params.end());
    s.bucket_id = bucket.id;
    s.fed.assign(bucket.params.size(), false);
    s.offsets = bucket.offsets;
    s.numels = bucket.numels;
    s.q_offsets.assign(bucket.params.size(), -1);
    s.q_rows.assign(bucket.params.size(), 0);
    s.q_cols.assign(bucket.params.size(), 0);
    s.p_offsets.assign(bucket.params.size(), -1);
    s.p_rows.assign(bucket.params.size(), 0);
    for (const auto& group : plan.groups) {
      for (const PowerSGDMatrix& mat : group) {
        s.q_offsets[mat.slot] = mat.q_offset;
        s.q_rows[mat.slot] = mat.m;
        s.q_cols[mat.slot] = mat.r;
        s.p_offsets[mat.slot] = plan.uncompressed_numel + mat.p_offset;  // wire: [uncompressed | P]
        s.p_rows[mat.slot] = mat.n;
      }
    }
    const auto options = bucket.flat.options();
    s.wire = at::empty({plan.uncompressed_numel + plan.p_numel}, options);
    if (options_.use_error_feedback) {
      s.error = at::zeros({bucket.flat.numel()}, options);
      s.source = at::empty({bucket.flat.numel()}, options);
    }
  }
  BucketState& s = *slot;
  randomize = !s.q_memory.defined();  // first step, or no warm start
  if (!s.q_spare.defined()) s.q_spare = at::empty({plan.q_numel}, bucket.flat.options());
  if (fresh) adopt_carried(s, plan, randomize);
  return slot;
}

std::shared_ptr<PowerSGDHook::BucketState> PowerSGDHook::existing_state(
    const Bucket& bucket) const {
  std::lock_guard<std::mutex> lock(mutex_);
  for (const auto& entry : states_) {
    if (entry.second->bucket_id == bucket.id) return entry.second;
  }
  return nullptr;
}

void PowerSGDHook::adopt_carried(BucketState& s, const PowerSGDPlan& plan, bool& randomize) {
  for (size_t k = 0; k < s.params.size(); ++k) {
    auto it = carried_.errors.find(s.params[k]);
    if (it == carried_.errors.end()) continue;
    if (s.error.defined()) s.error.narrow(0, s.offsets[k], s.numels[k]).copy_(it->second.reshape(-1));
    carried_.errors.erase(it);
  }
  if (!options_.warm_start) return;
  // Without every Q of the bucket torch would draw them all: do the same
  // (the draw keeps the generator where the uninterrupted run has it), then
  // put back the ones we have.
  bool all = true;
  for (const auto& group : plan.groups) {
    for (const PowerSGDMatrix& mat : group) all = all && carried_.qs.count(s.params[mat.slot]);
  }
  // A bucket with no matrix has no Q of its own to tell: torch still draws a
  // seed for it, unless it resumes a state that knew it (carried_has_qs_).
  if (randomize && all && (!plan.groups.empty() || carried_has_qs_)) randomize = false;
  for (const auto& group : plan.groups) {
    for (const PowerSGDMatrix& mat : group) {
      auto it = carried_.qs.find(s.params[mat.slot]);
      if (it == carried_.qs.end()) continue;
      FASTDDP_CHECK_VALUE(it->second.numel() == mat.m * mat.r,
                          "fastddp powersgd: the saved Q of parameter ", s.params[mat.slot],
                          " has ", it->second.numel(), " elements, expected ", mat.m, " x ", mat.r);
      s.qs_after_draw.emplace_back(mat.q_offset, it->second);
      carried_.qs.erase(it);
    }
  }
}

at::Tensor PowerSGDHook::settle_step(const at::Tensor& finite) {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<Spare> written;
  for (auto& entry : states_) {
    BucketState& s = *entry.second;
    if (s.pending) {
      if (options_.use_error_feedback) written.push_back({&s.error, &s.source});
      if (options_.warm_start) written.push_back({&s.q_memory, &s.q_spare});
    }
    s.pending = false;
  }
  if (written.empty()) return finite;
  // The state every bucket holds, before this step's.
  return settle_spares(written, finite, [this](bool witness) {
    std::vector<at::Tensor> read;
    for (auto& entry : states_) {
      const BucketState& s = *entry.second;
      if (witness) {
        // On a device: with warm start the Qs stand for the state (a non-finite
        // error makes that step's P, and so its Q, non-finite), r/n of the
        // error's bytes; without, the errors themselves.
        const at::Tensor& w = options_.warm_start ? s.q_memory : s.error;
        if (w.defined()) read.push_back(w);
        continue;
      }
      if (options_.use_error_feedback) read.push_back(s.error);
      if (options_.warm_start && s.q_memory.defined()) read.push_back(s.q_memory);
    }
    return read;
  });
}

void PowerSGDHook::discard_step() {
  std::lock_guard<std::mutex> lock(mutex_);
  for (auto& entry : states_) {
    BucketState& s = *entry.second;
    s.pending = false;  // the spares are scratch again
    // Note [error feedback in the copy-in]: a failed step's M is not the next one's.
    std::fill(s.fed.begin(), s.fed.end(), false);
  }
}

void PowerSGDHook::carry(const BucketState& s, PowerSGDCheckpoint& into) const {
  for (size_t k = 0; k < s.params.size(); ++k) {
    if (s.error.defined()) into.errors[s.params[k]] = s.error.narrow(0, s.offsets[k], s.numels[k]);
    if (s.q_offsets[k] >= 0 && s.q_memory.defined()) {
      into.qs[s.params[k]] = s.q_memory.narrow(0, s.q_offsets[k], s.q_rows[k] * s.q_cols[k])
                            .view({s.q_rows[k], s.q_cols[k]});
      // With Q, P is the last step's (q_memory is only kept with warm start).
      into.ps[s.params[k]] = s.wire.narrow(0, s.p_offsets[k], s.p_rows[k] * s.q_cols[k])
                            .view({s.p_rows[k], s.q_cols[k]});
    }
  }
}

void PowerSGDHook::on_new_buckets(const std::vector<Bucket>& buckets) {
  (void)buckets;
  std::lock_guard<std::mutex> lock(mutex_);
  carry_buckets(carried_);
  carried_has_qs_ = !carried_.qs.empty();
  carried_.ps.clear();  // P is not state (PowerSGDCheckpoint)
  states_.clear();
}

void PowerSGDHook::carry_buckets(PowerSGDCheckpoint& into) const {
  for (const auto& entry : states_) carry(*entry.second, into);
}

void PowerSGDHook::count(const PowerSGDPlan& plan, size_t index, bool is_last,
                         int64_t element_size) {
  std::lock_guard<std::mutex> lock(mutex_);
  stats_.add_bucket(plan.numel_before, plan.numel_after, plan.numel_before * element_size,
                    (plan.uncompressed_numel + plan.p_numel + plan.q_numel) * element_size,
                    index, is_last, iter_.load());
}

}  // namespace fastddp
