"""Pickling a fastddp model (torch.save(model), copy.deepcopy, pickle), as torch DDP's
__getstate__/__setstate__: only with the default process group; what is native (the C++
reducer, its hook, the process group) is left out and rebuilt on load."""

from __future__ import annotations

import copy
from typing import Any

import torch.distributed as dist
from torch import nn

from fastddp.ddp import _hook_install, _python_reducer
from fastddp.ddp._construction import _not_yet
from fastddp.ddp._reducer_proxy import ReducerProxy

_NATIVE = ("process_group", "_reducer", "_native_hook", "reducer", "_auto", "_in_backward",
           "_python_reducer")


def state_of(ddp: Any) -> dict:
    """The model's __getstate__."""
    ddp._check_default_group()
    if ddp._delayed is not None or ddp._mp is not None:  # their hooks do not travel
        raise _not_yet("pickling a model with delay_all_reduce_named_params or "
                       "mixed_precision", "their hooks are not rebuilt on load")
    if getattr(ddp, "_overlap", None) is not None:
        raise _not_yet("pickling a model with an overlapped optimizer (overlap_optimizer, "
                       "_register_fused_optim)", "the optimizer is not part of the model: a "
                       "copy would train without stepping; pickle it before overlapping")
    if getattr(ddp, "_sharded", None) is not None:
        raise _not_yet("pickling a model whose gradients a fastddp.optim.ShardedOptimizer "
                       "holds", "the optimizer is not part of the model: a copy would "
                       "reduce-scatter into shards nobody steps; pickle it before sharding")
    attrs = copy.copy(ddp.__dict__)
    for native in _NATIVE:
        attrs.pop(native, None)
    attrs["_lazy_init_ran"] = False  # the copy finds its own optimizers in backward
    return attrs


def restore(ddp: Any, state: dict) -> None:
    """The model's __setstate__: the default group, a new reducer and the registered hook."""
    ddp.process_group = dist.distributed_c10d._get_default_group()
    nn.Module.__setstate__(ddp, state)  # not torch DDP's: it builds torch's reducer
    ddp._reducer = None
    ddp._native_hook = None
    ddp._auto = None
    ddp._in_backward = None
    ddp._overlap = None  # refused in state_of; older pickles lack it
    ddp.reducer = ReducerProxy(ddp)
    ddp._python_reducer = _python_reducer.attach(ddp)
    ddp.require_forward_param_sync = True
    ddp.require_backward_grad_sync = True
    if ddp._wants_reducer():
        ddp._build_reducer()
    if ddp._comm_hooks and not ddp._use_python_reducer:  # that one reads _comm_hooks
        # torch loses the hook with its reducer; fastddp keeps it (no silent change of
        # what is on the wire).
        hook, hook_state = ddp._comm_hooks[0]
        _hook_install.install(ddp, hook_state, hook)
