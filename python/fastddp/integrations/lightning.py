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

``FastDDPStrategy(shard_optimizer=True)`` (or a dict of ShardedOptimizer's options:
``overlap_all_gather``, ``zero_stage``, ``gradient_wire``): the SGD, Adam or AdamW that
``configure_optimizers`` returns over the module's parameters becomes a
``fastddp.optim.ShardedOptimizer`` of the same class, groups and hyperparameters
(docs/sharded.md), and its schedulers schedule the sharded one. The Trainer's
``gradient_clip_val`` (by norm) clips the shards; by value it is refused (no rank holds a
whole gradient), as is another optimizer beside it. Checkpoints are Lightning's own: its
``optimizer_state`` consolidates an optimizer that has ``consolidate_state_dict`` on rank 0,
and every rank loads the whole state back.
"""

from contextlib import nullcontext
from typing import Any

import torch
from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from torch.nn import Module

from fastddp.ddp import DistributedDataParallel
from fastddp.launch.hook_spec import fastddp_hook, parse_hook_spec
from fastddp.optim import ShardedOptimizer, point_scheduler_at, shard_torch_optimizer

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

    def __init__(self, *args: Any, hook: Any = None, shard_optimizer: bool | dict = False,
                 **kwargs: Any) -> None:
        if not isinstance(shard_optimizer, (bool, dict)):
            raise TypeError("FastDDPStrategy: shard_optimizer is True, False or a dict of "
                            "fastddp.optim.ShardedOptimizer's options, got "
                            f"{type(shard_optimizer).__name__}")
        self._shard_options = {} if shard_optimizer is True else shard_optimizer or None
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

    def setup_optimizers(self, trainer: Any) -> None:
        super().setup_optimizers(trainer)
        if self._shard_options is None or not self.optimizers:
            return
        who = "FastDDPStrategy(shard_optimizer=...)"
        if len(self.optimizers) > 1:
            raise NotImplementedError(
                f"{who}: configure_optimizers returned {len(self.optimizers)} optimizers; one "
                "sharded optimizer holds all of the model's parameters")
        sharded = shard_torch_optimizer(self.optimizers[0], self.model, who,
                                        **self._shard_options)
        replaced = {id(self.optimizers[0]): sharded}
        for config in self.lr_scheduler_configs:
            point_scheduler_at(config.scheduler, replaced)
        self.optimizers = [sharded]
        _clip_shards(self.precision_plugin)

    @classmethod
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        for name, (hook, description) in STRATEGIES.items():
            # override=True: importing this module again (importlib.reload) re-registers
            # the same names rather than failing.
            strategy_registry.register(name, cls, description=description, override=True,
                                       hook=hook)


FastDDPStrategy.register_strategies(StrategyRegistry)


def _clip_shards(plugin: Any) -> None:
    """The Trainer's gradient clipping on a ShardedOptimizer: by norm over the shards (its
    clip_grad_norm_, the norm torch's gives over whole gradients); by value refused. Set on
    this strategy's own precision plugin, whose methods clip ``.grad``, which the shards are
    not; other optimizers keep the plugin's own."""
    by_norm, by_value = plugin.clip_grad_by_norm, plugin.clip_grad_by_value

    def clip_grad_by_norm(optimizer: Any, clip_val: float) -> None:
        inner = getattr(optimizer, "_optimizer", optimizer)  # a LightningOptimizer's
        if isinstance(inner, ShardedOptimizer):
            inner.clip_grad_norm_(clip_val)
        else:
            by_norm(optimizer, clip_val)

    def clip_grad_by_value(optimizer: Any, clip_val: float) -> None:
        if isinstance(getattr(optimizer, "_optimizer", optimizer), ShardedOptimizer):
            raise NotImplementedError(
                "FastDDPStrategy(shard_optimizer=...): gradient_clip_algorithm='value' has no "
                "whole gradient to clip on any rank; clip by norm")
        by_value(optimizer, clip_val)

    plugin.clip_grad_by_norm = clip_grad_by_norm
    plugin.clip_grad_by_value = clip_grad_by_value
