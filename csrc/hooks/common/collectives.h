// The single-tensor collectives, under the names of the torch we compile against.
//
// Note [collective names]
// torch 2.14 renamed ProcessGroup::alltoall_base, _allgather_base and
// _reduce_scatter_base to all_to_all_single, all_gather_single and
// reduce_scatter_single; the old names stay as deprecated aliases (a warning
// in every build log), and torch 2.11 has only the old ones. Each call below
// picks, at compile time, the new name where the header declares it: the
// branch not taken is never instantiated, so neither warns nor fails.
#pragma once

#include <ATen/ops/add.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <type_traits>
#include <vector>

namespace fastddp {
namespace collective_detail {

template <class G, class = void>
struct HasNewNames : std::false_type {};
template <class G>
struct HasNewNames<G, std::void_t<decltype(&G::all_to_all_single),
                                  decltype(&G::all_gather_single),
                                  decltype(&G::reduce_scatter_single)>> : std::true_type {};

}  // namespace collective_detail

// out[r * n / world : ...] = rank r's in[rank * n / world : ...]: equal splits.
template <class G>
c10::intrusive_ptr<c10d::Work> all_to_all_even(G& group, at::Tensor& out, at::Tensor& in) {
  std::vector<int64_t> even;
  if constexpr (collective_detail::HasNewNames<G>::value) {
    return group.all_to_all_single(out, in, even, even);
  } else {
    return group.alltoall_base(out, in, even, even);
  }
}

// out = every rank's `in`, in rank order.
template <class G>
c10::intrusive_ptr<c10d::Work> all_gather_into(G& group, at::Tensor& out, at::Tensor& in) {
  if constexpr (collective_detail::HasNewNames<G>::value) {
    return group.all_gather_single(out, in);
  } else {
    return group._allgather_base(out, in);
  }
}

// out = the sum over ranks of this rank's 1/world of `in`.
template <class G>
c10::intrusive_ptr<c10d::Work> reduce_scatter_into(G& group, at::Tensor& out, at::Tensor& in) {
  if constexpr (collective_detail::HasNewNames<G>::value) {
    return group.reduce_scatter_single(out, in);
  } else {
    return group._reduce_scatter_base(out, in);
  }
}

// The local half of a reduce-scatter built on all_to_all_even (the CPU's, where gloo's own
// reduce_scatter costs more than its alltoall and this sum together): `received` holds
// `count` rows of out's length, row r rank r's copy of this rank's shard; out = their sum
// in rank order, the same order on every rank.
inline void sum_rows_in_rank_order(at::Tensor& out, const at::Tensor& received, int64_t count) {
  const at::Tensor rows = received.view({count, out.numel()});
  if (count == 1) {
    out.copy_(rows[0]);
    return;
  }
  at::add_out(out, rows[0], rows[1]);
  for (int64_t r = 2; r < count; ++r) out.add_(rows[r]);
}

}  // namespace fastddp
