"""Make unmodified training scripts use fastddp: swap torch's DistributedDataParallel.

``fastddp.patch()`` replaces ``torch.nn.parallel.DistributedDataParallel`` and
``torch.nn.parallel.distributed.DistributedDataParallel`` with a subclass of
``fastddp.DistributedDataParallel`` that applies optional overrides (a communication hook,
a bucket size) to every model a script wraps. ``python -m fastddp`` (``launcher.py``) calls
it before running the script. Modules imported before the patch that bound torch's class
under a name of their own (``from torch.nn.parallel import DistributedDataParallel``, as
Lightning does) get the replacement under that name too; ``Patch.rebound`` lists them.
With ``FASTDDP_DISABLE=1`` the names stay torch's own class; overrides, if any, are then
applied to stock torch DDP through torch's built-in hooks, so that one command line can
compare the two.
"""

import inspect
import os
import sys
import weakref
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch
from torch import nn

from fastddp.ddp import DistributedDataParallel as FastDDP
from fastddp.ddp import surface
from fastddp.launch._emulate_link import LinkEmulation
# The --hook option's names, re-exported: the launcher, benchmarks and tests import them here.
from fastddp.launch.hook_spec import (FP8_FORMATS, HOOK_NAMES, HookSpec,  # noqa: F401
                                      HookUnavailableError, fastddp_hook, fastddp_hook_maker,
                                      parse_hook_spec, torch_hook)
from fastddp.launch.report import format_comm_stats
from fastddp.launch.shard_patch import OptimizerSharding
from fastddp.link.model import Link
from fastddp.tuning.advise import Advisor

_PATCHED_NAMES = (
    "torch.nn.parallel.DistributedDataParallel",
    "torch.nn.parallel.distributed.DistributedDataParallel",
)
_active: "Patch | None" = None


def fastddp_disabled(environ: dict[str, str] | None = None) -> bool:
    """Whether ``FASTDDP_DISABLE`` asks for stock torch DDP (1/true/yes; 0/false/no/empty)."""
    value = (os.environ if environ is None else environ).get("FASTDDP_DISABLE", "").strip()
    if value.lower() in ("1", "true", "yes", "on"):
        return True
    if value.lower() in ("", "0", "false", "no", "off"):
        return False
    raise ValueError(f"FASTDDP_DISABLE={value!r}: use 1 to run stock torch DDP, 0 or unset for "
                     "fastddp")


