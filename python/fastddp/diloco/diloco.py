"""DiLoCo (arXiv 2311.08105): every rank takes `sync_every` steps of its own inner optimizer with
no collective; then the ranks average the pseudo-gradient (anchor weights minus current
weights), an outer torch.optim.SGD with Nesterov momentum steps the anchor with that average as
its gradient, and every rank's model is reset to the new anchor.

Streaming DiLoCo (arXiv 2501.18512), on torchft's DiLoCo's schedule: with P fragments, one
fragment syncs every H / P steps, in turn, so each fragment every H steps; with overlap = tau
its exchange is launched tau inner steps before it is applied (the steps in between run while
it is in flight) and the fragment's weights become lerp(new anchor, local weights, merge_alpha).

The syncs run from a post-hook on the inner optimizer's step(), so a training loop written for
torch DDP (forward, backward, optimizer.step()) needs no other change than building a DiLoCo
instead of wrapping the model.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fastddp._group_ops import broadcast_tensors
from fastddp.diloco._args import DiLoCoConfig, check_config, check_settings
from fastddp.diloco._fragment import Fragment
from fastddp.diloco._split import split_parameters

_STATE_KEYS = ("config", "step", "fragments")


class DiLoCo:
    """DiLoCo over `process_group` (the default group when None).

    Args:
        model: the module every rank trains; its parameters and buffers are broadcast from
            rank 0 now (as torch DDP does at construction) and become the first anchor.
        inner_optimizer: the optimizer of the local steps (AdamW in the paper); each of its
            step() calls is one inner step; it must hold only `model`'s parameters.
        sync_every: H, the inner steps between two syncs.
        outer_lr, outer_momentum: the outer torch.optim.SGD's (nesterov=True; plain SGD when
            outer_momentum is 0, where torch refuses Nesterov and the two coincide).
        fragments: P, streaming DiLoCo's fragments: contiguous runs of the parameters of
            about equal size, or a list of modules whose parameters make each fragment
            (torchft's model_fragments); sync_every must be a multiple of P.
        overlap: tau < sync_every / P, the inner steps a fragment's exchange overlaps.
        merge_alpha: a synced fragment's weights become new anchor + merge_alpha * (local -
            new anchor) (torchft's fragment_update_alpha; 0: the new anchor).
        wire: "fp32" (allreduce), "bf16", "int8" or "int4" (allgather of codes, float32 sum,
            error feedback on the pseudo-gradient when `error_feedback`).
        quantized_sum: "gather" (every rank sums every rank's codes) or, for int8 and int4,
            "shards" (alltoall, a float32 sum per shard, re-quantized allgather: the "int8"
            hook's form, fewer bytes from 3 ranks on, one more rounding).
        broadcast_buffers: after each sync, rank 0's buffers are copied to every rank, as
            torch DDP's broadcast_buffers does before each forward.

    state_dict() / load_state_dict() carry the step counter and per fragment the anchor, the
    outer momentum, the wire's residuals and an exchange in flight (waited for); with the
    model's and the inner optimizer's state dicts they restart a run exactly. Load them after
    building the DiLoCo: building it broadcasts rank 0's weights, which would overwrite the
    other ranks' loaded local weights.
    """

    def __init__(self, model: nn.Module, inner_optimizer: torch.optim.Optimizer, sync_every: int,
                 outer_lr: float = 0.7, outer_momentum: float = 0.9,
                 fragments: int | Sequence[nn.Module] = 1, wire: str = "fp32", overlap: int = 0,
                 merge_alpha: float = 0.0, quantized_sum: str = "gather",
                 error_feedback: bool = True,
                 broadcast_buffers: bool = True,
                 process_group: dist.ProcessGroup | None = None):
        self.config = check_config(model, inner_optimizer, sync_every, outer_lr, outer_momentum,
                                   fragments, wire, overlap, merge_alpha, quantized_sum,
                                   error_feedback, broadcast_buffers)
        self.group = _group(process_group)
        self.model, self.inner_optimizer = model, inner_optimizer
        params = [p for p in model.parameters() if p.requires_grad]
        if not params:
            raise ValueError("fastddp.DiLoCo: model has no parameter that requires grad")
        _check_inner_params(model, inner_optimizer)
        # The checked count (a numpy integer is an int there), or the given modules.
        shares = split_parameters(params, fragments if isinstance(fragments, (list, tuple))
                                  else self.config.fragments)
        self._buffers = list(model.buffers())
        with torch.no_grad():
            broadcast_tensors(self.group, [t.detach() for t in model.parameters()]
                              + self._buffers, 0)
        c = self.config
        self.fragments = [Fragment(share, self.group, c.wire, c.quantized_sum,
                                   c.error_feedback, c.outer_lr, c.outer_momentum,
                                   c.merge_alpha) for share in shares]
        self._period = c.sync_every // c.fragments
        self._step = 0
        self._hook = inner_optimizer.register_step_post_hook(self._after_inner_step)

    @staticmethod
    def check_settings(**settings: Any) -> None:
        """Checks DiLoCo's settings (the keyword arguments after ``sync_every``'s position,
        ``sync_every`` included) before any model exists, with the constructor's defaults for
        those not given: what ``python -m fastddp --sync`` does before the script runs.
        Raises ValueError or TypeError naming the culprit, as the constructor would."""
        defaults = {name: p.default for name, p in inspect.signature(DiLoCo).parameters.items()
                    if p.default is not inspect.Parameter.empty}
        settings = {**defaults, **settings}
        check_settings(**{name: settings[name] for name in DiLoCoConfig.__dataclass_fields__})

    @property
    def step(self) -> int:
        """Inner steps taken since the start of training (restored by load_state_dict)."""
        return self._step

    @property
    def outer_optimizer(self) -> torch.optim.Optimizer:
        """The outer optimizer of the only fragment (fragments=1)."""
        if len(self.fragments) != 1:
            raise AttributeError("fastddp.DiLoCo: with fragments, each has its own outer "
                                 "optimizer: fragments[i].outer")
        return self.fragments[0].outer

    def _after_inner_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self._step += 1
        # The fragment whose turn ends at the next multiple of the period (torchft's order).
        fragment = self.fragments[((self._step - 1) // self._period) % len(self.fragments)]
        within = self._step % self._period
        overlap = self.config.overlap
        if within == (self._period - overlap) % self._period:
            fragment.prepare()
        if overlap >= 2 and within == self._period - overlap // 2:
            # quantized_sum="shards": the second collective, halfway through the window.
            fragment.advance()
        if within == 0:
            fragment.perform()
            self._after_sync()

    def _after_sync(self) -> None:
        if self.config.broadcast_buffers and self._buffers:
            broadcast_tensors(self.group, self._buffers, 0)

    def sync(self) -> None:
        """Syncs every fragment now (a collective: every rank calls it); the inner
        optimizer's hook syncs on the schedule by itself."""
        if any(f.in_flight for f in self.fragments):
            raise RuntimeError("fastddp.DiLoCo.sync: a fragment's exchange is in flight "
                               "(overlap); it is applied at its own step")
        for fragment in self.fragments:
            fragment.prepare()
        for fragment in self.fragments:
            fragment.perform()
        self._after_sync()

    def stats(self) -> dict[str, int]:
        """The step counter (restored by load_state_dict), and since this DiLoCo was built the
        fragment syncs applied and the bytes this rank put into the averaging collectives
        (their input buffers: fp32 4 bytes a value, bf16 2, int8 1 plus a float32 scale per
        256 with the values padded to whole blocks, int4 half a byte plus a float32 scale per
        64 with the codes padded to 4 bytes; with quantized_sum="shards" the alltoall's and
        the allgather's)."""
        return {"inner_steps": self._step, "syncs": sum(f.syncs for f in self.fragments),
                "payload_bytes": sum(f.wire.payload_bytes for f in self.fragments)}

    def close(self) -> None:
        """Stops syncing: removes the hook on the inner optimizer."""
        self._hook.remove()

    def __enter__(self) -> "DiLoCo":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def state_dict(self) -> dict[str, Any]:
        """A snapshot (copies, not views) of what a restart needs besides the model's and the
        inner optimizer's own state dicts."""
        return {"config": self.config.as_dict(), "step": self._step,
                "fragments": [f.state_dict() for f in self.fragments]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        missing = [k for k in _STATE_KEYS if k not in state]
        if missing:
            raise KeyError(f"fastddp.DiLoCo.load_state_dict: state lacks {missing}")
        mine = self.config.as_dict()
        for key, value in state["config"].items():
            if mine.get(key) != value:
                raise ValueError(f"fastddp.DiLoCo.load_state_dict: the state was saved with "
                                 f"{key}={value!r}, this DiLoCo has {key}={mine.get(key)!r}")
        step = state["step"]
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"fastddp.DiLoCo.load_state_dict: 'step' must be an int >= 0, "
                             f"got {step!r}")
        if len(state["fragments"]) != len(self.fragments):
            raise ValueError(f"fastddp.DiLoCo.load_state_dict: the state has "
                             f"{len(state['fragments'])} fragments, this DiLoCo "
                             f"{len(self.fragments)}")
        for fragment, saved in zip(self.fragments, state["fragments"]):
            fragment.load_state_dict(saved)
        self._step = step


def _group(process_group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    if process_group is not None:
        if not isinstance(process_group, dist.ProcessGroup):
            raise TypeError(f"fastddp.DiLoCo: process_group must be a "
                            f"torch.distributed.ProcessGroup, got {type(process_group).__name__}")
        return process_group
    if not dist.is_initialized():
        raise RuntimeError("fastddp.DiLoCo: torch.distributed is not initialized; call "
                           "torch.distributed.init_process_group first or pass process_group")
    return dist.group.WORLD


def _check_inner_params(model: nn.Module, inner_optimizer: torch.optim.Optimizer) -> None:
    """A parameter the inner optimizer steps but the anchor does not know would drift apart
    across ranks, never averaged."""
    known = {id(p) for p in model.parameters()}
    for g, group in enumerate(inner_optimizer.param_groups):
        for p in group["params"]:
            if id(p) not in known:
                raise ValueError(
                    f"fastddp.DiLoCo: inner_optimizer's param_groups[{g}] holds a tensor of "
                    f"shape {tuple(p.shape)} that is not a parameter of model")
