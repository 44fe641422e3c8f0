"""Uneven inputs: fastddp's side of torch.distributed.algorithms.Join.

Ranks that still have data run their usual forward and backward; ranks that
ran out run ``_JoinHook.main_hook`` in the Join loop instead, which issues the
same collectives in the same order with zero gradients (the reducer's
``shadow_backward``), so nobody waits forever. The order, on both sides:
Join's notify allreduce, the one bucket rebuild (a broadcast), the buffer
broadcast from an agreed rank, the "will this backward sync" allreduce, then
the buckets' reductions (and the used-parameter bitmap under
find_unused_parameters).
"""

from __future__ import annotations


import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import JoinHook
# The model: fastddp's DistributedDataParallel, which imports this module; the hints name
# torch's class, which it subclasses.
from torch.nn.parallel import DistributedDataParallel

from fastddp import _group_ops
from fastddp.ddp._hook_state import hook_name


def find_common_rank(ddp: DistributedDataParallel, candidate: bool) -> int:
    """The largest rank among those where ``candidate`` holds (one allreduce). The group's
    own rank and allreduce, not dist.get_rank(group): a group written in Python need not be
    in c10d's group map (_group_ops)."""
    group = ddp.process_group
    rank = torch.tensor([group.rank() if candidate else -1], device=ddp.device)
    _group_ops.all_reduce(group, rank, op=dist.ReduceOp.MAX)
    common = int(rank.item())
    if common < 0:
        raise RuntimeError("fastddp join: no rank qualified as the authoritative model copy")
    return common


def announce_backward_sync(ddp: DistributedDataParallel, joined: bool) -> bool | None:
    """Tells the joined ranks whether this iteration's backward synchronizes.

    A training rank contributes 1 when it will sync and does not wait; a joined
    rank contributes 0, waits and learns whether any rank syncs."""
    flag = torch.ones(1, device=ddp.device)
    if joined or not ddp.require_backward_grad_sync:
        flag.zero_()
    work = _group_ops.all_reduce(ddp.process_group, flag, async_op=True)
    if not joined:
        return None
    _group_ops.wait(work)
    return bool(flag.item() != 0)


def sync_buffers(ddp: DistributedDataParallel, joined: bool = False) -> None:
    """Broadcasts the module's buffers before a forward: from rank 0, or under
    join() from the largest rank still training (rank 0 may have stale ones)."""
    src = find_common_rank(ddp, not joined) if ddp._join_config.enable else 0
    try:
        with torch.no_grad():
            _group_ops.broadcast_tensors(ddp.process_group, ddp.modules_buffers, src=src)
    except RuntimeError as e:
        # Typically a dead or stuck peer: gloo's text names neither the collective nor
        # what it carried, and this is the first collective of a step.
        raise RuntimeError(
            f"fastddp: the broadcast of the module's buffers from rank {src} before the "
            f"forward (comm hook {hook_name(ddp)!r}) failed on rank "
            f"{ddp.process_group.rank()}: {e}") from e


class _JoinHook(JoinHook):
    def __init__(self, ddp: DistributedDataParallel, divide_by_initial_world_size: bool):
        if getattr(ddp, "mixed_precision", None) is not None:
            # torch's joined ranks run its upcast hook on parameters that were never cast.
            raise NotImplementedError("fastddp.DistributedDataParallel: join() with "
                                      "mixed_precision is not supported")
        self.ddp = ddp
        ddp._divide_by_initial_world_size = divide_by_initial_world_size

    def main_hook(self) -> None:
        ddp = self.ddp
        reducer = ddp._reducer
        if reducer is None:
            return
        reducer.before_forward(False)
        if ddp._will_sync_buffers():
            sync_buffers(ddp, joined=True)
        should_sync = announce_backward_sync(ddp, joined=True)
        ddp.require_forward_param_sync = should_sync
        if not should_sync:
            return
        reducer.shadow_backward()
        reducer.record_default_ready_order()

    def post_hook(self, is_last_joiner: bool) -> None:
        """Every rank takes the parameters and buffers of the last joiner."""
        ddp = self.ddp
        src = find_common_rank(ddp, is_last_joiner)
        states = [p.detach() for p in ddp._module_parameters]
        if ddp.forward_sync_buffers:
            states += [b.detach() for b in ddp.modules_buffers]
        with torch.no_grad():
            _group_ops.broadcast_tensors(ddp.process_group, states, src=src)
