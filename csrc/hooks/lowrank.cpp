#include "lowrank.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

#include "../kernels/lowrank.h"

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

// Rows per task: about 64K elements, so small matrices stay on one thread.
int64_t row_grain(int64_t m) { return std::max<int64_t>(1, 65536 / std::max<int64_t>(m, 1)); }

}  // namespace

void lowrank_project(const at::Tensor& mats, const at::Tensor& q, at::Tensor& p) {
  if (!fused({&mats, &q, &p})) {
    at::bmm_out(p, mats, q);
    return;
  }
  const int64_t batch = mats.size(0), n = mats.size(1), m = mats.size(2), r = q.size(2);
  std::vector<float> q_t(static_cast<size_t>(r * m));
  for (int64_t b = 0; b < batch; ++b) {
    const float* mat = mats.data_ptr<float>() + b * n * m;
    float* p_b = p.data_ptr<float>() + b * n * r;
    kernels::transpose_cpu(q.data_ptr<float>() + b * m * r, m, r, q_t.data());
    at::parallel_for(0, n, row_grain(m), [&](int64_t begin, int64_t end) {
      kernels::lowrank_project_cpu(mat, m, q_t.data(), r, p_b, begin, end);
    });
  }
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
  const int64_t batch = out.size(0), n = out.size(1), m = out.size(2), r = p.size(2);
  std::vector<float> q_t(static_cast<size_t>(r * m));
  for (int64_t b = 0; b < batch; ++b) {
    const float* p_b = p.data_ptr<float>() + b * n * r;
    float* out_b = out.data_ptr<float>() + b * n * m;
    const float* src_b = with_error ? src.data_ptr<float>() + b * n * m : nullptr;
    float* err_b = with_error ? err.data_ptr<float>() + b * n * m : nullptr;
    kernels::transpose_cpu(q.data_ptr<float>() + b * m * r, m, r, q_t.data());
    at::parallel_for(0, n, row_grain(m), [&](int64_t begin, int64_t end) {
      kernels::lowrank_expand_cpu(p_b, q_t.data(), m, r, out_b, src_b, err_b, begin, end);
    });
  }
}

}  // namespace fastddp
