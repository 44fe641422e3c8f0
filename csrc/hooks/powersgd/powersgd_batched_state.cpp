// The batched PowerSGD hook's state: per bucket while training; per
// parameter (errors) and per first parameter (Q, the padding's error)
// across a bucket rebuild and in a checkpoint; its statistics.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include "powersgd_batched.h"
#include "../../util/message.h"
#include "../common/spare_state.h"

namespace fastddp {

std::shared_ptr<BatchedPowerSGDHook::BucketState> BatchedPowerSGDHook::bucket_state(
    const Bucket& bucket, size_t index) {
  std::lock_guard<std::mutex> lock(mutex_);
  std::shared_ptr<BucketState>& slot = states_[index];
  if (slot) return slot;
  slot = std::make_shared<BucketState>();
  BucketState& s = *slot;
  s.params.assign(bucket.params.begin(), bucket.params.end());
  s.flat_offsets = bucket.offsets;
  s.numels = bucket.numels;
  s.numel = 0;
  for (int64_t n : s.numels) {
    s.offsets.push_back(s.numel);
    s.numel += n;
  }
  s.side = batched_powersgd_side(s.numel);
  const auto options = bucket.flat.options();
  s.padded = at::empty({s.side * s.side}, options);
  if (options_.use_error_feedback) {
    s.error = at::zeros({s.side * s.side}, options);
    s.copy = at::empty({s.side * s.side}, options);
  }
  s.p = at::empty({s.side, options_.matrix_approximation_rank}, options);
  s.q = at::empty({s.side, options_.matrix_approximation_rank}, options);
  if (options_.warm_start) s.q_spare = at::empty_like(s.q);
  adopt_carried(s);
  return slot;
}

void BatchedPowerSGDHook::adopt_carried(BucketState& s) {
  const int64_t tail = s.side * s.side - s.numel;
  if (s.error.defined()) {
    for (size_t k = 0; k < s.params.size(); ++k) {
      auto it = carried_.errors.find(s.params[k]);
      if (it == carried_.errors.end()) continue;
      FASTDDP_CHECK_VALUE(it->second.numel() == s.numels[k], "fastddp powersgd_batched: the saved "
                          "error of parameter ", s.params[k], " has ", it->second.numel(),
                          " elements, expected ", s.numels[k]);
      s.error.narrow(0, s.offsets[k], s.numels[k]).copy_(it->second.reshape(-1));
      carried_.errors.erase(it);
    }
  }
  if (s.params.empty()) return;
  // Per-bucket state belongs to a bucket with the same first parameter and
  // numel (checked through the shapes); any other bucket starts afresh.
  const int64_t key = s.params.front();
  auto t = carried_.bucket_error_tails.find(key);
  if (t != carried_.bucket_error_tails.end()) {
    if (s.error.defined() && t->second.numel() == tail) {
      s.error.narrow(0, s.numel, tail).copy_(t->second.reshape(-1));
    }
    carried_.bucket_error_tails.erase(t);
  }
  auto q = carried_.bucket_qs.find(key);
  if (q != carried_.bucket_qs.end()) {
    // torch would not draw for a bucket that has its Q: neither do we.
    if (options_.warm_start && q->second.sizes() == s.q.sizes()) {
      s.q.copy_(q->second);
      s.q_ready = true;
    }
    carried_.bucket_qs.erase(q);
  }
}

void BatchedPowerSGDHook::carry(const BucketState& s, PowerSGDCheckpoint& into) const {
  if (s.params.empty()) return;
  if (s.error.defined()) {
    for (size_t k = 0; k < s.params.size(); ++k) {
      into.errors[s.params[k]] = s.error.narrow(0, s.offsets[k], s.numels[k]);
    }
    const int64_t tail = s.side * s.side - s.numel;
    if (tail > 0) into.bucket_error_tails[s.params.front()] = s.error.narrow(0, s.numel, tail);
  }
  // Without warm start Q is drawn every step: nothing to keep.
  if (options_.warm_start && s.q_ready) {
    into.bucket_qs[s.params.front()] = s.q;
    into.bucket_ps[s.params.front()] = s.p;  // read only (PowerSGDCheckpoint)
  }
}

void BatchedPowerSGDHook::on_new_buckets(const std::vector<Bucket>& buckets) {
  std::lock_guard<std::mutex> lock(mutex_);
  for (const auto& entry : states_) {
    const BucketState& s = *entry.second;
    carry(s, carried_);
    // Q and the padding's error only go on to the same bucket: same first
    // parameter and numel (the shape checks at adoption cannot tell every
    // other bucket apart).
    bool same = false;
    for (const Bucket& b : buckets) {
      same = same || (!b.params.empty() && !s.params.empty() &&
                      static_cast<int64_t>(b.params.front()) == s.params.front() &&
                      b.payload_numel() == s.numel);
    }
    if (!same && !s.params.empty()) {
      carried_.bucket_qs.erase(s.params.front());
      carried_.bucket_error_tails.erase(s.params.front());
    }
  }
  carried_.bucket_ps.clear();  // P is not state (PowerSGDCheckpoint)
  states_.clear();
}

void BatchedPowerSGDHook::carry_buckets(PowerSGDCheckpoint& into) const {
  for (const auto& entry : states_) carry(*entry.second, into);
}

at::Tensor BatchedPowerSGDHook::settle_step(const at::Tensor& finite) {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<Spare> written;
  std::vector<BucketState*> pending;
  for (auto& entry : states_) {
    BucketState& s = *entry.second;
    if (s.pending) {
      pending.push_back(&s);
      if (options_.use_error_feedback) written.push_back({&s.error, &s.copy});
      if (options_.warm_start) written.push_back({&s.q, &s.q_spare, !s.q_ready});
    }
    s.pending = false;
  }
  if (written.empty()) return finite;
  // The state as the step found it (q_ready is still last step's).
  const at::Tensor kept = settle_spares(written, finite, [this](bool witness) {
    std::vector<at::Tensor> read;
    for (auto& entry : states_) {
      const BucketState& s = *entry.second;
      if (witness) {
        // On a device, as PowerSGDHook::settle_step: Q stands for the state with warm start.
        if (options_.warm_start ? s.q_ready : options_.use_error_feedback) {
          read.push_back(options_.warm_start ? s.q : s.error);
        }
        continue;
      }
      if (options_.use_error_feedback) read.push_back(s.error);
      if (options_.warm_start && s.q_ready) read.push_back(s.q);
    }
    return read;
  });
  // On the CPU the choice is known: a Q made by a step put back is drawn again.
  const bool keep = !kept.is_cpu() || settle_as_on_device() || kept.item<bool>();
  if (keep && options_.warm_start) {
    for (BucketState* s : pending) s->q_ready = true;
  }
  return kept;
}

void BatchedPowerSGDHook::discard_step() {
  std::lock_guard<std::mutex> lock(mutex_);
  for (auto& entry : states_) entry.second->pending = false;
}

void BatchedPowerSGDHook::check_checkpoint(const PowerSGDCheckpoint& ck) const {
  FASTDDP_CHECK_VALUE(ck.qs.empty(), "fastddp powersgd_batched: the checkpoint has per-parameter "
                      "Qs (a \"powersgd\" hook's); this hook keeps one Q per bucket (bucket_qs)");
}

}  // namespace fastddp
