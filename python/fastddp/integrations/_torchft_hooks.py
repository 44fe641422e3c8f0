"""Which comm hooks fastddp runs under torchft (fastddp/integrations/torchft.py), and in what
form: every hook is made again for each quorum's group, so it must be one fastddp can build
for a group it is handed (a fastddp built-in), never one tied to a group of its own.

- fastddp's built-ins (``fastddp.hooks.bf16()``, ``"powersgd:4"``, ...): as they are.
- torch's default hooks (``allreduce_hook``, ``bf16_compress_hook``, ``fp16_compress_hook``
  and their ``*_wrapper(allreduce_hook)`` forms) with state None: their fastddp built-in,
  over the quorum. torch would reduce over WORLD with state None, which under torchft is
  the replica group's own world, or nothing: never across the replicas.
- the hierarchical hook: with the replica group as its node (_torchft_hierarchical.py).
- refused (NotImplementedError): the auto hook, torch's PowerSGD hooks with their
  PowerSGDState (its process_group is the user's; fastddp.hooks.powersgd() is the same
  algorithm), any other Python hook (its collectives go where its state says, outside the
  quorum), and a process group as the state.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState

from fastddp.hooks import AutoHook, CommHook, HierarchicalHook, torch_builtin
from fastddp.integrations import _torchft_hierarchical


def for_quorum(state: object, hook: Any, manager: Any) -> tuple[None, CommHook]:
    """(None, the fastddp hook that runs `hook` over each quorum's group), or raises."""
    where = "fastddp under torchft"
    if isinstance(hook, AutoHook):
        raise NotImplementedError(f"{where}: the auto hook is not supported (its trials time "
                                  "steps that a quorum change would split)")
    if state is not None:
        what = (f"a {type(state).__name__}" if not isinstance(state, dist.ProcessGroup)
                else "a process group")
        if isinstance(state, PowerSGDState):
            raise NotImplementedError(
                f"{where}: torch's PowerSGD hooks with a PowerSGDState reduce over its "
                "process_group, not the quorum's; use fastddp.hooks.powersgd(...) (the same "
                "algorithm) or hook='powersgd:RANK'")
        raise ValueError(f"{where}: the hook's state must be None (the hook runs over each "
                         f"quorum's group), got {what}")
    if isinstance(hook, HierarchicalHook):
        if isinstance(hook, _torchft_hierarchical.ReplicaGroupHierarchical):
            return None, hook
        return None, _torchft_hierarchical.for_replica_group(hook, manager)
    if isinstance(hook, CommHook):
        return None, hook
    builtin = torch_builtin(hook)
    if builtin is not None:
        return None, CommHook(builtin)
    name = getattr(hook, "__qualname__", type(hook).__name__)
    raise NotImplementedError(
        f"{where}: the Python comm hook {name} would issue its collectives outside the "
        "quorum's group; use a fastddp built-in (fastddp.hooks: allreduce, bf16, fp16, int8, "
        "fp8, powersgd, acpsgd, hierarchical) or torch's default hooks")
