#include "lowrank.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

#include "../../kernels/lowrank.h"

namespace fastddp {
namespace {

bool fused(std::initializer_list<const at::Tensor*> tensors) {
  for (const at::Tensor* t : tensors) {
    if (!t->device().is_cpu() || t->scalar_type() != at::kFloat || !t->is_contiguous()) {
      return false;
    }
  }
  return true;
}

// For each (n, m) matrix b of the batch: Q[b] (m x r) transposed once into
// a cached r x m copy, then fn(b, q_t, row_begin, row_end) over row ranges
// in parallel, about 64K elements per task (small matrices stay on one thread).
template <typename Fn>
void rows_against_q_t(const at::Tensor& q, int64_t n, int64_t m, const Fn& fn) {
  const int64_t batch = q.size(0), r = q.size(2);
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(m, 1));
  std::vector<float> q_t(static_cast<size_t>(r * m));
  for (int64_t b = 0; b < batch; ++b) {
    kernels::transpose_cpu(q.data_ptr<float>() + b * m * r, m, r, q_t.data());
    at::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) {
      fn(b, q_t.data(), begin, end);
    });
  }
}

}  // namespace

void lowrank_project(const at::Tensor& mats, const at::Tensor& q, at::Tensor& p) {
  if (!fused({&mats, &q, &p})) {
    at::bmm_out(p, mats, q);
    return;
  }
  const int64_t n = mats.size(1), m = mats.size(2), r = q.size(2);
  rows_against_q_t(q, n, m, [&](int64_t b, const float* q_t, int64_t begin, int64_t end) {
    kernels::lowrank_project_cpu(mats.data_ptr<float>() + b * n * m, m, q_t, r,
                                 p.data_ptr<float>() + b * n * r, begin, end);
  });
}

void lowrank_back_project(const at::Tensor& mats, const at::Tensor& p, at::Tensor& q) {
  if (!fused({&mats, &p, &q})) {
    at::bmm_out(q, mats.transpose(1, 2), p);
    return;
  }
  const int64_t batch = mats.size(0), n = mats.size(1), m = mats.size(2), r = p.size(2);
  // Every row adds into all of Q^T: one matrix per task.
  at::parallel_for(0, batch, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> q_t(static_cast<size_t>(r * m));
    for (int64_t b = begin; b < end; ++b) {
      kernels::lowrank_back_project_cpu(mats.data_ptr<float>() + b * n * m, n, m,
                                        p.data_ptr<float>() + b * n * r, r, q_t.data());
      kernels::transpose_cpu(q_t.data(), r, m, q.data_ptr<float>() + b * m * r);
    }
  });
}

void lowrank_expand(const at::Tensor& p, const at::Tensor& q, at::Tensor& out,
                    const at::Tensor& src, at::Tensor err) {
  const bool with_error = src.defined();
  if (!fused({&p, &q, &out}) || (with_error && !fused({&src, &err}))) {
    at::bmm_out(out, p, q.transpose(1, 2));
    if (with_error) at::sub_out(err, src, out);
    return;
  }
  const int64_t n = out.size(1), m = out.size(2), r = p.size(2);
  rows_against_q_t(q, n, m, [&](int64_t b, const float* q_t, int64_t begin, int64_t end) {
    const int64_t offset = b * n * m;
    kernels::lowrank_expand_cpu(p.data_ptr<float>() + b * n * r, q_t, m, r,
                                out.data_ptr<float>() + offset,
                                with_error ? src.data_ptr<float>() + offset : nullptr,
                                with_error ? err.data_ptr<float>() + offset : nullptr, begin, end);
  });
}

}  // namespace fastddp
