"""The ``--hook`` option's language: ``parse_hook_spec("powersgd:4")`` gives a ``HookSpec``,
which ``fastddp_hook`` turns into fastddp's hook and ``torch_hook`` into stock torch DDP's
closest built-in (for ``FASTDDP_DISABLE=1`` comparisons). Used by ``fastddp.patch()`` and the
launcher."""

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fastddp.hooks import catalog

# The names and what each takes come from the hooks' catalog (fastddp/hooks/catalog.py).
HOOK_NAMES = catalog.flags()
_RANKED = tuple(c.flag for c in catalog.CONFIGS if c.argument == "rank")  # NAME:RANK
FP8_FORMATS = catalog.hook("fp8").option("format").choices
# hier:INNER's inner hook: any fixed hook of HOOK_NAMES, and "none" for plain allreduce.
_HIER_NOT_INNER = (catalog.AUTO, catalog.HIER)

class HookUnavailableError(NotImplementedError):
    """The requested communication hook does not exist in this build (or in stock torch).

    A NotImplementedError, so that code probing for features (benchmarks/article.py) treats
    it like any other feature that has not landed yet.
    """


@dataclass(frozen=True)
class HookSpec:
    """A built-in hook by name, as ``--hook`` takes it: ``bf16``, ``powersgd:4``, ..."""

    name: str
    rank: int | None = None  # PowerSGD's / ACP-SGD's rank; None: the hook's default
    policy: str | None = None  # auto's policy (fastddp/tuning/auto.py)
    format: str | None = None  # fp8's format (e4m3, e5m2); None: the hook's default
    inner: "HookSpec | None" = None  # hier's inter-node hook

    def __str__(self) -> str:
        if self.inner is not None:
            return f"{self.name}:{self.inner}"
        if self.policy is not None:
            return f"{self.name}:{self.policy}"
        if self.format is not None:
            return f"{self.name}:{self.format}"
        return self.name if self.rank is None else f"{self.name}:{self.rank}"


def parse_hook_spec(text: str, option: str = "--hook") -> HookSpec:
    """``"powersgd:2"`` -> ``HookSpec("powersgd", 2)``; an unknown name is an error naming it."""
    name, sep, rank_text = text.partition(":")
    if name not in HOOK_NAMES:
        raise ValueError(f"{option} {text!r}: unknown hook {name!r}; choose one of "
                         f"{', '.join(HOOK_NAMES)} (powersgd and acpsgd take an optional "
                         ":RANK, fp8 an optional :FORMAT, hier an optional :INNER)")
    if name == catalog.AUTO:
        policy = rank_text if sep else "any"
        if policy not in catalog.POLICIES:
            raise ValueError(f"{option} {text!r}: auto's policy must be one of "
                             f"{', '.join(catalog.POLICIES)} (auto:POLICY)")
        return HookSpec(name, policy=policy)
    if name == catalog.HIER:
        return _parse_hier(text, rank_text if sep else "bf16", option)
    if not sep:
        return HookSpec(name)
    argument = catalog.config(name).argument
    if argument not in ("", "rank"):  # an option with choices: fp8:FORMAT
        choices = catalog.hook(catalog.config(name).hook).option(argument).choices
        if rank_text not in choices:
            raise ValueError(f"{option} {text!r}: {name}'s {argument} must be one of "
                             f"{', '.join(choices)} ({name}:{argument.upper()})")
        return HookSpec(name, format=rank_text)
    if name not in _RANKED:
        raise ValueError(f"{option} {text!r}: only powersgd and acpsgd take a rank "
                         f"({name}:RANK is not a hook)")
    if not rank_text.isdigit() or int(rank_text) < 1:
        raise ValueError(f"{option} {text!r}: the {name} rank must be a positive integer")
    return HookSpec(name, int(rank_text))


def _parse_hier(text: str, inner_text: str, option: str) -> HookSpec:
    """``hier:INNER``: hierarchical reduction with INNER between nodes (default bf16)."""
    if inner_text == "none":
        inner_text = "allreduce"
    try:
        inner = parse_hook_spec(inner_text, option)
    except ValueError as e:
        raise ValueError(f"{option} {text!r}: hier's inter-node hook {inner_text!r} is not a "
                         f"hook ({e}); use hier:none, hier:bf16, hier:bf16-fp32acc, ...") from e
    if inner.name in _HIER_NOT_INNER:
        raise ValueError(f"{option} {text!r}: hier's inter-node hook must be a fixed hook, "
                         f"not {inner.name}")
    return HookSpec("hier", inner=inner)


