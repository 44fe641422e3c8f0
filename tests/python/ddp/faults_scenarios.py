"""A rank killed by SIGKILL while the others train (see test_faults.py).

Every rank trains the same small model on its own data in a group with a short gloo
timeout; the victim rank kills itself at a chosen point. Survivors catch what their step
raises and return it, with the wall-clock time it was raised; the victim writes the time
of its death to a file first (it cannot return anything).
"""

import datetime
import os
import signal
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import fastddp

GROUP_TIMEOUT_S = 3.0
BUCKET_CAP_MB = 0.01  # four buckets after the rebuild: [head, high], [mid], [low], [inp]
# Builders of the hooks under test, by the id the tests use ("default": none registered).
HOOKS = {
    "default": lambda: None,
    "bf16": lambda: fastddp.hooks.bf16(),
    "fp16": lambda: fastddp.hooks.fp16(),
    "bf16_fp32acc": lambda: fastddp.hooks.bf16(accumulate="fp32"),
    # Compression from step 2 on: the kill steps below are compressed steps.
    "powersgd": lambda: fastddp.hooks.powersgd(start_powerSGD_iter=2),
    "batched_powersgd": lambda: fastddp.hooks.batched_powersgd(start_powerSGD_iter=2),
}


def _die(stamp_path: str, stall_s: float = 0.0) -> None:
    """Writes the time, then stalls for `stall_s` (its peers see a live rank that does not
    answer, until their timeout), then dies by SIGKILL."""
    with open(stamp_path, "w") as f:
        f.write(repr(time.time()))
    time.sleep(stall_s)
    os.kill(os.getpid(), signal.SIGKILL)


class _KillInBackward(torch.autograd.Function):
    """Identity; its backward kills the process (after stalling `stall_s` seconds) when
    `armed` says so. It sits between
    `low` and `mid`, so buckets [head, high] and [mid] are launched before it runs
    (autograd accumulates a parameter's gradient, which launches its bucket, before it
    runs the next backward node)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, armed: bool, stall_s: float,
                stamp_path: str) -> torch.Tensor:
        ctx.armed, ctx.stall_s, ctx.stamp_path = armed, stall_s, stamp_path
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        if ctx.armed:
            _die(ctx.stamp_path, ctx.stall_s)
        return grad, None, None, None


class Tower(nn.Module):
    def __init__(self, buffers: bool):
        super().__init__()
        self.inp = nn.Linear(16, 64)
        self.low = nn.Linear(64, 64)
        self.mid = nn.Linear(64, 64)
        self.high = nn.Linear(64, 64)
        self.head = nn.Linear(64, 8)
        self.norm = nn.BatchNorm1d(64) if buffers else nn.Identity()
        self.kill_now = False
        self.stall_s = 0.0
        self.stamp_path = ""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.low(torch.tanh(self.inp(x))))
        h = _KillInBackward.apply(h, self.kill_now, self.stall_s, self.stamp_path)
        h = torch.tanh(self.high(torch.tanh(self.mid(h))))
        return self.head(self.norm(h))


def train_until_killed(hook: str, victim: int, kill: str, kill_step: int, stamp_path: str,
                       buffers: bool = False) -> dict[str, Any]:
    """Trains until rank `victim` kills itself at step `kill_step`: in that step's
    backward (`kill="backward"`), after its optimizer step (`kill="between"`), or in its
    backward after stalling past the group's timeout (`kill="stall"`).

    A survivor returns where its step raised ("forward" or "backward"), at which step,
    the exception, and when (time.time()); "phase" None if nothing raised. Also whether
    the step before the kill sent fewer bytes than it reduced (compression was on).
    """
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S))
    rank = dist.get_rank()
    torch.manual_seed(0)
    tower = Tower(buffers)
    tower.stamp_path = stamp_path
    tower.stall_s = GROUP_TIMEOUT_S + 1.0 if kill == "stall" else 0.0
    model = fastddp.DistributedDataParallel(tower, process_group=group,
                                            bucket_cap_mb=BUCKET_CAP_MB)
    comm_hook = HOOKS[hook]()
    if comm_hook is not None:
        model.register_comm_hook(None, comm_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    out: dict[str, Any] = {"phase": None, "compressed_before_kill": None}
    for step in range(kill_step + 2):
        gen = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(16, 16, generator=gen), torch.randn(16, 8, generator=gen)
        tower.kill_now = rank == victim and kill in ("backward", "stall") and step == kill_step
        phase = "forward"
        try:
            loss = (model(x) - y).square().mean()
            opt.zero_grad()
            phase = "backward"
            loss.backward()
        except Exception as e:
            out.update(phase=phase, step=step, raised_at=time.time(),
                       error_type=type(e).__name__, error=str(e),
                       num_buckets=len(model.bucket_plan()))
            return out
        opt.step()
        if step == kill_step - 1:
            stats = model.comm_stats()
            out["compressed_before_kill"] = stats["bytes_sent"] < stats["bytes_reduced"]
        if rank == victim and kill == "between" and step == kill_step:
            _die(stamp_path)
    return out
