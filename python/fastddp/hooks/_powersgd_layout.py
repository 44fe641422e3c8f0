"""The checkpoint format of torch's ``PowerSGDState`` on fastddp: the native PowerSGD hooks'
state (per parameter index, C++) as torch's per-bucket dicts and back. The live view that
reads it (powersgd_live.py) and any state saved from it use this layout.

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
"""

from typing import TYPE_CHECKING, Any, Protocol

import torch

if TYPE_CHECKING:  # numpy only where a torch PowerSGDState's generator is read or made
    import numpy as np

from fastddp import _C

LAYOUT_ATTR = "_fastddp_layout"


class Parameters(Protocol):
    """What the conversions read of a model and its native hook (powersgd_live's _Source):
    the reduced parameters' names and tensors in the reducer's order, the hook's rank and
    whether it is the batched one."""

    names: list[str]
    params: list[torch.Tensor]
    rank: int

    @property
    def batched(self) -> bool: ...


# --- native (per parameter index) -> torch (per bucket index) -----------------------------

def _annotated(t: torch.Tensor, hook: str, params: list[tuple]) -> torch.Tensor:
    setattr(t, LAYOUT_ATTR, {"hook": hook, "params": params})
    return t


def _matrix_shape(p: torch.Tensor) -> tuple[int, int]:
    n = p.shape[0] if p.dim() > 0 else 1
    return n, (p.numel() // n if n else 0)


def powersgd_to_torch(raw: dict, plan: list[list[int]], src: Parameters) -> tuple[dict, dict, dict]:
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
    return errors, ps, qs


def batched_to_torch(raw: dict, plan: list[list[int]], src: Parameters) -> tuple[dict, dict, dict]:
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
    return errors, ps, qs


def numpy_rng(native_state: str) -> "np.random.RandomState":
    """The native generator as torch's PowerSGDState holds it. numpy is imported here, not
    at module level: torch's wheel does not require numpy, and only a torch PowerSGDState
    (whose generator is numpy's) needs it."""
    import numpy as np

    pos, *key = (int(v) for v in native_state.split())
    rng = np.random.RandomState()
    rng.set_state(("MT19937", np.array(key, dtype=np.uint32), pos, 0, 0.0))
    return rng


# --- torch (per bucket index) -> native (per parameter index) ------------------------------

def _numpy() -> Any:
    """numpy, or None where it is not installed (then no PowerSGDState can hold its rng)."""
    try:
        import numpy
    except ImportError:
        return None
    return numpy


def to_native(fields: dict[str, Any], src: Parameters) -> dict[str, Any]:
    """A PowerSGDState's training state as the native hook's load_state_dict takes it."""
    where = "register_comm_hook: the PowerSGDState"
    for name in ("iter", "total_numel_before_compression", "total_numel_after_compression",
                 "next_stats_report"):
        value = fields[name]
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"fastddp: {where}'s {name} must be an int >= 0, got {value!r}")
    rng = fields["rng"]
    np = _numpy()
    if np is None or not isinstance(rng, np.random.RandomState):
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
                    tensor: torch.Tensor, raw: dict, src: Parameters) -> None:
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
                   tensor: torch.Tensor, raw: dict, src: Parameters) -> None:
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
