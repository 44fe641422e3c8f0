"""Which parameters make each fragment of streaming DiLoCo: contiguous runs of the model's
parameters of about equal size (``fragments=P``), or the parameters of the modules given
(``fragments=[module, ...]``, as torchft's DiLoCo takes its model_fragments)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn


def split_parameters(params: Sequence[torch.Tensor],
                     fragments: int | Sequence[nn.Module]) -> list[list[torch.Tensor]]:
    """`params` (the model's trainable parameters, in order) cut into fragments."""
    if isinstance(fragments, int):
        return _even(params, fragments)
    return _by_module(params, fragments)


def _even(params: Sequence[torch.Tensor], count: int) -> list[list[torch.Tensor]]:
    n = len(params)
    if count > n:
        raise ValueError(f"fastddp.DiLoCo: fragments={count} but the model has only {n} "
                         "trainable parameters")
    sizes = [p.numel() for p in params]
    total = sum(sizes)
    out: list[list[torch.Tensor]] = []
    start, done = 0, 0
    for f in range(count):
        # At least one parameter each, and one left for each later fragment; a parameter goes
        # here while its middle falls within this fragment's share of the total.
        last = n - (count - f - 1)
        end, done = start + 1, done + sizes[start]
        while end < last and done + sizes[end] / 2 <= total * (f + 1) / count:
            done, end = done + sizes[end], end + 1
        out.append(list(params[start:end]))
        start = end
    return out


def _by_module(params: Sequence[torch.Tensor],
               modules: Sequence[nn.Module]) -> list[list[torch.Tensor]]:
    wanted = {id(p) for p in params}
    owner: dict[int, int] = {}
    out: list[list[torch.Tensor]] = []
    for f, module in enumerate(modules):
        if not isinstance(module, nn.Module):
            raise TypeError(f"fastddp.DiLoCo: fragments[{f}] must be a torch.nn.Module, got "
                            f"{type(module).__name__}")
        mine = []
        for name, p in module.named_parameters():
            if id(p) not in wanted:
                if p.requires_grad:
                    raise ValueError(f"fastddp.DiLoCo: fragments[{f}].{name} is not a "
                                     "parameter of model")
                continue
            if id(p) in owner:
                raise ValueError(f"fastddp.DiLoCo: fragments[{f}].{name} is also in "
                                 f"fragments[{owner[id(p)]}]")
            owner[id(p)] = f
            mine.append(p)
        if not mine:
            raise ValueError(f"fastddp.DiLoCo: fragments[{f}] has no trainable parameter")
        out.append(mine)
    left = [i for i, p in enumerate(params) if id(p) not in owner]
    if left:
        raise ValueError(f"fastddp.DiLoCo: {len(left)} trainable parameters of model (the "
                         f"first: parameter {left[0]}) are in no fragment and would never sync")
    return out
