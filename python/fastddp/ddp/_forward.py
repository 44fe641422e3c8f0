"""DistributedDataParallel.forward around the module call (distributed.py calls these): the
inputs to the device, the tuner's turn, join's collectives, the buffers' broadcast and the
reducer's before- and after-forward. Both run eagerly under torch.compile (_compile.py)."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.algorithms.join import Join
# The model: fastddp's DistributedDataParallel, which imports this module; the hints name
# torch's class, which it subclasses.
from torch.nn.parallel import DistributedDataParallel
from torch.utils._pytree import tree_flatten, tree_unflatten

from fastddp import _group_ops
from fastddp.ddp import _compile, _hook_state
from fastddp.ddp._construction import _move_inputs
from fastddp.ddp._join import announce_backward_sync, sync_buffers


@_compile.eager
def before_module(ddp: DistributedDataParallel, inputs: tuple, kwargs: dict
                  ) -> tuple[tuple, dict, tuple]:
    """forward up to the module call: inputs, kwargs, and what after_module needs."""
    if ddp.device_ids:
        inputs, kwargs = _move_inputs(inputs, kwargs, ddp.device_type, ddp.device_ids[0])
    if ddp._mp is not None:  # as torch's _pre_forward, after the move
        inputs, kwargs = ddp._mp.cast_inputs(inputs, kwargs)
    if ddp._auto is not None and torch.is_grad_enabled() and ddp.require_backward_grad_sync:
        ddp._auto.before_forward()  # may change the hook or rebuild the reducer
    reducer = ddp._reducer
    if reducer is None:
        return inputs, kwargs, ()
    if ddp._native_hook is not None and hasattr(ddp._native_hook, "take_stats_reports"):
        _hook_state.log_stats(ddp._native_hook)
    grad_enabled = torch.is_grad_enabled()
    sync = grad_enabled and ddp.require_backward_grad_sync
    # Collective order must match _join.py's main_hook on joined ranks.
    work = Join.notify_join_context(ddp)
    if work is not None and not ddp._divide_by_initial_world_size:
        # Divide by the ranks still training (a host sync, only in this mode). A Python Work
        # is waited on as C++ waits on it (_group_ops.wait).
        _group_ops.wait(work)
        reducer.set_divide_factor(int(work.get_future().value()[0].item()))
    if sync:
        ddp.logger.before_forward(reducer.num_iterations, reducer.comm_stats,
                                  lambda: reducer.num_buckets_reduced)
    if grad_enabled:
        with ddp.logger.recording_errors():
            reducer.before_forward(sync)
    if ddp._will_sync_buffers():
        sync_buffers(ddp)
    if ddp._join_config.enable:
        announce_backward_sync(ddp, joined=False)
    return inputs, kwargs, (grad_enabled, ddp.logger.now())

@_compile.eager
def after_module(ddp: DistributedDataParallel, output: Any, state: tuple) -> Any:
    """forward after the module call: tells the reducer the forward is done."""
    grad_enabled, started = state
    reducer = ddp._reducer
    ddp.logger.forward_done(started)
    # Read again, as torch's _post_forward does: Lightning's manual optimization runs its
    # own backward inside the module's forward and turns sync off before returning.
    sync = grad_enabled and ddp.require_backward_grad_sync
    if not sync:
        ddp.require_forward_param_sync = False
        if grad_enabled:
            reducer.after_forward(False, [])
            output = _compile.guard_outputs(output)  # the hooks run without sync too
        return output
    ddp.require_forward_param_sync = True
    if not reducer.needs_outputs:
        reducer.after_forward(True, [])
        return _compile.guard_outputs(output)
    leaves, spec = tree_flatten(output)
    slots = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor) and x.grad_fn]
    passed = reducer.after_forward(True, [leaves[i] for i in slots])
    for i, tensor in zip(slots, passed):
        leaves[i] = tensor
    return _compile.guard_outputs(tree_unflatten(leaves, spec))
