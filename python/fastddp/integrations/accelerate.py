"""fastddp in Hugging Face Accelerate: an ``Accelerator`` whose ``prepare()`` wraps the model in
fastddp.DistributedDataParallel, started with ``accelerate launch`` (no ``-m fastddp``).

    from accelerate.utils import DDPCommunicationHookType, DistributedDataParallelKwargs
    from fastddp.integrations.accelerate import Accelerator   # instead of accelerate's

    accelerator = Accelerator(kwargs_handlers=[
        DistributedDataParallelKwargs(comm_hook=DDPCommunicationHookType.BF16)])

Everything else is Accelerate's (checked on 1.15): this class is a subclass of
``accelerate.Accelerator``, and fastddp's wrapper a subclass of torch's, so Accelerate's
``isinstance(model, DistributedDataParallel)`` checks (``no_sync``, ``unwrap_model``) hold.

Why a subclass and not only a kwargs handler: Accelerate files a handler by its exact class
(``handler_class_to_attr[handler.__class__]``), so it refuses a subclass of
``DistributedDataParallelKwargs``; and ``prepare_model`` builds the wrapper by the name
``torch.nn.parallel.DistributedDataParallel`` itself. ``Accelerator.prepare_model`` here runs
Accelerate's own ``prepare_model`` code with one global of its own changed: ``torch``, seen
through an overlay that answers fastddp's class for ``torch.nn.parallel
.DistributedDataParallel`` (see ``_with_fastddp``). Nothing is patched: torch, Accelerate's
module and other threads keep torch's class.

``DDPCommunicationHookType`` choices (``DistributedDataParallelKwargs.comm_hook``) run as
fastddp's native C++ hooks: Accelerate registers torch's hook functions on the wrapper, and
fastddp's ``register_comm_hook`` runs those natively (docs/hooks.md): FP16 -> ``fp16``, BF16 ->
``bf16``, POWER_SGD -> ``powersgd`` and BATCHED_POWER_SGD -> ``powersgd_batched``, with the
``PowerSGDState`` built from ``comm_state_option``. ``comm_wrapper`` of the hook's own
precision (FP16 on FP16, BF16 on BF16) changes no value (the bucket is already in that
precision when the hook casts it) and runs as the hook alone; any other ``comm_wrapper`` raises
NotImplementedError (fastddp has no native PowerSGD in half precision, nor a cast to one half
format before a hook in the other). fastddp's other hooks: ``FastDDPKwargs(hook=...)``.

``Accelerator(shard_optimizer=True)`` (or a dict of ShardedOptimizer's options:
``overlap_all_gather``, ``zero_stage``, ``gradient_wire``): ``prepare()`` makes an SGD, Adam or
AdamW over exactly a prepared model's parameters a ``fastddp.optim.ShardedOptimizer`` of the
same class, param groups and hyperparameters (docs/sharded.md); the model must be prepared
first or in the same call, as Accelerate prepares models before optimizers. A scheduler built
on the torch optimizer is pointed at the sharded one when prepared. ``clip_grad_norm_`` over
the model's parameters clips the shards. Refused, naming the cause: an optimizer with state
already, a scaler's unscale (fp16; ShardedOptimizer unscales inside its step), and
``clip_grad_value_`` (no rank holds a whole gradient). ``save_state`` needs the consolidated
state (ShardedOptimizer.state_dict() says so); sharded checkpoints: docs/sharded.md (DCP).
"""

import copy
import dataclasses
import types
from typing import Any

import accelerate
import torch
from accelerate.utils import DDPCommunicationHookType, DistributedDataParallelKwargs

from fastddp.ddp import DistributedDataParallel
from fastddp.ddp import surface
from fastddp.launch.hook_spec import fastddp_hook, parse_hook_spec
from fastddp.optim import ShardedOptimizer, point_scheduler_at, shard_torch_optimizer

