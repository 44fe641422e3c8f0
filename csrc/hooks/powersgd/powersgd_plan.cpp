#include "powersgd_plan.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>

#include "orthogonalize.h"
#include "../../util/message.h"
#include "../../util/step_cost.h"

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

}  // namespace

PowerSGDPlan plan_powersgd(const Bucket& bucket, const PowerSGDOptions& o) {
  PowerSGDPlan plan;
  for (size_t k = 0; k < bucket.views.size(); ++k) {
    const int64_t numel = bucket.numels[k];
    // torch's per-tensor view: tensor.view(tensor.shape[0], -1) over the
    // slot's slice (row-major, as torch's contiguous bucket views).
    const int64_t n = bucket.views[k].dim() > 0 ? bucket.views[k].size(0) : 1;
    const int64_t m = n > 0 ? numel / n : 0;
    const int64_t r = std::min({n, m, o.matrix_approximation_rank});
    const int64_t compressed = (n + m) * r;
    plan.numel_before += numel;
    if (!(static_cast<double>(compressed) * o.min_compression_rate < static_cast<double>(numel))) {
      plan.numel_after += numel;
      plan.uncompressed.push_back(k);
      plan.uncompressed_numel += numel;
      continue;
    }
    plan.numel_after += compressed;
    PowerSGDMatrix mat{k, bucket.offsets[k], n, m, r, 0, 0};
    auto group = std::find_if(plan.groups.begin(), plan.groups.end(), [&](const auto& g) {
      return g.front().n == n && g.front().m == m;
    });
    if (group == plan.groups.end()) {
      plan.groups.push_back({std::move(mat)});
    } else {
      group->push_back(std::move(mat));
    }
  }
  // Group order is memory order, batched or not.
  for (auto& group : plan.groups) {
    for (PowerSGDMatrix& mat : group) {
      mat.p_offset = plan.p_numel;
      mat.q_offset = plan.q_numel;
      plan.p_numel += mat.n * mat.r;
      plan.q_numel += mat.m * mat.r;
    }
  }
  return plan;
}

PowerSGDWork make_powersgd_work(const PowerSGDPlan& plan, const PowerSGDOptions& o,
                                const at::Tensor& source, const at::Tensor& dest,
                                const at::Tensor& p_memory, const at::Tensor& q_memory,
                                const at::Tensor& p_read, const at::Tensor& q_read) {
  PowerSGDWork work;
  auto matrix = [](const at::Tensor& flat, const PowerSGDMatrix& mat) {
    return flat.narrow(0, mat.offset, mat.n * mat.m).view({mat.n, mat.m});
  };
  auto p_view = [&](const PowerSGDMatrix& first, int64_t count, const at::Tensor& memory) {
    return memory.narrow(0, first.p_offset, count * first.n * first.r)
        .view({count, first.n, first.r});
  };
  auto q_view = [&](const PowerSGDMatrix& first, int64_t count, const at::Tensor& memory) {
    return memory.narrow(0, first.q_offset, count * first.m * first.r)
        .view({count, first.m, first.r});
  };
  for (const auto& group : plan.groups) {
    const auto count = static_cast<int64_t>(group.size());
    work.p_groups.push_back(p_view(group.front(), count, p_memory));
    work.q_groups.push_back(q_view(group.front(), count, q_memory));
    if (p_read.defined()) work.p_read_groups.push_back(p_view(group.front(), count, p_read));
    if (q_read.defined()) work.q_read_groups.push_back(q_view(group.front(), count, q_read));
    if (o.batch_tensors_with_same_shape && count > 1) {
      PowerSGDBatch batch;
      std::vector<at::Tensor> views;
      views.reserve(group.size());
      for (const PowerSGDMatrix& mat : group) {
        views.push_back(matrix(source, mat));
        batch.unstack.push_back(matrix(dest, mat));
      }
      batch.matrices = at::stack(views);
      batch.out = batch.matrices;  // torch decompresses into the stack, then copies back
      batch.p = p_view(group.front(), count, p_memory);
      batch.q = q_view(group.front(), count, q_memory);
      work.batches.push_back(std::move(batch));
      continue;
    }
    for (const PowerSGDMatrix& mat : group) {
      work.batches.push_back(
          {matrix(source, mat).unsqueeze(0), matrix(dest, mat).unsqueeze(0), {},
           p_view(mat, 1, p_memory), q_view(mat, 1, q_memory), mat.offset});
    }
  }
  return work;
}

