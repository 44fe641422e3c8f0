"""Scenarios for test_no_host_sync.py (issue 43 item 4): training steps on one GPU over NCCL,
fastddp's reducer forced at world size 1 (FASTDDP_WORLD1_REDUCER=1), watched for any host
synchronization.

Two watchers, because neither sees every kind:
- ``torch.cuda.set_sync_debug_mode("error")`` raises at a synchronizing copy or stream sync
  (``.item()``, ``.cpu()``, ``torch.cuda.synchronize()``), but c10's
  ``Event::synchronize`` (``cudaEventSynchronize``) does not consult it;
- torch's GPU trace (``torch.cuda._gpu_trace``, what the CUDA sanitizer uses) reports event,
  stream and device synchronizations, ``cudaEventSynchronize`` included, but not a copy.
The first raises at the sync, which fails the step: the scenario returns the message and the
step. The second records; the scenario returns what it recorded.

Every step's inputs are made on the GPU before the watch (a copy from pageable host memory
is itself a sync), and the watch starts after ``WARMUP`` steps: the bucket rebuild at the
second forward reads rank 0's plan on the host once per run, and the third step is
PowerSGD's and ACP-SGD's first compressed one (start_powerSGD_iter=2), which creates their
state."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import fastddp
from fastddp.ddp._options import WORLD1_REDUCER_ENV
from tests.python.scenarios import mlp, vector_batch

WARMUP = 3
STEPS = 50
# About a bucket per parameter of mlp() after the rebuild (world1_hooks_scenarios.py's
# "plain"): the pipelined hooks then have a bucket i-1 to finish while bucket i starts.
CAP_MB = 0.0001
PSGD = {"matrix_approximation_rank": 2, "min_compression_rate": 1}


def _hierarchical() -> object:
    # hierarchical() refuses groups of one rank (no hierarchy to exploit), so its group
    # cache is seeded with two one-rank groups: the C++ hook then runs its three stages
    # (reduce-scatter, the inner bf16 allreduce, allgather) and its side-stream work.
    hook = fastddp.hooks.hierarchical(inter=fastddp.hooks.bf16())
    group = dist.group.WORLD
    hook._made[id(group)] = (group, dist.new_group([0]), dist.new_group([0]))
    return hook


HOOKS: dict[str, Callable[[], object] | None] = {
    "default": None,
    "bucket_view": None,
    "overlap_optimizer": None,
    "bf16": fastddp.hooks.bf16,
    "fp16": fastddp.hooks.fp16,
    "int8": fastddp.hooks.int8,
    "fp8": fastddp.hooks.fp8,
    "powersgd": lambda: fastddp.hooks.powersgd(start_powerSGD_iter=2, **PSGD),
    "batched_powersgd": lambda: fastddp.hooks.batched_powersgd(start_powerSGD_iter=2, **PSGD),
    "acpsgd": lambda: fastddp.hooks.acpsgd(start_iter=2, **PSGD),
    "hierarchical": _hierarchical,
}
# Options that must sync when on (docs/design.md, Host synchronization), and their off
# counterparts. Each: (DDP keyword arguments, model, whether to train inside join()).
OPTIONS: dict[str, tuple[dict, Callable[[], nn.Module], bool]] = {
    "nan_check": ({"check_for_nan_in_grad": True}, mlp, False),
    "find_unused_all_used": ({"find_unused_parameters": True}, mlp, False),
    "find_unused_locally_unused": ({"find_unused_parameters": True}, lambda: UnusedHead(), False),
    "join_bufferless": ({}, mlp, True),
    "buffers_without_join": ({}, lambda: WithBatchNorm(), False),
    "join_with_buffers": ({}, lambda: WithBatchNorm(), True),
}


class UnusedHead(nn.Module):
    """mlp() and a head the forward never uses: locally unused on this (only) rank."""

    def __init__(self) -> None:
        super().__init__()
        self.net = mlp()
        self.unused = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class WithBatchNorm(nn.Module):
    """A model with buffers (BatchNorm's running statistics), which DDP broadcasts."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.BatchNorm1d(32), nn.ReLU(),
                                 nn.Linear(32, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


_traced: list[str] | None = None  # the watch's record while one is open
_trace_on = False


def _start_trace() -> None:
    """torch's GPU trace, once per process; its callbacks record only inside a watch."""
    global _trace_on
    if _trace_on:
        return
    from torch.cuda import _gpu_trace

    torch._C._activate_gpu_trace()
    for kind in ("event", "stream", "device"):
        register = getattr(_gpu_trace, f"register_callback_for_{kind}_synchronization")
        register(lambda *args, kind=kind: _traced is not None and _traced.append(
            f"{kind} synchronization {args}"))
    _trace_on = True


@contextlib.contextmanager
def watching() -> Iterator[list[str]]:
    """Any host sync inside raises (sync debug mode) or is recorded (GPU trace)."""
    global _traced
    _start_trace()
    seen: list[str] = []
    _traced = seen
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield seen
    finally:
        torch.cuda.set_sync_debug_mode(0)
        _traced = None


def _wrap(model: nn.Module, **ddp_kwargs) -> fastddp.DistributedDataParallel:
    os.environ[WORLD1_REDUCER_ENV] = "1"
    try:
        fast = fastddp.DistributedDataParallel(model.cuda(), device_ids=[0],
                                               bucket_cap_mb=CAP_MB, **ddp_kwargs)
    finally:
        os.environ.pop(WORLD1_REDUCER_ENV, None)
    assert fast._reducer is not None
    return fast


def _train(fast: fastddp.DistributedDataParallel, optimizer: torch.optim.Optimizer | None,
           in_join: bool, steps: int = STEPS) -> dict:
    batches = [vector_batch(step, device="cuda") for step in range(WARMUP + steps)]
    torch.cuda.synchronize()
    out: dict = {"raised": None, "step": None, "traced": []}

    def step(k: int) -> None:
        inputs, target = batches[k]
        if optimizer is not None:
            optimizer.zero_grad()
        F.mse_loss(fast(inputs), target).backward()
        if optimizer is not None:
            optimizer.step()

    with fast.join() if in_join else contextlib.nullcontext():
        for k in range(WARMUP):
            step(k)
        torch.cuda.synchronize()
        # The watch ends inside join(): its exit reads the ranks still training, a sync
        # outside the steps.
        with watching() as seen:
            try:
                for k in range(WARMUP, WARMUP + steps):
                    out["step"] = k + 1
                    step(k)
                out["step"] = None
            except RuntimeError as e:
                if "synchronizing CUDA operation" not in str(e):  # sync debug mode's text
                    raise  # any other failure is the scenario's, not a finding
                out["raised"] = str(e)[:2000]
        out["traced"] = list(seen)
    torch.cuda.synchronize()
    if out["raised"] is None:
        out["finite"] = all(bool(p.isfinite().all()) for p in fast.parameters())
        out["stats"] = {k: v for k, v in fast.comm_stats().items() if k != "buckets"}
    return out


def hook_steps(case: str, steps: int = STEPS) -> dict:
    """`steps` steps with the hook (or option) `case`, watched; see the module docstring."""
    torch.manual_seed(0)
    fast = _wrap(mlp(), gradient_as_bucket_view=case == "bucket_view")
    make = HOOKS[case]
    if make is not None:
        fast.register_comm_hook(None, make())
    optimizer = torch.optim.SGD(fast.parameters(), lr=0.01, momentum=0.9)
    if case == "overlap_optimizer":
        fast.overlap_optimizer(optimizer)  # steps inside backward: the script calls none
        optimizer = None
    return _train(fast, optimizer, in_join=False, steps=steps)


def option_steps(option: str, steps: int = STEPS) -> dict:
    """As hook_steps, the default hook, with one of OPTIONS."""
    torch.manual_seed(0)
    kwargs, build, in_join = OPTIONS[option]
    fast = _wrap(build(), **kwargs)
    optimizer = torch.optim.SGD(fast.parameters(), lr=0.01, momentum=0.9)
    return _train(fast, optimizer, in_join=in_join, steps=steps)


def sampled_timing(steps: int = 24, rate: int = 5) -> dict:
    """Which steps record device timing events (Note [device timeline]): the logger's
    sampled ones, at sample rate `rate`. After each step the device is synchronized (by
    the test, outside fastddp) so that comm_stats() finds that step's events complete if
    it recorded any: timed_iteration then names the last timed step. Also the logger's
    figures, read without a wait during a watched run of the same model."""
    torch.manual_seed(0)
    fast = _wrap(mlp())
    fast._set_ddp_runtime_logging_sample_rate(rate)
    timed = []
    for k in range(steps):
        inputs, target = vector_batch(k, device="cuda")
        F.mse_loss(fast(inputs), target).backward()
        torch.cuda.synchronize()
        timed.append(fast.comm_stats()["timed_iteration"])
    # Then watched: comm_stats() and the logger's reads must not sync.
    more = _train(fast, None, in_join=False, steps=2 * rate)
    data = fast._get_ddp_logging_data()
    return {"timed": timed, "watched": more, "iteration": data.get("iteration"),
            "avg_backward_comm_time": data.get("avg_backward_comm_time")}
