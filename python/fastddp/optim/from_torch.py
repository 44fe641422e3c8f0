"""A torch optimizer a framework built becomes a ShardedOptimizer: what the integrations
(Accelerate's ``Accelerator(shard_optimizer=...)``, Lightning's ``FastDDPStrategy(
shard_optimizer=...)``) do after the framework wrapped the model and built its optimizer and
schedulers.

- ``shard_torch_optimizer(optimizer, model, **options)``: a ShardedOptimizer of
  ``optimizer``'s class over ``model`` with its param groups and hyperparameters (the
  schedulers' ``initial_lr`` kept), before it stepped.
- ``point_scheduler_at(scheduler, replaced)``: a scheduler built on a replaced optimizer
  schedules its ShardedOptimizer instead.
"""

from __future__ import annotations

import inspect
import weakref
from typing import Any

import torch

from fastddp.ddp import surface
from fastddp.optim.sharded import ShardedOptimizer


def shard_torch_optimizer(optimizer: torch.optim.Optimizer, model: Any, who: str,
                          **options: Any) -> ShardedOptimizer:
    """``optimizer`` (torch's SGD, Adam or AdamW over exactly ``model``'s averaged
    parameters, not stepped yet) as a ShardedOptimizer with the same class, param groups and
    hyperparameters; ``options`` are ShardedOptimizer's (overlap_all_gather, zero_stage,
    gradient_wire). ``who`` names the caller in errors."""
    mine = {id(p) for group in optimizer.param_groups for p in group["params"]}
    theirs = {id(p) for _, p in surface.averaged_parameters(model)}
    if mine != theirs:
        raise NotImplementedError(
            f"{who}: the {type(optimizer).__name__} holds {len(mine & theirs)} of the model's "
            f"{len(theirs)} averaged parameters (and {len(mine - theirs)} others); one sharded "
            "optimizer holds exactly all of them (model.parameters())")
    if optimizer.state:
        raise NotImplementedError(
            f"{who}: the {type(optimizer).__name__} has state already (it stepped, or loaded "
            "a state dict); shard it before it steps, then load a checkpoint into the sharded "
            "optimizer")
    cls = type(optimizer)
    # The constructor's keywords only: AdamW's defaults hold Adam's decoupled_weight_decay,
    # which AdamW's constructor does not take.
    accepted = set(inspect.signature(cls.__init__).parameters)
    defaults = {k: v for k, v in optimizer.defaults.items() if k in accepted}
    groups = [dict(group) for group in optimizer.param_groups]
    return ShardedOptimizer(model, cls, groups, **options, **defaults)


def point_scheduler_at(scheduler: Any, replaced: dict[int, ShardedOptimizer]) -> None:
    """A scheduler built on a torch optimizer that was replaced (``replaced``: id of the
    torch optimizer -> its ShardedOptimizer) now schedules the ShardedOptimizer's param
    groups, which started as copies of the torch optimizer's with the scheduler's
    initial_lr. The step counter torch's LRScheduler wraps around ``optimizer.step`` (for its
    warning of a scheduler stepped first) is wrapped again around the sharded optimizer's.
    Chained schedulers (SequentialLR, ChainedScheduler) are followed."""
    for child in getattr(scheduler, "_schedulers", []):
        point_scheduler_at(child, replaced)
    sharded = replaced.get(id(getattr(scheduler, "optimizer", None)))
    if sharded is None:
        return
    scheduler.optimizer = sharded
    if not hasattr(sharded.step, "_wrapped_by_lr_sched"):
        step, ref = type(sharded).step, weakref.ref(sharded)

        def counted_step(*args: Any, **kwargs: Any) -> Any:
            optimizer = ref()
            optimizer._opt_called = True
            return step(optimizer, *args, **kwargs)

        counted_step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
        sharded.step = counted_step
