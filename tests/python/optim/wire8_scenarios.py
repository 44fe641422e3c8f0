"""The sharded optimizer's 8-bit reduce-scatter (``gradient_wire="int8"``, ``"fp8"``,
``"e5m2"``) against the computation written out with torch's ops: every rank's divided
gradient, in the bucket's layout, cut into one row per destination; each row quantized
once by the 8-bit hooks' independent reference (tests/python/hooks/quant8_reference.py:
torch.round, torch's own float8 casts); the received rows dequantized and summed in float32
in rank order. Scenarios for a harness world (2 and 3 gloo ranks)."""

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F

import fastddp
from fastddp.optim import ShardedOptimizer
from tests.python.hooks import quant8_reference as ref
from tests.python.optim.sharded_scenarios import CAP_MB
from tests.python.scenarios import mlp, vector_batch

FORMATS = {"int8": "int8", "fp8": "e4m3", "e5m2": "e5m2"}


def shards_are_the_written_out_sum(wire: str = "int8", steps: int = 3,
                                   device: str = "cpu") -> dict:
    """Each step's shards against the reference; the training moves on through step().
    ``device``: "cuda" on a GPU world (NCCL)."""
    fmt = FORMATS[wire]
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    first = mlp().to(device)
    model = fastddp.DistributedDataParallel(copy.deepcopy(first), bucket_cap_mb=CAP_MB,
                                            device_ids=[0] if device == "cuda" else None)
    local = copy.deepcopy(first)  # this rank's own gradients, as DDP's copy-in reads them
    opt = ShardedOptimizer(model, torch.optim.SGD, lr=0.1, momentum=0.9, gradient_wire=wire)
    position = {id(p): i for i, p in enumerate(model.module.parameters())}
    local_params = list(local.parameters())
    diffs, errors = [], []
    for step in range(steps):
        inputs, target = vector_batch(step, device=device)
        opt.zero_grad()
        F.mse_loss(model(inputs), target).backward()
        local.zero_grad()
        F.mse_loss(local(inputs), target).backward()
        for bucket in model._sharded:
            mine = torch.zeros(bucket.flat.numel(), device=device)
            for p, offset, numel in zip(bucket.params, bucket.offsets, bucket.numels):
                # torch DDP's copy-in: x * (1 / n) (not x / n: they differ in the last bit
                # for n = 3)
                mine[offset:offset + numel] = (local_params[position[id(p)]].grad
                                               * (1.0 / world)).reshape(-1)
            rows = [torch.empty_like(mine) for _ in range(world)]
            dist.all_gather(rows, mine)
            n = bucket.grad.numel()
            want = None
            exact = torch.zeros(n, device=device)
            for r in range(world):
                row = rows[r][rank * n:(rank + 1) * n]
                value = ref.dequantize(*ref.quantize(row, fmt), fmt)[:n]
                want = value if want is None else want + value
                exact += row
            diffs.append((bucket.grad - want).abs().max().item())
            # how far the 8-bit average is from the float32 one, relative to its size
            errors.append(((bucket.grad - exact).abs().max()
                           / exact.abs().max().clamp_min(1e-30)).item())
        opt.step()
        with torch.no_grad():  # the reference follows the sharded model's weights
            for p, q in zip(local.parameters(), model.module.parameters()):
                p.copy_(q)
    return {"diff": max(diffs), "relative_error": max(errors),
            "hook": model._native_hook.name}
