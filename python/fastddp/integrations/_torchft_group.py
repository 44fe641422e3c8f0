"""The process groups fastddp's reducer runs on under torchft (fastddp/integrations/torchft.py).

torchft's Manager reconfigures its process group whenever the quorum changes: its
``ProcessGroupGloo`` / ``ProcessGroupNCCL`` (``ProcessGroupWrapper`` subclasses written in
Python) make a new c10d group over the quorum's replicas and keep it as ``_pg``. fastddp's
reducer and hooks issue their collectives on that c10d group directly, from C++: a Python
wrapper in between would put a Python call on every bucket (what torchft's own DDP does
through its comm hook), and its size, fixed at 1 in C++ (torchft's groups call
``ProcessGroup.__init__(0, 1)``), would hide the quorum's.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def placeholder_group() -> dist.ProcessGroup:
    """A one-rank gloo group for construction, before the first quorum: fastddp's
    constructor talks to no one over it (size 1, written in C++), as torchft's DDP soaks its
    constructor's broadcast up with a dummy group; the first step binds the quorum's."""
    store = dist.HashStore()
    group = dist.ProcessGroup(store, 0, 1)
    backend = dist.ProcessGroupGloo(store, 0, 1)
    group._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
    group._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, backend)
    return group


def quorum_group(manager: Any) -> dist.ProcessGroup:
    """The c10d process group of the manager's current quorum (call after wait_quorum)."""
    from torchft.process_group import ProcessGroupWrapper

    group = manager._pg
    # Wrappers of wrappers (ErrorSwallowingProcessGroupWrapper(pg=ProcessGroupGloo())) hand
    # configure() down to the innermost one, which holds the c10d group.
    while isinstance(group, ProcessGroupWrapper):
        group = group._pg
        if group is None:
            raise RuntimeError("fastddp: the torchft manager's process group is not "
                               "configured (no quorum yet: call manager.start_quorum(), as "
                               "torchft.optim.OptimizerWrapper.zero_grad() does, before the "
                               "forward)")
    if type(group) is not dist.ProcessGroup:
        raise NotImplementedError(
            f"fastddp under torchft: the manager's process group {type(manager._pg).__name__} "
            "runs its collectives in Python or in a subprocess (ProcessGroupBaby*); fastddp's "
            "reducer needs one that holds a c10d group (torchft's ProcessGroupGloo or "
            "ProcessGroupNCCL)")
    return group


# The Manager internals fastddp reads, as of torchft 0.2.0: its process group wrapper, its
# state-dict functions (one key per model), its healing step (fastddp heals before the
# forward, as torchft's synchronous quorum does; _recovery_event too, where there is one),
# and its rank in the replica group (the hierarchical hook's node).
_MANAGER_INTERNALS = ("_pg", "_load_state_dict_fns", "_healing", "_apply_pending_state_dict",
                      "_pending_state_dict", "_group_rank", "_group_world_size")


def check_manager(manager: Any) -> None:
    """Raises for a manager fastddp cannot drive, naming it, before anything is built."""
    from torchft.manager import Manager
    from torchft.process_group import ProcessGroupWrapper

    if not isinstance(manager, Manager):
        raise TypeError(f"fastddp.integrations.torchft.DistributedDataParallel: manager must "
                        f"be a torchft.Manager, got {type(manager).__name__}")
    missing = [name for name in _MANAGER_INTERNALS if not hasattr(manager, name)]
    if missing:
        raise NotImplementedError(
            f"fastddp under torchft: this torchft's Manager lacks {missing}, which fastddp "
            "reads (checked with torchft 0.2.0, see docs/torchft.md)")
    if not isinstance(manager._pg, ProcessGroupWrapper):
        raise NotImplementedError(
            f"fastddp under torchft: the manager's process group {type(manager._pg).__name__} "
            "is not a reconfigurable c10d group; use torchft's ProcessGroupGloo or "
            "ProcessGroupNCCL")
