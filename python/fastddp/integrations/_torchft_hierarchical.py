"""The hierarchical hook under torchft (fastddp/integrations/torchft.py), in the shape of
torchft's HSDP: a replica group of several ranks is one node.

torchft gives each rank of a replica group its own Manager, whose quorum group joins the
ranks with this rank's group rank in every replica group of the quorum: exactly the
``inter`` group of a hierarchical reduction (Note [hierarchical reduction] in
csrc/hooks/hierarchical/hierarchical.h). ``intra`` is the replica group's own process group,
which torchft leaves alone (the user's ``init_process_group`` inside the replica group, or
``groups=(intra, None)``). Per bucket: a reduce-scatter inside the replica group, the inner
hook on this rank's shard over the quorum, an allgather inside the replica group. So only
1/local_size of the gradients (times the inner hook's compression) crosses between replica
groups, where the slow links are.

The reducer runs on the quorum's group, so its divide factor (the step's participants)
counts replica groups; the C++ hook multiplies it by the replica group's size
(factor_counts_nodes). A quorum of one replica group is fine (an inter group of one).
A failed step keeps the intra collectives matched on every rank of the replica group (the
Note's failure paragraph), whose ranks all report it: torchft's should_commit is false on
all of them if on one.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from fastddp import _C
from fastddp.hooks import HierarchicalHook

# Inner hooks whose state (PowerSGD's Q and iteration, ACP-SGD's P) would have to follow the
# quorum's groups into a new C++ hook and come from a peer on healing: not carried here.
_STATEFUL_INNERS = ("powersgd", "powersgd_batched", "acpsgd")


class ReplicaGroupHierarchical(HierarchicalHook):
    """``hierarchical(inner)`` with the replica group as the node: ``native(quorum_group)``
    builds the C++ hook for one quorum (made again at every quorum change)."""

    def __init__(self, inter: Any, intra: dist.ProcessGroup):
        super().__init__(inter, groups=None)
        self.intra = intra

    def __repr__(self) -> str:
        return f"fastddp.hooks.hierarchical(inter={self.inter!r}, intra=<the replica group>)"

    def native(self, process_group: dist.ProcessGroup) -> "_C.CommHook":
        return _C.create_hierarchical_comm_hook(self.intra, process_group,
                                                self.inter.native(process_group),
                                                factor_counts_nodes=True)


def for_replica_group(hook: HierarchicalHook, manager: Any) -> ReplicaGroupHierarchical:
    """The hook a user registered, for this manager's replica group; raises, naming what is
    wrong, for what it cannot be."""
    where = f"fastddp under torchft: {hook!r}"
    if hook.mesh is not None or hook.local_size is not None:
        raise NotImplementedError(f"{where}: under torchft the node is the replica group; pass "
                                  "groups=(replica_group, None), or nothing for the default "
                                  "process group, not mesh= or local_size=")
    if hook.inter.name in _STATEFUL_INNERS:
        raise NotImplementedError(f"{where}: an inner {hook.inter.name} hook's state is not "
                                  "carried across torchft's quorums; use a stateless inner "
                                  "hook (allreduce, bf16, fp16, int8, fp8) or "
                                  f"{hook.inter.name} without hierarchical")
    if hook.groups is not None:
        intra, inter = hook.groups
        if inter is not None:
            raise ValueError(f"{where}: the inter group is the manager's quorum group; pass "
                             "groups=(replica_group, None)")
    elif dist.is_initialized():
        intra = dist.group.WORLD
    else:
        raise ValueError(f"{where}: no replica group: call dist.init_process_group inside the "
                         "replica group (torchrun's world there) or pass "
                         "groups=(replica_group, None)")
    if not isinstance(intra, dist.ProcessGroup):
        raise TypeError(f"{where}: the replica group must be a ProcessGroup, got "
                        f"{type(intra).__name__}")
    size, rank = manager._group_world_size, manager._group_rank
    if (intra.size(), intra.rank()) != (size, rank):
        raise ValueError(f"{where}: the replica group has {intra.size()} ranks and this is its "
                         f"rank {intra.rank()}, but the manager was made for rank {rank} of "
                         f"{size}: intra must be this replica group's own group")
    if size < 2:
        raise ValueError(f"{where}: the replica group has one rank: there is nothing to reduce "
                         f"inside it; register {hook.inter!r} itself")
    return ReplicaGroupHierarchical(hook.inter, intra)
