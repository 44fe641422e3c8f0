// find_unused_parameters' accounting (Note [unused parameters] in reducer.h):
// which parameters this rank's graph leaves unused, a used-bitmap of the
// gradients that arrived, and its allreduce, read only by a rank that has a
// locally unused parameter.
#pragma once

#include <ATen/Tensor.h>
#include <c10/core/Device.h>
#include <c10/util/intrusive_ptr.h>

#include <cstddef>
#include <vector>

namespace c10d {
class ProcessGroup;
class Work;
}  // namespace c10d

namespace fastddp {

class UnusedParameters {
 public:
  UnusedParameters() = default;
  UnusedParameters(size_t num_params, const at::Device& device);

  // A new backward: its unused parameters are not marked ready yet.
  void begin_step() { marked_ = false; }
  // This iteration's unused parameters, in increasing order.
  void set(std::vector<size_t> unused) { unused_ = std::move(unused); }
  void clear() { unused_.clear(); }
  const std::vector<size_t>& list() const { return unused_; }
  bool contains(size_t index) const;
  // True once per backward, at its first hook: the moment to mark the unused
  // parameters ready.
  bool take_marking();

  // A gradient arrived for parameter `index` (no_sync steps included).
  void note_used(size_t index);
  // Starts the allreduce of the used-bitmap. Never waits.
  void launch_allreduce(c10d::ProcessGroup& group);
  // No training rank used parameter `index`: only a locally unused parameter
  // waits for the bitmap (a host sync on CUDA, as in torch).
  bool globally_unused(size_t index);
  // The end of backward: the bitmap's allreduce is done.
  void wait();
  // join(): a shadow step's all-zero bitmap, reduced at once.
  void reduce_zeros(c10d::ProcessGroup& group);
  // Forget the gradients seen; `unread`: the next read waits for a new allreduce.
  void zero(bool unread);

 private:
  std::vector<size_t> unused_;
  bool marked_ = false;
  at::Tensor map_;      // int32 on the CPU: 1 where a grad arrived
  at::Tensor map_dev_;  // its copy on the parameters' device, allreduced
  c10::intrusive_ptr<c10d::Work> work_;
  bool reduced_ = false;  // map_ holds the allreduced bitmap
};

}  // namespace fastddp
