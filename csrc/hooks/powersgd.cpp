#include "powersgd.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <algorithm>
#include <array>
#include <sstream>
#include <utility>

#include "../reducer/nvtx.h"
#include "registry.h"

namespace fastddp {
namespace {

// torch's _orthogonalize_gram_schmidt, op for op, so rounding matches.
void gram_schmidt(at::Tensor& matrices, double epsilon) {
  const int64_t cols = matrices.size(2);
  for (int64_t i = 0; i < cols; ++i) {
    at::Tensor col = matrices.narrow(2, i, 1);
    at::Tensor norm = at::linalg_vector_norm(col, 2, at::IntArrayRef{1}, /*keepdim=*/true);
    // epsilon == 0: a zero column becomes NaN, as in torch (tensor division
    // never raises the ZeroDivisionError torch's code catches).
    if (epsilon == 0) {
      col.div_(norm);
    } else {
      col.div_(norm + epsilon);
    }
    if (i + 1 < cols) {
      at::Tensor rest = matrices.narrow(2, i + 1, cols - i - 1);
      rest.sub_(at::sum(col * rest, at::IntArrayRef{1}, /*keepdim=*/true) * col);
    }
  }
}

// One compressed matrix batch: B same-shape (n, m) matrices and their P, Q.
struct Batch {
  at::Tensor matrices;               // (B, n, m): views of the bucket, or a stacked copy
  std::vector<at::Tensor> originals;  // when stacked: the (n, m) views to copy back into
  at::Tensor p, q;                    // (B, n, r), (B, m, r) views of the P, Q memories
};

struct Plan {
  std::vector<at::Tensor> uncompressed;  // flat slices of the bucket
  int64_t uncompressed_numel = 0;
  // Compressed (n, m) matrices grouped by shape, in order of first appearance.
  std::vector<std::pair<std::pair<int64_t, int64_t>, std::vector<at::Tensor>>> groups;
  int64_t p_numel = 0, q_numel = 0;
  int64_t numel_before = 0, numel_after = 0;
};

// torch's per-tensor view: tensor.view(tensor.shape[0], -1) over the slot's
// slice of the flat buffer (row-major, as torch's contiguous bucket views).
Plan plan_bucket(const Bucket& bucket, const PowerSGDOptions& o) {
  Plan plan;
  for (size_t k = 0; k < bucket.views.size(); ++k) {
    const int64_t numel = bucket.numels[k];
    at::Tensor slice = bucket.flat.narrow(0, bucket.offsets[k], numel);
    const int64_t n = bucket.views[k].dim() > 0 ? bucket.views[k].size(0) : 1;
    const int64_t m = n > 0 ? numel / n : 0;
    const int64_t r = std::min({n, m, o.matrix_approximation_rank});
    const int64_t compressed = (n + m) * r;
    plan.numel_before += numel;
    if (static_cast<double>(compressed) * o.min_compression_rate < static_cast<double>(numel)) {
      plan.numel_after += compressed;
      plan.p_numel += n * r;
      plan.q_numel += m * r;
      at::Tensor matrix = slice.view({n, m});
      auto it = std::find_if(plan.groups.begin(), plan.groups.end(),
                             [&](const auto& g) { return g.first == std::make_pair(n, m); });
      if (it == plan.groups.end()) {
        plan.groups.push_back({{n, m}, {matrix}});
      } else {
        it->second.push_back(matrix);
      }
    } else {
      plan.numel_after += numel;
      plan.uncompressed.push_back(slice);
      plan.uncompressed_numel += numel;
    }
  }
  return plan;
}

// torch's maybe_batched_tensors_to_compress, with P and Q laid out in the same order.
std::vector<Batch> make_batches(const Plan& plan, const PowerSGDOptions& o, const at::Tensor& p_mem,
                                const at::Tensor& q_mem) {
  std::vector<Batch> batches;
  int64_t p_at = 0, q_at = 0;
  auto add = [&](at::Tensor matrices, std::vector<at::Tensor> originals) {
    const int64_t b = matrices.size(0), n = matrices.size(1), m = matrices.size(2);
    const int64_t r = std::min({n, m, o.matrix_approximation_rank});
    Batch batch;
    batch.matrices = std::move(matrices);
    batch.originals = std::move(originals);
    batch.p = p_mem.narrow(0, p_at, b * n * r).view({b, n, r});
    batch.q = q_mem.narrow(0, q_at, b * m * r).view({b, m, r});
    p_at += b * n * r;
    q_at += b * m * r;
    batches.push_back(std::move(batch));
  };
  for (const auto& group : plan.groups) {
    const std::vector<at::Tensor>& matrices = group.second;
    if (o.batch_tensors_with_same_shape && matrices.size() > 1) {
      add(at::stack(matrices), matrices);
    } else {
      for (const at::Tensor& m : matrices) add(m.unsqueeze(0), {});
    }
  }
  return batches;
}

c10::intrusive_ptr<c10::ivalue::Future> allreduce(c10d::ProcessGroup& group, at::Tensor t) {
  std::vector<at::Tensor> tensors{std::move(t)};
  return group.allreduce(tensors)->getFuture();
}

}  // namespace

void powersgd_orthogonalize(at::Tensor& matrices, double epsilon) {
  TORCH_CHECK(matrices.dim() == 3 && matrices.size(2) <= matrices.size(1),
              "fastddp powersgd_orthogonalize: matrices must be (batch, n, r) with r <= n, got ",
              matrices.sizes());
  const int64_t rank = matrices.size(2);
  const auto dtype = matrices.scalar_type();
  if (rank <= 2 || dtype == at::kHalf || dtype == at::kBFloat16) {
    gram_schmidt(matrices, epsilon);
  } else {
    // torch: linalg.qr(matrices, out=(matrices, R)); epsilon is not used.
    matrices.copy_(std::get<0>(at::linalg_qr(matrices)));
  }
}

PowerSGDHook::PowerSGDHook(c10::intrusive_ptr<c10d::ProcessGroup> group, PowerSGDOptions options,
                           NumpyRandomState rng)
    : group_(std::move(group)), options_(options), rng_(rng), iter_(options.iter) {
  TORCH_CHECK(group_, "fastddp: the powersgd comm hook needs a process group");
  world_size_ = group_->getSize();
}

void PowerSGDHook::on_new_buckets(const std::vector<Bucket>& buckets) {
  (void)buckets;
  std::lock_guard<std::mutex> lock(mutex_);
  states_.clear();
}

std::vector<double> PowerSGDHook::compression_stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  const double rate = numel_after_ > 0 ? static_cast<double>(numel_before_) / numel_after_ : 0.0;
  return {rate, static_cast<double>(numel_before_), static_cast<double>(numel_after_)};
}

