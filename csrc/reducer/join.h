// The reducer's state for join() (uneven inputs): the zero buckets a rank
// without data reduces in the others' order, and the divisor of the next
// backward's sum under join(divide_by_initial_world_size=False).
#pragma once

#include <cstdint>
#include <vector>

#include "bucket.h"

namespace fastddp {

class JoinShadow {
 public:
  // Zero copies of `buckets`, made on first use and kept across join
  // iterations (hooks key per-bucket state by Bucket::id); with lazy buckets,
  // their buffers allocated now (release() gives them back).
  std::vector<Bucket>& buckets_for(const std::vector<Bucket>& buckets, bool lazy,
                                   int64_t align_bytes);
  void release() { release_flat(shadows_); }
  // The buckets were rebuilt: new shadows at the next use.
  void forget() { shadows_.clear(); }
  int64_t held_bytes() const { return fastddp::held_bytes(shadows_); }

  // The next backward's sum is divided by `factor` (the ranks still training);
  // 0: by the world size, as after every synchronized backward.
  void set_divide_factor(int64_t factor) { divide_factor_ = factor; }
  int64_t divide_factor(int world_size) const {
    return divide_factor_ > 0 ? divide_factor_ : world_size;
  }

 private:
  std::vector<Bucket> shadows_;
  int64_t divide_factor_ = 0;
};

}  // namespace fastddp
