// Bucket planning: which gradients share a flat buffer and one collective.
//
// Torch-free on purpose (docs/design.md, "Layout": csrc/core/ is the torch-free
// layer): the Catch2 tests build this without LibTorch, so an ATen include here
// fails to compile.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace fastddp {

// DDP's default bucket sizes, as torch's: bucket_cap_mb=25, and a first bucket
// of 1 MiB (torch.distributed._DEFAULT_FIRST_BUCKET_BYTES). The one definition:
// the reducer's options and the bindings read them here, Python as
// fastddp._C.DEFAULT_BUCKET_CAP_BYTES and DEFAULT_FIRST_BUCKET_BYTES.
inline constexpr size_t kDefaultBucketCapBytes = 25 * 1024 * 1024;
inline constexpr size_t kDefaultFirstBucketBytes = 1024 * 1024;

// What the planner needs to know about one parameter's gradient.
struct TensorSpec {
  int64_t numel = 0;
  int64_t element_size = 0;  // bytes per element
  int32_t dtype = 0;         // any code; equal codes share buckets
  int32_t device = 0;        // any code; equal codes share buckets
  bool sparse = false;       // a sparse gradient always gets a bucket of its own

  int64_t bytes() const { return numel * element_size; }
};

// The result of planning: bucket b holds the parameters `buckets[b]`, in the
// order their gradients are laid out in the flat buffer.
struct BucketPlan {
  std::vector<std::vector<size_t>> buckets;
  // The size limit that was in force when each bucket was closed (0 for sparse).
  std::vector<size_t> size_limits;

  size_t num_buckets() const { return buckets.size(); }
};

// Note [bucket assignment]
// Mirrors torch.distributed._compute_bucket_assignment_by_size so that a model
// gets the same buckets under fastddp as under torch DDP:
//  - tensors are visited in the given order and grouped by (dtype, device);
//  - each group walks through `size_limits`: a bucket is closed as soon as its
//    byte size reaches the current limit, and the group then moves on to the
//    next limit (the last one repeats);
//  - when `order` is empty, tensor i has index i and the buckets are sorted by
//    their smallest index; otherwise tensor i has index order[i] (the observed
//    grad-ready order) and buckets keep the order in which they were closed,
//    the unfinished ones last, in the order their group first appeared.
// Throws std::invalid_argument on an empty limit list or a bad `order`.
BucketPlan plan_buckets(const std::vector<TensorSpec>& tensors,
                        const std::vector<size_t>& size_limits,
                        const std::vector<size_t>& order = {});

// The buckets a reducer starts with, in the order it reduces them: the plan of
// plan_buckets in the given (forward) order, its buckets reversed. Backward makes
// the last parameters' gradients ready first, so their bucket is reduced first;
// torch DDP hands its Reducer `reversed(_compute_bucket_assignment_by_size(...))`
// for the same reason. DDP's constructor takes it from here (_C.initial_bucket_plan)
// and passes it to the Reducer unchanged.
BucketPlan plan_initial_buckets(const std::vector<TensorSpec>& tensors,
                                const std::vector<size_t>& size_limits);

// Plans the rebuilt buckets from the order in which gradients became ready,
// as torch's Reducer does after its first iteration (its limits are
// {first_bucket_bytes, bucket_bytes_cap}, or the user's per-bucket list).
// `ready_order` lists every parameter index into `tensors` exactly once.
BucketPlan plan_buckets_from_ready_order(const std::vector<TensorSpec>& tensors,
                                         const std::vector<size_t>& ready_order,
                                         const std::vector<size_t>& size_limits);

}  // namespace fastddp
