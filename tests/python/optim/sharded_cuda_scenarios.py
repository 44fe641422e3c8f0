"""The sharded optimizer on one GPU over NCCL (world size 1: the reduce-scatter and the
all-gather are NCCL's, on NCCL's stream, with their Work futures), against torch DDP + the
same optimizer on the GPU. Scenarios for a harness world of backend "nccl"."""

import copy

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import fastddp
from fastddp.optim import ShardedOptimizer
from tests.python.optim.sharded_scenarios import CAP_MB, OPTIMIZERS
from tests.python.scenarios import mlp


def _batch(step: int):
    g = torch.Generator().manual_seed(1000 * step)
    return torch.randn(6, 8, generator=g).cuda(), torch.randn(6, 4, generator=g).cuda()


def against_torch(optimizer: str = "adamw_fused", overlap_all_gather: bool = False,
                  zero_stage: int = 1, steps: int = 10) -> dict:
    """Ten steps on cuda:0; the largest |difference| of the weights from torch's, whether
    every parameter ended on the GPU and .grad None, and the reducer's held bucket bytes."""
    cls, kwargs = OPTIMIZERS[optimizer]
    torch.manual_seed(0)
    base = mlp().cuda()
    fast = fastddp.DistributedDataParallel(copy.deepcopy(base), device_ids=[0],
                                           bucket_cap_mb=CAP_MB)
    ref = TorchDDP(copy.deepcopy(base), device_ids=[0], bucket_cap_mb=CAP_MB)
    fast_opt = ShardedOptimizer(fast, cls, overlap_all_gather=overlap_all_gather,
                                zero_stage=zero_stage, **kwargs)
    ref_opt = cls(ref.parameters(), **kwargs)
    for step in range(steps):
        inputs, target = _batch(step)
        for model, opt in ((fast, fast_opt), (ref, ref_opt)):
            opt.zero_grad()
            F.mse_loss(model(inputs), target).backward()
            opt.step()
    fast_opt.wait()
    torch.cuda.synchronize()
    return {"diff": max((a - b).abs().max().item() for a, b in
                        zip(fast.module.parameters(), ref.module.parameters())),
            "on_gpu": all(p.is_cuda for p in fast.module.parameters()),
            "grads_none": all(p.grad is None for p in fast.module.parameters()),
            "held_bucket_bytes": fast._reducer.held_bucket_bytes(),
            "step_cost": fast.comm_stats()["step_cost"]}
