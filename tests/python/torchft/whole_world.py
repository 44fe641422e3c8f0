"""The references for torchft's replica groups of several ranks (test_hierarchical.py): the
same ranks as one plain torch.distributed world (harness.py's world4, gloo, no torchft), each
with the batches replica.py gives it, training with torch DDP and with fastddp's hierarchical
hook over node-major nodes of `local_size` ranks. Run on every rank of the world."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tests.python.torchft import replica as replica_module

# replica.py's default: several buckets per step.
BUCKET_CAP_MB = 0.004


def train_both(local_size: int, steps: int, inner: str) -> dict[str, dict[str, Any]]:
    """{"torch": result, "fastddp": result} for this rank after `steps` steps, each result
    in the form of replica.py's (the weights and the optimizer state)."""
    import fastddp
    from fastddp.launch.hook_spec import fastddp_hook, parse_hook_spec

    rank = dist.get_rank()
    inner_hook = fastddp_hook(parse_hook_spec(inner, "inner"), "inner")[1]
    models = {
        "torch": nn.parallel.DistributedDataParallel(
            replica_module.make_model(), bucket_cap_mb=BUCKET_CAP_MB),
        "fastddp": fastddp.DistributedDataParallel(
            replica_module.make_model(), bucket_cap_mb=BUCKET_CAP_MB)}
    models["fastddp"].register_comm_hook(
        None, fastddp.hooks.hierarchical(inner_hook, local_size=local_size))
    results = {}
    for impl, model in models.items():
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        for step in range(steps):
            optimizer.zero_grad()
            x, y = replica_module.batch(rank, step)
            nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
        results[impl] = {"model": model.module.state_dict(), "optim": optimizer.state_dict()}
    return results
