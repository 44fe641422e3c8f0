// The parameters' places in the buckets, bucket views and lazy buffers.
#include "bucket_views.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/variable.h>

#include "../util/profile_range.h"
#include "../util/step_cost.h"

namespace fastddp {
namespace {

// Who refers to a tensor or its memory. torch's own test (is_tensor_stealable,
// which AccumulateGrad uses to take a gradient without a copy): a Python
// wrapper that only the tensor itself keeps alive is not a holder.
bool held_elsewhere(const at::Tensor& tensor, size_t expected) {
  return !torch::autograd::impl::is_tensor_stealable(tensor, expected);
}

// Moves a handed-out gradient's storage (over its bucket slot) to new memory
// of its own with the same bytes; the slot's DataPtr, which held the bucket's
// buffer alive, goes. Its bytes.
int64_t own_memory(c10::StorageImpl& storage) {
  const int64_t nbytes = static_cast<int64_t>(storage.nbytes());
  const c10::Device device = storage.device();
  const auto bytes = at::TensorOptions().dtype(at::kByte).device(device);
  at::Tensor fresh = at::empty({nbytes}, bytes);
  // On the current stream, before this backward's first copy-in writes the slot.
  fresh.copy_(at::from_blob(storage.mutable_data(), {nbytes}, bytes));
  storage.set_data_ptr_noswap(
      fresh.storage().unsafeGetStorageImpl()->set_data_ptr(at::DataPtr(nullptr, device)));
  return nbytes;
}

int64_t storage_refs(const c10::Storage& storage) {
  size_t refs = storage.use_count();
  if (refs >= 2 && storage.unsafeGetStorageImpl()->pyobj_slot()->has_unique_reference()) --refs;
  return static_cast<int64_t>(refs);
}

}  // namespace

void BucketViews::reset(std::vector<Bucket>& buckets, std::vector<at::Tensor>& params) {
  locator_.assign(params.size(), {0, 0});
  // A new layout: a gradient handed out over the old one is the user's
  // gradient now, written back into as any kept .grad (never replaced: it is
  // the same object under torch).
  handed_.assign(buckets.size(), {});
  for (size_t b = 0; b < buckets.size(); ++b) {
    Bucket& bucket = buckets[b];
    handed_[b].resize(bucket.params.size());
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

at::Tensor BucketViews::hand_out(const at::Tensor& grad, size_t index, const Bucket& bucket,
                                 size_t b, size_t k) {
  if (as_grads_ || lazy_ || bucket.sparse || !grad.defined()) return at::Tensor();
  const at::Tensor& view = bucket.views[k];
  // New (not .grad at the forward already: that one stays, as under torch)
  // and alone: nothing else refers to the tensor or to its memory.
  if (index < last_grads_.size() && last_grads_[index] &&
      last_grads_[index]->lock().get() == grad.unsafeGetTensorImpl()) {
    return at::Tensor();
  }
  const bool alone = !held_elsewhere(grad, 1) && grad.has_storage() &&
                     storage_refs(grad.storage()) == 1 && !grad.requires_grad();
  if (!alone || grad.scalar_type() != view.scalar_type() || grad.device() != view.device() ||
      grad.sizes() != view.sizes() || grad.strides() != view.strides()) {
    return at::Tensor();
  }
  // A storage of its own over the slot's bytes, which keeps the bucket's
  // memory alive until guard_reuse gives it memory of its own.
  at::Tensor slot = at::from_blob(
      view.data_ptr(), view.sizes(), view.strides(), [keep = view.storage()](void*) {},
      view.options());
  handed_[b][k].emplace(slot.storage().getWeakStorageImpl());
  return slot;
}

int64_t BucketViews::guard_reuse(std::vector<Bucket>& buckets,
                                 const std::vector<at::Tensor>& params) {
  int64_t moved = 0;
  for (size_t b = 0; b < handed_.size(); ++b) {
    for (size_t k = 0; k < handed_[b].size(); ++k) {
      auto& handed = handed_[b][k];
      if (!handed) continue;
      const c10::intrusive_ptr<c10::StorageImpl> storage = handed->lock();
      if (!storage) {  // dropped by everyone: its slot is free
        handed.reset();
        continue;
      }
      const at::Tensor& grad = params[buckets[b].params[k]].grad();
      // Still .grad: the user's gradient, written in place as under torch.
      if (grad.defined() && grad.has_storage() &&
          grad.storage().unsafeGetStorageImpl() == storage.get()) {
        continue;
      }
      // Alive but not .grad (a list of last step's gradients, an optimizer's
      // reference, a view of one): under torch it keeps last step's values.
      // Its storage gets memory of its own, with those values, under every
      // tensor that views it; the bucket stays where it is (and the memory
      // the holder keeps is the gradient's, not the whole buffer's).
      moved += own_memory(*storage);
      handed.reset();
    }
  }
  if (moved > 0) cost::add(cost::kKeptGradCopy, 2 * moved);  // read and written once
  return moved;
}

void BucketViews::note_grads(const std::vector<at::Tensor>& params) {
  if (as_grads_ || lazy_) return;
  last_grads_.resize(params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    const at::Tensor& grad = params[i].grad();
    last_grads_[i].reset();
    if (grad.defined()) last_grads_[i].emplace(grad.getIntrusivePtr());
  }
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
