"""fastddp as a Lightning strategy: ``Trainer(strategy="fastddp")``, no launcher needed.

    import fastddp.integrations.lightning  # registers the strategies below
    trainer = L.Trainer(strategy="fastddp", accelerator="gpu", devices=8)

Lightning (checked on 2.6) finds strategies by name in ``lightning.pytorch.strategies
.StrategyRegistry``, filled when that package is imported, from its own modules only: it
reads no entry point for strategies (its only entry-point groups are callback factories,
which the Trainer reads after it has resolved the strategy name). So the names are registered
here, when this module is imported, with Lightning's own ``register_strategies`` classmethod
convention. Lightning's process launcher re-runs the script in every process, so each one
imports this module again and finds the names.

Registered names (each the matching ``--hook`` of the launcher, docs/frameworks.md):

- ``"fastddp"``: fastddp.DistributedDataParallel with no hook (a float allreduce, as "ddp");
- ``"fastddp_bf16"``: with ``fastddp.hooks.bf16()``;
- ``"fastddp_powersgd"``: with ``fastddp.hooks.powersgd()`` as ``--hook powersgd`` builds it
  (rank 1, compressing from step 2).

Any other hook or DDP argument: ``strategy=FastDDPStrategy(hook=..., static_graph=True)``,
where ``hook`` is a ``--hook`` spelling (``"powersgd:4"``, ``"int8"``) or a hook object
(``fastddp.hooks.powersgd(matrix_approximation_rank=4, start_powerSGD_iter=1000)``).
"""

from contextlib import nullcontext
from typing import Any

import torch
from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from torch.nn import Module

from fastddp.ddp import DistributedDataParallel
from fastddp.launch.hook_spec import fastddp_hook, parse_hook_spec

# name: (the --hook spelling of its hook, None for none; Lightning's description)
STRATEGIES = {
    "fastddp": (None, "fastddp.DistributedDataParallel (C++ reducer), no comm hook"),
    "fastddp_bf16": ("bf16", "fastddp.DistributedDataParallel with fastddp.hooks.bf16()"),
    "fastddp_powersgd": ("powersgd", "fastddp.DistributedDataParallel with "
                                     "fastddp.hooks.powersgd() (rank 1, from step 2)"),
}


class FastDDPStrategy(DDPStrategy):
    """Lightning's DDPStrategy with fastddp.DistributedDataParallel as the wrapper.

    Everything else is DDPStrategy's (process launch, process group, samplers, manual
    optimization, checkpoints): fastddp's class is a subclass of torch's, so Lightning's
    ``isinstance(model, DistributedDataParallel)`` checks hold. ``hook``: a ``--hook``
    spelling or a hook object, registered on every device type (Lightning registers its own
    ``ddp_comm_hook`` on CUDA only, and still does so here); the other keyword arguments are
    DDPStrategy's, the unknown ones going to the wrapper as with DDPStrategy.
    """

    def __init__(self, *args: Any, hook: Any = None, **kwargs: Any) -> None:
        if hook is not None and kwargs.get("ddp_comm_hook") is not None:
            raise ValueError("FastDDPStrategy: give either hook or ddp_comm_hook, not both "
                             "(a model takes one communication hook)")
        if isinstance(hook, str):
            parse_hook_spec(hook, "FastDDPStrategy(hook=...)")  # a bad name fails here
        elif hook is not None and not callable(hook):
            raise TypeError(f"FastDDPStrategy: hook must be a --hook spelling or a hook "
                            f"object, got {type(hook).__name__}")
        super().__init__(*args, **kwargs)
        self._fastddp_hook = hook

    def _setup_model(self, model: Module) -> DistributedDataParallel:
        # DDPStrategy._setup_model with fastddp's class: the same device ids, side stream
        # and keyword arguments.
        device_ids = self.determine_ddp_device_ids()
        ctx = torch.cuda.stream(torch.cuda.Stream()) if device_ids is not None else nullcontext()
        with ctx:
            return DistributedDataParallel(module=model, device_ids=device_ids,
                                           **self._ddp_kwargs)

    def _register_ddp_hooks(self) -> None:
        super()._register_ddp_hooks()
        hook = self._fastddp_hook
        if hook is None:
            return
        state = None
        if isinstance(hook, str):
            # Built now, once the process group exists (a hook's state may need it), and
            # per model, so no two trainers share a hook's state.
            state, hook = fastddp_hook(parse_hook_spec(hook, "FastDDPStrategy(hook=...)"),
                                       "FastDDPStrategy(hook=...)")
        self.model.register_comm_hook(state, hook)

    @classmethod
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        for name, (hook, description) in STRATEGIES.items():
            # override=True: importing this module again (importlib.reload) re-registers
            # the same names rather than failing.
            strategy_registry.register(name, cls, description=description, override=True,
                                       hook=hook)


FastDDPStrategy.register_strategies(StrategyRegistry)