int64_t PowerSGDHook::wire_bytes(const Bucket& bucket) const {
  if (iter_.load() < options_.start_powerSGD_iter) return bucket.bytes();
  const Plan plan = plan_bucket(bucket, options_);
  return (plan.uncompressed_numel + plan.p_numel + plan.q_numel) *
         static_cast<int64_t>(bucket.flat.element_size());
}

c10::intrusive_ptr<c10::ivalue::Future> PowerSGDHook::run(Bucket& bucket, size_t index,
                                                          bool is_last) {
  if (iter_.load() >= options_.start_powerSGD_iter) return run_compressed(bucket, index, is_last);
  FASTDDP_NVTX_RANGE("fastddp launch (powersgd vanilla)");
  // torch's vanilla phase (default._allreduce_fut): divide first, then sum.
  if (is_last) ++iter_;
  bucket.flat.div_(world_size_);
  return allreduce(*group_, bucket.flat);
}

c10::intrusive_ptr<c10::ivalue::Future> PowerSGDHook::run_compressed(Bucket& bucket, size_t index,
                                                                     bool is_last) {
  FASTDDP_NVTX_RANGE("fastddp launch (powersgd)");
  at::Tensor input = bucket.flat;
  std::shared_ptr<BucketState> state;
  Plan plan = plan_bucket(bucket, options_);
  bool randomize = false;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    std::shared_ptr<BucketState>& slot = states_[index];
    if (!slot) slot = std::make_shared<BucketState>();
    state = slot;
    numel_before_ += plan.numel_before;
    numel_after_ += plan.numel_after;
    if (!options_.warm_start || !state->p_memory.defined() ||
        state->p_memory.numel() != plan.p_numel || state->q_memory.numel() != plan.q_numel) {
      randomize = true;
      state->p_memory = at::empty({plan.p_numel}, input.options());
      state->q_memory = at::empty({plan.q_numel}, input.options());
    }
  }
  at::Tensor input_copy;
  if (options_.use_error_feedback) {
    if (state->error.defined() && state->error.numel() == input.numel()) {
      input.add_(state->error);
    } else {
      state->error = at::zeros_like(input);
    }
    input_copy = input.clone();
  }

  // Matrices are stacked (when batching) after the error feedback is added:
  // torch stacks views of the already-corrected buffer.
  std::vector<Batch> batches = make_batches(plan, options_, state->p_memory, state->q_memory);
  const double eps = options_.orthogonalization_epsilon;
  if (!randomize) {
    for (Batch& b : batches) powersgd_orthogonalize(b.q, eps);
  } else {
    // torch: fork_rng; manual_seed(rng.randint(1e9)); q.copy_(randn(q.shape, cpu)) per Q.
    at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(
        static_cast<uint64_t>(rng_.randint(1000000000)));
    for (Batch& b : batches) {
      b.q.copy_(at::randn(b.q.sizes(), gen, input.options().device(at::kCPU)));
      powersgd_orthogonalize(b.q, eps);
    }
  }
  for (Batch& b : batches) at::bmm_out(b.p, b.matrices, b.q);

  // The uncompressed slots in one buffer; both allreduces are in flight together.
  at::Tensor uncompressed = plan.uncompressed.empty() ? at::empty({0}, input.options())
                                                      : at::cat(plan.uncompressed);
  auto uncompressed_fut = allreduce(*group_, uncompressed);
  auto p_fut = allreduce(*group_, state->p_memory);
  p_fut->wait();
  uncompressed_fut->wait();
  TORCH_CHECK(!p_fut->hasError() && !uncompressed_fut->hasError(),
              "fastddp: the powersgd comm hook's allreduce failed for bucket ", index, ": ",
              p_fut->hasError() ? p_fut->tryRetrieveErrorMessage()
                                : uncompressed_fut->tryRetrieveErrorMessage());
  uncompressed.div_(world_size_);
  int64_t at_elem = 0;
  for (at::Tensor& slice : plan.uncompressed) {
    slice.copy_(uncompressed.narrow(0, at_elem, slice.numel()));
    at_elem += slice.numel();
  }
  for (Batch& b : batches) {
    powersgd_orthogonalize(b.p, eps);
    at::bmm_out(b.q, b.matrices.transpose(1, 2), b.p);
  }
  auto q_fut = allreduce(*group_, state->q_memory);

  // Local work only from here: safe in the completion callback.
  const int world = world_size_;
  const bool error_feedback = options_.use_error_feedback;
  const bool warm_start = options_.warm_start;
  auto decompress = [this, state, batches = std::move(batches), input, input_copy, world,
                     error_feedback, warm_start, is_last](c10::ivalue::Future& done) {
    if (done.hasError()) std::rethrow_exception(done.exception_ptr());
    FASTDDP_NVTX_RANGE("fastddp decompress (powersgd)");
    state->q_memory.div_(world);
    for (const Batch& b : batches) {
      at::Tensor out = b.matrices;  // a handle: bmm_out writes the bucket's memory
      at::bmm_out(out, b.p, b.q.transpose(1, 2));
      for (size_t i = 0; i < b.originals.size(); ++i) b.originals[i].copy_(b.matrices[i]);
    }
    if (error_feedback) state->error = input_copy - input;
    if (!warm_start) {
      std::lock_guard<std::mutex> lock(mutex_);
      state->p_memory = at::Tensor();
      state->q_memory = at::Tensor();
    }
    if (is_last) ++iter_;
    return c10::IValue(input);
  };
  return q_fut->then(std::move(decompress), c10::TensorType::get());
}