class Patch:
    """What ``patch()`` did. Undo it with ``unpatch()`` or by leaving its ``with`` block."""

    def __init__(self, hook: HookSpec | None, bucket_cap_mb: float | None, report: bool,
                 disabled: bool, option: str = "--hook", emulate_link: Link | str | None = None,
                 check_for_nan_in_grad: bool = False, advise: bool = False,
                 shard_optimizer: bool = False):
        self.hook = hook
        self.advisor = Advisor() if advise else None
        self.emulation = None if emulate_link is None else LinkEmulation(emulate_link)
        self.bucket_cap_mb = bucket_cap_mb
        self.check_for_nan_in_grad = check_for_nan_in_grad
        self.report = report
        self.disabled = disabled
        self.models_wrapped = 0
        self._original = nn.parallel.distributed.DistributedDataParallel
        self._hook_factory = _hook_factory(hook, disabled, option)
        self._last_model: Any = None
        self._notes: set[str] = set()
        self.sharding = OptimizerSharding(disabled, self.note_once) if shard_optimizer else None
        # (module, attribute) pairs outside torch that held torch's class; see imported_bindings.
        self._rebound: list[tuple[ModuleType, str]] = []
        if advise and hook is not None and hook.name == "auto":
            raise ValueError(f"{option} {hook} with advise: auto changes the hook while it "
                             "measures, advise measures one fixed configuration; choose one")
        if disabled and advise:
            raise NotImplementedError(
                "advise reads fastddp's comm_stats(): stock torch DDP (FASTDDP_DISABLE=1) has "
                "none; run --advise without FASTDDP_DISABLE")
        # Stock torch without overrides: nothing to change, the script runs exactly as is.
        if disabled and check_for_nan_in_grad:
            raise NotImplementedError(
                "check_for_nan_in_grad is fastddp's: stock torch DDP (FASTDDP_DISABLE=1) has "
                "no such check")
        self.cls = None if (disabled and hook is None and bucket_cap_mb is None
                            and emulate_link is None and not shard_optimizer) else (
            _patched_class(self._original if disabled else FastDDP, self))

    @property
    def rebound(self) -> list[str]:
        """``module.attribute`` names, bound to torch's class by modules imported before the
        patch, that now hold the replacement (restored by ``unpatch()``)."""
        return [f"{module.__name__}.{attr}" for module, attr in self._rebound]

    @property
    def last_model(self) -> nn.Module | None:
        """The most recently constructed wrapper (kept alive only with report=True)."""
        model = self._last_model
        return model() if isinstance(model, weakref.ref) else model

    def describe(self) -> str:
        """The one line the launcher prints on rank 0."""
        settings = []
        if self.hook is not None:
            settings.append(f"hook={self.hook} (launcher; replaces any hook the script "
                            "registers)")
        if self.bucket_cap_mb is not None:
            settings.append(f"bucket_cap_mb={self.bucket_cap_mb:g} (launcher)")
        if self.check_for_nan_in_grad:
            settings.append("check_for_nan_in_grad=True (launcher)")
        if self.emulation is not None:
            settings.append(self.emulation.describe())
        if self.report:
            settings.append("comm report at exit")
        if self.advisor is not None:
            settings.append("hook advice at exit (observes only)")
        if self.sharding is not None:
            settings.append("torch.optim.SGD/Adam/AdamW over a wrapped model sharded ("
                            + ("torch's ZeroRedundancyOptimizer" if self.disabled else
                               "fastddp.optim.ShardedOptimizer") + ")")
        rest = "; other arguments as the script passes them"
        if self._rebound:
            rest += ("; also replaced where already-imported modules bound it: "
                     f"{', '.join(self.rebound)}")
        if not self.disabled:
            return (f"[fastddp] {' and '.join(_PATCHED_NAMES)} -> fastddp.DistributedDataParallel"
                    f" ({', '.join(settings) or 'no overrides'}){rest}")
        if self.cls is None:
            return "[fastddp] FASTDDP_DISABLE=1: stock torch DDP, nothing replaced"
        return (f"[fastddp] FASTDDP_DISABLE=1: stock torch DDP with {', '.join(settings)}"
                f" (torch's built-in hooks){rest}")

    def report_text(self) -> str:
        """The communication report of the last model, or why there is none, and with
        ``emulate_link`` what went through the emulated link."""
        text = self._comm_report_text()
        return text if self.emulation is None else text + "\n" + self.emulation.report_text()

    def _comm_report_text(self) -> str:
        model = self.last_model
        if self.disabled:
            return "[fastddp] comm report unavailable: FASTDDP_DISABLE=1 (stock torch DDP)"
        if model is None:
            return ("[fastddp] comm report unavailable: the script constructed no "
                    "DistributedDataParallel")
        if not callable(getattr(model, "comm_stats", None)):
            return ("[fastddp] comm report unavailable: this fastddp build has no "
                    "DistributedDataParallel.comm_stats()")
        try:
            return format_comm_stats(model.comm_stats())
        except Exception as e:  # noqa: BLE001 -- a report must not fail a finished run
            return f"[fastddp] comm report unavailable: comm_stats() raised {type(e).__name__}: {e}"

    def advice_text(self, out_dir: str = ".", command: str | None = None) -> str:
        """With ``advise=True``: the advice table (fastddp/tuning/advise.py), also written to
        ``out_dir`` as fastddp_advice.md and .json; or why there is none."""
        from fastddp.tuning import advise

        if self.advisor is None:
            return "[fastddp] advice unavailable: patch(advise=True) was not given"
        errors = [r["error"] for r in self.advisor.records if "error" in r]
        records = [r for r in self.advisor.records if r["samples"] and "error" not in r]
        if not records:
            why = (f"reading comm_stats() failed: {errors[0]}" if errors else
                   f"no wrapped model ran {self.advisor.warmup + 2} synchronized steps at "
                   "world size > 1")
            return f"[fastddp] advice unavailable: {why}"
        link = None if self.emulation is None else self.emulation.link
        advices, texts = [], []
        try:
            for record in records:
                samples = record["samples"]
                shapes = [s for bucket in samples[-1]["shapes"] for s in bucket]
                costs = advise.kernel_costs(shapes, record["device"])
                current = advise.current_candidate(self.hook, samples[-1]["stats"]["hook"])
                result = advise.advise(samples, link, current, costs)
                spec = result["best_hook"]
                advices.append(result)
                texts.append(advise.format_markdown(result, None if command is None else
                                                    command.format(hook=f"--hook {spec} " if spec
                                                                   else "")))
        except Exception as e:  # noqa: BLE001 -- advice must not fail a finished run
            return f"[fastddp] advice unavailable: {type(e).__name__}: {e}"
        text = "\n\n".join(texts)
        paths = advise.write_advice(advices, text, out_dir)
        return text + f"\n[fastddp] advice written to {', '.join(paths)}"

    def emulated_state(self, state: Any, hook: Any) -> Any:
        """A hook's state as registered: with ``emulate_link``, the process group it names
        replaced by its EmulatedLinkGroup (``LinkEmulation.hook_state``)."""
        if self.emulation is None:
            return state
        return self.emulation.hook_state(state, hook, self.note_once)

    def note_once(self, text: str) -> None:
        """Prints ``text`` once per process, on rank 0 only."""
        if text not in self._notes:
            self._notes.add(text)
            if _rank() == 0:
                print(f"[fastddp] {text}", file=sys.stderr, flush=True)

    def unpatch(self) -> None:
        """Puts torch's own class back under both names, and under the names ``rebound``
        lists (those that still hold the replacement)."""
        global _active
        if _active is self:
            _set_ddp_names(self._original)
            for module, attr in self._rebound:
                if getattr(module, attr, None) is self.cls:
                    setattr(module, attr, self._original)
            self._rebound = []
            if self.sharding is not None:
                self.sharding.uninstall()
            _active = None

    def __enter__(self) -> "Patch":
        return self

    def __exit__(self, *exc: object) -> None:
        self.unpatch()


