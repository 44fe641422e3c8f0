#include "bucket.h"

#include <ATen/ATen.h>

namespace fastddp {

TensorSpec spec_of(const at::Tensor& tensor, bool expect_sparse) {
  TensorSpec s;
  s.numel = tensor.numel();
  s.element_size = static_cast<int64_t>(tensor.element_size());
  s.dtype = static_cast<int32_t>(tensor.scalar_type());
  // Distinct for every (device type, index), including index -1.
  s.device = static_cast<int32_t>(tensor.device().type()) * 1024 + tensor.device().index() + 1;
  s.sparse = expect_sparse;
  return s;
}

int64_t Bucket::bytes() const { return flat.numel() * static_cast<int64_t>(flat.element_size()); }

Bucket Bucket::zeros_like() const {
  Bucket copy;
  copy.flat = at::zeros_like(flat);
  copy.params = params;
  copy.offsets = offsets;
  copy.numels = numels;
  copy.sparse = sparse;
  if (sparse) {
    copy.views = views;
    return copy;
  }
  for (size_t k = 0; k < views.size(); ++k) {
    copy.views.push_back(copy.flat.as_strided(views[k].sizes(), views[k].strides(), offsets[k]));
  }
  return copy;
}

std::vector<Bucket> make_buckets(const std::vector<at::Tensor>& params,
                                 const std::vector<std::vector<size_t>>& plan,
                                 const std::vector<bool>& sparse) {
  std::vector<Bucket> buckets(plan.size());
  for (size_t b = 0; b < plan.size(); ++b) {
    Bucket& bucket = buckets[b];
    TORCH_CHECK(!plan[b].empty(), "fastddp: bucket ", b, " of the plan is empty");
    const at::Tensor& first = params.at(plan[b].front());
    if (!sparse.empty() && sparse.at(plan[b].front())) {
      TORCH_CHECK(plan[b].size() == 1, "fastddp: bucket ", b, " holds parameter ",
                  plan[b].front(), ", which gets sparse gradients, and ", plan[b].size() - 1,
                  " others; a sparse gradient needs a bucket of its own");
      bucket.sparse = true;
      bucket.params = plan[b];
      bucket.offsets = {0};
      bucket.numels = {first.numel()};
      bucket.flat = at::empty({0}, first.options().requires_grad(false));
      bucket.views = {at::zeros({}, bucket.flat.options()).expand(first.sizes())};
      continue;
    }
    int64_t total = 0;
    for (size_t index : plan[b]) {
      const at::Tensor& p = params.at(index);
      TORCH_CHECK(p.scalar_type() == first.scalar_type() && p.device() == first.device(),
                  "fastddp: bucket ", b, " mixes ", first.scalar_type(), " on ", first.device(),
                  " with ", p.scalar_type(), " on ", p.device(), " (parameter ", index, ")");
      bucket.params.push_back(index);
      bucket.offsets.push_back(total);
      bucket.numels.push_back(p.numel());
      total += p.numel();
    }
    bucket.flat = at::empty({total}, first.options().requires_grad(false));
    for (size_t k = 0; k < bucket.params.size(); ++k) {
      const at::Tensor& p = params[bucket.params[k]];
      if (p.is_non_overlapping_and_dense()) {
        bucket.views.push_back(bucket.flat.as_strided(p.sizes(), p.strides(), bucket.offsets[k]));
      } else {
        bucket.views.push_back(
            bucket.flat.narrow(0, bucket.offsets[k], bucket.numels[k]).view(p.sizes()));
      }
    }
  }
  return buckets;
}

}  // namespace fastddp
