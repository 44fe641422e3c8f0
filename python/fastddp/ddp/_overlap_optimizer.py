"""The optimizer overlapped with backward: ``model.overlap_optimizer(optimizer)``, and torch's
``_register_fused_optim`` on top of it.

Note [overlapped optimizer, Python side]
The reducer steps the optimizer bucket by bucket, each as soon as that bucket's averaged
gradients are in ``param.grad`` (csrc/optim/optimizer_step.h, Note [overlapped
optimizer]). Each step is the optimizer's own ``step()`` with every param group narrowed to
the bucket's parameters: every ``torch.optim`` update is elementwise per parameter (the
single-tensor, foreach and fused implementations alike), so the steps together give the
numbers of one ``optimizer.step()`` after torch DDP's backward, and the optimizer's state,
``state_dict()``, learning-rate schedulers and ``zero_grad()`` stay the user's. Parameters
of the optimizer that no bucket holds (outside this model) step at the end of backward.
For torch's SGD, Adam and AdamW built with ``fused=True`` the reducer calls torch's fused
kernels itself, with no Python per bucket (``_fused_step.py``): the same kernels on the same
tensors as that optimizer's step().

What changes for the user: a synchronized backward steps the optimizer, so the script does
not call ``optimizer.step()`` (a call raises, naming why: it would step twice; a
GradScaler's ``scaler.step(optimizer)`` is such a call). Under ``no_sync()`` nothing is
reduced and nothing steps: the gradients accumulate for the next synchronized backward, as
with torch's optimizers in backward. ``.grad`` holds the averaged gradient afterwards, as
after torch DDP's backward; ``optimizer.zero_grad()`` works as before.
"""

from __future__ import annotations

from typing import Any

import torch

from fastddp import _C
from fastddp.ddp import _fused_step

_HOW = "fastddp.DistributedDataParallel.overlap_optimizer"


class OverlappedOptimizer:
    """``optimizer`` stepped by ``ddp``'s reducer, bucket by bucket."""

    def __init__(self, ddp: Any, optimizer: torch.optim.Optimizer):
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"{_HOW}: expected a torch.optim.Optimizer, got "
                            f"{type(optimizer).__name__}")
        if isinstance(optimizer, torch.optim.LBFGS):
            raise NotImplementedError(
                f"{_HOW}: LBFGS re-evaluates the loss through a closure inside its step; a "
                "step inside backward has none")
        self.optimizer = optimizer
        self._params = ddp._reducer_params  # the reducer's order: bucket indices name them
        self._rest: list[torch.Tensor] = []
        self._narrowed: dict[tuple, list[list[torch.Tensor]]] = {}
        self._groups_key: tuple = ()
        self._kind: str | None = None
        self._stepping = False
        self._pre_hook = optimizer.register_step_pre_hook(self._refuse_user_step)
        self.native: Any = None
        self.refresh()

    def refresh(self) -> bool:
        """Before each forward: whether ``native`` changed (the param groups or the state
        were replaced, as add_param_group and load_state_dict do); the native step's
        hyperparameters are read again either way (LR schedulers change them)."""
        optimizer = self.optimizer
        key = (id(optimizer.state),) + tuple((id(g), id(g["params"]), len(g["params"]))
                                             for g in optimizer.param_groups)
        if key == self._groups_key:
            if self._kind is not None:
                self.native.set_groups(_fused_step.hyperparameters(self._kind, optimizer))
            return False
        self._groups_key = key
        self._narrowed.clear()
        in_model = {id(p) for p in self._params}
        self._rest = [p for group in optimizer.param_groups for p in group["params"]
                      if id(p) not in in_model]
        # torch's fused kernels called from C++ where they give the optimizer's numbers,
        # else its own step(), narrowed per bucket.
        self._kind = _fused_step.kind_of(optimizer, self._params)
        self.native = (_fused_step.build(self._kind, optimizer, self._params) if self._kind
                       else _C.python_optimizer_step(self._on_step))
        return True

    def _refuse_user_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if not self._stepping:
            raise RuntimeError(
                f"{type(optimizer).__name__}.step() was called on an optimizer that "
                f"{_HOW}() steps inside every synchronized backward; a second step would "
                "apply each update twice. Drop the optimizer.step() call (and a GradScaler's "
                "scaler.step(optimizer): overlapped steps cannot be skipped or unscaled)")

    def _on_step(self, indices: list[int] | None) -> None:
        """Called by the reducer: a bucket's parameter indices, or None at the end of
        backward (the parameters no bucket holds)."""
        if indices is None:
            if self._rest:
                self._step_narrowed(self._rest, None)
            return
        self._step_narrowed([self._params[i] for i in indices], tuple(indices))

    def _step_narrowed(self, params: list[torch.Tensor], key: tuple | None) -> None:
        groups = self.optimizer.param_groups
        # Cached per bucket; refresh() clears the cache when the param groups change.
        narrowed = self._narrowed.get(key) if key is not None else None
        if narrowed is None:
            wanted = {id(p) for p in params}
            narrowed = [[p for p in g["params"] if id(p) in wanted] for g in groups]
            if key is not None:
                self._narrowed[key] = narrowed
        if not any(narrowed):
            return
        optimizer = self.optimizer
        kept = [(g, subset, g["params"]) for g, subset in zip(groups, narrowed) if subset]
        self._stepping = True
        try:
            # Only the groups with a parameter here, each narrowed to those parameters.
            optimizer.param_groups = [g for g, _, _ in kept]
            for group, subset, _ in kept:
                group["params"] = subset
            optimizer.step()
        finally:
            self._stepping = False
            optimizer.param_groups = groups
            for group, _, full in kept:
                group["params"] = full


def register(ddp: Any, optimizer: torch.optim.Optimizer) -> None:
    """``ddp.overlap_optimizer(optimizer)``."""
    if getattr(ddp, "_use_python_reducer", False):
        raise NotImplementedError(
            f"{_HOW}: not under compiled autograd (optimize_ddp='python_reducer'), which "
            "reduces per parameter without fastddp's reducer")
    if ddp.mixed_precision is not None:
        raise NotImplementedError(
            f"{_HOW}: not with mixed_precision, whose full-precision parameters come back "
            "only after the whole backward")
    if ddp._delayed is not None:
        raise NotImplementedError(
            f"{_HOW}: not with delay_all_reduce_named_params, whose parameters are averaged "
            "outside the buckets, by a reduction of their own")
    if getattr(ddp, "_sharded", None) is not None:
        raise NotImplementedError(
            f"{_HOW}: not on a model whose gradients a fastddp.optim.ShardedOptimizer holds")
    if ddp._overlap is not None:
        raise RuntimeError(f"{_HOW}: an optimizer is already overlapped with this model's "
                           "backward; only one can be")
    overlapped = OverlappedOptimizer(ddp, optimizer)
    ddp._overlap = overlapped
    if ddp._reducer is None:  # world size 1: the reducer is what steps it
        ddp._build_reducer()  # attaches ddp._overlap
    else:
        ddp._reducer.set_optimizer_step(overlapped.native)


def register_fused(ddp: Any, optim: type, args: tuple, optim_params: Any,
                   kwargs: dict) -> None:
    """torch's ``ddp._register_fused_optim(optim, *args, optim_params=None, **kwargs)``: an
    ``optim`` over ``optim_params`` (default: the model's parameters that require grad),
    stepped per bucket right after its reduction. Unlike torch's it takes any torch.optim
    class, composes with a comm hook and with no_sync()."""
    params = list(optim_params) if optim_params is not None else list(ddp._reducer_params)
    register(ddp, optim(params, *args, **kwargs))
