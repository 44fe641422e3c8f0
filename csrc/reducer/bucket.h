// A bucket: one flat gradient buffer shared by several parameters, reduced by
// a single collective.
#pragma once

#include <ATen/Tensor.h>
#include <ATen/core/ivalue.h>
#include <c10/util/intrusive_ptr.h>

#include <cstdint>
#include <optional>
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
// handed out] in bucket_views.h), so that copying one into the other moves
// nothing.
bool same_elements(const at::Tensor& a, const at::Tensor& b);

// Allocates the buckets of a plan over `params` (Note [aligned flat buffer]).
// Every bucket must hold parameters of a single dtype and device.
// `sparse[i]`: parameter i gets sparse gradients (empty: none does).
// `align_bytes`: 0 packs the slots; else a power of two that every slot's
// start is rounded up to. `dtype`: the buffers' dtype when not the
// parameters' (mixed_precision's reduce_dtype, Note [mixed precision]).
// `lazy`: released buffers (Note [lazy bucket storage]).
std::vector<Bucket> make_buckets(const std::vector<at::Tensor>& params,
                                 const std::vector<std::vector<size_t>>& plan,
                                 const std::vector<bool>& sparse, int64_t align_bytes,
                                 std::optional<c10::ScalarType> dtype = std::nullopt,
                                 bool lazy = false);

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

}  // namespace fastddp
