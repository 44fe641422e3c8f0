"""torch's own hooks on fastddp: torch DDP's checks of a hook, and the C++ hook that runs a
registered one. torch's default hooks and its PowerSGD hooks with a ``PowerSGDState`` run as
fastddp's built-ins (native_torch_hooks()); any other callable runs in Python on a real
``torch.distributed.GradBucket``, as under torch DDP."""

import inspect
from typing import Any

import torch
import torch.distributed as dist

from fastddp import _C
from fastddp.hooks import catalog
from fastddp.hooks.auto_hook import AutoHook
from fastddp.hooks._comm_hook import CommHook
from fastddp.hooks._constructors import allreduce, fp16
from fastddp.hooks._powersgd_args import options_from_state

# PowerSGD's hook functions take a PowerSGDState, whose settings the native hook reads.
_STATE_MODULE = "powerSGD_hook"


def _native_by_torch_hook() -> dict[str, str]:
    """The catalog's torch hook spellings ("module.function", "module.wrapper(allreduce_hook)")
    and the registry name of the built-in that runs each."""
    return {t: h.factory for h in catalog.HOOKS for t in h.torch_hooks}


def native_torch_hooks() -> dict[str, str]:
    """torch hook functions that fastddp runs natively, and the built-in that runs them."""
    return {t + (" (with a PowerSGDState)" if t.startswith(_STATE_MODULE + ".") else ""): n
            for t, n in _native_by_torch_hook().items()}


def _from_powersgd_state(state: Any, name: str) -> tuple[dist.ProcessGroup | None, CommHook]:
    """torch's PowerSGDState as the native hook `name`: its settings, iteration and generator."""
    return state.process_group, CommHook(name, **options_from_state(state))


def torch_builtin(hook: Any) -> str | None:
    """The fastddp built-in equivalent to one of torch's default hooks (by name), or None."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as dh

    if not inspect.isfunction(hook) or hook.__module__ != dh.__name__:
        return None
    natives = {t.removeprefix("default_hooks."): n for t, n in _native_by_torch_hook().items()
               if t.startswith("default_hooks.")}
    if hook.__name__ in natives and getattr(dh, hook.__name__, None) is hook:
        return natives[hook.__name__]
    # torch's wrapper(allreduce_hook): the closure "<wrapper>.<locals>.<wrapper>_hook".
    wrapper = hook.__qualname__.partition(".<locals>.")[0]
    half = natives.get(f"{wrapper}(allreduce_hook)")
    if (half is None or hook.__qualname__ != f"{wrapper}.<locals>.{wrapper}_hook"
            or hook.__closure__ is None):
        return None
    # The wrapper's closure holds the hook it wraps; only allreduce_hook is equivalent.
    cells = dict(zip(hook.__code__.co_freevars, hook.__closure__))
    wrapped = cells.get("hook")
    try:
        return half if wrapped is not None and wrapped.cell_contents is dh.allreduce_hook else None
    except ValueError:  # an empty cell
        return None


def check_comm_hook(hook: Any) -> None:
    """torch DDP's checks of a hook's signature, with torch's exceptions and messages.
    (torch's extra "BF16 ... required CUDA 11+ and NCCL 2.10+" check does not apply:
    fastddp runs bf16 hooks on gloo too.)"""
    if isinstance(hook, (CommHook, AutoHook)):
        return
    if not callable(hook):
        raise TypeError("Communication hook must be callable.")
    sig = inspect.signature(hook)
    if (sig.parameters["bucket"].annotation != inspect._empty
            and sig.parameters["bucket"].annotation != dist.GradBucket):
        raise ValueError("Communication hook: bucket annotation should be dist.GradBucket.")
    if (sig.return_annotation != inspect._empty
            and sig.return_annotation != torch.futures.Future[torch.Tensor]):
        raise ValueError("Communication hook: return annotation should be "
                         "torch.futures.Future[torch.Tensor].")


def resolve(state: object, hook: Any, process_group: dist.ProcessGroup,
            params: list[torch.Tensor]) -> "_C.CommHook":
    """The C++ hook that runs `hook(state, ...)` for a model over `process_group`."""
    if isinstance(hook, AutoHook):
        raise TypeError(f"{hook!r} is resolved by the model it is registered on")
    if isinstance(hook, CommHook):
        if state is not None and not isinstance(state, dist.ProcessGroup):
            raise ValueError(f"{hook!r}: state must be None (the model's process group) or a "
                             f"ProcessGroup, got {type(state).__name__}")
        return hook.native(state if state is not None else process_group)
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

    native_name = next((n for t, n in _native_by_torch_hook().items()
                        if t.startswith(_STATE_MODULE + ".")
                        and hook is getattr(psgd, t.removeprefix(_STATE_MODULE + "."))), None)
    if native_name is not None and isinstance(state, psgd.PowerSGDState):
        group, native = _from_powersgd_state(state, native_name)
        # torch's hook reduces over state.process_group, or WORLD when it is None.
        return native.native(group if group is not None else dist.group.WORLD)
    builtin = torch_builtin(hook)
    if builtin is not None and (state is None or isinstance(state, dist.ProcessGroup)):
        # torch's hooks reduce over `state`, or WORLD when it is None.
        group = state if state is not None else dist.group.WORLD
        return CommHook(builtin).native(group)
    name = getattr(hook, "__qualname__", type(hook).__name__)
    return _C.PythonCommHook(state, hook, params, name)


def builtin_for_type(comm_hook_type: Any) -> CommHook:
    """torch's dist.BuiltinCommHookType as a fastddp built-in."""
    if comm_hook_type == dist.BuiltinCommHookType.ALLREDUCE:
        return allreduce()
    if comm_hook_type == dist.BuiltinCommHookType.FP16_COMPRESS:
        return fp16()
    raise NotImplementedError(f"fastddp: built-in comm hook type {comm_hook_type} is not supported")
