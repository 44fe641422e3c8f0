"""Registering a comm hook on fastddp.DistributedDataParallel: the C++ hook that runs it,
torch's PowerSGDState tied live to it (fastddp/hooks/powersgd_live.py), and for
``fastddp.hooks.auto()`` the tuner that picks the hook while training (fastddp.tuning,
started through fastddp.hooks.auto_hook)."""

from __future__ import annotations

from typing import Any

# The model: fastddp's DistributedDataParallel, which imports this module; the hints name
# torch's class, which it subclasses.
from torch.nn.parallel import DistributedDataParallel

from fastddp import hooks
from fastddp.ddp._mixed_precision import refuse_comm_hook
from fastddp.ddp._tuner_handle import TunerHandle
from fastddp.hooks import AutoHook, auto_hook, powersgd_live


def install(ddp: DistributedDataParallel, state: object, hook: Any) -> None:
    """Makes ``hook(state, ...)`` the model's comm hook (checked by the caller, as torch
    checks it): the C++ hook that runs it on the reducer, built at world size 1 too; raises
    before anything changes for a hook or state it cannot take."""
    refuse_comm_hook(ddp, f"a comm hook ({getattr(hook, '__qualname__', repr(hook))})")
    if getattr(ddp, "_sharded", None) is not None:
        raise NotImplementedError(
            f"fastddp.DistributedDataParallel: a comm hook "
            f"({getattr(hook, '__qualname__', repr(hook))}) cannot replace the "
            "reduce-scatter of a model whose gradients a fastddp.optim.ShardedOptimizer holds")
    if isinstance(hook, AutoHook):
        if state is not None and state is not ddp.process_group:
            raise ValueError(f"{hook!r}: state must be None (the model's process group), "
                             f"got {type(state).__name__}")
        state, ddp._auto = None, auto_hook.start_tuner(TunerHandle(ddp), hook,
                                                         ddp._auto_install)
        hook = ddp._auto.initial_hook()
    native = hooks.resolve(state, hook, ddp.process_group, ddp._reducer_params)
    # torch's PowerSGDState: its training state goes into the native hook (raises, before
    # anything changes, for a state it cannot take), and is read from it from now on.
    live = powersgd_live.load(state, ddp, native)
    if ddp._reducer is None:  # world size 1: a hook runs there too, as in torch
        ddp._build_reducer()
    ddp._native_hook = native
    ddp._reducer.set_comm_hook(native)
    if live:
        powersgd_live.link(state, ddp, native)
