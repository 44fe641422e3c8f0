// Unit tests of the torch-free bucket planner (csrc/core/bucket_plan.h) against
// hand-computed plans. Sizes are chosen so that byte counts are easy to add up:
// a float32 tensor of numel n holds 4n bytes, a bfloat16 one 2n bytes.
#include "core/bucket_plan.h"

#include <catch2/catch.hpp>

#include <cstdint>
#include <initializer_list>
#include <stdexcept>
#include <vector>

namespace {

using fastddp::BucketPlan;
using fastddp::plan_buckets;
using fastddp::plan_buckets_from_ready_order;
using fastddp::plan_initial_buckets;
using fastddp::TensorSpec;

using Buckets = std::vector<std::vector<size_t>>;
using Limits = std::vector<size_t>;

// Any codes work; these are torch's ScalarType values for readability.
constexpr int32_t kFloat = 6;
constexpr int32_t kBFloat16 = 15;

TensorSpec f32(int64_t numel, int32_t device = 0) {
  return TensorSpec{numel, 4, kFloat, device, false};
}

TensorSpec bf16(int64_t numel, int32_t device = 0) {
  return TensorSpec{numel, 2, kBFloat16, device, false};
}

TensorSpec sparse_f32(int64_t numel) { return TensorSpec{numel, 4, kFloat, 0, true}; }

// Dense float32 tensors on device 0, one per numel.
std::vector<TensorSpec> f32s(std::initializer_list<int64_t> numels) {
  std::vector<TensorSpec> tensors;
  for (int64_t numel : numels) tensors.push_back(f32(numel));
  return tensors;
}

}  // namespace

TEST_CASE("a bucket closes once its bytes reach the limit", "[bucket_plan]") {
  SECTION("reaching the limit exactly closes the bucket") {
    // 40 bytes each, limit 80: every second tensor closes a bucket.
    const BucketPlan plan = plan_buckets(f32s({10, 10, 10, 10, 10}), {80});
    CHECK(plan.buckets == Buckets{{0, 1}, {2, 3}, {4}});
    CHECK(plan.size_limits == Limits{80, 80, 80});
  }
  SECTION("the tensor that crosses the limit stays in the bucket, which overshoots") {
    // 60 + 60 = 120 bytes >= 100: the second tensor joins, then the bucket closes.
    const BucketPlan plan = plan_buckets(f32s({15, 15, 15}), {100});
    CHECK(plan.buckets == Buckets{{0, 1}, {2}});
  }
}

TEST_CASE("the limit list advances per closed bucket and its last limit repeats",
          "[bucket_plan]") {
  // 40 bytes each under limits 40, 80, 120: buckets of 1, 2, then 3 tensors from
  // then on; the last, unfinished bucket has only one.
  const BucketPlan plan =
      plan_buckets(f32s({10, 10, 10, 10, 10, 10, 10, 10, 10, 10}), {40, 80, 120});
  CHECK(plan.buckets == Buckets{{0}, {1, 2}, {3, 4, 5}, {6, 7, 8}, {9}});
  CHECK(plan.size_limits == Limits{40, 80, 120, 120, 120});
}

TEST_CASE("each dtype walks its own limit list", "[bucket_plan]") {
  // Every tensor is 40 bytes except the last. float32: {0} closes at 40, {2, 4}
  // at 80. bfloat16 starts at the first limit although float32 has moved on:
  // {1} at 40, {3, 5} at 80, and {6} is left unfinished.
  const std::vector<TensorSpec> tensors = {f32(10),  bf16(20), f32(10), bf16(20),
                                           f32(10), bf16(20), bf16(10)};
  const BucketPlan plan = plan_buckets(tensors, {40, 80});
  CHECK(plan.buckets == Buckets{{0}, {1}, {2, 4}, {3, 5}, {6}});
  CHECK(plan.size_limits == Limits{40, 40, 80, 80, 80});
}