@dataclasses.dataclass
class FastDDPKwargs(DistributedDataParallelKwargs):
    """``DistributedDataParallelKwargs`` with ``hook``: one of fastddp's hooks, as a ``--hook``
    spelling (``"int8"``, ``"powersgd:4"``) or a ``fastddp.hooks`` object. Give it to this
    module's ``Accelerator`` (Accelerate's own refuses subclasses of its handlers); ``hook``
    and ``comm_hook`` exclude each other (a model takes one communication hook)."""

    hook: Any = None

    def __post_init__(self) -> None:
        # Members, also from their values ("bf16"): Accelerate looks its hooks up by member,
        # and its own handler registers nothing for a string.
        self.comm_hook = DDPCommunicationHookType(self.comm_hook)
        self.comm_wrapper = DDPCommunicationHookType(self.comm_wrapper)
        if self.hook is not None and self.comm_hook != DDPCommunicationHookType.NO:
            raise ValueError("FastDDPKwargs: give either hook or comm_hook, not both (a model "
                             "takes one communication hook)")
        if self.hook is not None and (self.comm_wrapper != DDPCommunicationHookType.NO
                                      or self.comm_state_option):
            raise ValueError("FastDDPKwargs: comm_wrapper and comm_state_option go with "
                             "comm_hook; with hook=, give the hook's options in its spelling "
                             "('powersgd:4') or object (fastddp.hooks.powersgd(...))")
        if isinstance(self.hook, str):
            parse_hook_spec(self.hook, "FastDDPKwargs(hook=...)")  # a bad name fails here
        elif self.hook is not None and not callable(self.hook):
            raise TypeError(f"FastDDPKwargs: hook must be a --hook spelling or a fastddp.hooks "
                            f"object, got {type(self.hook).__name__}")
        wrapper = self.comm_wrapper
        if (wrapper != DDPCommunicationHookType.NO and self.comm_hook != wrapper
                and self.comm_hook != DDPCommunicationHookType.NO):
            raise NotImplementedError(
                f"fastddp: comm_wrapper={wrapper.value!r} on comm_hook="
                f"{self.comm_hook.value!r} has no native hook (fastddp's PowerSGD reduces in "
                f"float32, and no hook casts to one half format before another); use "
                f"comm_wrapper='no'")

    @classmethod
    def of(cls, handler: DistributedDataParallelKwargs) -> "FastDDPKwargs":
        """Accelerate's handler as one of these (the same fields, no fastddp hook)."""
        return cls(**{f.name: getattr(handler, f.name)
                      for f in dataclasses.fields(DistributedDataParallelKwargs)})

    def to_dict(self, ignore_keys=("comm_hook", "comm_wrapper", "comm_state_option", "hook")):
        # The wrapper's keyword arguments, as Accelerate's to_kwargs() reads them (its
        # to_dict deep-copies every field first, a hook object too: not done here).
        return {k: copy.deepcopy(v) for k, v in vars(self).items() if k not in ignore_keys}

    def register_comm_hook(self, model: torch.nn.Module) -> None:
        if self.hook is not None:
            state, hook = None, self.hook
            if isinstance(hook, str):
                # Built now, once the process group exists (a hook's state may need it), and
                # per model, so no two models share a hook's state.
                state, hook = fastddp_hook(parse_hook_spec(hook, "FastDDPKwargs(hook=...)"),
                                           "FastDDPKwargs(hook=...)")
            model.register_comm_hook(state, hook)
            return
        # A wrapper of the hook's own precision casts a bucket the hook then casts to the same
        # format: the hook alone, which fastddp runs natively (a wrapped hook would not be).
        plain = dataclasses.replace(self, comm_wrapper=DDPCommunicationHookType.NO)
        DistributedDataParallelKwargs.register_comm_hook(plain, model)


class _Overlay(types.ModuleType):
    """A module that answers ``overrides`` by name and everything else from ``base``."""

    def __init__(self, base: types.ModuleType, **overrides: Any) -> None:
        super().__init__(base.__name__, base.__doc__)
        vars(self).update(overrides)
        self._overlay_base = base

    def __getattr__(self, name: str) -> Any:
        return getattr(self._overlay_base, name)


