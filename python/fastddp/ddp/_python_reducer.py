"""torch._dynamo.config.optimize_ddp="python_reducer": compiled autograd traces the
gradient averaging.

Note [python reducer]
fastddp's reducer hooks are C++ post hooks on the grad accumulators; compiled autograd
cannot trace them (torch's C++ reducer has the same limit). torch DDP built while
``optimize_ddp == "python_reducer"`` leaves its C++ reducer idle: its forward is the bare
module call (no input move, no buffer broadcast, no reducer calls), and a Python
post-accumulate-grad hook on each parameter averages that parameter's gradient with a
functional collective (``grad / world_size``, then ``all_reduce(sum)``, copied back), or
calls each registered comm hook as ``hook(state, (grad, param))``. Compiled autograd traces
those hooks into the compiled backward, and inductor buckets the collectives
(``_fuse_ddp_communication``, at ``bucket_cap_mb``).

fastddp built in that mode does the same, with the same hooks and the same inductor
settings, and builds no C++ reducer (there is nothing for it to do). Its own built-in comm
hooks are C++ bucket hooks, not per-parameter functions: registering one in this mode
raises NotImplementedError. Other modes (``"python_reducer_without_compiled_forward"``
included: torch DDP keeps its C++ reducer there) use fastddp's reducer, whose hooks raise
NotImplementedError naming compiled autograd if a compiled backward meets them (torch's
raise a RuntimeError there).
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from fastddp.hooks import AutoHook, CommHook


def requested() -> bool:
    """Whether a model built now uses the Python reducer: torch DDP's own test
    (``get_optimize_ddp_mode() == "python_reducer"``). torch._dynamo not imported: nobody
    set the mode."""
    dynamo = sys.modules.get("torch._dynamo")
    return dynamo is not None and dynamo.utils.get_optimize_ddp_mode() == "python_reducer"


def attach(ddp: Any, *bucket_cap_mb: float | None) -> "PythonReducer | None":
    """The model's PythonReducer if it was built in this mode (ddp._use_python_reducer; a
    pickle without it was not), else None. With `bucket_cap_mb` (at construction), torch
    DDP's inductor settings for this mode too: the traced collectives fused into buckets of
    that size (as given, None included)."""
    ddp._use_python_reducer = getattr(ddp, "_use_python_reducer", False)
    if not ddp._use_python_reducer:
        return None
    if getattr(ddp, "mixed_precision", None) is not None:  # torch's upcast hook is per bucket
        raise NotImplementedError(
            "fastddp.DistributedDataParallel: mixed_precision under torch._dynamo.config."
            "optimize_ddp=\"python_reducer\" is not supported: its reduction is a bucket "
            "hook, and this mode reduces one parameter at a time")
    if bucket_cap_mb:
        import torch._inductor.config as inductor

        inductor._fuse_ddp_communication = True
        inductor._fuse_ddp_bucket_size = bucket_cap_mb[0]
    return PythonReducer(ddp)


def check_comm_hook(hook: Any) -> None:
    """Refuses fastddp's built-in hooks in this mode: they reduce buckets in C++, and this
    mode calls a hook per parameter (Note [python reducer])."""
    if isinstance(hook, (CommHook, AutoHook)):
        raise NotImplementedError(
            f"fastddp.DistributedDataParallel: {hook!r} under torch._dynamo.config."
            f"optimize_ddp=\"python_reducer\": fastddp's built-in hooks reduce whole buckets "
            f"in C++, and this mode calls the comm hook per parameter as hook(state, (grad, "
            f"param)); register a Python hook written for that, or build the model in "
            f"another mode")


class PythonReducer:
    """The per-parameter averaging hooks of Note [python reducer]."""

    def __init__(self, ddp: Any):
        self._ddp = ddp
        self._handles: list[RemovableHandle] = [
            p.register_post_accumulate_grad_hook(self._averaged)
            for p in ddp._module_parameters if p.requires_grad
        ]

    def _averaged(self, param: torch.Tensor) -> None:
        import torch.distributed._functional_collectives as fcol

        ddp = self._ddp
        if not ddp.require_backward_grad_sync or param.grad is None:
            return
        if ddp._comm_hooks:
            for hook, state in ddp._comm_hooks:
                hook(state, (param.grad, param))
            return
        group = ddp.process_group
        gradient = fcol.all_reduce(param.grad / group.size(), "sum", group)
        param.grad.copy_(gradient)
