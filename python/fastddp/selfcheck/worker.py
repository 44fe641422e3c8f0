"""One rank of the self-check: every case on one device, reported through a queue.

Runs in a spawned process (runner.py). Before each case every rank reports ("start",
index), so that if a process dies (a crash in native code) the runner knows which case did
it; after it rank 0 reports ("row", index, excess, failure, seconds).
"""

from __future__ import annotations

import copy
import datetime
import faulthandler
import os
import time
import traceback
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import fastddp
from fastddp.selfcheck.cases import STEPS, Case, Tolerance, all_cases

# A hung collective becomes an error, and the runner's deadline is the last resort.
_TIMEOUT = datetime.timedelta(seconds=60)


def _mlp(device: torch.device) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(),
                               torch.nn.Linear(64, 64), torch.nn.ReLU(),
                               torch.nn.Linear(64, 8)).to(device)


def _batch(rank: int, step: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * rank + step)
    return (torch.randn(16, 32, generator=gen).to(device),
            torch.randn(16, 8, generator=gen).to(device))


def excess(got: list[torch.Tensor], want: list[torch.Tensor], tol: Tolerance) -> float:
    """max over elements of |got - want| / what `tol` allows there: at most 1 passes; with
    nothing allowed (EXACT), 0 if equal bit for bit, else infinity."""
    scope = max(w.abs().max().item() for w in want) if tol.scope == "model" else None
    worst = 0.0
    for a, b in zip(got, want):
        a, b = a.double(), b.double()
        top = scope if scope is not None else b.abs().max().item()
        allowed = tol.floor + tol.rel * b.abs() + tol.of_max * top
        diff = (a - b).abs()
        over = torch.where(diff == 0, torch.zeros_like(diff), diff / allowed)  # x/0 = inf
        worst = max(worst, over.max().item())
    return worst


def _register(model: Any, made: tuple[Any, Any] | None) -> None:
    if made is not None:
        model.register_comm_hook(*made)


def _grads(model: Any, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    F.mse_loss(model(x), y).backward()
    return [p.grad for p in model.parameters()]


def _exact_mean(local: torch.nn.Module, x: torch.Tensor, y: torch.Tensor,
                group: dist.ProcessGroup) -> list[torch.Tensor]:
    """The float32 mean of every rank's local gradient, by torch alone."""
    grads = [g.clone() for g in _grads(local, x, y)]
    for g in grads:
        dist.all_reduce(g, group=group)
        g.div_(group.size())
    return grads


def run_case(case: Case, group: dist.ProcessGroup, device: torch.device, rank: int) -> float:
    """excess() of the case's gradients over its reference, worst of steps and ranks.
    Each step the reference starts from fastddp's parameters (an SGD step of lr 0.1), so
    each step's difference is the hook's alone."""
    base = _mlp(device)
    ids = [device.index] if device.type == "cuda" else None
    model = fastddp.DistributedDataParallel(copy.deepcopy(base), device_ids=ids,
                                            process_group=group)
    _register(model, case.fastddp_hook(group))
    if case.reference == "torch":
        ref = TorchDDP(copy.deepcopy(base), device_ids=ids, process_group=group)
        _register(ref, case.torch_hook(group))
    else:
        ref = copy.deepcopy(base)  # rank-local; its gradients are averaged by torch
    worst = 0.0
    for step in range(STEPS):
        x, y = _batch(rank, step, device)
        got = _grads(model, x, y)
        want = _grads(ref, x, y) if case.reference == "torch" else _exact_mean(ref, x, y, group)
        worst = max(worst, excess(got, want, case.tolerance))
        with torch.no_grad():
            for p, q in zip(model.parameters(), ref.parameters()):
                p.sub_(0.1 * p.grad)
                q.copy_(p)
    # Every rank's verdict is the worst rank's: a float64 MAX on the CPU group or the device.
    found = torch.tensor([worst], dtype=torch.float64,
                         device=device if dist.get_backend(group) == "nccl" else "cpu")
    dist.all_reduce(found, op=dist.ReduceOp.MAX, group=group)
    return found.item()


def main(rank: int, world: int, backend: str, device: str, port: int, indices: list[int],
         queue: Any) -> None:
    """Entry point of a spawned rank (runner.run_world)."""
    faulthandler.enable()  # a crash prints where, for the report
    warnings.simplefilter("ignore")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=_TIMEOUT)
    group = dist.group.WORLD
    cases = all_cases()
    try:
        for index in indices:
            queue.put(("start", index))
            start = time.perf_counter()
            try:
                error, failure = run_case(cases[index], group, dev, rank), None
            except Exception as e:  # reported as the case's row; the next case still runs
                error, failure = None, "".join(
                    traceback.format_exception_only(type(e), e)).strip()
            if rank == 0:
                queue.put(("row", index, error, failure, time.perf_counter() - start))
    finally:
        dist.destroy_process_group()
