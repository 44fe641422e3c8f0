// The ACP-SGD hook's state (Note [acpsgd]): per bucket while training, per
// parameter across a bucket rebuild (the error, P and Q of every compressed
// slot, the error of the others).
#include <ATen/ATen.h>

#include <utility>

#include "../../util/message.h"
#include "../common/spare_state.h"
#include "acpsgd.h"

namespace fastddp {

std::shared_ptr<AcpSgdHook::BucketState> AcpSgdHook::bucket_state(const Bucket& bucket,
                                                                  size_t index,
                                                                  const PowerSGDPlan& plan,
                                                                  bool& randomize) {
  std::lock_guard<std::mutex> lock(mutex_);
  std::shared_ptr<BucketState>& slot = states_[index];
  if (!slot) {
    slot = std::make_shared<BucketState>();
    BucketState& s = *slot;
    s.params.assign(bucket.params.begin(), bucket.params.end());
    s.offsets = bucket.offsets;
    s.numels = bucket.numels;
    const size_t slots = bucket.params.size();
    s.p_offsets.assign(slots, -1);
    s.q_offsets.assign(slots, -1);
    s.rows.assign(slots, 0);
    s.cols.assign(slots, 0);
    s.ranks.assign(slots, 0);
    for (const auto& group : plan.groups) {
      for (const PowerSGDMatrix& mat : group) {
        // In the wires: [uncompressed | P] and [uncompressed | Q].
        s.p_offsets[mat.slot] = plan.uncompressed_numel + mat.p_offset;
        s.q_offsets[mat.slot] = plan.uncompressed_numel + mat.q_offset;
        s.rows[mat.slot] = mat.n;
        s.cols[mat.slot] = mat.m;
        s.ranks[mat.slot] = mat.r;
      }
    }
    const auto options = bucket.flat.options();
    s.error = at::zeros({bucket.flat.numel()}, options);
    s.source = at::empty({bucket.flat.numel()}, options);
    s.wire_p = at::empty({plan.uncompressed_numel + plan.p_numel}, options);
    s.wire_q = at::empty({plan.uncompressed_numel + plan.q_numel}, options);
    s.head = plan.uncompressed_numel;
    randomize = true;
    adopt_carried(s, randomize);
    s.has_factors = !randomize;
    created_.push_back(index);
  }
  return slot;
}

void AcpSgdHook::adopt_carried(BucketState& s, bool& randomize) {
  bool all_factors = true;
  for (size_t k = 0; k < s.params.size(); ++k) {
    const int64_t param = s.params[k];
    auto error = carried_.errors.find(param);
    if (error != carried_.errors.end()) {
      s.error.narrow(0, s.offsets[k], s.numels[k]).copy_(error->second.reshape(-1));
      carried_.errors.erase(error);
    }
    if (s.q_offsets[k] < 0) continue;
    auto p = carried_.ps.find(param);
    auto q = carried_.qs.find(param);
    if (p == carried_.ps.end() || q == carried_.qs.end()) {
      all_factors = false;
      continue;
    }
    FASTDDP_CHECK_VALUE(p->second.numel() == s.rows[k] * s.ranks[k] &&
                            q->second.numel() == s.cols[k] * s.ranks[k],
                        "fastddp acpsgd: the carried P and Q of parameter ", param,
                        " do not fit its ", s.rows[k], " x ", s.cols[k], " matrix at rank ",
                        s.ranks[k]);
    s.wire_p.narrow(0, s.p_offsets[k], p->second.numel()).copy_(p->second.reshape(-1));
    s.wire_q.narrow(0, s.q_offsets[k], q->second.numel()).copy_(q->second.reshape(-1));
    carried_.ps.erase(p);
    carried_.qs.erase(q);
  }
  // Every factor carried: nothing to draw. Otherwise the bucket starts again
  // from a drawn Q (its carried factors are overwritten), on every rank alike.
  // A bucket with no matrix draws, as PowerSGD's first step does, unless the
  // carried state knew buckets (carried_has_qs_).
  if (all_factors && carried_has_qs_) randomize = false;
}

void AcpSgdHook::on_new_buckets(const std::vector<Bucket>& buckets) {
  (void)buckets;
  std::lock_guard<std::mutex> lock(mutex_);
  carry_buckets(carried_);
  carried_has_qs_ = !carried_.qs.empty();
  states_.clear();
}

at::Tensor AcpSgdHook::settle_step(const at::Tensor& finite) {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<Spare> written;
  // Every bucket, and whether its wires held factors before the step.
  std::vector<std::pair<const BucketState*, bool>> buckets;
  for (auto& entry : states_) {
    BucketState& s = *entry.second;
    const bool fresh = s.pending && s.fresh;
    if (s.pending) {
      written.push_back({&s.error, &s.source});
      written.push_back({&s.wire_p, &s.p_spare, fresh});
      written.push_back({&s.wire_q, &s.q_spare, fresh});
    }
    s.pending = false;
    s.fresh = false;
    buckets.emplace_back(&s, !fresh);
  }
  if (written.empty()) return finite;
  // The state as the step found it.
  return settle_spares(written, finite, [&buckets](bool witness) {
    std::vector<at::Tensor> read;
    for (const auto& [s, held] : buckets) {
      if (!witness) read.push_back(s->error);
      if (!held) continue;  // its wires held nothing before the step
      // The factors, past the wires' uncompressed part (scratch). On a device
      // they stand for the state, as PowerSGD's Qs do: a non-finite error
      // makes that step's factor non-finite.
      read.push_back(s->wire_p.narrow(0, s->head, s->wire_p.numel() - s->head));
      read.push_back(s->wire_q.narrow(0, s->head, s->wire_q.numel() - s->head));
    }
    return read;
  });
}

void AcpSgdHook::discard_step() {
  std::lock_guard<std::mutex> lock(mutex_);
  for (auto& entry : states_) entry.second->pending = false;
}

void AcpSgdHook::loaded() {
  // The loaded iter and state replace the last step's: nothing of it to take back.
  settle_pending_ = false;
  created_.clear();
}

void AcpSgdHook::carry_buckets(PowerSGDCheckpoint& into) const {
  for (const auto& entry : states_) {
    const BucketState& s = *entry.second;
    for (size_t k = 0; k < s.params.size(); ++k) {
      const int64_t param = s.params[k];
      into.errors[param] = s.error.narrow(0, s.offsets[k], s.numels[k]);
      if (s.q_offsets[k] < 0) continue;
      into.ps[param] = s.wire_p.narrow(0, s.p_offsets[k], s.rows[k] * s.ranks[k])
                           .view({s.rows[k], s.ranks[k]});
      into.qs[param] = s.wire_q.narrow(0, s.q_offsets[k], s.cols[k] * s.ranks[k])
                           .view({s.cols[k], s.ranks[k]});
    }
  }
}

}  // namespace fastddp