TEST_CASE("each device walks its own limit list", "[bucket_plan]") {
  // Three groups: (float32, 0), (float32, 1), (bfloat16, 1). Each one's first
  // bucket closes at 40 bytes, whatever the others did before.
  const std::vector<TensorSpec> tensors = {f32(10, 0), f32(10, 1), bf16(20, 1),
                                           f32(20, 0), f32(5, 1)};
  const BucketPlan plan = plan_buckets(tensors, {40, 80});
  CHECK(plan.buckets == Buckets{{0}, {1}, {2}, {3}, {4}});
  CHECK(plan.size_limits == Limits{40, 40, 40, 80, 80});
}

TEST_CASE("without an order, buckets are sorted by their smallest index", "[bucket_plan]") {
  // Closing order is {1} (100 bytes at once), then {0, 3} (40 + 60); {2} is
  // unfinished. Sorted by smallest index: {0, 3}, {1}, {2}.
  const std::vector<TensorSpec> tensors = {f32(10), bf16(50), bf16(5), f32(15)};
  const BucketPlan plan = plan_buckets(tensors, {100});
  CHECK(plan.buckets == Buckets{{0, 3}, {1}, {2}});
  CHECK(plan.size_limits == Limits{100, 100, 100});
}

TEST_CASE("a rebuild from the ready order keeps that order", "[bucket_plan]") {
  // Parameters in model order; backward makes them ready in reverse.
  const std::vector<TensorSpec> params = {f32(15), bf16(10), f32(10), bf16(10), f32(10), bf16(40)};
  const Limits limits = {40, 100};  // {first_bucket_bytes, bucket_bytes_cap}

  SECTION("closed buckets first, in closing order; unfinished ones after them") {
    // Ready 5 (bf16, 80 B) closes {5} at 40; 4 (f32, 40 B) closes {4} at 40;
    // f32 then gathers 2 + 0 = 40 + 60 bytes and closes {2, 0} at 100; bf16's
    // {3, 1} (40 bytes) is unfinished, so it comes last although it began
    // before {2, 0}. Indices inside a bucket keep the ready order.
    const BucketPlan plan = plan_buckets_from_ready_order(params, {5, 4, 3, 2, 1, 0}, limits);
    CHECK(plan.buckets == Buckets{{5}, {4}, {2, 0}, {3, 1}});
    CHECK(plan.size_limits == Limits{40, 40, 100, 100});
  }
  SECTION("is plan_buckets over the reordered tensors with the ready order as indices") {
    const std::vector<size_t> ready = {5, 4, 3, 2, 1, 0};
    std::vector<TensorSpec> reordered;
    for (size_t index : ready) reordered.push_back(params[index]);
    const BucketPlan direct = plan_buckets(reordered, limits, ready);
    const BucketPlan rebuilt = plan_buckets_from_ready_order(params, ready, limits);
    CHECK(direct.buckets == rebuilt.buckets);
    CHECK(direct.size_limits == rebuilt.size_limits);
  }
  SECTION("unfinished buckets follow in the order their group first appeared") {
    const std::vector<TensorSpec> small = {bf16(1), f32(1), f32(1, 1)};
    const BucketPlan plan = plan_buckets_from_ready_order(small, {2, 0, 1}, {1000});
    CHECK(plan.buckets == Buckets{{2}, {0}, {1}});
  }
}

TEST_CASE("a sparse tensor gets a bucket of its own with limit 0", "[bucket_plan]") {
  // The sparse tensor neither joins the float32 bucket nor uses up its first
  // limit: the dense tensors still go {1} at 40, then {2, 3} at 80.
  const std::vector<TensorSpec> tensors = {sparse_f32(1000), f32(10), f32(10), sparse_f32(1),
                                           f32(10)};
  const BucketPlan plan = plan_buckets(tensors, {40, 80});
  CHECK(plan.buckets == Buckets{{0}, {1}, {2, 4}, {3}});
  CHECK(plan.size_limits == Limits{0, 40, 80, 0});
}

TEST_CASE("an empty model has no buckets", "[bucket_plan]") {
  const BucketPlan plan = plan_buckets({}, {25 << 20});
  CHECK(plan.num_buckets() == 0);
  CHECK(plan.size_limits.empty());
  CHECK(plan_buckets_from_ready_order({}, {}, {1 << 20, 25 << 20}).num_buckets() == 0);
}

