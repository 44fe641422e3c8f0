"""One fragment of streaming DiLoCo (arXiv 2501.18512, torchft's _StreamingDiLoCoFragment): a
share of the parameters with its own anchor, wire (and error feedback) and outer optimizer.

prepare() takes the fragment's pseudo-gradient and launches its exchange; the inner steps go on
while it is in flight; perform() waits for it, steps the anchor with the average, and sets the
fragment's parameters to anchor + alpha * (local - anchor) (torchft's lerp toward the local
weights, ``fragment_update_alpha``; 0: the new anchor).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from fastddp.diloco._anchor import Anchor
from fastddp.diloco._shard_wire import ShardSumWire
from fastddp.diloco._wire import Exchange, make_wire


class Fragment:
    def __init__(self, params: Sequence[torch.Tensor], group: dist.ProcessGroup, wire: str,
                 quantized_sum: str, error_feedback: bool, outer_lr: float,
                 outer_momentum: float, alpha: float):
        self.anchor = Anchor(params)
        self.wire = (ShardSumWire(wire, group, self.anchor.flats, error_feedback)
                     if quantized_sum == "shards"
                     else make_wire(wire, group, self.anchor.flats, error_feedback))
        self.outer = torch.optim.SGD(self.anchor.flats, lr=outer_lr, momentum=outer_momentum,
                                     nesterov=outer_momentum > 0)
        self.alpha = alpha
        self.syncs = 0  # outer steps applied (statistics, not restored by load_state_dict)
        self._exchanges: list[Exchange] = []
        # The averages of an exchange that landed before perform() (state_dict waits for one).
        self._landed: list[torch.Tensor] | None = None

    @property
    def in_flight(self) -> bool:
        return bool(self._exchanges) or self._landed is not None

    def prepare(self) -> None:
        """Takes the pseudo-gradient now and launches its exchange (a collective)."""
        if self.in_flight:
            raise RuntimeError("fastddp.DiLoCo: a fragment's exchange was launched again "
                               "before the last one was applied")
        pseudo = self.anchor.pseudo_gradients()
        self._exchanges = [self.wire.start(i, g) for i, g in enumerate(pseudo)]

    def advance(self) -> None:
        """Moves a two-collective exchange (quantized_sum="shards") to its second one."""
        for exchange in self._exchanges:
            middle = getattr(exchange, "middle", None)
            if middle is not None:
                middle()

    def land(self) -> list[torch.Tensor]:
        """Waits for the exchange in flight; its averages."""
        if self._landed is None:
            self._landed = [e.wait() for e in self._exchanges]
            self._exchanges = []
        return self._landed

    def perform(self) -> None:
        """Applies the landed average: outer step, then the merge into the parameters."""
        averages = self.land()
        for flat, average in zip(self.anchor.flats, averages):
            flat.grad = average
        self.outer.step()
        self.outer.zero_grad(set_to_none=True)
        self._landed = None
        self.anchor.reset_model(self.alpha)
        self.syncs += 1

    def state_dict(self) -> dict[str, Any]:
        # An exchange in flight is waited for (every rank saves at the same step, so every rank
        # waits for the same one) and its averages saved: the restart applies them as landed.
        pending = None if not self.in_flight else [a.clone() for a in self.land()]
        return {"anchor": [f.detach().clone() for f in self.anchor.flats],
                "outer_optimizer": copy.deepcopy(self.outer.state_dict()),
                "residuals": self.wire.state_dict(),
                "pending": pending}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.anchor.load(state["anchor"])
        self.wire.load_state_dict(state["residuals"])
        self.outer.load_state_dict(copy.deepcopy(state["outer_optimizer"]))
        pending = state["pending"]
        if pending is not None:
            self.anchor.check_fits(pending, "pending")
        self._exchanges = []
        # On the anchors' devices (a checkpoint loaded with map_location="cpu").
        self._landed = None if pending is None else [
            p.to(flat.device, copy=True) for p, flat in zip(pending, self.anchor.flats)]
