"""The references for torchft's replica groups of several ranks (test_hierarchical.py): the
same ranks as one plain torch.distributed world (gloo, no torchft), each with the batches
replica.py gives it, training with torch DDP and with fastddp's hierarchical hook over
node-major nodes of `local_size` ranks. Returns each rank's weights and optimizer state per
model (the form of replica.py's results)."""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tests.python.torchft import replica as replica_module

# replica.py's default: several buckets per step.
BUCKET_CAP_MB = 0.004


def run_whole_world(tmp_path: Path, *, world: int, local_size: int, steps: int,
                    inner: str) -> dict[str, dict[int, dict[str, Any]]]:
    """{"torch": {rank: result}, "fastddp": {rank: result}} after `steps` steps."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    store = dist.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    context = mp.get_context("spawn")
    processes = [context.Process(target=_rank, args=(rank, world, local_size, steps, inner,
                                                     store.port, str(tmp_path)))
                 for rank in range(world)]
    for p in processes:
        p.start()
    for p in processes:
        p.join(timeout=300)  # a hang guard, far above a run's 10-30 s
    try:
        assert all(p.exitcode == 0 for p in processes), [p.exitcode for p in processes]
    finally:
        for p in processes:
            if p.is_alive():
                p.kill()
    return {impl: {rank: torch.load(tmp_path / f"{impl}{rank}.pt", weights_only=False)
                   for rank in range(world)} for impl in ("torch", "fastddp")}


def _rank(rank: int, world: int, local_size: int, steps: int, inner: str, port: int,
          folder: str) -> None:
    import fastddp
    from fastddp.launch.hook_spec import fastddp_hook, parse_hook_spec

    store = dist.TCPStore("localhost", port, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    try:
        inner_hook = fastddp_hook(parse_hook_spec(inner, "inner"), "inner")[1]
        hook = fastddp.hooks.hierarchical(inner_hook, local_size=local_size)
        models = {
            "torch": nn.parallel.DistributedDataParallel(
                replica_module.make_model(), bucket_cap_mb=BUCKET_CAP_MB),
            "fastddp": fastddp.DistributedDataParallel(
                replica_module.make_model(), bucket_cap_mb=BUCKET_CAP_MB)}
        models["fastddp"].register_comm_hook(None, hook)
        for impl, model in models.items():
            optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
            for step in range(steps):
                optimizer.zero_grad()
                x, y = replica_module.batch(rank, step)
                nn.functional.mse_loss(model(x), y).backward()
                optimizer.step()
            torch.save({"model": model.module.state_dict(), "optim": optimizer.state_dict()},
                       Path(folder) / f"{impl}{rank}.pt")
    finally:
        dist.destroy_process_group()
