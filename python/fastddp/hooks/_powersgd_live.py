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

Layout (what the dicts mean next to torch's): keys are the model's current bucket indices
(``bucket.index()``, as torch's); values are torch's per-bucket tensors for that bucket:
``error_dict[b]`` the bucket's flat error (batched: padded to side * side), ``q_memory_dict[b]``
/ ``p_memory_dict[b]`` the bucket's Qs / Ps, laid out as torch lays them out (matrices grouped
by shape in order of first appearance; batched: one side x r matrix). With torch's bucket
layout (the same model, bucket_cap_mb and gradient order) they are torch's values within
rounding. The native hook keeps its state per parameter, so each tensor also carries the
parameters it covers, in order (the ``_fastddp_layout`` attribute, which ``torch.save`` and
pickle keep): a state fastddp wrote loads back onto any bucket layout, per parameter. A
state filled by torch's own hook lacks it and raises NotImplementedError at registration
(which parameters torch's bucket indices held is unknown here); emptying its three dicts
keeps its iteration, generator and statistics.

P is not state: both hooks overwrite it before reading it. ``p_memory_dict`` holds the native
P when the compiled module reports it (``"ps"`` / ``"bucket_ps"`` in the hook's
``state_dict()``); an older module reports no P, and then it holds zeros of P's shapes (so
torch's hook given the state still reuses its Q). Loading ignores it.

When the model goes (garbage collected), the state takes the hook's final values and
becomes a plain ``PowerSGDState`` again: a snapshot that no longer changes. Registered on
another model, a state follows the model it was registered on last. A copy of the model
(``copy.deepcopy``, pickle) holds a copy of the state, live on the copy's hook. The same
holds at world size 1, where a registered hook runs as in torch.
"""

from __future__ import annotations

import copyreg
import logging
import weakref
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

from fastddp import _C

if TYPE_CHECKING:
    from fastddp.ddp import DistributedDataParallel

logger = logging.getLogger("fastddp.hooks")

LAYOUT_ATTR = "_fastddp_layout"
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
        layout = _batched_to_torch if self.batched else _powersgd_to_torch
        errors, ps, qs = layout(raw, plan, self)
        return {"iter": int(raw["iter"]), "error_dict": errors, "p_memory_dict": ps,
                "q_memory_dict": qs, "rng": _numpy_rng(raw["rng_state"]),
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
    native.load_state_dict(_to_native(_training_state(state), _Source(ddp, native)))
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


# --- native (per parameter index) -> torch (per bucket index) -----------------------------

def _annotated(t: torch.Tensor, hook: str, params: list[tuple]) -> torch.Tensor:
    setattr(t, LAYOUT_ATTR, {"hook": hook, "params": params})
    return t


def _matrix_shape(p: torch.Tensor) -> tuple[int, int]:
    n = p.shape[0] if p.dim() > 0 else 1
    return n, (p.numel() // n if n else 0)


def _powersgd_to_torch(raw: dict, plan: list[list[int]], src: _Source) -> tuple[dict, dict, dict]:
    errors_by, qs_by, ps_by = raw["errors"], raw["qs"], raw.get("ps")
    errors, ps, qs = {}, {}, {}
    for b, bucket in enumerate(plan):
        if any(i in errors_by for i in bucket):
            like = next(errors_by[i] for i in bucket if i in errors_by)
            parts = [errors_by[i].reshape(-1) if i in errors_by else
                     like.new_zeros(src.params[i].numel()) for i in bucket]
            errors[b] = _annotated(torch.cat(parts), "powersgd",
                                   [(src.names[i], src.params[i].numel()) for i in bucket])
        # torch's Q and P memories: matrices grouped by (n, m) in order of first appearance.
        groups: dict[tuple[int, int], list[int]] = {}
        for i in bucket:
            if i in qs_by:
                groups.setdefault(_matrix_shape(src.params[i]), []).append(i)
        order = [i for group in groups.values() for i in group]
        if not order:
            continue
        qs[b] = _annotated(torch.cat([qs_by[i].reshape(-1) for i in order]), "powersgd",
                           [(src.names[i], *qs_by[i].shape) for i in order])
        shapes = [(_matrix_shape(src.params[i])[0], qs_by[i].shape[1]) for i in order]
        p_parts = [ps_by[i].reshape(-1) if ps_by is not None and i in ps_by else
                   qs_by[i].new_zeros(n * r) for i, (n, r) in zip(order, shapes)]
        ps[b] = _annotated(torch.cat(p_parts), "powersgd",
                           [(src.names[i], n, r) for i, (n, r) in zip(order, shapes)])
    return ReadOnlyDict(errors), ReadOnlyDict(ps), ReadOnlyDict(qs)


def _batched_to_torch(raw: dict, plan: list[list[int]], src: _Source) -> tuple[dict, dict, dict]:
    errors_by, tails = raw["errors"], raw.get("bucket_error_tails", {})
    qs_by, ps_by = raw.get("bucket_qs", {}), raw.get("bucket_ps")
    errors, ps, qs = {}, {}, {}
    for b, bucket in enumerate(plan):
        numel = sum(src.params[i].numel() for i in bucket)
        side = _C.batched_powersgd_side(numel)
        first = bucket[0]
        tail = tails.get(first)
        if tail is not None and tail.numel() != side * side - numel:
            tail = None  # waiting for a bucket of another size: not this one's
        if any(i in errors_by for i in bucket) or tail is not None:
            like = tail if tail is not None else next(errors_by[i] for i in bucket
                                                       if i in errors_by)
            parts = [errors_by[i].reshape(-1) if i in errors_by else
                     like.new_zeros(src.params[i].numel()) for i in bucket]
            parts.append(tail.reshape(-1) if tail is not None else
                         like.new_zeros(side * side - numel))
            errors[b] = _annotated(torch.cat(parts), "powersgd_batched",
                                   [(src.names[i], src.params[i].numel()) for i in bucket])
        q = qs_by.get(first)
        if q is None or tuple(q.shape) != (side, src.rank):
            continue  # none, or one waiting for a bucket of another size
        qs[b] = _annotated(q, "powersgd_batched", [(src.names[first], side, src.rank)])
        p = ps_by.get(first) if ps_by is not None else None
        ps[b] = _annotated(p if p is not None else q.new_zeros(side, src.rank),
                           "powersgd_batched", [(src.names[first], side, src.rank)])
    return ReadOnlyDict(errors), ReadOnlyDict(ps), ReadOnlyDict(qs)


def _numpy_rng(native_state: str) -> np.random.RandomState:
    pos, *key = (int(v) for v in native_state.split())
    rng = np.random.RandomState()
    rng.set_state(("MT19937", np.array(key, dtype=np.uint32), pos, 0, 0.0))
    return rng


# --- torch (per bucket index) -> native (per parameter index) ------------------------------

def _to_native(fields: dict[str, Any], src: _Source) -> dict[str, Any]:
    """A PowerSGDState's training state as the native hook's load_state_dict takes it."""
    where = "register_comm_hook: the PowerSGDState"
    for name in ("iter", "total_numel_before_compression", "total_numel_after_compression",
                 "next_stats_report"):
        value = fields[name]
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"fastddp: {where}'s {name} must be an int >= 0, got {value!r}")
    rng = fields["rng"]
    if not isinstance(rng, np.random.RandomState):
        raise ValueError(f"fastddp: {where}'s rng must be a numpy RandomState, got "
                         f"{type(rng).__name__}")
    _, key, pos, *_ = rng.get_state()
    raw: dict[str, Any] = {
        "iter": fields["iter"], "rng_state": " ".join(str(int(v)) for v in [pos, *key]),
        "numel_before": fields["total_numel_before_compression"],
        "numel_after": fields["total_numel_after_compression"],
        "next_stats_report": fields["next_stats_report"],
        "errors": {}, "qs": {}}
    hook = "powersgd_batched" if src.batched else "powersgd"
    index = {n: i for i, n in enumerate(src.names)}
    for dict_name in ("error_dict", "q_memory_dict", "p_memory_dict"):
        table = fields[dict_name]
        if not isinstance(table, dict):
            raise ValueError(f"fastddp: {where}'s {dict_name} must be a dict, got "
                             f"{type(table).__name__}")
        if dict_name == "p_memory_dict":
            continue  # P is not state: both hooks compute it before reading it
        for key, tensor in table.items():
            what = f"{where}'s {dict_name}[{key!r}]"
            per_param = _split(what, tensor, hook, index)
            if src.batched:
                _batched_entry(what, dict_name, per_param, tensor, raw, src)
            else:
                _powersgd_entry(what, dict_name, per_param, tensor, raw, src)
    return raw


def _powersgd_entry(what: str, dict_name: str, per_param: list[tuple[int, torch.Tensor]],
                    tensor: torch.Tensor, raw: dict, src: _Source) -> None:
    target = raw["errors"] if dict_name == "error_dict" else raw["qs"]
    if sum(t.numel() for _, t in per_param) != tensor.numel():
        raise ValueError(f"fastddp: {what} has {tensor.numel()} elements, its parameters' "
                         "parts more or fewer")
    for i, t in per_param:
        p, name = src.params[i], src.names[i]
        if i in target:
            raise ValueError(f"fastddp: {what}: parameter {name!r} is also in another entry")
        if dict_name == "error_dict":
            want: tuple[int, ...] = (p.numel(),)
        else:
            n, m = _matrix_shape(p)
            want = (m, min(n, m, src.rank))
        if tuple(t.shape) != want:
            raise ValueError(f"fastddp: {what}: parameter {name!r}'s part must be "
                             f"{list(want)}, got {list(t.shape)}")
        target[i] = t.to(device=p.device, dtype=p.dtype)


def _split(what: str, tensor: Any, hook: str,
           index: dict[str, int]) -> list[tuple[int, torch.Tensor]]:
    """An annotated torch-layout tensor as (parameter index, its part), in order; a tail
    the parameters leave (batched padding) is handled by the caller."""
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"fastddp: {what} must be a tensor, got {type(tensor).__name__}")
    layout = getattr(tensor, LAYOUT_ATTR, None)
    if layout is None:
        raise NotImplementedError(
            f"fastddp: {what} was not written by fastddp (torch's own hook keys its state by "
            "torch's bucket indices, and which parameters they held is not known here). "
            "fastddp resumes a PowerSGDState it ran; to start from this one anyway, empty "
            "error_dict, p_memory_dict and q_memory_dict (error feedback and warm start "
            "restart; iter, rng and the statistics are kept)")
    if layout.get("hook") != hook:
        raise ValueError(f"fastddp: {what} is the state of the native {layout.get('hook')!r} "
                         f"hook, but {hook!r} runs this model")
    flat = tensor.detach().reshape(-1)
    out, offset = [], 0
    for name, *dims in layout["params"]:
        if name not in index:
            raise ValueError(f"fastddp: {what} holds parameter {name!r}, which this model "
                             "does not reduce")
        i = index[name]
        numel = 1
        for d in dims:
            numel *= d
        if offset + numel > flat.numel():
            raise ValueError(f"fastddp: {what} has {flat.numel()} elements, fewer than its "
                             "parameters need")
        out.append((i, flat[offset:offset + numel].view(*dims) if len(dims) > 1 else
                    flat[offset:offset + numel]))
        offset += numel
    return out


def _batched_entry(what: str, dict_name: str, per_param: list[tuple[int, torch.Tensor]],
                   tensor: torch.Tensor, raw: dict, src: _Source) -> None:
    if dict_name == "q_memory_dict":
        (i, q), = per_param
        if tuple(q.shape) != tuple(tensor.shape) or q.shape[1] != src.rank:
            raise ValueError(f"fastddp: {what} must be one side x {src.rank} matrix, got "
                             f"{list(tensor.shape)}")
        if i in raw.get("bucket_qs", {}):
            raise ValueError(f"fastddp: {what}: a bucket starting at {src.names[i]!r} is also "
                             "in another entry")
        raw.setdefault("bucket_qs", {})[i] = q
        return
    total = sum(t.numel() for _, t in per_param)
    side = _C.batched_powersgd_side(total)
    if tensor.numel() != side * side:
        raise ValueError(f"fastddp: {what} has {tensor.numel()} elements; its parameters "
                         f"({total} elements) make a {side} x {side} matrix")
    for i, t in per_param:
        if i in raw["errors"]:
            raise ValueError(f"fastddp: {what}: parameter {src.names[i]!r} is also in another "
                             "entry")
        if t.numel() != src.params[i].numel():
            raise ValueError(f"fastddp: {what}: parameter {src.names[i]!r} has "
                             f"{src.params[i].numel()} elements, the state {t.numel()}")
        raw["errors"][i] = t.to(device=src.params[i].device, dtype=src.params[i].dtype)
    if side * side > total:
        raw.setdefault("bucket_error_tails", {})[per_param[0][0]] = (
            tensor.detach().reshape(-1)[total:])
