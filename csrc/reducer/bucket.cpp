// Buckets: their flat buffers, the parameters' places in them, bucket views and
// lazy buffers.
#include "bucket.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <utility>

#include "../util/message.h"
#include "../util/profile_range.h"
#include "../util/step_cost.h"

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

int64_t Bucket::payload_numel() const {
  int64_t n = 0;
  for (int64_t k : numels) n += k;
  return n;
}

bool Bucket::padded() const {
  int64_t next = 0;
  for (size_t k = 0; k < numels.size(); ++k) {
    if (offsets[k] != next) return true;
    next += numels[k];
  }
  return next != flat.numel();
}

uint64_t Bucket::next_bucket_id() {
  static std::atomic<uint64_t> next{1};
  return next.fetch_add(1, std::memory_order_relaxed);
}

Bucket Bucket::zeros_like() const {
  Bucket copy;
  // On the bucket's device, also while this one is released (meta).
  copy.flat = at::zeros({flat.numel()}, flat.options().device(device));
  copy.device = device;
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

namespace {

int64_t round_up(int64_t n, int64_t multiple) { return (n + multiple - 1) / multiple * multiple; }

// Slot offsets of a dense bucket, and its length, with slots starting at
// multiples of `align` elements.
int64_t lay_out(Bucket& bucket, const std::vector<at::Tensor>& params, int64_t align) {
  int64_t total = 0;
  for (size_t index : bucket.params) {
    total = round_up(total, align);
    bucket.offsets.push_back(total);
    bucket.numels.push_back(params[index].numel());
    total += params[index].numel();
  }
  return round_up(total, align);
}

}  // namespace

std::vector<Bucket> make_buckets(const std::vector<at::Tensor>& params,
                                 const std::vector<std::vector<size_t>>& plan,
                                 const std::vector<bool>& sparse, int64_t align_bytes,
                                 std::optional<c10::ScalarType> dtype, bool lazy,
                                 int64_t shards) {
  FASTDDP_CHECK(align_bytes >= 0 && (align_bytes & (align_bytes - 1)) == 0,
                "fastddp: the bucket alignment must be 0 or a power of two, got ", align_bytes);
  FASTDDP_CHECK(shards >= 1, "fastddp: a bucket needs at least one shard, got ", shards);
  std::vector<Bucket> buckets(plan.size());
  // Per (device, dtype): the dense buckets and each one's start in the buffer.
  std::map<std::pair<std::string, c10::ScalarType>, std::vector<std::pair<size_t, int64_t>>>
      groups;
  std::map<std::pair<std::string, c10::ScalarType>, int64_t> group_numel;
  for (size_t b = 0; b < plan.size(); ++b) {
    Bucket& bucket = buckets[b];
    FASTDDP_CHECK(!plan[b].empty(), "fastddp: bucket ", b, " of the plan is empty");
    const at::Tensor& first = params.at(plan[b].front());
    if (!sparse.empty() && sparse.at(plan[b].front())) {
      FASTDDP_CHECK(plan[b].size() == 1, "fastddp: bucket ", b, " holds parameter ",
                    plan[b].front(), ", which gets sparse gradients, and ", plan[b].size() - 1,
                    " others; a sparse gradient needs a bucket of its own");
      bucket.sparse = true;
      bucket.device = first.device();
      bucket.params = plan[b];
      bucket.offsets = {0};
      bucket.numels = {first.numel()};
      bucket.flat = at::empty({0}, first.options().requires_grad(false));
      bucket.views = {at::zeros({}, bucket.flat.options()).expand(first.sizes())};
      continue;
    }
    for (size_t index : plan[b]) {
      const at::Tensor& p = params.at(index);
      FASTDDP_CHECK(p.scalar_type() == first.scalar_type() && p.device() == first.device(),
                    "fastddp: bucket ", b, " mixes ", first.scalar_type(), " on ", first.device(),
                    " with ", p.scalar_type(), " on ", p.device(), " (parameter ", index, ")");
      bucket.params.push_back(index);
    }
    const c10::ScalarType type = dtype.value_or(first.scalar_type());
    const int64_t esize = static_cast<int64_t>(c10::elementSize(type));
    const int64_t align = std::max<int64_t>(1, align_bytes / esize);
    const auto key = std::make_pair(first.device().str(), type);
    int64_t& used = group_numel[key];
    groups[key].emplace_back(b, used);
    int64_t length = lay_out(bucket, params, align);
    // Note [sharded buckets]: `shards` equal shards, each starting aligned.
    if (shards > 1) length = shards * round_up((length + shards - 1) / shards, align);
    used += length;
  }
  // The layout over meta buffers (sizes and strides, no memory); allocate_flat
  // puts the real buffers behind it.
  for (const auto& [key, members] : groups) {
    const at::Tensor& like = params[buckets[members.front().first].params.front()];
    // In the group's dtype (reduce_dtype under mixed_precision): allocate_flat
    // allocates in the meta buffer's dtype, on the bucket's device.
    const at::Tensor buffer = at::empty(
        {group_numel[key]},
        like.options().dtype(key.second).requires_grad(false).device(at::kMeta));
    for (size_t m = 0; m < members.size(); ++m) {
      const auto [b, start] = members[m];
      const int64_t end = m + 1 < members.size() ? members[m + 1].second : group_numel[key];
      Bucket& bucket = buckets[b];
      bucket.device = like.device();
      bucket.flat = buffer.narrow(0, start, end - start);
      for (size_t k = 0; k < bucket.params.size(); ++k) {
        const at::Tensor& p = params[bucket.params[k]];
        if (p.is_non_overlapping_and_dense()) {
          bucket.views.push_back(bucket.flat.as_strided(
              p.sizes(), p.strides(), bucket.flat.storage_offset() + bucket.offsets[k]));
        } else {
          bucket.views.push_back(
              bucket.flat.narrow(0, bucket.offsets[k], bucket.numels[k]).view(p.sizes()));
        }
      }
    }
  }
  if (!lazy) allocate_flat(buckets, align_bytes);
  return buckets;
}

namespace {

// A buffer of `numel` elements for one (device, dtype), its start aligned to
// `align_bytes`; zeros where there is padding (Note [aligned flat buffer]).
at::Tensor new_buffer(int64_t numel, const at::TensorOptions& options, int64_t align_bytes) {
  const int64_t esize = static_cast<int64_t>(c10::elementSize(options.dtype().toScalarType()));
  if (align_bytes <= esize) return at::empty({numel}, options);
  // Zeros: the padding is reduced with the slots, so it must be finite.
  // Allocators align to 64 (CPU) or 512 (CUDA) bytes: room to align the start to more.
  const int64_t spare = align_bytes / esize;
  at::Tensor buffer = at::zeros({numel + spare}, options);
  const auto address = reinterpret_cast<uintptr_t>(buffer.data_ptr());
  const int64_t shift =
      static_cast<int64_t>((align_bytes - address % align_bytes) % align_bytes) / esize;
  return buffer.narrow(0, shift, numel);
}

// Zeros where no slot is: between the slots and after the last one.
void zero_gaps(Bucket& bucket) {
  int64_t next = 0;
  for (size_t k = 0; k <= bucket.numels.size(); ++k) {
    const int64_t start = k < bucket.numels.size() ? bucket.offsets[k] : bucket.flat.numel();
    if (start > next) bucket.flat.narrow(0, next, start - next).zero_();
    if (k < bucket.numels.size()) next = bucket.offsets[k] + bucket.numels[k];
  }
}

// Points the dense buckets' flat and views at one new buffer per (device,
// dtype), in bucket order (make_buckets' order), keeping the views' sizes and
// strides: real buffers, or meta ones (`meta`: released).
void rebind(std::vector<Bucket>& buckets, int64_t align_bytes, bool meta) {
  std::map<std::pair<std::string, c10::ScalarType>, std::vector<size_t>> groups;
  for (size_t b = 0; b < buckets.size(); ++b) {
    if (buckets[b].sparse) continue;
    groups[{buckets[b].device.str(), buckets[b].flat.scalar_type()}].push_back(b);
  }
  for (const auto& [key, members] : groups) {
    int64_t total = 0;
    for (size_t b : members) total += buckets[b].flat.numel();
    const Bucket& first = buckets[members.front()];
    const auto options = first.flat.options().device(meta ? c10::Device(at::kMeta) : first.device);
    const at::Tensor buffer = meta ? at::empty({total}, options)
                                   : new_buffer(total, options, align_bytes);
    // Packed slots (align_bytes 0) but padded buckets (Note [sharded buckets]): new_buffer
    // zeroed nothing, so the padding is zeroed here, and only the padding.
    const bool zero_padding = !meta && buffer.numel() && align_bytes <=
        static_cast<int64_t>(c10::elementSize(first.flat.scalar_type()));
    int64_t start = 0;
    for (size_t b : members) {
      Bucket& bucket = buckets[b];
      bucket.flat = buffer.narrow(0, start, bucket.flat.numel());
      start += bucket.flat.numel();
      if (zero_padding && bucket.padded()) zero_gaps(bucket);
      for (size_t k = 0; k < bucket.views.size(); ++k) {
        at::Tensor& view = bucket.views[k];
        view = bucket.flat.as_strided(view.sizes(), view.strides(),
                                      bucket.flat.storage_offset() + bucket.offsets[k]);
      }
    }
  }
}

}  // namespace

bool same_elements(const at::Tensor& a, const at::Tensor& b) {
  if (a.is_same(b)) return true;
  // Not is_alias_of: a handed-out gradient has a storage of its own over its slot.
  return a.defined() && b.defined() && a.has_storage() && b.has_storage() &&
         a.data_ptr() == b.data_ptr() && a.device() == b.device() &&
         a.scalar_type() == b.scalar_type() && a.sizes() == b.sizes() &&
         a.strides() == b.strides();
}

void allocate_flat(std::vector<Bucket>& buckets, int64_t align_bytes) {
  rebind(buckets, align_bytes, false);
}

void release_flat(std::vector<Bucket>& buckets) { rebind(buckets, 0, true); }

bool all_allocated(const std::vector<Bucket>& buckets) {
  for (const Bucket& bucket : buckets) {
    if (!bucket.allocated()) return false;
  }
  return true;
}

int64_t held_bytes(const std::vector<Bucket>& buckets) {
  std::set<const void*> seen;
  int64_t bytes = 0;
  for (const Bucket& bucket : buckets) {
    if (!bucket.flat.defined() || bucket.flat.is_meta()) continue;
    const c10::StorageImpl* storage = bucket.flat.storage().unsafeGetStorageImpl();
    if (seen.insert(storage).second) bytes += static_cast<int64_t>(storage->nbytes());
  }
  return bytes;
}

namespace {

// Copies the slots at src_offsets of `src` to dst_offsets of `dst`.
void copy_slots(const at::Tensor& src, const std::vector<int64_t>& src_offsets,
                const at::Tensor& dst, const std::vector<int64_t>& dst_offsets,
                const std::vector<int64_t>& numels) {
  std::vector<at::Tensor> srcs, dsts;
  for (size_t k = 0; k < numels.size(); ++k) {
    if (numels[k] == 0) continue;
    srcs.push_back(src.narrow(0, src_offsets[k], numels[k]));
    dsts.push_back(dst.narrow(0, dst_offsets[k], numels[k]));
  }
  if (!dsts.empty()) at::_foreach_copy_(dsts, srcs);
}

std::vector<int64_t> packed_offsets(const std::vector<int64_t>& numels) {
  std::vector<int64_t> offsets;
  int64_t total = 0;
  for (int64_t n : numels) {
    offsets.push_back(total);
    total += n;
  }
  return offsets;
}

}  // namespace

void pack_slots(const std::vector<int64_t>& offsets, const std::vector<int64_t>& numels,
                const at::Tensor& flat, const at::Tensor& packed) {
  const std::vector<int64_t> to = packed_offsets(numels);
  if (to == offsets) {
    const int64_t n = numels.empty() ? 0 : to.back() + numels.back();
    packed.narrow(0, 0, n).copy_(flat.narrow(0, 0, n));
    return;
  }
  copy_slots(flat, offsets, packed, to, numels);
}

void unpack_slots(const std::vector<int64_t>& offsets, const std::vector<int64_t>& numels,
                  const at::Tensor& packed, const at::Tensor& flat) {
  const std::vector<int64_t> from = packed_offsets(numels);
  if (from == offsets) {
    const int64_t n = numels.empty() ? 0 : from.back() + numels.back();
    flat.narrow(0, 0, n).copy_(packed.narrow(0, 0, n));
    return;
  }
  copy_slots(packed, from, flat, offsets, numels);
}

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
