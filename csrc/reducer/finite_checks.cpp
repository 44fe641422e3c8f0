// The step's finiteness (finite_checks.h): the non-finite guard's collective,
// the averaged gradients' check, and the reducer's side of
// check_for_nan_in_grad.
#include "finite_checks.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <algorithm>
#include <atomic>
#include <limits>

#include "../kernels/nonfinite.h"
#include "../util/message.h"
#include "../util/step_cost.h"
#include "reducer.h"

namespace fastddp {

FiniteChecks::FiniteChecks() = default;
FiniteChecks::FiniteChecks(FiniteChecks&&) noexcept = default;
FiniteChecks& FiniteChecks::operator=(FiniteChecks&&) noexcept = default;
FiniteChecks::~FiniteChecks() = default;

FiniteChecks::FiniteChecks(bool guard, int rank, int world_size, size_t num_params) {
  if (guard) guard_ = std::make_unique<NonFiniteGuard>(rank, world_size, num_params);
}

bool FiniteChecks::take_guard_failed() {
  const bool failed = guard_failed_;
  guard_failed_ = false;
  return failed;
}

void FiniteChecks::begin_step() {
  if (guard_) guard_->begin_step();
  reduced_.clear();
  last_ = at::Tensor();
}

void FiniteChecks::collect(const std::vector<at::Tensor>& reduced, bool hook_settles) {
  if (!track_ && !hook_settles) return;
  for (const at::Tensor& t : reduced) {
    if (t.defined()) reduced_.push_back(t);  // checked once all are in
  }
}

at::Tensor FiniteChecks::check() {
  if (reduced_.empty()) return at::Tensor();
  const at::NoGradGuard no_grad;
  at::Tensor finite = all_finite(reduced_);
  if (track_) last_ = finite;
  reduced_.clear();
  return finite;
}

void FiniteChecks::set_tracking(bool on) {
  track_ = on;
  last_ = at::Tensor();
}

std::optional<bool> FiniteChecks::last_step_finite() const {
  if (!last_.defined()) return std::nullopt;
  return last_.item<bool>();
}

// Whether a CPU tensor holds only finite values: fastddp's branch-free loop
// (kernels/nonfinite.h) over dense float32/float64 memory, threaded in chunks;
// ATen otherwise. Ours because ATen's CPU max-norm (_foreach_norm falls back
// to one linalg_vector_norm per tensor there) ran at a fraction of memory
// speed: 53 ms of a 182 ms PowerSGD step on 20M gradients (benchmarks/
// powersgd.py --parts b, issue 43).
bool cpu_all_finite(const at::Tensor& t) {
  const bool dense = t.is_non_overlapping_and_dense();
  if (dense && (t.scalar_type() == at::kFloat || t.scalar_type() == at::kDouble)) {
    std::atomic<bool> bad{false};
    const bool is_float = t.scalar_type() == at::kFloat;
    at::parallel_for(0, t.numel(), 1 << 16, [&](int64_t begin, int64_t end) {
      if (bad.load(std::memory_order_relaxed)) return;
      const bool found =
          is_float ? kernels::any_nonfinite_cpu(t.const_data_ptr<float>() + begin, end - begin)
                   : kernels::any_nonfinite_cpu(t.const_data_ptr<double>() + begin, end - begin);
      if (found) bad = true;
    });
    return !bad.load();
  }
  return at::isfinite(t).all().item<bool>();
}

at::Tensor all_finite(const std::vector<at::Tensor>& tensors) {
  // Empty tensors hold nothing non-finite, and have no infinity norm.
  std::vector<at::Tensor> held;
  held.reserve(tensors.size());
  for (const at::Tensor& t : tensors) {
    if (t.numel() > 0) held.push_back(t);
  }
  if (held.empty()) {
    const auto where = tensors.empty() ? at::TensorOptions() : tensors.front().options();
    return at::ones({}, where.dtype(at::kBool));
  }
  cost::add(cost::kCheck, cost::bytes(held));
  if (std::all_of(held.begin(), held.end(), [](const at::Tensor& t) { return t.is_cpu(); })) {
    // Stops at the first tensor with a NaN or an infinity.
    const bool finite = std::all_of(held.begin(), held.end(), cpu_all_finite);
    return at::scalar_tensor(finite, at::kBool);
  }
  // The largest magnitude of each tensor (one fused launch per dtype and
  // device on CUDA): NaN or Inf if it holds one, finite otherwise (no sum of
  // squares to overflow on large finite values).
  const std::vector<at::Tensor> maxima =
      at::_foreach_norm(held, std::numeric_limits<double>::infinity());
  return at::stack(maxima).isfinite().all();
}

NonFiniteGuard::NonFiniteGuard(int rank, int world_size, size_t num_params)
    : rank_(rank), world_size_(world_size), num_params_(num_params) {}

void NonFiniteGuard::begin_step() {
  host_first_ = 0;
  flags_armed_ = false;  // zeroed on first use: a CPU model never allocates them
  work_.reset();
}

void NonFiniteGuard::note(size_t param, bool nonfinite) {
  if (nonfinite && host_first_ == 0) host_first_ = static_cast<int64_t>(param) + 1;
}

int32_t* NonFiniteGuard::device_flag(size_t param, const at::Tensor& like) {
  FASTDDP_CHECK(param < num_params_, "fastddp: parameter index ", param, " out of range");
  if (!flags_.defined() || flags_.device() != like.device()) {
    flags_ = at::zeros({static_cast<int64_t>(num_params_)},
                       like.options().dtype(at::kInt));
  } else if (!flags_armed_) {
    flags_.zero_();  // asynchronous, on the current stream, as the kernels
  }
  flags_armed_ = true;
  return flags_.data_ptr<int32_t>() + param;
}

void NonFiniteGuard::note_tensor(size_t param, const at::Tensor& grad) {
  if (grad.is_cpu()) {
    note(param, !at::isfinite(grad).all().item<bool>());
    return;
  }
  const at::NoGradGuard no_grad;
  device_flag(param, grad);
  at::Tensor bad = at::logical_not(at::isfinite(grad)).any().to(at::kInt);
  flags_.narrow(0, static_cast<int64_t>(param), 1).bitwise_or_(bad);
}

void NonFiniteGuard::launch(c10d::ProcessGroup& group, const at::Device& device, int64_t step) {
  if (work_) return;
  shared_ = at::zeros({2 * world_size_}, at::TensorOptions().dtype(at::kLong).device(device));
  at::Tensor mine = shared_.narrow(0, 2 * rank_, 2);
  at::Tensor first = at::full({}, host_first_, mine.options());
  if (flags_armed_) {
    // The first flagged parameter (argmax takes the first of equal maxima),
    // on the device: no host sync here.
    const at::Tensor flagged = flags_.max().gt(0).to(device);
    const at::Tensor index = flags_.argmax().to(at::kLong).add(1).to(device);
    first = at::where(first.eq(0).logical_and(flagged), index, first);
  }
  mine.select(0, 0).copy_(first);
  mine.select(0, 1).fill_(step);
  std::vector<at::Tensor> tensors{shared_};
  work_ = group.allreduce(tensors);
}

std::vector<NonFiniteGuard::Finding> NonFiniteGuard::wait() {
  std::vector<Finding> found;
  if (!work_) return found;
  work_->wait();
  work_.reset();
  cost::host_sync(shared_);
  const at::Tensor host = shared_.cpu();  // the step's one host sync on CUDA
  const int64_t* values = host.data_ptr<int64_t>();
  for (int r = 0; r < world_size_; ++r) {
    if (values[2 * r] != 0) {
      found.push_back({r, static_cast<size_t>(values[2 * r] - 1), values[2 * r + 1]});
    }
  }
  return found;
}

void Reducer::check_finite_gradients() {
  const at::Device device = params_[0].device();
  NonFiniteGuard& guard = *finite_.guard();
  guard.launch(*group_, device, num_iterations_);
  const std::vector<NonFiniteGuard::Finding> found = guard.wait();
  if (found.empty()) return;
  finite_.note_guard_failed();  // fail_iteration tells the hook, once the step's futures are done
  std::vector<std::string> where;
  for (const auto& f : found) {
    const std::string name = f.param < names_.size() ? names_[f.param] : "?";
    where.push_back(cat("in parameter '", name, "' on rank ", f.rank, " at step ", f.step));
  }
  FASTDDP_CHECK(false, "fastddp: non-finite gradient (NaN or Inf) ", join(where, "; "),
                " (check_for_nan_in_grad=True). No averaged gradient was written to param.grad "
                "this step, so the non-finite values did not reach other ranks' .grad",
                options_.gradient_as_bucket_view
                    ? " (but with gradient_as_bucket_view=True .grad is the bucket itself and "
                      "holds the reduced values)"
                    : "",
                "; zero the gradients before the next backward.");
}

void Reducer::set_track_finite(bool on) {
  std::lock_guard<std::mutex> lock(mutex_);
  finite_.set_tracking(on);
}

std::optional<bool> Reducer::last_step_finite() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return finite_.last_step_finite();
}

}  // namespace fastddp
