"""``python -m fastddp --sync diloco:H=...``: an unmodified torch DDP script trains with DiLoCo.

Torch's DistributedDataParallel (both import paths, and the names already-imported modules
bound to it, as fastddp.patch() does) becomes LocalReplica: it broadcasts rank 0's weights
and buffers as DDP's constructor does, then runs the module locally with no gradient
collective. The first step() of an optimizer whose parameters all belong to one wrapped model
builds a DiLoCo over that model and optimizer (from a global optimizer pre-hook, before the
step, so that the weights are still the broadcast ones); from then on every H-th step() syncs.
Optimizers over anything else are left alone.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from fastddp._group_ops import broadcast_tensors
from fastddp.diloco import DiLoCo
from fastddp.launch.patch import _set_ddp_names, imported_bindings

# --sync diloco:KEY=VALUE,... : the DiLoCo argument each key sets, and its type.
SYNC_KEYS = {"H": ("sync_every", int), "outer_lr": ("outer_lr", float),
             "outer_momentum": ("outer_momentum", float), "wire": ("wire", str),
             "fragments": ("fragments", int), "overlap": ("overlap", int),
             "merge_alpha": ("merge_alpha", float), "quantized_sum": ("quantized_sum", str)}


def parse_sync_spec(text: str) -> dict[str, Any]:
    """DiLoCo's keyword arguments from ``diloco:H=100,outer_lr=0.7,...``; ValueError naming
    what is wrong."""
    name, _, rest = text.partition(":")
    if name != "diloco":
        raise ValueError(f"--sync {text!r}: the only method is 'diloco' (diloco:H=STEPS)")
    kwargs: dict[str, Any] = {}
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        if not eq or key not in SYNC_KEYS:
            raise ValueError(f"--sync {text!r}: {item!r} is not KEY=VALUE with KEY one of "
                             f"{list(SYNC_KEYS)}")
        argument, kind = SYNC_KEYS[key]
        try:
            kwargs[argument] = kind(value)
        except ValueError:
            raise ValueError(f"--sync {text!r}: {key}={value!r} is not a valid {kind.__name__}")
    if "sync_every" not in kwargs:
        raise ValueError(f"--sync {text!r}: H=STEPS (inner steps between syncs) is required")
    # Every setting checked now, with DiLoCo's defaults for the others, rather than at the
    # script's first optimizer step.
    try:
        DiLoCo.check_settings(**kwargs)
    except (TypeError, ValueError) as e:
        raise ValueError(f"--sync {text!r}: {e}") from None
    return kwargs


class SyncPatch:
    """What ``sync_patch()`` did; ``unpatch()`` undoes it (also as a context manager)."""

    def __init__(self, diloco_kwargs: dict[str, Any]):
        self.diloco_kwargs = diloco_kwargs
        self.models: list[weakref.ref] = []
        self.dilocos: dict[int, DiLoCo] = {}
        # Optimizers found over no wrapped model, with how many models there were then: they
        # are looked at again only once another model is wrapped. Weak: a new optimizer
        # could reuse a freed one's id.
        self._unmatched: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._original = nn.parallel.distributed.DistributedDataParallel
        self.cls = _local_replica_class(self)
        self._rebound = imported_bindings(self._original)
        _set_ddp_names(self.cls)
        for module, attr in self._rebound:
            setattr(module, attr, self.cls)
        self._hook = register_optimizer_step_pre_hook(self._before_step)

    def describe(self) -> str:
        """The one line the launcher prints on rank 0."""
        settings = ", ".join(f"{k}={v}" for k, v in self.diloco_kwargs.items())
        return (f"[fastddp] torch.nn.parallel.DistributedDataParallel -> a local replica "
                f"(no per-step collective); fastddp.DiLoCo({settings}) on the optimizer of "
                "each wrapped model")

    def _before_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if id(optimizer) in self.dilocos or self._unmatched.get(optimizer) == len(
                self.models):
            return
        params = {id(p) for g in optimizer.param_groups for p in g["params"]}
        for ref in self.models:
            model = ref()
            if model is not None and params <= {id(p) for p in model.module.parameters()}:
                if any(d.model is model.module for d in self.dilocos.values()):
                    # A DiLoCo anchors and steps all of its model's parameters: a second
                    # one would undo the first's local steps and apply the outer steps twice.
                    raise NotImplementedError(
                        "fastddp --sync diloco: a second optimizer steps parameters of a model "
                        "that already syncs through another one; --sync diloco takes one "
                        "optimizer per model (fastddp.DiLoCo(model, optimizer) on one of them "
                        "covers all of the model's parameters)")
                self.dilocos[id(optimizer)] = DiLoCo(model.module, optimizer,
                                                     process_group=model.process_group,
                                                     **self.diloco_kwargs)
                return
        self._unmatched[optimizer] = len(self.models)

    def unpatch(self) -> None:
        self._hook.remove()
        for diloco in self.dilocos.values():
            diloco.close()
        _set_ddp_names(self._original)
        for module, attr in self._rebound:
            if getattr(module, attr, None) is self.cls:
                setattr(module, attr, self._original)

    def __enter__(self) -> "SyncPatch":
        return self

    def __exit__(self, *exc: object) -> None:
        self.unpatch()


def sync_patch(spec: str) -> SyncPatch:
    """Replaces torch's DDP with a local replica and syncs with DiLoCo as ``spec`` says."""
    return SyncPatch(parse_sync_spec(spec))


def _local_replica_class(owner: SyncPatch) -> type:

    class LocalReplica(nn.Module):
        """Stands in for torch's DistributedDataParallel under ``--sync``: ``module`` runs
        locally; fastddp.DiLoCo averages every H optimizer steps."""

        def __init__(self, module: nn.Module, *args: Any, process_group: Any = None,
                     **kwargs: Any) -> None:
            super().__init__()
            self.module = module
            self.process_group = process_group or torch.distributed.group.WORLD
            with torch.no_grad():
                broadcast_tensors(self.process_group, [t.detach() for t in module.parameters()]
                                  + list(module.buffers()), 0)
            owner.models.append(weakref.ref(self))

        def forward(self, *inputs: Any, **kwargs: Any) -> Any:
            return self.module(*inputs, **kwargs)

        @contextlib.contextmanager
        def no_sync(self):
            # Every step is local already.
            yield

        def register_comm_hook(self, state: object, hook: Any) -> None:
            # No gradient is communicated: a hook would never run.
            pass

    LocalReplica.__qualname__ = "DistributedDataParallel"
    return LocalReplica
