"""DiLoCo's arguments, checked before anything is allocated or communicated: a bad value raises
an exception naming the argument, an argument fastddp does not implement (yet) raises
NotImplementedError."""

from __future__ import annotations

import math
import numbers
from dataclasses import asdict, dataclass

import torch
from torch import nn

# The averaging wires (fastddp/diloco/_wire.py).
WIRES = ("fp32", "bf16", "int8", "int4")
# How a quantized wire sums: every rank gathers every rank's codes (one quantization), or the
# "int8" hook's shard sums (fastddp/diloco/_shard_wire.py; fewer bytes from 3 ranks on).
QUANTIZED_SUMS = ("gather", "shards")


@dataclass(frozen=True)
class DiLoCoConfig:
    """What a DiLoCo was built with; its state_dict carries it so that a state is only
    loaded into a DiLoCo that would have produced it."""

    sync_every: int
    outer_lr: float
    outer_momentum: float
    fragments: int
    wire: str
    overlap: int
    merge_alpha: float
    quantized_sum: str
    error_feedback: bool
    broadcast_buffers: bool

    def as_dict(self) -> dict:
        return asdict(self)


def _integer(name: str, value: object, minimum: int) -> int:
    # bool is an int to Python; True as sync_every is a mistake, not 1.
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"fastddp.DiLoCo: {name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"fastddp.DiLoCo: {name} must be >= {minimum}, got {value}")
    return int(value)


def _real(name: str, value: object, low: float, high: float | None) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"fastddp.DiLoCo: {name} must be a number, got {type(value).__name__}")
    value = float(value)
    if not math.isfinite(value):  # an infinite outer_lr makes every anchor inf at a sync
        raise ValueError(f"fastddp.DiLoCo: {name} must be a finite number, got {value}")
    if value < low or (high is not None and value > high):
        bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise ValueError(f"fastddp.DiLoCo: {name} must be {bound}, got {value}")
    return value


def check_config(model: object, inner_optimizer: object, sync_every: object, outer_lr: object,
                 outer_momentum: object, fragments: object, wire: object, overlap: object,
                 merge_alpha: object, quantized_sum: object, error_feedback: object,
                 broadcast_buffers: object) -> DiLoCoConfig:
    """The checked configuration, or the exception that names the culprit."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"fastddp.DiLoCo: model must be a torch.nn.Module, got "
                        f"{type(model).__name__}")
    if not isinstance(inner_optimizer, torch.optim.Optimizer):
        raise TypeError(f"fastddp.DiLoCo: inner_optimizer must be a torch.optim.Optimizer, "
                        f"got {type(inner_optimizer).__name__}")
    return check_settings(sync_every, outer_lr, outer_momentum, fragments, wire, overlap,
                          merge_alpha, quantized_sum, error_feedback, broadcast_buffers)


def check_settings(sync_every: object, outer_lr: object, outer_momentum: object,
                   fragments: object, wire: object, overlap: object, merge_alpha: object,
                   quantized_sum: object, error_feedback: object,
                   broadcast_buffers: object) -> DiLoCoConfig:
    """check_config without the model and optimizer (the launcher's --sync, before the
    script runs)."""
    config = DiLoCoConfig(
        sync_every=_integer("sync_every", sync_every, 1),
        outer_lr=_real("outer_lr", outer_lr, 0.0, None),
        outer_momentum=_real("outer_momentum", outer_momentum, 0.0, 1.0),
        fragments=_fragment_count(fragments),
        wire=_wire(wire),
        overlap=_integer("overlap", overlap, 0),
        merge_alpha=_real("merge_alpha", merge_alpha, 0.0, 1.0),
        quantized_sum=_choice("quantized_sum", quantized_sum, QUANTIZED_SUMS),
        error_feedback=_flag("error_feedback", error_feedback),
        broadcast_buffers=_flag("broadcast_buffers", broadcast_buffers),
    )
    if config.outer_momentum == 1.0:
        raise ValueError("fastddp.DiLoCo: outer_momentum must be < 1 (1 never forgets a step)")
    if config.quantized_sum == "shards" and config.wire not in ("int8", "int4"):
        raise ValueError(f"fastddp.DiLoCo: quantized_sum='shards' sums int8 or int4 shards; "
                         f"wire={config.wire!r} has no such form")
    # torchft's DiLoCo's schedule: one fragment syncs every sync_every / fragments steps, so
    # each fragment every sync_every steps; its exchange is launched `overlap` steps earlier.
    if config.sync_every % config.fragments:
        raise ValueError(f"fastddp.DiLoCo: sync_every={config.sync_every} must be a multiple of "
                         f"the number of fragments ({config.fragments})")
    period = config.sync_every // config.fragments
    if config.overlap >= period:
        raise ValueError(f"fastddp.DiLoCo: overlap={config.overlap} must be < sync_every / "
                         f"fragments = {period}: a fragment's exchange must land before the "
                         "next one is launched")
    return config


def _fragment_count(fragments: object) -> int:
    """fragments is a count or the modules that make each fragment (checked in _split.py)."""
    if isinstance(fragments, (list, tuple)):
        if not fragments:
            raise ValueError("fastddp.DiLoCo: fragments is an empty list")
        return len(fragments)
    return _integer("fragments", fragments, 1)


def _wire(wire: object) -> str:
    return _choice("wire", wire, WIRES)


def _choice(name: str, value: object, choices: tuple[str, ...]) -> str:
    if not isinstance(value, str):
        raise TypeError(f"fastddp.DiLoCo: {name} must be a str, got {type(value).__name__}")
    if value not in choices:
        raise ValueError(f"fastddp.DiLoCo: {name} must be one of {choices}, got {value!r}")
    return value


def _flag(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"fastddp.DiLoCo: {name} must be a bool, got {type(value).__name__}")
    return value
