// Where each parameter's gradient lives in the buckets, and the three ways the
// buckets' storage is shared with the user: gradient_as_bucket_view (param.grad
// is its bucket view: no copy in or out), gradients handed out (the default's
// one pass, Note [gradients handed out]) and lazy_bucket_allocation (the flat
// buffers exist only while a backward reduces, Note [lazy bucket storage] in
// bucket.h).
//
// Note [gradients handed out]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~
// torch's reducer copies each gradient into its bucket and, after the
// reduction, the bucket back into .grad: two passes over the gradients where
// the reduction needs one. In the common step, `optimizer.zero_grad()` with
// set_to_none=True, .grad is None when backward reaches a parameter and
// autograd makes a new tensor for it, which nothing else refers to. At the
// write-back such a gradient is replaced by a tensor over its bucket slot,
// where the reduction's result already is: no copy back, and autograd's
// tensor is freed. The handed-out tensor is what torch's would be: the
// parameter's dtype, shape and strides, a storage of its own of exactly its
// bytes at offset 0 (over the slot's memory, which the storage keeps alive:
// torch.save and deepcopy see only the gradient), not a view (detach_()
// works), a new object each step, nothing kept by the reducer but weak
// references.
//
// Replaced only when nobody could tell: the gradient was not already .grad at
// the synchronized forward (that object stays, as under torch: a gradient
// kept by zero_grad(set_to_none=False) or accumulated under no_sync(), a
// tensor the user assigned), and nothing else refers to it or to its memory
// (torch's own test, is_tensor_stealable).
//
// The next backward writes into the buckets again. A handed-out gradient that
// is still .grad is the user's gradient, and torch writes into that in place
// too (the copy-in reads it from its slot, in place). One that is no longer
// .grad but is still alive (a list of last step's gradients, an optimizer that
// keeps them, a view of one) must keep its values, as under torch: before the
// backward's first copy-in (guard_reuse) its storage gets memory of its own,
// a copy of its bytes, under every tensor that views it (cost::kKeptGradCopy
// counts it). The buckets never move, and a holder keeps the gradient's
// bytes alive, not the whole buffer's.
//
// For whole configurations the write-back stays: gradient_as_bucket_view
// (its own contract), lazy buckets (which must not outlive the backward),
// mixed_precision (buckets in another dtype), find_unused_parameters and
// static_graph (a parameter unused on every rank keeps its .grad while its
// slot is reduced), check_for_nan_in_grad (a failed step leaves the local
// gradients in .grad, which a kept slot would not), distributed autograd.
// docs/arguments.md lists them.
#pragma once

#include <ATen/Tensor.h>

#include <cstddef>
#include <cstdint>
#include <optional>
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

  // Note [gradients handed out]. At the write-back of slot k of bucket b,
  // parameter `index`'s gradient: where it is new and nothing else refers to
  // it, the tensor over its slot to replace it with once the result is there
  // (undefined: keep the gradient).
  at::Tensor hand_out(const at::Tensor& grad, size_t index, const Bucket& bucket, size_t b,
                      size_t k);
  // Before a synchronized backward's first copy-in: a gradient handed out
  // earlier that is alive but no longer .grad gets memory of its own (a copy
  // of its bytes), so that the copy-in does not overwrite it. Bytes moved.
  int64_t guard_reuse(std::vector<Bucket>& buckets, const std::vector<at::Tensor>& params);
  // At a synchronized forward: which tensor each .grad is, so that its
  // backward keeps the same ones (made earlier: kept from the last step, or
  // accumulated under no_sync(), as torch keeps them).
  void note_grads(const std::vector<at::Tensor>& params);

  // Lazy buckets: the flat buffers for this backward, and their release
  // after the write-back (a no-op without lazy_bucket_allocation).
  void allocate(std::vector<Bucket>& buckets) const;
  void release(std::vector<Bucket>& buckets) const;

 private:
  bool as_grads_ = false;  // gradient_as_bucket_view
  bool lazy_ = false;      // lazy_bucket_allocation
  int64_t align_bytes_ = 0;
  std::vector<std::pair<size_t, size_t>> locator_;  // per parameter: bucket, slot
  // Note [gradients handed out], weak references only: per bucket and slot,
  // the storage of the tensor last handed out over it; per parameter, its
  // .grad at the synchronized forward.
  using WeakStorage = c10::weak_intrusive_ptr<c10::StorageImpl>;
  using WeakTensor = c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>;
  std::vector<std::vector<std::optional<WeakStorage>>> handed_;
  std::vector<std::optional<WeakTensor>> last_grads_;
};

}  // namespace fastddp