def patch(hook: str | HookSpec | None = None, bucket_cap_mb: float | None = None,
          report: bool = False, disable: bool | None = None, _option: str = "hook=",
          emulate_link: Link | str | None = None, check_for_nan_in_grad: bool = False,
          advise: bool = False, shard_optimizer: bool = False) -> Patch:
    """Replace torch's DistributedDataParallel (both import paths) with fastddp's.

    ``hook`` (``"bf16"``, ``"bf16-fp32acc"``, ``"powersgd:4"``, ...) is registered on every
    wrapped model and replaces hooks the script registers itself; ``bucket_cap_mb``
    overrides the script's value. ``emulate_link`` (``"3GB/s,20us"`` or a
    :class:`fastddp.link.Link`) puts every model's process group, and the group a built-in
    hook's state names, behind an EmulatedLinkGroup of that link (fastddp/link/emulator.py;
    with FASTDDP_DISABLE=1 too). ``check_for_nan_in_grad=True`` turns the non-finite
    gradient check on for every wrapped model. ``advise=True`` observes the wrapped models'
    comm_stats() on rank 0, changing nothing, for ``Patch.advice_text()``
    (fastddp/tuning/advise.py). ``report=True`` keeps the last model alive for
    ``Patch.report_text()``. ``shard_optimizer=True``: torch's SGD, Adam and AdamW over a
    wrapped model's parameters become fastddp.optim.ShardedOptimizer (shard_patch.py).
    ``disable=None`` reads ``FASTDDP_DISABLE``. Returns a Patch
    (a context manager); models constructed before the patch are not affected.
    """
    global _active
    if _active is not None:
        raise RuntimeError("fastddp.patch(): already patched; call unpatch() on the first "
                           "Patch before patching again")
    spec = parse_hook_spec(hook, _option) if isinstance(hook, str) else hook
    if bucket_cap_mb is not None and not bucket_cap_mb > 0:
        raise ValueError(f"bucket_cap_mb={bucket_cap_mb}: must be positive")
    disabled = fastddp_disabled() if disable is None else disable
    result = Patch(spec, bucket_cap_mb, report, disabled, _option, emulate_link,
                   check_for_nan_in_grad, advise, shard_optimizer)
    if result.cls is not None:
        result._rebound = imported_bindings(result._original)
        _set_ddp_names(result.cls)
        for module, attr in result._rebound:
            setattr(module, attr, result.cls)
        if result.sharding is not None:
            result.sharding.install()
        _active = result
    return result


def imported_bindings(cls: type) -> list[tuple[ModuleType, str]]:
    """``(module, attribute)`` for every module in ``sys.modules`` whose global ``attribute``
    is ``cls`` (a name bound by ``from ... import``, under any alias), each module once.

    torch's own modules are left out: they keep torch's class for their own needs
    (``torch.distributed._composable.replicate`` builds torch's DDP internally), as they
    did before this scan. Only module dictionaries are read; nothing is imported.
    """
    found, seen = [], set()
    for name, module in list(sys.modules.items()):
        if not isinstance(module, ModuleType) or id(module) in seen:
            continue
        seen.add(id(module))
        if name == "torch" or name.startswith("torch."):
            continue
        for attr, value in list(vars(module).items()):
            if value is cls:
                found.append((module, attr))
    return found


