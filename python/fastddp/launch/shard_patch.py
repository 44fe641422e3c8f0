"""``--shard-optimizer`` (``fastddp.patch(shard_optimizer=True)``): an unmodified script's
``torch.optim.SGD``, ``Adam`` or ``AdamW`` over the parameters of a model the patch wrapped
becomes ``fastddp.optim.ShardedOptimizer`` (its state sharded over the ranks, docs/sharded.md),
and ``torch.nn.utils.clip_grad_norm_`` over that model's parameters clips the shards.

Note [sharded optimizer under the launcher]
The three names in ``torch.optim`` are replaced, while the patch lasts, by subclasses whose
``__new__`` looks at the parameters: when they are exactly the parameters a wrapped model
averages (as ``model.parameters()`` gives them, in any param groups), it returns a
ShardedOptimizer of torch's class with the script's arguments; otherwise (another set of
parameters, or an optimizer built before its model was wrapped) the torch optimizer itself,
and rank 0 says once why it was not sharded. The returned object is not an instance of the
torch class (it is a torch.optim.Optimizer, as schedulers ask). After a synchronized
backward the parameters' ``.grad`` is None, so ``clip_grad_norm_`` must reach the shards:
over exactly a sharded model's parameters it calls the optimizer's ``clip_grad_norm_``; over
a part of them it raises rather than return a norm of nothing. ``optimizer.state_dict()``
needs ``consolidate_state_dict()`` first (it raises, naming it). With ``FASTDDP_DISABLE=1``
the optimizer is torch's ``ZeroRedundancyOptimizer`` over torch DDP instead, so that one
command line compares the two.
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Callable
from typing import Any

import torch

from fastddp.ddp import surface
from fastddp.optim import ShardedOptimizer

_NAMES = ("SGD", "Adam", "AdamW")


class OptimizerSharding:
    """What ``--shard-optimizer`` replaced, and the wrapped models it shards for."""

    def __init__(self, disabled: bool, note_once: Callable[[str], None]):
        self.disabled = disabled
        self._note = note_once
        self._models: list[weakref.ref] = []
        # id(parameter) -> the sharded optimizer holding it (for clip_grad_norm_)
        self._holders: dict[int, weakref.ref] = {}
        self._originals: dict[str, Any] = {}
        self.optimizers_sharded = 0

    def add_model(self, model: torch.nn.Module) -> None:
        self._models.append(weakref.ref(model))

    def install(self) -> None:
        for name in _NAMES:
            self._originals[name] = getattr(torch.optim, name)
            setattr(torch.optim, name, self._redirect(self._originals[name]))
        self._originals["clip"] = torch.nn.utils.clip_grad_norm_
        torch.nn.utils.clip_grad_norm_ = self._clip
        torch.nn.utils.clip_grad.clip_grad_norm_ = self._clip

    def uninstall(self) -> None:
        for name in _NAMES:
            setattr(torch.optim, name, self._originals[name])
        torch.nn.utils.clip_grad_norm_ = self._originals["clip"]
        torch.nn.utils.clip_grad.clip_grad_norm_ = self._originals["clip"]

    def _owner(self, params: list) -> Any:
        """The wrapped model whose averaged parameters are exactly ``params``'s, or None."""
        mine = {id(p) for entry in params
                for p in (entry["params"] if isinstance(entry, dict) else [entry])}
        for ref in self._models:
            model = ref()
            if model is None:
                continue
            theirs = {id(p) for _, p in _averaged(model)}
            if mine == theirs:
                return model
            if mine & theirs:
                self._note("an optimizer over part of a wrapped model's parameters was not "
                           "sharded (--shard-optimizer shards one optimizer over all of them)")
                return None
        self._note("an optimizer built before its model was wrapped (or over parameters of "
                   "no wrapped model) was not sharded")
        return None

    def _redirect(self, cls: type) -> type:
        owner = self
        names = list(inspect.signature(cls.__init__).parameters)[2:]  # after self, params

        class Sharding(cls):  # type: ignore[misc, valid-type]
            def __new__(klass, params: Any, *args: Any, **kwargs: Any) -> Any:
                kwargs.update(zip(names, args))
                params = list(params)
                model = owner._owner(params)
                if model is None:
                    return cls(params, **kwargs)
                if owner.disabled:
                    from torch.distributed.optim import ZeroRedundancyOptimizer
                    return ZeroRedundancyOptimizer(params, optimizer_class=cls, **kwargs)
                optimizer = ShardedOptimizer(model, cls, params, **kwargs)
                for _, p in _averaged(model):
                    owner._holders[id(p)] = weakref.ref(optimizer)
                owner.optimizers_sharded += 1
                return optimizer

        Sharding.__name__ = Sharding.__qualname__ = cls.__name__
        Sharding.__module__ = cls.__module__
        return Sharding

    def _clip(self, parameters: Any, max_norm: float, norm_type: float = 2.0,
              error_if_nonfinite: bool = False, foreach: bool | None = None) -> torch.Tensor:
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        holders = {id(h()) : h() for h in (self._holders.get(id(p)) for p in params)
                   if h is not None and h() is not None}
        if not holders:
            return self._originals["clip"](params, max_norm, norm_type, error_if_nonfinite,
                                           foreach)
        (optimizer,) = holders.values() if len(holders) == 1 else (None,)
        held = {id(p) for g in (optimizer.param_groups if optimizer else []) for p in g["params"]}
        if optimizer is None or {id(p) for p in params} != held:
            raise NotImplementedError(
                "torch.nn.utils.clip_grad_norm_ under --shard-optimizer: the gradients are "
                "sharded, so only the whole set of a sharded optimizer's parameters can be "
                "clipped (model.parameters()), not a part of them or several models' at once")
        return optimizer.clip_grad_norm_(max_norm, norm_type, error_if_nonfinite)


def _averaged(model: Any) -> list:
    try:
        return surface.averaged_parameters(model)
    except TypeError:  # FASTDDP_DISABLE=1: torch's DDP, whose parameters all are
        return [(n, p) for n, p in model.named_parameters() if p.requires_grad]
