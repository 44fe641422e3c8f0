#include "bucket_plan.h"

#include <algorithm>
#include <stdexcept>
#include <string>
#include <utility>

namespace fastddp {
namespace {

struct OpenBucket {
  int32_t dtype;
  int32_t device;
  std::vector<size_t> indices;
  int64_t bytes = 0;
  size_t limit_pos = 0;  // position in the size-limit list for this group
  size_t limit = 0;      // the limit in force when the last tensor was added
};

}  // namespace

BucketPlan plan_buckets(const std::vector<TensorSpec>& tensors,
                        const std::vector<size_t>& size_limits,
                        const std::vector<size_t>& order) {
  if (size_limits.empty()) {
    throw std::invalid_argument("plan_buckets: size_limits must not be empty");
  }
  if (!order.empty() && order.size() != tensors.size()) {
    throw std::invalid_argument("plan_buckets: order has " + std::to_string(order.size()) +
                                " entries for " + std::to_string(tensors.size()) + " tensors");
  }

  std::vector<bool> seen(order.empty() ? 0 : tensors.size(), false);
  std::vector<std::pair<std::vector<size_t>, size_t>> closed;
  // A handful of (dtype, device) groups at most: a linear scan beats a map.
  std::vector<OpenBucket> open;

  for (size_t i = 0; i < tensors.size(); ++i) {
    const TensorSpec& t = tensors[i];
    const size_t index = order.empty() ? i : order[i];
    if (index >= tensors.size() || (!order.empty() && seen[index])) {
      throw std::invalid_argument("plan_buckets: order[" + std::to_string(i) + "] = " +
                                  std::to_string(index) + " is out of range or repeated");
    }
    if (!order.empty()) seen[index] = true;
    if (t.sparse) {
      closed.emplace_back(std::vector<size_t>{index}, 0);
      continue;
    }
    auto it = std::find_if(open.begin(), open.end(), [&](const OpenBucket& b) {
      return b.dtype == t.dtype && b.device == t.device;
    });
    if (it == open.end()) {
      open.push_back(OpenBucket{t.dtype, t.device, {}, 0, 0, 0});
      it = open.end() - 1;
    }
    OpenBucket& b = *it;
    b.indices.push_back(index);
    b.bytes += t.bytes();
    b.limit = size_limits[b.limit_pos];
    if (static_cast<size_t>(b.bytes) >= b.limit) {
      closed.emplace_back(std::move(b.indices), b.limit);
      b.indices.clear();
      b.bytes = 0;
      if (b.limit_pos + 1 < size_limits.size()) ++b.limit_pos;
    }
  }
  for (OpenBucket& b : open) {
    if (!b.indices.empty()) closed.emplace_back(std::move(b.indices), b.limit);
  }

  if (order.empty()) {
    std::stable_sort(closed.begin(), closed.end(), [](const auto& a, const auto& b) {
      return *std::min_element(a.first.begin(), a.first.end()) <
             *std::min_element(b.first.begin(), b.first.end());
    });
  }

  BucketPlan plan;
  plan.buckets.reserve(closed.size());
  plan.size_limits.reserve(closed.size());
  for (auto& [indices, limit] : closed) {
    plan.buckets.push_back(std::move(indices));
    plan.size_limits.push_back(limit);
  }
  return plan;
}

BucketPlan plan_initial_buckets(const std::vector<TensorSpec>& tensors,
                                const std::vector<size_t>& size_limits) {
  BucketPlan plan = plan_buckets(tensors, size_limits);
  std::reverse(plan.buckets.begin(), plan.buckets.end());
  std::reverse(plan.size_limits.begin(), plan.size_limits.end());
  return plan;
}

BucketPlan plan_buckets_from_ready_order(const std::vector<TensorSpec>& tensors,
                                         const std::vector<size_t>& ready_order,
                                         const std::vector<size_t>& size_limits) {
  if (ready_order.size() != tensors.size()) {
    throw std::invalid_argument("plan_buckets_from_ready_order: " +
                                std::to_string(ready_order.size()) + " ready parameters for " +
                                std::to_string(tensors.size()) + " parameters");
  }
  std::vector<TensorSpec> ordered;
  ordered.reserve(tensors.size());
  for (size_t index : ready_order) {
    if (index >= tensors.size()) {
      throw std::invalid_argument("plan_buckets_from_ready_order: index " +
                                  std::to_string(index) + " is out of range");
    }
    ordered.push_back(tensors[index]);
  }
  return plan_buckets(ordered, size_limits, ready_order);
}

}  // namespace fastddp
