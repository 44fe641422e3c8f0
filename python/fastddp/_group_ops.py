"""The collectives fastddp issues from Python (outside the C++ reducer), called on the process
group object itself, as torch DDP's reducer and ``dist._broadcast_coalesced`` call it.

Not ``dist.all_reduce(group=...)`` and friends: those look the group up in c10d's group map
(``dist.all_gather`` refuses a group that is not in it, ``dist.get_rank(group)`` too), and
a process group written in Python (a ``dist.ProcessGroup`` subclass, as torchft's and the
``test_c10d_pypg`` groups are) need never be registered there. torch DDP accepts such a
group because its reducer only ever calls the group's methods; so does fastddp.

A Python ``Work`` is waited on as C++ waits on it: ``wait(timeout)`` with c10d's
``kNoTimeout`` (0 ms: "the backend's own timeout"), the argument torch's PyWork trampoline
passes. ``dist.all_reduce``'s own ``work.wait()`` passes none, and a Work whose ``wait``
takes ``timeout`` as torch declares it (``def wait(self, timeout)``) raises TypeError there.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import (AllgatherOptions, AllreduceOptions, AllToAllOptions,
                                        BroadcastOptions)

from fastddp import _C

# c10d's kNoTimeout (Work::wait's default in C++): wait as long as the backend's timeout.
NO_TIMEOUT = timedelta(0)
# torch DDP broadcasts module state in chunks of this size.
BROADCAST_BUCKET_BYTES = 250 * 1024 * 1024


def wait(work: dist.Work) -> None:
    """Waits for ``work`` as C++ does (``Work::wait(kNoTimeout)``), whatever wrote it."""
    work.wait(NO_TIMEOUT)


def all_reduce(group: dist.ProcessGroup, tensor: torch.Tensor,
               op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
               async_op: bool = False) -> dist.Work | None:
    """``dist.all_reduce`` of one tensor, on ``group`` directly (options always passed: a
    Python group may take them as a required argument, as torch's tests' groups do).
    Waited for here, a contiguous tensor goes to the backend as an alias made in C++, so
    that no backend thread can hold this Python tensor past the call (Note [no Python
    tensor in a Work], csrc/hooks/common/collectives.h: a process exiting right after
    would abort)."""
    if not async_op and tensor.is_contiguous():
        _C.all_reduce_in_place(group, tensor, op)
        return None
    opts = AllreduceOptions()
    opts.reduceOp = op
    work = group.allreduce([tensor], opts)
    if async_op:
        return work
    wait(work)
    return None


def all_gather(group: dist.ProcessGroup, outputs: list[torch.Tensor],
               tensor: torch.Tensor) -> None:
    """``dist.all_gather``: ``outputs[r]`` gets group rank r's ``tensor``."""
    wait(group.allgather([outputs], [tensor], AllgatherOptions()))


def broadcast(group: dist.ProcessGroup, tensor: torch.Tensor, src: int) -> None:
    """``dist.broadcast`` from group rank ``src``."""
    opts = BroadcastOptions()
    opts.rootRank = src
    wait(group.broadcast([tensor], opts))


def gather(group: dist.ProcessGroup, tensor: torch.Tensor, outputs: list[torch.Tensor],
           root: int) -> None:
    """``dist.gather`` to group rank ``root``: ``outputs`` (one tensor per rank there, an
    empty list elsewhere) gets every rank's ``tensor``, waited for, through aliases made in
    C++ (Note [no Python tensor in a Work], as all_reduce)."""
    _C.gather_in_place(group, tensor, outputs, root)


def registered(group: dist.ProcessGroup) -> bool:
    """Whether c10d's group map knows ``group`` (made by init_process_group, new_group or a
    registered backend), so that ``dist.get_process_group_ranks`` can name its ranks."""
    return group in dist.distributed_c10d._world.pg_group_ranks


def global_ranks(group: dist.ProcessGroup, device: torch.device | str = "cpu") -> list[int]:
    """The default group's rank of each of ``group``'s ranks, in group-rank order: c10d's
    record where it has one, else each rank's ``dist.get_rank()`` gathered through the group
    itself (a collective: every rank of ``group`` calls it)."""
    if registered(group):
        return list(dist.get_process_group_ranks(group))
    mine = torch.tensor([dist.get_rank()], dtype=torch.int64, device=device)
    gathered = [torch.zeros_like(mine) for _ in range(group.size())]
    all_gather(group, gathered, mine)
    return [int(t.item()) for t in gathered]


def all_to_all_single(group: dist.ProcessGroup, output: torch.Tensor,
                      tensor: torch.Tensor) -> None:
    """``dist.all_to_all_single`` with even splits (empty split lists: c10d's even split)."""
    wait(group.alltoall_base(output, tensor, [], [], AllToAllOptions()))


def all_gather_single(group: dist.ProcessGroup, output: torch.Tensor,
                      tensor: torch.Tensor) -> dist.Work:
    """``dist.all_gather_single`` (``all_gather_into_tensor`` before torch 2.14), launched:
    ``output`` is every rank's ``tensor`` in rank order once the Work completes."""
    # torch 2.14 added the method under this name; the old one is c10d's _allgather_base.
    launch = getattr(group, "all_gather_single", None) or group._allgather_base
    return launch(output, tensor, AllgatherOptions())


def broadcast_tensors(group: dist.ProcessGroup, tensors: Sequence[torch.Tensor], src: int) -> None:
    """Copies `tensors` from rank `src` to every rank, coalesced into few collectives."""
    if tensors:
        dist._broadcast_coalesced(group, list(tensors), BROADCAST_BUCKET_BYTES, src)
