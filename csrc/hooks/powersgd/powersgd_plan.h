// How the PowerSGD hook cuts a bucket into matrices (Note [powersgd]):
// which slots are compressed, how same-shape matrices are batched, and
// where each matrix's P and Q live in the bucket's P and Q memories.
#pragma once

#include <ATen/Tensor.h>

#include <array>
#include <cstdint>
#include <utility>
#include <vector>

#include "../../reducer/bucket.h"

namespace fastddp {

struct PowerSGDOptions {
  int64_t matrix_approximation_rank = 1;
  int64_t start_powerSGD_iter = 1000;
  double min_compression_rate = 2.0;
  bool use_error_feedback = true;
  bool warm_start = true;
  double orthogonalization_epsilon = 0.0;
  bool batch_tensors_with_same_shape = false;
  int64_t compression_stats_logging_frequency = 10000;
  int64_t iter = 0;  // the step to start counting from (a resumed PowerSGDState's iter)
};

// A compressed slot: its offset in the bucket (elements), its (n, m)
// matrix shape, rank r, and the offsets of its P (n x r) and Q (m x r) in the
// memories.
struct PowerSGDMatrix {
  size_t slot = 0;
  int64_t offset = 0;
  int64_t n = 0, m = 0, r = 0;
  int64_t p_offset = 0, q_offset = 0;
};

struct PowerSGDPlan {
  std::vector<size_t> uncompressed;  // slots sent as they are
  int64_t uncompressed_numel = 0;
  // Compressed matrices grouped by (n, m) in order of first appearance
  // (torch's order: it lays out P and Q and draws the random Q).
  std::vector<std::vector<PowerSGDMatrix>> groups;
  int64_t p_numel = 0, q_numel = 0;
  int64_t numel_before = 0, numel_after = 0;  // torch's compression statistics
};

// One bmm's worth: B same-shape matrices and their P, Q.
struct PowerSGDBatch {
  at::Tensor matrices;             // (B, n, m): a view of the source, or a stacked copy
  at::Tensor out;                  // (B, n, m): where P Q^T goes (a view, or stacked scratch)
  std::vector<at::Tensor> unstack;  // when stacked: the (n, m) destinations of `out`
  at::Tensor p, q;                 // (B, n, r), (B, m, r) views of the memories
  int64_t offset = -1;             // unstacked: the matrix's offset in the bucket
  at::Tensor error;                // unstacked, from PowerSGDWorkCache: the error's (B, n, m)
};

// A step's compression work: the bmm batches (torch's
// maybe_batched_tensors_to_compress), and every same-shape group's P and Q
// as one (B, n, r) / (B, m, r) view to orthogonalize in one call (the
// memories are laid out group by group, so these are plain views).
struct PowerSGDWork {
  std::vector<PowerSGDBatch> batches;
  std::vector<at::Tensor> p_groups, q_groups;
  // The same groups in the memories the step reads (the state, where the
  // step writes its factors into spares; empty where none was given): what
  // powersgd_orthogonalize_from orthogonalizes into p_groups / q_groups.
  std::vector<at::Tensor> p_read_groups, q_read_groups;
  // From PowerSGDWorkCache: the uncompressed slots of the source, the bucket
  // and the error (empty where the cache was given no error).
  std::vector<at::Tensor> uncompressed_source, uncompressed_dest, uncompressed_error;
};

// The bucket's layout only: no tensor is touched.
PowerSGDPlan plan_powersgd(const Bucket& bucket, const PowerSGDOptions& options);

// Views the matrices in `source` (M) and `dest` (where P Q^T goes; the same
// tensor without error feedback), both of the bucket's layout, stacking
// copies of same-shape matrices now when batch_tensors_with_same_shape.
// `p_read`, `q_read` (may be undefined): memories of p_memory's and
// q_memory's layout that the step reads its factors from.
PowerSGDWork make_powersgd_work(const PowerSGDPlan& plan, const PowerSGDOptions& options,
                                const at::Tensor& source, const at::Tensor& dest,
                                const at::Tensor& p_memory, const at::Tensor& q_memory,
                                const at::Tensor& p_read = {}, const at::Tensor& q_read = {});

// make_powersgd_work's views, made once per bucket state and handed out again
// while they view the same tensors: each view is a dispatched op, and they are
// ~10 per matrix per step, host time that on a GPU delays the launches behind
// it (reducer_cost.py --count). Stacked batches copy data, so
// batch_tensors_with_same_shape makes them afresh. `error` (may be undefined):
// the error feedback, also viewed per unstacked matrix (PowerSGDBatch::error).
// `p_read`, `q_read`: as make_powersgd_work's.
// It keeps two sets: a double-buffered state (Note [double-buffered step
// state]) swaps its buffers after every step that stands, so the tensors
// alternate between two sets of pointers. Once a third set comes
// (lazy_bucket_allocation gives the bucket a new buffer every backward,
// Note [lazy bucket storage]) it keeps nothing: kept views would hold the
// released buffers alive between steps. `keep` false: a step whose tensors
// will not come again (warm start's first, which draws Q and reads no
// state): made, not kept, and not counted as a set.
class PowerSGDWorkCache {
 public:
  // `offsets` and `numels`: the bucket's slots.
  PowerSGDWork get(const PowerSGDPlan& plan, const PowerSGDOptions& options,
                   const std::vector<int64_t>& offsets, const std::vector<int64_t>& numels,
                   const at::Tensor& source, const at::Tensor& dest, const at::Tensor& p_memory,
                   const at::Tensor& q_memory, const at::Tensor& error,
                   const at::Tensor& p_read = {}, const at::Tensor& q_read = {},
                   bool keep = true);

 private:
  // What a work views: the data pointer and size of each tensor get() is given.
  using Viewed = std::array<intptr_t, 14>;
  struct Kept {
    PowerSGDWork work;
    Viewed of{};
    bool set = false;
  };
  std::array<Kept, 2> kept_;
  size_t next_ = 0;  // the entry a new set of pointers goes into
  bool moving_ = false;
};

// The uncompressed slots (their views, PowerSGDWork::uncompressed_source), one
// after another into `head`: the front of a hook's wire.
void pack_uncompressed(const std::vector<at::Tensor>& slices, at::Tensor head);
// The reverse, once `head` is reduced (a sum): divided by the world size in place, then
// into the slots' views (PowerSGDWork::uncompressed_dest) in one multi-tensor copy (one
// launch on CUDA).
void unpack_uncompressed(at::Tensor head, int64_t world_size,
                         const std::vector<at::Tensor>& dests);

// torch's _orthogonalize on a batch of (n, r) matrices, in place: the fused
// kernels where they apply (float32/64, small r; r > 2 gives QR's columns up
// to sign), else torch's ops.
void powersgd_orthogonalize(at::Tensor& matrices, double epsilon);
// The same of `src` (only read; same shape, not overlapping) into `matrices`:
// a state's factor orthogonalized into its spare (Note [double-buffered step
// state]). The fused kernels read src in their first pass; torch's ops (the
// fallback) work in place on a copy, counted as a state copy.
void powersgd_orthogonalize_from(const at::Tensor& src, at::Tensor& matrices, double epsilon);

}  // namespace fastddp
