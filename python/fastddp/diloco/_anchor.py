"""The anchor: the weights every rank agrees on, kept flat (one buffer per device and dtype) so
that a pseudo-gradient is one subtraction and the reset to the anchor one foreach copy per
buffer, with no Python loop over the parameters on the sync path."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch._utils import _flatten_dense_tensors


class Anchor:
    """Flat copies of `params`, grouped by (device, dtype) in first-appearance order."""

    def __init__(self, params: Sequence[torch.Tensor]):
        groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for p in params:
            groups.setdefault((p.device, p.dtype), []).append(p)
        self.params: list[list[torch.Tensor]] = list(groups.values())
        with torch.no_grad():
            # Leaf tensors without autograd: the outer optimizer steps them.
            self.flats: list[torch.Tensor] = [
                _flatten_dense_tensors(ps).clone() for ps in self.params]
        self.views: list[list[torch.Tensor]] = [
            [v.view_as(p) for v, p in zip(flat.split([p.numel() for p in ps]), ps)]
            for flat, ps in zip(self.flats, self.params)]

    def pseudo_gradients(self) -> list[torch.Tensor]:
        """anchor - current weights, one flat tensor per group (fresh buffers)."""
        with torch.no_grad():
            return [torch.sub(flat, _flatten_dense_tensors(ps))
                    for flat, ps in zip(self.flats, self.params)]

    def reset_model(self, alpha: float = 0.0) -> None:
        """Sets the parameters to the anchor (alpha 0), or to lerp(anchor, parameters,
        alpha): torchft's merge of the new anchor with the local weights."""
        with torch.no_grad():
            for ps, views in zip(self.params, self.views):
                if alpha == 0.0:
                    torch._foreach_copy_(ps, views)
                else:
                    torch._foreach_copy_(ps, torch._foreach_lerp(views, ps, alpha))

    def load(self, flats: Sequence[torch.Tensor]) -> None:
        """Copies saved anchors in, after checking they fit."""
        self.check_fits(flats, "anchor")
        with torch.no_grad():
            torch._foreach_copy_(self.flats, list(flats))

    def check_fits(self, flats: Sequence[torch.Tensor], key: str) -> None:
        """Saved flat buffers (the anchors, or an exchange's averages) fit these groups: as
        many, each of the same shape and dtype (the device is the copy's business)."""
        if len(flats) != len(self.flats):
            raise ValueError(f"fastddp.DiLoCo.load_state_dict: {key!r} has {len(flats)} "
                             f"buffers, this model's parameters make {len(self.flats)}")
        for i, (mine, saved) in enumerate(zip(self.flats, flats)):
            if saved.shape != mine.shape or saved.dtype != mine.dtype:
                raise ValueError(
                    f"fastddp.DiLoCo.load_state_dict: {key} buffer {i} is {saved.dtype} "
                    f"{tuple(saved.shape)}, this model's is {mine.dtype} {tuple(mine.shape)}")
