#include "powersgd_base.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <array>
#include <charconv>
#include <string_view>

#include "../../util/profile_range.h"
#include "../../util/message.h"

namespace fastddp {
namespace {

// A checkpoint's own copies: not views of the live state, nor the caller's.
void clone_tensors(PowerSGDCheckpoint& ck) {
  for (auto* map : {&ck.errors, &ck.qs, &ck.bucket_qs, &ck.bucket_error_tails, &ck.ps,
                    &ck.bucket_ps}) {
    for (auto& e : *map) e.second = e.second.clone();
  }
}

}  // namespace

// "pos k0 k1 ... k623", numpy's Mersenne Twister as PowerSGDState keeps it.
// std::to_chars/from_chars, not streams (Note [no streams in _C]).
std::string numpy_rng_state(const NumpyRandomState& rng) {
  std::string out = cat(rng.pos());
  for (uint32_t k : rng.key()) {
    out.push_back(' ');
    out += cat(k);
  }
  return out;
}

namespace {

void skip_spaces(std::string_view& text) {
  while (!text.empty() && (text.front() == ' ' || text.front() == '\t' || text.front() == '\n'))
    text.remove_prefix(1);
}

// Reads one decimal number after spaces; false when there is none or it overflows T.
template <class T>
bool read_number(std::string_view& text, T& value) {
  skip_spaces(text);
  const std::from_chars_result r = std::from_chars(text.data(), text.data() + text.size(), value);
  if (r.ec != std::errc()) return false;
  text.remove_prefix(static_cast<size_t>(r.ptr - text.data()));
  return true;
}

}  // namespace

void set_numpy_rng_state(NumpyRandomState& rng, const std::string& state) {
  std::string_view text(state);
  int pos = -1;
  std::array<uint32_t, NumpyRandomState::kN> key{};
  bool ok = read_number(text, pos);
  for (uint32_t& k : key) ok = ok && read_number(text, k);
  skip_spaces(text);
  FASTDDP_CHECK_VALUE(ok && text.empty() && pos >= 0 && pos <= NumpyRandomState::kN,
                      "comm hook 'powersgd': a numpy generator state must be a position in "
                      "[0, 624] and 624 words");
  rng.set_state(key, pos);
}

PowerSGDBase::PowerSGDBase(c10::intrusive_ptr<c10d::ProcessGroup> group, PowerSGDOptions options,
                           NumpyRandomState rng, const std::string& hook_name)
    : group_(std::move(group)),
      options_(options),
      rng_(rng),
      iter_(options.iter),
      stats_(options.compression_stats_logging_frequency) {
  FASTDDP_CHECK(group_, "fastddp: the ", hook_name, " comm hook needs a process group");
  divisor_ = group_->getSize();
}

PowerSGDBase::~PowerSGDBase() = default;

c10::intrusive_ptr<c10::ivalue::Future> PowerSGDBase::allreduce(at::Tensor tensor) {
  std::vector<at::Tensor> tensors{std::move(tensor)};
  return group_->allreduce(tensors)->getFuture();
}

c10::intrusive_ptr<c10::ivalue::Future> PowerSGDBase::maybe_vanilla(Bucket& bucket,
                                                                    bool is_last) {
  if (iter_.load() >= options_.start_powerSGD_iter) return {};
  FASTDDP_PROFILE_RANGE("fastddp launch (powersgd vanilla)");
  if (is_last) ++iter_;
  bucket.flat.div_(divisor_);
  return allreduce(bucket.flat);
}

void PowerSGDBase::draw_random_q(const std::vector<at::Tensor>& qs) {
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(
      static_cast<uint64_t>(rng_.randint(1000000000)));
  for (const at::Tensor& q : qs) {
    // On CUDA through pinned memory, so the copy does not block the host
    // (without warm start this runs every step).
    const auto host = q.options().device(at::kCPU).pinned_memory(!q.is_cpu());
    at::Tensor values = at::empty(q.sizes(), host);
    values.normal_(0, 1, gen);  // what randn(shape, generator) draws
    at::Tensor dst = q;
    dst.copy_(values, /*non_blocking=*/true);
  }
}

void PowerSGDBase::wait_for_p(c10::ivalue::Future& p_reduced, size_t index) {
  p_reduced.wait();
  FASTDDP_CHECK(!p_reduced.hasError(), "fastddp: the ", name(), " comm hook's allreduce of P "
                "failed for bucket ", index, ": ", p_reduced.tryRetrieveErrorMessage());
}

std::vector<double> PowerSGDBase::compression_stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return stats_.compression_stats();
}

std::pair<int64_t, int64_t> PowerSGDBase::last_step_bytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return stats_.last_step_bytes();
}

std::vector<PowerSGDStatsReport> PowerSGDBase::take_stats_reports() {
  std::lock_guard<std::mutex> lock(mutex_);
  return stats_.take_reports();
}

PowerSGDCheckpoint PowerSGDBase::state_dict() const {
  std::lock_guard<std::mutex> lock(mutex_);
  PowerSGDCheckpoint ck = carried_;
  ck.iter = iter_.load();
  ck.rng_state = numpy_rng_state(rng_);
  ck.numel_before = stats_.numel_before;
  ck.numel_after = stats_.numel_after;
  ck.next_stats_report = stats_.next_report;
  carry_buckets(ck);
  clone_tensors(ck);
  return ck;
}

void PowerSGDBase::load_state_dict(const PowerSGDCheckpoint& ck) {
  check_checkpoint(ck);
  std::lock_guard<std::mutex> lock(mutex_);
  set_numpy_rng_state(rng_, ck.rng_state);
  iter_.store(ck.iter);
  stats_.numel_before = ck.numel_before;
  stats_.numel_after = ck.numel_after;
  stats_.next_report = ck.next_stats_report;
  drop_buckets();
  carried_ = ck;
  carried_has_qs_ = !carried_.qs.empty() || !carried_.bucket_qs.empty();
  if (!ps_are_state()) {
    carried_.ps.clear();  // P is not state (PowerSGDCheckpoint)
    carried_.bucket_ps.clear();
  }
  clone_tensors(carried_);
  loaded();
}

}  // namespace fastddp