namespace {

NumpyRandomState rng_from_options(const HookOptions& o) {
  const int64_t seed = o.get_int("random_seed", 0);
  TORCH_CHECK_VALUE(seed >= 0 && seed <= 0xffffffffLL,
                    "comm hook 'powersgd': random_seed must be between 0 and 2**32 - 1 "
                    "(numpy's RandomState seeds), got ", seed);
  NumpyRandomState rng(static_cast<uint32_t>(seed));
  // A torch PowerSGDState's generator, possibly advanced: "pos k0 ... k623".
  auto it = o.values().find("numpy_rng_state");
  if (it != o.values().end()) {
    TORCH_CHECK_VALUE(std::holds_alternative<std::string>(it->second),
                      "comm hook 'powersgd': numpy_rng_state must be a str");
    std::istringstream in(std::get<std::string>(it->second));
    int pos = 0;
    std::array<uint32_t, NumpyRandomState::kN> key{};
    in >> pos;
    for (uint32_t& k : key) in >> k;
    TORCH_CHECK_VALUE(in && pos >= 0 && pos <= NumpyRandomState::kN,
                      "comm hook 'powersgd': numpy_rng_state must be a position and 624 words");
    rng.set_state(key, pos);
  }
  return rng;
}

std::shared_ptr<CommHook> make_powersgd(const c10::intrusive_ptr<c10d::ProcessGroup>& group,
                                        const HookOptions& o) {
  o.check_known({"matrix_approximation_rank", "start_powerSGD_iter", "min_compression_rate",
                 "use_error_feedback", "warm_start", "orthogonalization_epsilon", "random_seed",
                 "batch_tensors_with_same_shape", "iter", "numpy_rng_state"});
  PowerSGDOptions p;
  p.matrix_approximation_rank = o.get_int("matrix_approximation_rank", 1);
  p.start_powerSGD_iter = o.get_int("start_powerSGD_iter", 1000);
  p.min_compression_rate = o.get_double("min_compression_rate", 2.0);
  p.use_error_feedback = o.get_bool("use_error_feedback", true);
  p.warm_start = o.get_bool("warm_start", true);
  p.orthogonalization_epsilon = o.get_double("orthogonalization_epsilon", 0.0);
  p.batch_tensors_with_same_shape = o.get_bool("batch_tensors_with_same_shape", false);
  p.iter = o.get_int("iter", 0);
  TORCH_CHECK_VALUE(p.matrix_approximation_rank >= 1,
                    "comm hook 'powersgd': matrix_approximation_rank must be >= 1, got ",
                    p.matrix_approximation_rank);
  TORCH_CHECK_VALUE(!((p.use_error_feedback || p.warm_start) && p.start_powerSGD_iter <= 1),
                    "comm hook 'powersgd': start_powerSGD_iter must be > 1 when "
                    "use_error_feedback or warm_start is enabled (torch's rule: buckets are "
                    "rebuilt after the first iteration), got ", p.start_powerSGD_iter);
  return std::make_shared<PowerSGDHook>(group, p, rng_from_options(o));
}

}  // namespace

FASTDDP_REGISTER_COMM_HOOK("powersgd", make_powersgd);

}  // namespace fastddp