def _set_ddp_names(cls: type) -> None:
    nn.parallel.DistributedDataParallel = cls
    nn.parallel.distributed.DistributedDataParallel = cls
    # `torch.nn.parallel.DistributedDataParallel` and `from torch.nn.parallel import ...`
    # both read the package attribute; torch's own code reads the module global.


def _hook_factory(spec: HookSpec | None, disabled: bool,
                  option: str) -> Callable[[], tuple[Any, Any]] | None:
    """A per-model (state, hook) maker, resolved now so a missing hook fails before the
    script runs; stateful hooks (PowerSGD) need a fresh state for every model."""
    if spec is None:
        return None
    if disabled:
        torch_hook(spec, option)  # torch's states need no process group to be built
        return lambda: torch_hook(spec, option)
    return fastddp_hook_maker(spec, option)


@surface.eager
def _advise_before_forward(advisor: Advisor, model: nn.Module) -> None:
    if _rank() == 0:
        # One small object, rank 0 only.
        advisor.before_forward(model, surface.TunerHandle(model))


def _patched_class(base: type, owner: Patch) -> type:
    signature = inspect.signature(base.__init__)

    class DistributedDataParallel(base):  # type: ignore[misc, valid-type]
        __doc__ = base.__doc__

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            if owner.bucket_cap_mb is not None or owner.emulation is not None:
                bound = signature.bind(self, *args, **kwargs)
                if owner.bucket_cap_mb is not None:
                    if bound.arguments.get("bucket_cap_mb_list") is not None:
                        owner.note_once("--bucket-cap-mb replaces the script's "
                                        "bucket_cap_mb_list")
                        bound.arguments["bucket_cap_mb_list"] = None
                    bound.arguments["bucket_cap_mb"] = owner.bucket_cap_mb
                if owner.emulation is not None:
                    bound.arguments["process_group"] = owner.emulation.model_group(
                        bound.arguments.get("process_group"), bound.arguments.get("device_mesh"))
                args, kwargs = bound.args[1:], bound.kwargs
            if owner.check_for_nan_in_grad:
                kwargs = {**kwargs, "check_for_nan_in_grad": True}
            super().__init__(*args, **kwargs)
            if owner._hook_factory is not None:
                state, hook = owner._hook_factory()
                base.register_comm_hook(self, owner.emulated_state(state, hook), hook)
            owner.models_wrapped += 1
            if owner.sharding is not None:
                owner.sharding.add_model(self)
            # With a report the model must outlive the script's own references to it.
            owner._last_model = self if owner.report else weakref.ref(self)

        if owner.advisor is not None:  # otherwise forward stays the base's: no extra frame

            # Kept from dynamo as the base's forward is (fastddp.ddp.surface, from _compile.py).
            @surface.nonrecursive_disable
            def forward(self, *inputs: Any, **kwargs: Any) -> Any:
                surface.skip_this_frame_from_now_on()
                _advise_before_forward(owner.advisor, self)
                return super().forward(*inputs, **kwargs)

        def register_comm_hook(self, state: object, hook: Callable[..., Any]) -> None:
            if owner.hook is not None:
                name = getattr(hook, "__qualname__", type(hook).__name__)
                owner.note_once(f"the script's comm hook {name} was not registered: "
                                f"--hook {owner.hook} given to the launcher takes precedence")
                return
            super().register_comm_hook(owner.emulated_state(state, hook), hook)

        def _register_builtin_comm_hook(self, comm_hook_type: Any) -> None:
            if owner.hook is not None:
                owner.note_once(f"the script's built-in comm hook {comm_hook_type} was not "
                                f"registered: --hook {owner.hook} given to the launcher takes "
                                "precedence")
                return
            super()._register_builtin_comm_hook(comm_hook_type)

    DistributedDataParallel.__module__ = __name__
    DistributedDataParallel.__qualname__ = "DistributedDataParallel"
    return DistributedDataParallel


def __getattr__(name: str) -> type:
    # The patched class is made per patch() call, so pickle (torch.save(model)) cannot find
    # it by name as a plain global; this module answers the name it carries: the active
    # patch's class, or fastddp's own where no patch is active (a model saved under the
    # launcher and loaded in a plain script).
    if name == "DistributedDataParallel":
        return _active.cls if _active is not None and _active.cls is not None else FastDDP
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _rank() -> int:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return int(os.environ.get("RANK", "0"))