def _with_fastddp(function: types.FunctionType, ddp_class: type) -> types.FunctionType:
    """``function`` (Accelerate's prepare_model) with its module's globals, but ``torch``
    overlaid so that ``torch.nn.parallel.DistributedDataParallel`` is ``ddp_class``. The
    globals are copied at each call, so the function sees the module as it is then."""
    if "DistributedDataParallel" not in function.__code__.co_names:
        raise NotImplementedError(
            f"fastddp: accelerate {accelerate.__version__}'s {function.__qualname__} does not "
            "build torch.nn.parallel.DistributedDataParallel by name (checked on 1.15); use "
            "fastddp.patch() before prepare(), or the -m fastddp launcher")
    overlay = _Overlay(torch, nn=_Overlay(torch.nn, parallel=_Overlay(
        torch.nn.parallel, DistributedDataParallel=ddp_class)))
    scope = dict(function.__globals__, torch=overlay)
    copy = types.FunctionType(function.__code__, scope, function.__name__,
                              function.__defaults__, function.__closure__)
    copy.__kwdefaults__ = function.__kwdefaults__
    return copy


class Accelerator(accelerate.Accelerator):
    """``accelerate.Accelerator`` whose ``prepare()`` wraps models in
    fastddp.DistributedDataParallel; takes Accelerate's arguments, and in ``kwargs_handlers``
    a ``DistributedDataParallelKwargs`` or a ``FastDDPKwargs`` (one of them)."""

    def __init__(self, *args: Any, kwargs_handlers: list | None = None,
                 shard_optimizer: bool | dict = False, **kwargs: Any) -> None:
        if not isinstance(shard_optimizer, (bool, dict)):
            raise TypeError("fastddp Accelerator: shard_optimizer is True, False or a dict of "
                            "fastddp.optim.ShardedOptimizer's options, got "
                            f"{type(shard_optimizer).__name__}")
        self._shard_options = ({} if shard_optimizer is True else shard_optimizer or None)
        # id(torch optimizer) -> the ShardedOptimizer that replaced it (for its schedulers)
        self._sharded_for: dict[int, ShardedOptimizer] = {}
        self._wrapped: list[DistributedDataParallel] = []  # the models prepare() wrapped
        handlers = list(kwargs_handlers or [])
        ddp = [h for h in handlers if isinstance(h, DistributedDataParallelKwargs)]
        if len(ddp) > 1:
            raise ValueError("fastddp Accelerator: pass one DistributedDataParallelKwargs or "
                             "FastDDPKwargs in kwargs_handlers, got "
                             f"{', '.join(type(h).__name__ for h in ddp)}")
        handlers = [h for h in handlers if not isinstance(h, DistributedDataParallelKwargs)]
        super().__init__(*args, kwargs_handlers=handlers, **kwargs)
        # Set after Accelerate filed the others: it refuses FastDDPKwargs (a subclass).
        self.ddp_handler = (ddp[0] if ddp and isinstance(ddp[0], FastDDPKwargs)
                            else FastDDPKwargs.of(ddp[0]) if ddp else None)

    def prepare_model(self, model: torch.nn.Module, device_placement: bool | None = None,
                      evaluation_mode: bool = False) -> torch.nn.Module:
        if self.ddp_handler is not None and not isinstance(self.ddp_handler, FastDDPKwargs):
            # One set after __init__: checked and mapped as well.
            self.ddp_handler = FastDDPKwargs.of(self.ddp_handler)
        # Under the launcher (fastddp.patch()), torch's name already holds fastddp's class
        # with the launcher's overrides; keep that one.
        current = torch.nn.parallel.DistributedDataParallel
        ddp_class = current if issubclass(current, DistributedDataParallel) \
            else DistributedDataParallel
        prepare = _with_fastddp(accelerate.Accelerator.prepare_model, ddp_class)
        model = prepare(self, model, device_placement, evaluation_mode)
        if isinstance(model, DistributedDataParallel):
            # Accelerate's _models holds the module it was given, not the CPU wrapper.
            self._wrapped.append(model)
        return model

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer,
                          device_placement: bool | None = None) -> Any:
        if (self._shard_options is not None
                and not getattr(optimizer, "_is_accelerate_prepared", False)):
            optimizer = self._sharded(optimizer)
        if isinstance(optimizer, ShardedOptimizer):
            # Its state is made where the model's buckets are; Accelerate's placement is a
            # state_dict() round trip, which a sharded state makes only consolidated.
            device_placement = False
        return super().prepare_optimizer(optimizer, device_placement)

    def _sharded(self, optimizer: torch.optim.Optimizer) -> ShardedOptimizer:
        """``optimizer`` as a ShardedOptimizer over the prepared model whose parameters are
        its own (module docstring)."""
        if isinstance(optimizer, ShardedOptimizer):
            return optimizer
        mine = {id(p) for group in optimizer.param_groups for p in group["params"]}
        owners = [m for m in self._wrapped
                  if mine & {id(p) for _, p in surface.averaged_parameters(m)}]
        if not owners:
            raise ValueError(
                f"fastddp Accelerator(shard_optimizer=...): no prepared model owns the "
                f"{type(optimizer).__name__}'s parameters; prepare the model before the "
                "optimizer or in the same prepare() call")
        sharded = shard_torch_optimizer(optimizer, owners[0],
                                        "fastddp Accelerator(shard_optimizer=...)",
                                        **self._shard_options)
        self._sharded_for[id(optimizer)] = sharded
        return sharded

    def prepare_scheduler(self, scheduler: Any) -> Any:
        point_scheduler_at(scheduler, self._sharded_for)
        return super().prepare_scheduler(scheduler)

    def _sharded_holding(self, params: list, what: str) -> ShardedOptimizer | None:
        ids = {id(p) for p in params}
        for accelerated in self._optimizers:
            inner = accelerated.optimizer
            if not isinstance(inner, ShardedOptimizer):
                continue
            held = {id(p) for group in inner.param_groups for p in group["params"]}
            if ids == held:
                return inner
            if ids & held:
                raise NotImplementedError(
                    f"fastddp Accelerator.{what}: the gradients of a sharded optimizer's "
                    "parameters are sharded; only all of its parameters (model.parameters()) "
                    "can be clipped together")
        return None

    def clip_grad_norm_(self, parameters: Any, max_norm: float, norm_type: float = 2) -> Any:
        params = _as_list(parameters)
        sharded = self._sharded_holding(params, "clip_grad_norm_")
        if sharded is None:
            return super().clip_grad_norm_(params, max_norm, norm_type)
        if self.scaler is not None:
            raise NotImplementedError(
                "fastddp Accelerator.clip_grad_norm_ with a sharded optimizer and a gradient "
                "scaler (fp16): the shards are unscaled inside the optimizer's step, not by "
                "scaler.unscale_(); use bf16 (no scaler) or no clipping")
        return sharded.clip_grad_norm_(max_norm, norm_type)

    def clip_grad_value_(self, parameters: Any, clip_value: float) -> None:
        params = _as_list(parameters)
        if self._sharded_holding(params, "clip_grad_value_") is not None:
            raise NotImplementedError(
                "fastddp Accelerator.clip_grad_value_ with a sharded optimizer: no rank holds "
                "a whole gradient (.grad is None); clip_grad_norm_ clips the shards")
        return super().clip_grad_value_(params, clip_value)

    def unscale_gradients(self, optimizer: Any = None) -> None:
        chosen = (self._optimizers if optimizer is None
                  else optimizer if isinstance(optimizer, list) else [optimizer])
        if self.scaler is not None and any(
                isinstance(getattr(o, "optimizer", o), ShardedOptimizer) for o in chosen):
            raise NotImplementedError(
                "fastddp Accelerator.unscale_gradients: a sharded optimizer's shards are "
                "unscaled inside its step (GradScaler's unscale_ sees no .grad)")
        return super().unscale_gradients(optimizer)


def _as_list(parameters: Any) -> list:
    """A tensor or an iterable of them (torch's clipping functions take either) as a list,
    read once (a generator such as model.parameters() is used up)."""
    return [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
