"""torch's ``PowerSGDState`` kept live on fastddp's native PowerSGD hooks.

``model.register_comm_hook(state, powerSGD_hook)`` (or ``batched_powerSGD_hook``) runs the
native hook, which keeps the training state in C++. Here `state` is tied to it: its class
becomes a subclass of its own whose training-state attributes read the native hook when
Python reads them, with no Python on the gradient path:

- ``iter``, ``total_numel_before_compression``, ``total_numel_after_compression``,
  ``compression_stats()``: the native counters (cheap reads);
- ``error_dict``, ``p_memory_dict``, ``q_memory_dict``, ``rng``, ``next_stats_report``: a
  copy of the native state (``state_dict()``, every tensor cloned), in torch's layout, made
  at each read; the dicts are read-only (a write would be lost, so it raises).
- ``pickle`` / ``torch.save`` / ``copy`` write a plain ``PowerSGDState`` (torch's class, so
  a checkpoint loads without fastddp) holding that copy, through torch's
  ``__getstate__`` / ``__setstate__`` rules. Registered again on a fastddp model (torch's
  resume recipe: set ``process_group``, register), the native hook resumes from it exactly.
- Writing a training-state attribute of a live state raises NotImplementedError (torch's
  hook function cannot drive it either); the settings are read once, at registration.

When the model goes (garbage collected), the state takes the hook's final values and
becomes a plain ``PowerSGDState`` again: a snapshot that no longer changes. Registered on
another model, a state follows the model it was registered on last. A copy of the model
(``copy.deepcopy``, pickle) holds a copy of the state, live on the copy's hook. The same
holds at world size 1, where a registered hook runs as in torch.

What the dicts hold, and how a state loads onto the native hook: _powersgd_layout.py.
"""

from __future__ import annotations

import copyreg
import logging
import weakref
from typing import Any

import torch
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
# The model: fastddp's DistributedDataParallel, which imports this module; the hints name
# torch's class, which it subclasses.
from torch.nn.parallel import DistributedDataParallel

from fastddp.hooks._powersgd_layout import (batched_to_torch, numpy_rng, powersgd_to_torch,
                                            to_native)

logger = logging.getLogger("fastddp.hooks")

_NATIVE_HOOKS = ("powersgd", "powersgd_batched")
# Read from the native hook while live; torch's slots.
_LIVE_FIELDS = ("iter", "error_dict", "p_memory_dict", "q_memory_dict", "rng",
                "total_numel_before_compression", "total_numel_after_compression",
                "next_stats_report")
_SLOTS = tuple(psgd.PowerSGDState.__slots__)


class _Source:
    """What a live state reads: the model's native hook and its bucket layout."""

    __slots__ = ("native", "reducer", "names", "params", "rank")

    def __init__(self, ddp: DistributedDataParallel, native: Any):
        self.native = native
        self.reducer = ddp._reducer
        self.names: list[str] = ddp._reducer_param_names
        self.params: list[torch.Tensor] = ddp._reducer_params
        self.rank = int(native.matrix_approximation_rank)

    @property
    def batched(self) -> bool:
        return self.native.name == "powersgd_batched"

    def stats(self) -> tuple[int, int]:
        _, before, after = self.native.compression_stats()
        return int(before), int(after)

    def read(self, field: str) -> Any:
        if field == "iter":
            return int(self.native.iter)
        if field == "total_numel_before_compression":
            return self.stats()[0]
        if field == "total_numel_after_compression":
            return self.stats()[1]
        return self.snapshot()[field]

    def snapshot(self) -> dict[str, Any]:
        """Every live field, from one copy of the native state."""
        raw = self.native.state_dict()
        plan = [list(b) for b in self.reducer.bucket_plan()]
        layout = batched_to_torch if self.batched else powersgd_to_torch
        errors, ps, qs = (ReadOnlyDict(d) for d in layout(raw, plan, self))
        return {"iter": int(raw["iter"]), "error_dict": errors, "p_memory_dict": ps,
                "q_memory_dict": qs, "rng": numpy_rng(raw["rng_state"]),
                "total_numel_before_compression": int(raw["numel_before"]),
                "total_numel_after_compression": int(raw["numel_after"]),
                "next_stats_report": int(raw["next_stats_report"])}


class _Link:
    __slots__ = ("model", "source")

    def __init__(self, ddp: DistributedDataParallel, source: _Source):
        self.model = weakref.ref(ddp)
        self.source = source


# id(state) -> its link. An entry lives as long as the model: the model's finalizer (which
# holds the state, so the id stays its own) removes it.
_LINKS: dict[int, _Link] = {}


def _source_of(state: Any) -> _Source | None:
    link = _LINKS.get(id(state))
    return link.source if link is not None and link.model() is not None else None


