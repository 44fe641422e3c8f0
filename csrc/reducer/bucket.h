// A bucket: one flat gradient buffer shared by several parameters, reduced by
// a single collective.
//
// BucketViews: where each parameter's gradient lives in the buckets, and the
// three ways the buckets' storage is shared with the user:
// gradient_as_bucket_view (param.grad is its bucket view: no copy in or out),
// gradients handed out (the default's one pass, Note [gradients handed out])
// and lazy_bucket_allocation (the flat buffers exist only while a backward
// reduces, Note [lazy bucket storage] below).
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
#include <ATen/core/ivalue.h>
#include <c10/util/intrusive_ptr.h>

#include <cstddef>
#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

#include "../core/bucket_plan.h"

namespace fastddp {

// Note [aligned flat buffer]
// The dense buckets of one (device, dtype) are slices of one zero-filled
// buffer, Megatron style, so that gradient_as_bucket_view puts every such
// .grad in one allocation. With an alignment of A bytes (ReducerOptions::
// align_bytes; 16 on CUDA by default, see fastddp/ddp/_options.py) every slot and
// every bucket starts A-aligned: the slot is padded up to the next multiple of
// A. Our CUDA kernels (casts, scaling, the non-finite check) and ATen's
// multi-tensor copies take their 16-byte vector path only when every tensor
// is aligned; a single parameter of odd size would otherwise drop a whole
// bucket to scalar accesses. The padding stays zero: every built-in hook maps
// zeros to zeros, and no slot's result reads it. Hooks that treat the bucket
// as one matrix (batched PowerSGD) pack the slots first, so their numbers do
// not depend on the padding. With A = 0 (the CPU default) slots are packed
// back to back, torch's layout, and GradBucket.buffer() is torch's.
//
// Note [lazy bucket storage]
// With lazy_bucket_allocation (torch 2.15) the reducer holds no bucket memory
// between backward passes: `flat` and `views` are then meta tensors of the
// same sizes and strides (the layout, and every size a hook or a report
// reads, stay valid; no memory behind them), allocate_flat() puts real
// buffers behind them when a backward's first gradient arrives, and
// release_flat() drops them after the write-back. Under gradient_as_bucket_view
// the .grad views keep their buffer alive, as torch's do; the next backward
// writes into a fresh one (torch 2.15 does too). Hooks key per-bucket state by
// `id`, which outlives the buffers, never by the buffer's address.
struct Bucket {
  // Contiguous buffer of the parameters' dtype (reduce_dtype under
  // mixed_precision), on their device: a slice of the (device, dtype) buffer,
  // padding included. On the meta device while released (Note [lazy bucket
  // storage]), in the same dtype.
  at::Tensor flat;
  // Where `flat` lives when allocated.
  c10::Device device = c10::Device(c10::kCPU);
  // This bucket's identity for the hooks' per-bucket state: unique in the
  // process, kept by copies, new for every Bucket constructed (a rebuild's,
  // join()'s shadows).
  uint64_t id = next_bucket_id();
  // Parameter indices (into the reducer's parameter list), in buffer order.
  std::vector<size_t> params;
  // views[k] aliases `flat` for params[k], with that parameter's shape and,
  // for dense parameters, its strides (so channels_last grads stay
  // channels_last, as torch's grad layout contract asks).
  std::vector<at::Tensor> views;
  std::vector<int64_t> offsets;  // in elements
  std::vector<int64_t> numels;

  // A bucket of one parameter whose gradient is sparse (nn.Embedding(sparse=True)),
  // as torch's reducer: `flat` is empty, views[0] only carries the parameter's
  // shape and options (a zero-stride expand), and the gradient itself travels
  // in `sparse_grad`. Only hooks whose supports_sparse() is true run on it.
  bool sparse = false;
  at::Tensor sparse_grad;

  // Per backward: gradients still missing, and the comm hook's reduction.
  size_t pending = 0;
  c10::intrusive_ptr<c10::ivalue::Future> future;

  int64_t bytes() const;
  // The parameters' elements, padding excluded.
  int64_t payload_numel() const;
  // Whether slots are not back to back from 0 to flat.numel() (padding).
  bool padded() const;
  // The same layout over a fresh zero-filled buffer (join() shadows the
  // collectives with it, leaving this bucket's gradients alone).
  Bucket zeros_like() const;
  // Whether `flat` has memory behind it (Note [lazy bucket storage]).
  bool allocated() const { return sparse || !flat.is_meta(); }

  static uint64_t next_bucket_id();
};

// What the planner needs to know of a tensor: its size, dtype and device.
TensorSpec spec_of(const at::Tensor& tensor, bool expect_sparse);

// Whether `a` and `b` are the same elements: one memory read through one
// layout (a slot's view and the gradient handed out over it, Note [gradients
// handed out] above), so that copying one into the other moves
// nothing.
bool same_elements(const at::Tensor& a, const at::Tensor& b);

// Allocates the buckets of a plan over `params` (Note [aligned flat buffer]).
// Every bucket must hold parameters of a single dtype and device.
// `sparse[i]`: parameter i gets sparse gradients (empty: none does).
// `align_bytes`: 0 packs the slots; else a power of two that every slot's
// start is rounded up to. `dtype`: the buffers' dtype when not the
// parameters' (mixed_precision's reduce_dtype, Note [mixed precision]).
// `lazy`: released buffers (Note [lazy bucket storage]). `shards`: every
// dense bucket's length a multiple of `shards` equal shards (Note [sharded
// buckets]).
//
// Note [sharded buckets]
// For the sharded optimizer (fastddp.optim.ShardedOptimizer) each rank owns
// one contiguous shard of every bucket: the bucket's length is padded with
// zeros up to `shards` equal shards, each a whole number of alignment units,
// so that a reduce-scatter of the bucket gives rank r elements
// [r * S, (r + 1) * S) with every shard starting aligned. The padding is zero
// (allocated zero-filled, never written), so the reduction and an elementwise
// optimizer step leave it zero.
std::vector<Bucket> make_buckets(const std::vector<at::Tensor>& params,
                                 const std::vector<std::vector<size_t>>& plan,
                                 const std::vector<bool>& sparse, int64_t align_bytes,
                                 std::optional<c10::ScalarType> dtype = std::nullopt,
                                 bool lazy = false, int64_t shards = 1);

// Note [lazy bucket storage]: one new buffer per (device, dtype) behind the
// dense buckets' flat and views, laid out as before (zero-filled where
// make_buckets fills zeros: the padding), in the dtype of the meta `flat`
// (make_buckets' `dtype`, so mixed_precision's reduce_dtype) on
// Bucket::device; release_flat: meta tensors again.
void allocate_flat(std::vector<Bucket>& buckets, int64_t align_bytes);
void release_flat(std::vector<Bucket>& buckets);
// Whether every dense bucket has its buffer.
bool all_allocated(const std::vector<Bucket>& buckets);
// Bytes of the distinct storages behind the buckets' flat buffers.
int64_t held_bytes(const std::vector<Bucket>& buckets);

// Slots (of `numels` elements at `offsets` of `flat`) back to back into
// `packed`, or back: one multi-tensor copy (ATen's _foreach_copy_), or one
// copy when the slots are packed already.
void pack_slots(const std::vector<int64_t>& offsets, const std::vector<int64_t>& numels,
                const at::Tensor& flat, const at::Tensor& packed);
void unpack_slots(const std::vector<int64_t>& offsets, const std::vector<int64_t>& numels,
                  const at::Tensor& packed, const at::Tensor& flat);

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
