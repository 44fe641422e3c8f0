// Where each parameter's gradient lives in the buckets, and the two ways the
// buckets' storage is shared with the user: gradient_as_bucket_view (param.grad
// is its bucket view: no copy in or out) and lazy_bucket_allocation (the flat
// buffers exist only while a backward reduces, Note [lazy bucket storage] in
// bucket.h).
#pragma once

#include <ATen/Tensor.h>

#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include "bucket.h"

namespace fastddp {

class BucketViews {
 public:
  BucketViews() = default;
  BucketViews(bool as_grads, bool lazy, int64_t align_bytes)
      : as_grads_(as_grads), lazy_(lazy), align_bytes_(align_bytes) {}

  // A new layout: where each of `params` lives, and under
  // gradient_as_bucket_view their existing grads moved into the views.
  void reset(std::vector<Bucket>& buckets, std::vector<at::Tensor>& params);
  // Parameter `index`'s bucket and slot.
  std::pair<size_t, size_t> locate(size_t index) const { return locator_[index]; }
  // After `grad` was copied into `view`: under gradient_as_bucket_view it
  // becomes the view. Whether it was replaced.
  bool adopt(at::Tensor& grad, const at::Tensor& view, bool sparse) const;

  // Lazy buckets: the flat buffers for this backward, and their release
  // after the write-back (a no-op without lazy_bucket_allocation).
  void allocate(std::vector<Bucket>& buckets) const;
  void release(std::vector<Bucket>& buckets) const;

 private:
  bool as_grads_ = false;  // gradient_as_bucket_view
  bool lazy_ = false;      // lazy_bucket_allocation
  int64_t align_bytes_ = 0;
  std::vector<std::pair<size_t, size_t>> locator_;  // per parameter: bucket, slot
};

}  // namespace fastddp
