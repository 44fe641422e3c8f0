"""fastddp under torchft: per-step fault tolerance with fastddp's C++ reducer and hooks.

    from torchft import Manager, OptimizerWrapper, ProcessGroupGloo
    from fastddp.integrations.torchft import DistributedDataParallel

    manager = Manager(pg=ProcessGroupGloo(), load_state_dict=..., state_dict=..., ...)
    model = DistributedDataParallel(manager, model, hook=fastddp.hooks.powersgd(4, 1))
    optimizer = OptimizerWrapper(manager, torch.optim.AdamW(model.parameters()))
    for batch in data:
        optimizer.zero_grad()          # starts the step's quorum
        loss_fn(model(batch)).backward()
        optimizer.step()               # steps only if manager.should_commit()

torchft's own DistributedDataParallel is torch DDP over a dummy group with a Python comm hook
calling ``manager.allreduce`` per bucket. Here fastddp's reducer and hooks run in C++ on the
quorum's own c10d group (_torchft_group.py), and torchft decides, as for its own DDP:

- a collective that fails (a replica died) fails the step instead of raising out of
  backward: the error goes to ``manager.report_error`` and ``should_commit()`` is then false
  on every replica; later buckets of the step are not sent;
- a hook's new state (error feedback, PowerSGD's Q) is kept only if the step commits; an
  uncommitted step leaves it as an overflow step does (Note [fault-tolerant step] in
  csrc/reducer/fault_tolerance.h);
- the mean divides by the step's participants, which change with the quorum; a replica
  still healing sends zeros, as torchft's allreduce does;
- a rejoining replica takes the hook's state from a peer with the weights
  (_torchft_state.py), registered on the manager for the user.

Checked with torchft 0.2.0 (docs/frameworks.md). torchft is imported only by this module.
Not supported under torchft, each raising NotImplementedError: static_graph,
mixed_precision, delay_all_reduce_named_params, gradient_as_bucket_view, join(),
broadcast_buffers=True (torchft's DDP does not broadcast buffers either; its group is a
dummy there), and the auto hook. The hierarchical hook takes the replica group of
several ranks as its node (_torchft_hierarchical.py).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import torch
from torch import nn

from fastddp.ddp import DistributedDataParallel as _FastDDP
from fastddp.ddp import surface
from fastddp.integrations import _torchft_group, _torchft_hooks, _torchft_state
from fastddp.launch.hook_spec import fastddp_hook, parse_hook_spec

logger = logging.getLogger("fastddp.torchft")

# DDP arguments that have no meaning under torchft's manager (its quorum's group is used).
_GROUP_ARGUMENTS = ("process_group", "device_mesh")
# Features that keep per-reducer state or talk outside the reducer's failure handling.
_UNSUPPORTED = ("static_graph", "mixed_precision", "delay_all_reduce_named_params",
                "gradient_as_bucket_view")
# Set by fastddp.DistributedDataParallel itself: from torchft's recovery, not a broadcast.
_OURS = ("init_sync",)
_OPTIMIZER_IN_BACKWARD = (
    "fastddp under torchft: an optimizer stepped inside backward (overlap_optimizer, "
    "_register_fused_optim, torch's _apply_optimizer_in_backward) is not supported: it would "
    "step before should_commit() decides whether the step stands")


class DistributedDataParallel(_FastDDP):
    """fastddp.DistributedDataParallel driven by a torchft ``Manager`` (see the module's text).

    ``hook``: a ``--hook`` spelling (``"bf16"``, ``"powersgd:4"``) or a hook object
    (``fastddp.hooks.powersgd(...)``, torch's hook functions); ``register_comm_hook`` works
    as well. The other keyword arguments are fastddp.DistributedDataParallel's.
    """

    __module__ = "fastddp.integrations.torchft"

    def __init__(self, manager: Any, module: nn.Module, hook: Any = None, **kwargs: Any):
        _torchft_group.check_manager(manager)
        for name in _GROUP_ARGUMENTS:
            if kwargs.get(name) is not None:
                raise ValueError(f"fastddp under torchft: {name} is the manager's (its quorum's "
                                 "process group); do not pass one")
        for name in _UNSUPPORTED:
            if kwargs.get(name):
                raise NotImplementedError(f"fastddp under torchft: {name} is not supported")
        for name in _OURS:
            if name in kwargs:
                raise ValueError(f"fastddp under torchft: {name} is set by the integration "
                                 "(the weights come from torchft's recovery); do not pass it")
        for name in _GROUP_ARGUMENTS:
            kwargs.pop(name, None)  # None only, checked above
        if kwargs.get("broadcast_buffers") and any(True for _ in module.buffers()):
            raise NotImplementedError(
                "fastddp under torchft: broadcast_buffers=True is not supported (buffers would "
                "be broadcast outside torchft's failure handling; torchft's DDP does not "
                "broadcast them either)")
        if _torchft_state.KEY in manager._load_state_dict_fns:
            raise ValueError("fastddp under torchft: this manager already drives a fastddp "
                             "model; use one manager per model")
        kwargs["broadcast_buffers"] = False
        # The initial weights come from torchft's recovery (init_sync), not a broadcast.
        super().__init__(module, process_group=_torchft_group.placeholder_group(),
                         init_sync=False, **kwargs)
        self._manager = manager
        self._bound = None  # the c10d group the reducer runs on (None: none yet)
        self._hook_args = None  # (state, hook) registered, installed again on every bind
        # The settle, against the quorum thread's state read (reentrant: an export settles
        # and reads through comm_hook_state_dict, which settles too).
        self._ft_lock = threading.RLock()
        self._step_at_forward = None  # manager.current_step() of the step awaiting its commit
        self._first_state = None  # a peer's hook state that came before the first bind
        manager.register_state_dict_fn(_torchft_state.KEY, self._load_hook_state,
                                       self._export_hook_state)
        if hook is not None:
            state = None
            if isinstance(hook, str):
                state, hook = fastddp_hook(parse_hook_spec(hook, "hook="), "hook=")
            self.register_comm_hook(state, hook)

    def register_comm_hook(self, state: object, hook: Any) -> None:
        state, hook = _torchft_hooks.for_quorum(state, hook, self._manager)
        super().register_comm_hook(state, hook)
        self._hook_args = (state, hook)

    def overlap_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        raise NotImplementedError(_OPTIMIZER_IN_BACKWARD)

    def _register_fused_optim(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError(_OPTIMIZER_IN_BACKWARD)

    def comm_hook_state_dict(self) -> dict:
        # The last step settled first, and not while the quorum thread reads the state.
        with self._ft_lock:
            self._settle()
            return super().comm_hook_state_dict()

    def load_comm_hook_state_dict(self, state: dict) -> None:
        with self._ft_lock:
            self._settle()
            super().load_comm_hook_state_dict(state)

    def join(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("fastddp under torchft: join() is not supported (torchft's "
                                  "quorum already handles replicas that stop)")

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        if torch.is_grad_enabled() and self.require_backward_grad_sync and not self._begin_step():
            # The manager failed this step already (in its quorum): nothing is reduced, and
            # should_commit() will drop the step, as torchft's allreduce would do nothing.
            with self.no_sync():
                return super().forward(*inputs, **kwargs)
        return super().forward(*inputs, **kwargs)

    # --- the step -----------------------------------------------------------------------

    def _begin_step(self) -> bool:
        """Before a synchronized forward: waits for the quorum, settles the last step and
        binds the quorum's group; False when the manager has failed this step already."""
        manager = self._manager
        if not self._lazy_init_ran and any(
                hasattr(p, "_in_backward_optimizers") for p in self._module_parameters):
            raise NotImplementedError(_OPTIMIZER_IN_BACKWARD)
        manager.wait_quorum()
        with self._ft_lock:
            # After the quorum: a replica that heals now (it restarted, or missed the
            # commit of its last step) keeps nothing of that step; the heal brings the
            # peer's state. Its step counter, set to the peers' by the quorum thread,
            # would say committed.
            self._settle(healing=manager._healing)
        if manager.errored() is not None:
            return False
        group = _torchft_group.quorum_group(manager)
        if group is not self._bound:
            self._bind(group)
        # torchft's answer for this step, before the heal below: a healing replica sends
        # zeros, as torchft's allreduce makes it (and its DDP) send.
        participating = manager.is_participating()
        # After the bind: the peer's hook state goes into this group's hook. Once a step: a
        # second synchronized forward finds the state applied (and the manager still healing).
        if manager._healing and manager._pending_state_dict is not None:
            self._heal_now()
        self._reducer.set_participants(manager.num_participants(), participating)
        self._step_at_forward = manager.current_step()
        return True

    def _heal_now(self) -> None:
        """A replica healing from a peer loads the peer's state before its forward, as
        torchft itself does with use_async_quorum=False (Manager.start_quorum), rather than
        in should_commit: a hook whose collectives follow its state (PowerSGD's iteration
        counter, ACP-SGD's turn) must issue this step the collectives the peers issue. It
        still sends zeros this step, as under torchft's own DDP (see _begin_step).

        The manager stays healing for the rest of the step, as under torchft's own DDP, so
        that ``manager.is_participating()`` says False until the next quorum (at step 0
        under init_sync too); only should_commit's own apply of the state, already done
        here, is skipped once."""
        manager = self._manager
        vars(manager).pop("_apply_pending_state_dict", None)  # a step that never committed
        # As torchft's should_commit before it applies the state: the checkpoint came on its
        # recovery stream (an accelerator's; None on the CPU).
        event = getattr(manager, "_recovery_event", None)
        if event is not None:
            event.synchronize()
            manager._recovery_event = None
        manager._apply_pending_state_dict()

        def applied_already() -> None:
            # should_commit's call, once: the instance's attribute goes, the class's method
            # serves the next heal. A state that came after (this step never reached
            # should_commit, and a later heal did not come through _heal_now) is applied.
            del manager._apply_pending_state_dict
            if manager._pending_state_dict is not None:
                manager._apply_pending_state_dict()
        manager._apply_pending_state_dict = applied_already

    def _settle(self, healing: bool = False) -> None:
        """The last step's hook state: kept if the manager committed it (its step counter
        moved on, and this replica is not healing), put back otherwise. Under
        self._ft_lock."""
        if self._step_at_forward is None or self._reducer is None:
            return
        committed = not healing and self._manager.current_step() != self._step_at_forward
        self._step_at_forward = None
        self._reducer.settle_pending(committed)

    def _bind(self, group: Any) -> None:
        """A new quorum: a reducer on its group, with the same buckets on every replica
        (never rebuilt), and the registered hook made again for it with its state."""
        saved = None
        if self._bound is not None and self._hook_args is not None:
            with self._ft_lock:
                saved = _torchft_state.export(self)
        if self._bound is not None:
            logger.info("fastddp: new quorum, %d ranks", group.size())
        self.process_group = group
        self._reducer = None  # the old one unhooks itself from autograd as it goes
        self._build_reducer()
        self._reducer.freeze_buckets()
        self._reducer.set_fault_sink(self._on_failure)
        if self._hook_args is not None:
            state, hook = self._hook_args
            surface.install_comm_hook(self, state, hook)
            if saved is not None and "residual_only" not in saved:
                self.load_comm_hook_state_dict(saved)  # this replica's own state, as it was
        self._bound = group
        if self._first_state is not None:
            # A peer's state that came before the first bind (torchft heals in zero_grad
            # with use_async_quorum=False): it goes into the hook of the group it is for.
            state, self._first_state = self._first_state, None
            with self._ft_lock:
                _torchft_state.load(self, state)

    def _on_failure(self, text: str) -> None:
        # From C++ (the reducer's fault sink), once per failed step.
        logger.warning("fastddp: step failed, reported to torchft: %s", text)
        self._manager.report_error(RuntimeError(f"fastddp: {text}"))

    # --- recovery (the manager's checkpoint transport) -------------------------------------

    def _export_hook_state(self) -> dict[str, Any]:
        with self._ft_lock:
            self._settle()
            return _torchft_state.export(self)

    def _load_hook_state(self, state: dict[str, Any]) -> None:
        with self._ft_lock:
            if self._bound is None:  # the placeholder's hook would take it and be dropped
                self._first_state = state
                return
            if self._reducer is not None:
                # This replica's own step (it sent zeros while healing) is not kept.
                self._step_at_forward = None
                self._reducer.settle_pending(False)
            _torchft_state.load(self, state)