class ReadOnlyDict(dict):
    """A live state's error_dict / p_memory_dict / q_memory_dict: a copy; writes raise."""

    def _refuse(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError(
            "fastddp: this dict of a PowerSGDState is a copy of the native PowerSGD hook's "
            "state (read when the attribute is read); changing it would change nothing. "
            "Change the state before register_comm_hook, or use the model's "
            "load_comm_hook_state_dict()")

    __setitem__ = __delitem__ = clear = pop = popitem = setdefault = update = _refuse
    __ior__ = _refuse

    def __reduce_ex__(self, protocol: int) -> Any:
        return dict, (dict(self),)  # a plain dict in a pickle: no fastddp needed to load


class _LiveState:
    """Mixed into a PowerSGDState's class (see _live_class): its training-state attributes
    read the native hook while the state is linked, its own slots otherwise."""

    __slots__ = ()
    _plain: type = psgd.PowerSGDState

    def compression_stats(self) -> tuple[float, int, int]:
        source = _source_of(self)
        if source is None:
            return self._plain.compression_stats(self)
        before, after = source.stats()
        return (before / after if after > 0 else 0, before, after)

    def __getstate__(self) -> dict[str, Any]:
        # torch's __getstate__ walks self.__slots__, which is () on this class.
        source = _source_of(self)
        snap = source.snapshot() if source is not None else {}
        psgd.logger.warning("NOTE: Process group is not serializable and excluded from a "
                            "saved state.")
        out = {}
        for slot in _SLOTS:
            if slot == "process_group":
                continue
            value = snap[slot] if slot in snap else getattr(self, slot)
            out[slot] = dict(value) if isinstance(value, ReadOnlyDict) else value
        return out

    def __reduce_ex__(self, protocol: int) -> Any:
        # The plain class: a checkpoint is torch's PowerSGDState (its __setstate__ loads it).
        # copyreg's reconstructor (object.__new__ of it), as pickle's __newobj__ insists on
        # the object's own class.
        return copyreg._reconstructor, (self._plain, object, None), self.__getstate__()


def _live_property(field: str) -> property:
    slot = psgd.PowerSGDState.__dict__[field]  # the slot's descriptor: the plain value

    def get(self: Any) -> Any:
        source = _source_of(self)
        return slot.__get__(self, type(self)) if source is None else source.read(field)

    def set_(self: Any, value: Any) -> None:
        if _source_of(self) is not None:
            raise NotImplementedError(
                f"fastddp: PowerSGDState.{field} of a state registered on a fastddp model "
                "is the native hook's; it cannot be set (set it before register_comm_hook, "
                "or use the model's load_comm_hook_state_dict())")
        slot.__set__(self, value)

    return property(get, set_, doc=f"torch's PowerSGDState.{field}, read from fastddp's "
                                   "native hook while registered")


for _field in _LIVE_FIELDS:
    setattr(_LiveState, _field, _live_property(_field))

_LIVE_CLASSES: dict[type, type] = {}


def _live_class(cls: type) -> type:
    """cls (PowerSGDState or a subclass) with _LiveState first: the same instance layout,
    so a state's __class__ can be swapped both ways."""
    if issubclass(cls, _LiveState):
        return cls
    if cls not in _LIVE_CLASSES:
        _LIVE_CLASSES[cls] = type(f"Live{cls.__name__}", (_LiveState, cls),
                                  {"__slots__": (), "_plain": cls, "__module__": __name__})
    return _LIVE_CLASSES[cls]


def load(state: object, ddp: DistributedDataParallel, native: Any) -> bool:
    """At registration: whether `state` is a PowerSGDState run by a native PowerSGD hook;
    if so, its training state is loaded into `native` (raises, with nothing changed, for a
    state it cannot take). Then link() it, once `native` is the model's hook."""
    if not isinstance(state, psgd.PowerSGDState) or getattr(native, "name", None) not in (
            _NATIVE_HOOKS):
        return False
    native.load_state_dict(to_native(_training_state(state), _Source(ddp, native)))
    return True


def link(state: Any, ddp: DistributedDataParallel, native: Any) -> None:
    """Ties a state load() took to the model's native hook, for as long as the model lives."""
    _LINKS[id(state)] = link_ = _Link(ddp, _Source(ddp, native))
    state.__class__ = _live_class(type(state))
    finalizer = weakref.finalize(ddp, _model_gone, state, link_)
    finalizer.atexit = False  # at exit nobody reads the state any more


def _training_state(state: Any) -> dict[str, Any]:
    source = _source_of(state)
    if source is not None:  # registered before, on a model still alive: its native state
        return source.snapshot()
    return {f: getattr(state, f) for f in _LIVE_FIELDS}


def _model_gone(state: Any, link: _Link) -> None:
    """The model died: the state keeps the hook's final values as a plain PowerSGDState."""
    if _LINKS.get(id(state)) is not link:
        return  # registered on another model since
    del _LINKS[id(state)]
    plain = state._plain
    try:
        snap = link.source.snapshot()
    except Exception as e:  # noqa: BLE001 - a finalizer must not raise
        logger.warning("fastddp: could not read the final state of a deleted model's PowerSGD "
                       "hook (%s); its PowerSGDState keeps the values it was registered with",
                       e)
        snap = {}
    for field, value in snap.items():
        psgd.PowerSGDState.__dict__[field].__set__(
            state, dict(value) if isinstance(value, ReadOnlyDict) else value)
    state.__class__ = plain