def fastddp_hook(spec: HookSpec, option: str = "--hook") -> tuple[Any, Any]:
    """``(state, hook)`` for fastddp's ``register_comm_hook``, from ``fastddp.hooks``.

    Raises HookUnavailableError naming ``option`` when this build has no such hook.
    """
    return fastddp_hook_maker(spec, option)()


def fastddp_hook_maker(spec: HookSpec, option: str) -> Callable[[], tuple[Any, Any]]:
    """Finds the hook's factory now; calls it only later (a hook's state may need the
    process group, which the script has not initialized when the launcher patches)."""
    try:
        hooks = importlib.import_module("fastddp.hooks")
    except ModuleNotFoundError as e:
        if e.name != "fastddp.hooks":
            raise
        raise HookUnavailableError(
            f"{option} {spec}: this fastddp build has no communication hooks (fastddp.hooks "
            "is missing); run without the option, or with FASTDDP_DISABLE=1 for torch's") from e
    if spec.name == catalog.HIER:
        inner_maker = fastddp_hook_maker(spec.inner, option)
        factory = getattr(hooks, "hierarchical", None)
        if factory is None:
            raise HookUnavailableError(
                f"{option} {spec}: fastddp.hooks.hierarchical() is not available in this build")
        # LOCAL_WORLD_SIZE and the groups are read when the hook is made and registered.
        return lambda: (None, factory(inter=inner_maker()[1]))
    config = catalog.config(spec.name) if spec.name != catalog.AUTO else None
    factory_name = config.hook if config is not None else spec.name
    factory = getattr(hooks, factory_name, None)
    if factory is None:
        raise HookUnavailableError(
            f"{option} {spec}: fastddp.hooks.{factory_name}() is not available in this build")
    kwargs: dict[str, Any] = {}
    if config is None:
        kwargs["policy"] = spec.policy
    else:
        kwargs.update(config.options)
        if config.argument not in ("", "rank") and spec.format is not None:
            kwargs[config.argument] = spec.format
        if config.start:
            # Start early as the FASTDDP_DISABLE comparison does (torch's PowerSGDState names).
            kwargs[config.start] = 2
        if config.argument == "rank" and spec.rank is not None:
            kwargs["matrix_approximation_rank"] = spec.rank
    return lambda: (None, factory(**kwargs))


def torch_hook(spec: HookSpec, option: str = "--hook") -> tuple[Any, Any]:
    """``(state, hook)`` for stock torch DDP: torch's built-in hook closest to ``spec``.

    PowerSGD starts compressing at iteration 2 rather than torch's default 1,000, so that
    short runs measure compression at all (torch requires > 1 with error feedback).
    """
    if spec.name == catalog.HIER:
        raise HookUnavailableError(
            f"{option} {spec}: stock torch DDP (FASTDDP_DISABLE=1) has no hierarchical "
            "reduction; run without FASTDDP_DISABLE, or give torch --hook " + str(spec.inner))
    if spec.name == catalog.AUTO:
        raise HookUnavailableError(
            f"{option} {spec}: stock torch DDP (FASTDDP_DISABLE=1) cannot tune its hook; run "
            "without FASTDDP_DISABLE, or give torch a fixed --hook")
    config = catalog.config(spec.name)
    if config.torch:  # "module.function" of torch's ddp_comm_hooks
        module, _, function = config.torch.partition(".")
        hooks = importlib.import_module(f"torch.distributed.algorithms.ddp_comm_hooks.{module}")
        state = None
        if module == "powerSGD_hook":
            state = hooks.PowerSGDState(process_group=None, matrix_approximation_rank=spec.rank
                                        or 1, start_powerSGD_iter=2)
        return state, getattr(hooks, function)
    raise HookUnavailableError(
        f"{option} {spec}: stock torch DDP has no {config.no_torch}; use --hook "
        f"{config.torch_instead} to compare with torch")
