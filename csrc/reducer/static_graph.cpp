// static_graph's hook counts (Note [static graph]).
#include "static_graph.h"

#include "../util/message.h"

namespace fastddp {

bool StaticGraph::last_hook(size_t index, const std::string& name, int rank) {
  FASTDDP_CHECK(left_[index] > 0,
                "Your training graph has changed in this iteration, e.g., one parameter is "
                "unused in first iteration, but then got used in the second iteration. this is "
                "not compatible with static_graph set to True. Parameter '",
                name, "' on rank ", rank, ".");
  return --left_[index] == 0;
}

std::vector<size_t> StaticGraph::unused() const {
  std::vector<size_t> unused;
  for (size_t i = 0; i < expected_.size(); ++i) {
    if (expected_[i] == 0) unused.push_back(i);
  }
  return unused;
}

}  // namespace fastddp
