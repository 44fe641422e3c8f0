"""A registered comm hook's state for checkpoints, and its compression statistics.

The native PowerSGD hooks keep their error feedback and warm-start Q (and ACP-SGD its P)
per parameter index (C++); here they are keyed by parameter name, so a checkpoint survives a
bucket rebuild, a different ``bucket_cap_mb`` and a restart.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
# The model: fastddp's DistributedDataParallel, which imports this module; the hints name
# torch's class, which it subclasses.
from torch.nn.parallel import DistributedDataParallel


logger = logging.getLogger("fastddp.hooks")

_SCALARS = ("iter", "rng_state", "numel_before", "numel_after", "next_stats_report")
# Batched PowerSGD's per-bucket Q and padding error, keyed by the bucket's first parameter
# (the hook re-draws Q / restarts the padding's error for a bucket that no longer fits).
_BUCKET_KEYS = {"bucket_q": "bucket_qs", "bucket_error_tail": "bucket_error_tails"}


def hook_name(ddp: DistributedDataParallel) -> str:
    return ddp._native_hook.name if ddp._native_hook is not None else "allreduce"


def _stateful(ddp: DistributedDataParallel, what: str) -> Any:
    """The registered C++ hook if it has a checkpointable state, None for a stateless hook;
    raises NotImplementedError for a hook whose state fastddp cannot save."""
    hook = ddp._native_hook
    if hook is not None and hasattr(hook, "state_dict"):
        return hook
    if has_state(ddp):
        raise NotImplementedError(f"fastddp: {what}: the comm hook {hook_name(ddp)!r} keeps "
                                  "state fastddp cannot save (PowerSGD's it can; a Python "
                                  "hook's state is its own object)")
    return None


def has_state(ddp: DistributedDataParallel) -> bool:
    """Whether the registered hook keeps state between steps (the half hooks with error
    feedback, or a Python hook, whose state is the user's object)."""
    if not ddp._comm_hooks:
        return False
    hook, _ = ddp._comm_hooks[0]
    options = getattr(hook, "options", None)
    return options is None or bool(options.get("error_feedback", False))


def _reduces(ddp: DistributedDataParallel, what: str) -> None:
    if ddp._reducer is None:
        raise ValueError(f"fastddp: {what}: at world size 1 fastddp reduces nothing and runs "
                         "no comm hook, so there is no hook state")


def state_dict(ddp: DistributedDataParallel) -> dict[str, Any]:
    _reduces(ddp, "comm_hook_state_dict()")
    hook = _stateful(ddp, "comm_hook_state_dict()")
    if hook is None:
        return {"hook": hook_name(ddp)}
    raw = hook.state_dict()
    names = ddp._reducer_param_names
    params = ddp._reducer_params
    out: dict[str, Any] = {"hook": hook.name, **{k: raw[k] for k in _SCALARS}}
    out["error"] = {names[i]: t.view(params[i].shape) for i, t in sorted(raw["errors"].items())}
    out["q"] = {names[i]: t for i, t in sorted(raw["qs"].items())}
    if hook.name == "acpsgd":  # P is state here (PowerSGD's is recomputed every step)
        out["p"] = {names[i]: t for i, t in sorted(raw.get("ps", {}).items())}
    for key, raw_key in _BUCKET_KEYS.items():  # batched PowerSGD: per bucket
        if raw.get(raw_key):
            out[key] = {names[i]: t for i, t in sorted(raw[raw_key].items())}
    return out


def load_state_dict(ddp: DistributedDataParallel, state: dict[str, Any]) -> None:
    where = "load_comm_hook_state_dict()"
    _reduces(ddp, where)
    if not isinstance(state, dict) or "hook" not in state:
        raise ValueError(f"fastddp: {where} takes what comm_hook_state_dict() returned "
                         f"(a dict with a 'hook' key), got {type(state).__name__}")
    hook = _stateful(ddp, where)
    name = hook_name(ddp)
    if state["hook"] != name:
        raise ValueError(f"fastddp: {where}: the state is of comm hook {state['hook']!r}, "
                         f"but {name!r} is registered")
    if hook is None:
        return  # a stateless hook: nothing to restore
    tables = ("error", "q", "p") if name == "acpsgd" else ("error", "q")
    missing = [k for k in (*_SCALARS, *tables) if k not in state]
    if missing:
        raise ValueError(f"fastddp: {where}: the state lacks {missing}")
    index = {n: i for i, n in enumerate(ddp._reducer_param_names)}
    params = ddp._reducer_params
    errors, qs, ps = {}, {}, {}
    for key, out in zip(tables, (errors, qs, ps)):
        table = state[key]
        for pname, tensor in table.items():
            if pname not in index:
                raise ValueError(f"fastddp: {where}: {key} of parameter {pname!r}, which this "
                                 "model does not reduce")
            p = params[index[pname]]
            want = p.numel() if key == "error" else _factor_numel(hook, p, key)
            if not isinstance(tensor, torch.Tensor) or tensor.numel() != want:
                raise ValueError(f"fastddp: {where}: {key} of parameter {pname!r} must have "
                                 f"{want} elements, got "
                                 f"{getattr(tensor, 'shape', type(tensor).__name__)}")
            out[index[pname]] = tensor.detach().to(device=p.device, dtype=p.dtype)
    raw = {**{k: state[k] for k in _SCALARS}, "errors": errors, "qs": qs}
    if ps:
        raw["ps"] = ps
    for key, raw_key in _BUCKET_KEYS.items():
        raw[raw_key] = {}
        for pname, tensor in state.get(key, {}).items():
            if pname not in index or not isinstance(tensor, torch.Tensor):
                raise ValueError(f"fastddp: {where}: {key} of parameter {pname!r} must be a "
                                 "tensor of a parameter this model reduces")
            raw[raw_key][index[pname]] = tensor.detach()
    hook.load_state_dict(raw)


def _factor_numel(hook: Any, p: torch.Tensor, key: str) -> int:
    """Elements of a parameter's Q (m x r) or P (n x r), its (n, m) matrix at the rank."""
    n = p.shape[0] if p.dim() > 0 else 1
    m = p.numel() // n if n else 0
    return (m if key == "q" else n) * min(n, m, hook.matrix_approximation_rank)


def compression_stats(ddp: DistributedDataParallel) -> dict[str, Any]:
    hook = ddp._native_hook
    if hook is None or not hasattr(hook, "compression_stats"):
        raise NotImplementedError(f"fastddp: compression_stats(): the comm hook "
                                  f"{hook_name(ddp)!r} "
                                  "keeps no PowerSGD statistics (see comm_stats())")
    rate, before, after = hook.compression_stats()
    step_in, step_out = hook.last_step_bytes()
    return {"iter": hook.iter, "rate": rate, "numel_before": int(before),
            "numel_after": int(after), "step_bytes_before": step_in,
            "step_bytes_after": step_out}


def log_stats(hook: Any) -> None:
    """torch's PowerSGD "Compression stats" log lines that came due in C++."""
    for it, before, after in hook.take_stats_reports():
        rate = before / after if after > 0 else 0
        logger.info("Compression stats: iter %s, total before compression %s, total after "
                    "compression %s, rate %s", it, before, after, rate)
