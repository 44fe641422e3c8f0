// join()'s shadow buckets.
#include "join_shadow.h"

namespace fastddp {

std::vector<Bucket>& JoinShadow::buckets_for(const std::vector<Bucket>& buckets, bool lazy,
                                             int64_t align_bytes) {
  if (shadows_.size() != buckets.size()) {
    shadows_.clear();
    for (const Bucket& bucket : buckets) shadows_.push_back(bucket.zeros_like());
  }
  if (lazy && !all_allocated(shadows_)) allocate_flat(shadows_, align_bytes);
  return shadows_;
}

}  // namespace fastddp
