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
#include <ATen/ops/empty.h>
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

// Note [no Python tensor in a Work]
// A backend's thread may drop the last reference to a Work's tensors after the Work
// completes: gloo's worker releases each Work after running it, NCCL's watchdog after
// watching it. A tensor whose Python object has already been dropped in Python keeps that
// object alive (torch hands its ownership to the TensorImpl), and releasing it takes the
// GIL. While the interpreter finalizes, Python ends a thread that asks for the GIL with
// pthread_exit, and the forced unwind through gloo's worker loop calls std::terminate:
// the process aborts at exit ("terminate called without an active exception"). The
// core dumps show it (~AsyncBroadcastWork or ~AsyncAllreduceWork -> ... ->
// TensorImpl::decref_pyobject -> take_gil -> PyThread_exit_thread, in
// ProcessGroupGloo::runLoop); a view made in C++ is no cure, for it holds its base
// (~DifferentiableViewMeta). docs/sharded.md's block on 2 ranks beside two busy loops
// aborted in 3 of 7 runs with the sharded optimizer's all-gather views made in Python, 5
// of 14 with C++ views of the flat buffer, 1 of 20 with the all-gather's aliases but
// clip_grad_norm_'s allreduce of a Python tensor, and 0 of 20 with both as below. So the
// tensors fastddp's step hands to a collective are storage_alias()es made in C++: they
// share the memory and hold only the storage, never a TensorImpl that Python has seen.
// torch DDP's own runs and other Python-issued collectives (a user's, Accelerate's) keep
// the hazard: tests/python/scripts/train_tiny.py's teardown (gc, barrier, destroy) is
// the user's side of it.

// `numel` elements of t's storage from t's element `offset` (t contiguous), with no link
// to t itself (no view metadata, no base): Note [no Python tensor in a Work].
inline at::Tensor storage_alias(const at::Tensor& t, int64_t offset, int64_t numel) {
  return at::empty({0}, t.options()).set_(t.storage(), t.storage_offset() + offset, {numel}, {1});
}

// Rank r's r-th of `world` equal parts of `flat` (contiguous) to every rank, in place,
// launched: the sharded optimizer's all-gather of its updated shards. On the CPU (gloo)
// one broadcast per rank, rooted at the shard's owner: a broadcast sends and receives in
// the tensor's own memory, where gloo's all-gather copies through buffers of its own and
// costs twice as much (16.8 MB on 2 ranks: 11.6 ms against 23.1 ms,
// benchmarks/results/sharded_step.md), and gloo runs two of them at once on its two
// worker threads. On a device (NCCL) one all-gather, in place.
template <class G>
std::vector<c10::intrusive_ptr<c10d::Work>> all_gather_in_place(G& group, const at::Tensor& flat) {
  const int world = group.getSize();
  const int64_t shard = flat.numel() / world;
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  if (!flat.device().is_cpu()) {
    at::Tensor whole = storage_alias(flat, 0, flat.numel());
    at::Tensor mine = storage_alias(flat, group.getRank() * shard, shard);
    works.push_back(all_gather_into(group, whole, mine));
    return works;
  }
  works.reserve(world);
  for (int root = 0; root < world; ++root) {
    std::vector<at::Tensor> one{storage_alias(flat, root * shard, shard)};
    c10d::BroadcastOptions opts;
    opts.rootRank = root;
    opts.rootTensor = 0;
    works.push_back(group.broadcast(one, opts));
  }
  return works;
}

// The local half of a reduce-scatter built on all_to_all_even (the CPU's, where gloo's own
// reduce_scatter costs more than its alltoall and this sum together): `received` holds
// `count` rows of out's length, row r rank r's copy of this rank's shard; out = their sum
// in rank order, the same order on every rank.
// A wider `out` than the rows (float32 from 16-bit rows: the sharded optimizer's float32
// main weights) sums in its own precision: row 0 widened (exact), then each row added in
// place, which computes in out's dtype (an out-of-place add of two 16-bit rows would round
// in 16 bits).
inline void sum_rows_in_rank_order(at::Tensor& out, const at::Tensor& received, int64_t count) {
  const at::Tensor rows = received.view({count, out.numel()});
  if (out.scalar_type() != received.scalar_type()) {
    out.copy_(rows[0]);
    for (int64_t r = 1; r < count; ++r) out.add_(rows[r]);
    return;
  }
  if (count == 1) {
    out.copy_(rows[0]);
    return;
  }
  at::add_out(out, rows[0], rows[1]);
  for (int64_t r = 2; r < count; ++r) out.add_(rows[r]);
}

}  // namespace fastddp