TEST_CASE("a parameter bigger than the cap gets a bucket of its own", "[bucket_plan]") {
  constexpr size_t kMiB = size_t{1} << 20;
  // 1 MiB closes the first bucket; the 12 GB parameter (its byte count does not
  // fit in 32 bits) then fills a 25 MiB bucket on its own.
  const std::vector<TensorSpec> tensors = {f32(kMiB / 4), f32(3'000'000'000), f32(10)};
  const BucketPlan plan = plan_buckets(tensors, {kMiB, 25 * kMiB});
  CHECK(plan.buckets == Buckets{{0}, {1}, {2}});
  CHECK(plan.size_limits == Limits{kMiB, 25 * kMiB, 25 * kMiB});
  CHECK(static_cast<size_t>(tensors[1].bytes()) > plan.size_limits[1]);
}

TEST_CASE("size_limits reports the limit in force for every bucket", "[bucket_plan]") {
  SECTION("one entry per bucket, the unfinished one included") {
    const BucketPlan plan = plan_buckets(f32s({10, 10, 10, 10, 10, 10, 10, 10}), {40, 80, 160});
    CHECK(plan.buckets == Buckets{{0}, {1, 2}, {3, 4, 5, 6}, {7}});
    CHECK(plan.size_limits == Limits{40, 80, 160, 160});
    CHECK(plan.size_limits.size() == plan.num_buckets());
  }
  SECTION("an unfinished first bucket reports the first limit") {
    const BucketPlan plan = plan_buckets(f32s({5}), {40, 80});
    CHECK(plan.buckets == Buckets{{0}});
    CHECK(plan.size_limits == Limits{40});
  }
}

TEST_CASE("the initial plan is the forward plan, its buckets reduced last first",
          "[bucket_plan]") {
  // Limits 40, 80, 120 over ten 40-byte tensors, as in the limit-list case above: the
  // same buckets, each with its limit, in reverse, so the 1-tensor bucket of the first
  // limit (the model's first parameter, whose gradient comes last) is reduced last.
  const BucketPlan plan =
      plan_initial_buckets(f32s({10, 10, 10, 10, 10, 10, 10, 10, 10, 10}), {40, 80, 120});
  CHECK(plan.buckets == Buckets{{9}, {6, 7, 8}, {3, 4, 5}, {1, 2}, {0}});
  CHECK(plan.size_limits == Limits{120, 120, 120, 80, 40});
  CHECK(plan_initial_buckets({}, {40}).num_buckets() == 0);
  CHECK_THROWS_AS(plan_initial_buckets(f32s({10}), {}), std::invalid_argument);
}

TEST_CASE("invalid inputs throw std::invalid_argument", "[bucket_plan]") {
  const std::vector<TensorSpec> tensors = f32s({10, 10, 10});

  SECTION("an empty limit list") {
    CHECK_THROWS_AS(plan_buckets(tensors, {}), std::invalid_argument);
    CHECK_THROWS_AS(plan_buckets({}, {}), std::invalid_argument);
    CHECK_THROWS_AS(plan_buckets_from_ready_order(tensors, {0, 1, 2}, {}),
                    std::invalid_argument);
  }
  SECTION("an order of the wrong size") {
    CHECK_THROWS_AS(plan_buckets(tensors, {100}, {0, 1}), std::invalid_argument);
    CHECK_THROWS_AS(plan_buckets_from_ready_order(tensors, {0, 1}, {100}),
                    std::invalid_argument);
    CHECK_THROWS_AS(plan_buckets_from_ready_order(tensors, {0, 1, 2, 0}, {100}),
                    std::invalid_argument);
  }
  SECTION("an index out of range") {
    CHECK_THROWS_AS(plan_buckets(tensors, {100}, {0, 1, 3}), std::invalid_argument);
    CHECK_THROWS_AS(plan_buckets_from_ready_order(tensors, {0, 3, 1}, {100}),
                    std::invalid_argument);
  }
  SECTION("a repeated index") {
    CHECK_THROWS_AS(plan_buckets(tensors, {100}, {0, 0, 1}), std::invalid_argument);
    CHECK_THROWS_AS(plan_buckets_from_ready_order(tensors, {0, 1, 1}, {100}),
                    std::invalid_argument);
  }
}