PowerSGDWork PowerSGDWorkCache::get(const PowerSGDPlan& plan, const PowerSGDOptions& options,
                                    const std::vector<int64_t>& offsets,
                                    const std::vector<int64_t>& numels,
                                    const at::Tensor& source, const at::Tensor& dest,
                                    const at::Tensor& p_memory, const at::Tensor& q_memory,
                                    const at::Tensor& error, const at::Tensor& p_read,
                                    const at::Tensor& q_read, bool keep) {
  Viewed of{};  // on the stack: this runs per bucket per step
  size_t i = 0;
  for (const at::Tensor* t : {&source, &dest, &p_memory, &q_memory, &error, &p_read, &q_read}) {
    of[i++] = t->defined() ? reinterpret_cast<intptr_t>(t->data_ptr()) : 0;
    of[i++] = t->defined() ? t->numel() : -1;
  }
  for (const Kept& k : kept_) {
    if (k.set && k.of == of) return k.work;  // a copy: the tensors' handles, no data
  }
  // A third set: moved, keep nothing from now on.
  if (keep && kept_[next_].set && kept_[1 - next_].set) {
    moving_ = true;
    kept_ = {};
  }
  PowerSGDWork work =
      make_powersgd_work(plan, options, source, dest, p_memory, q_memory, p_read, q_read);
  if (error.defined()) {
    for (PowerSGDBatch& b : work.batches) {
      if (b.unstack.empty()) b.error = error.narrow(0, b.offset, b.out.numel()).view_as(b.out);
    }
  }
  for (size_t k : plan.uncompressed) {
    work.uncompressed_source.push_back(source.narrow(0, offsets[k], numels[k]));
    work.uncompressed_dest.push_back(dest.narrow(0, offsets[k], numels[k]));
    if (error.defined()) {
      work.uncompressed_error.push_back(error.narrow(0, offsets[k], numels[k]));
    }
  }
  if (!keep || moving_ || options.batch_tensors_with_same_shape) return work;
  kept_[next_] = {work, of, true};
  next_ = 1 - next_;
  return work;
}

void pack_uncompressed(const std::vector<at::Tensor>& slices, at::Tensor head) {
  if (!slices.empty()) at::cat_out(head, slices);
}

void unpack_uncompressed(at::Tensor head, int64_t world_size,
                         const std::vector<at::Tensor>& dests) {
  if (dests.empty()) return;
  head.div_(world_size);
  std::vector<at::Tensor> srcs;
  int64_t at_elem = 0;
  for (const at::Tensor& d : dests) {
    srcs.push_back(head.narrow(0, at_elem, d.numel()));
    at_elem += d.numel();
  }
  at::_foreach_copy_(dests, srcs);
}

void powersgd_orthogonalize(at::Tensor& matrices, double epsilon) {
  FASTDDP_CHECK(matrices.dim() == 3 && matrices.size(2) <= matrices.size(1),
                "fastddp powersgd_orthogonalize: matrices must be (batch, n, r) with r <= n, got ",
                matrices.sizes());
  if (fused_orthogonalize(matrices, epsilon)) return;
  const int64_t rank = matrices.size(2);
  const auto dtype = matrices.scalar_type();
  if (rank <= 2 || dtype == at::kHalf || dtype == at::kBFloat16) {
    gram_schmidt(matrices, epsilon);
  } else {
    // torch: linalg.qr(matrices, out=(matrices, R)); epsilon is not used.
    matrices.copy_(std::get<0>(at::linalg_qr(matrices)));
  }
}

void powersgd_orthogonalize_from(const at::Tensor& src, at::Tensor& matrices, double epsilon) {
  FASTDDP_CHECK(src.sizes() == matrices.sizes(),
                "fastddp powersgd_orthogonalize_from: src is ", src.sizes(), ", matrices ",
                matrices.sizes());
  if (fused_orthogonalize(matrices, epsilon, src)) return;
  matrices.copy_(src);
  cost::add(cost::kStateCopy, 2 * static_cast<int64_t>(matrices.nbytes()));
  powersgd_orthogonalize(matrices, epsilon);
}

}  // namespace fastddp
