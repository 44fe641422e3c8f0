// The parameters' places in the buckets, bucket views and lazy buffers.
#include "bucket_views.h"

#include <ATen/ATen.h>

#include "../util/profile_range.h"

namespace fastddp {

void BucketViews::reset(std::vector<Bucket>& buckets, std::vector<at::Tensor>& params) {
  locator_.assign(params.size(), {0, 0});
  for (size_t b = 0; b < buckets.size(); ++b) {
    Bucket& bucket = buckets[b];
    for (size_t k = 0; k < bucket.params.size(); ++k) {
      locator_[bucket.params[k]] = {b, k};
      if (!as_grads_ || !bucket.allocated() || bucket.sparse) continue;
      // Existing grads move into the (new) buckets, as torch's reducer does
      // (lazily allocated buckets: the first backward's copy_in moves them).
      at::Tensor& grad = params[bucket.params[k]].mutable_grad();
      if (grad.defined() && !grad.is_alias_of(bucket.views[k])) {
        bucket.views[k].copy_(grad);
        grad = bucket.views[k];
      }
    }
  }
}

bool BucketViews::adopt(at::Tensor& grad, const at::Tensor& view, bool sparse) const {
  if (!as_grads_ || sparse || !grad.defined() || grad.is_alias_of(view)) return false;
  grad = view;
  return true;
}

void BucketViews::allocate(std::vector<Bucket>& buckets) const {
  FASTDDP_PROFILE_RANGE("fastddp allocate buckets");
  allocate_flat(buckets, align_bytes_);
}

void BucketViews::release(std::vector<Bucket>& buckets) const {
  // After the write-back: the gradients are in .grad (under
  // gradient_as_bucket_view the views keep their buffer alive themselves).
  if (lazy_) release_flat(buckets);
}

}  // namespace fastddp
