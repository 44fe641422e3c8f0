"""The sharded optimizer on one GPU over NCCL (world size 1: the reduce-scatter and the
all-gather are NCCL's, on NCCL's stream, with their Work futures), against torch DDP + the
same optimizer on the GPU. Scenarios for a harness world of backend "nccl"."""

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import fastddp
from fastddp.optim import ShardedOptimizer
from tests.python.ddp.gpu_paths_scenarios import SLEEP_CYCLES, _MarkBackward
from tests.python.optim.sharded_scenarios import CAP_MB, OPTIMIZERS
from tests.python.scenarios import mlp


def _batch(step: int):
    g = torch.Generator().manual_seed(1000 * step)
    return torch.randn(6, 8, generator=g).cuda(), torch.randn(6, 4, generator=g).cuda()


def against_torch(optimizer: str = "adamw_fused", overlap_all_gather: bool = False,
                  zero_stage: int = 1, steps: int = 10, wire: str = "fp32") -> dict:
    """Ten steps on cuda:0; the largest |difference| of the weights from torch's, whether
    every parameter ended on the GPU and .grad None, and the reducer's held bucket bytes.
    wire="bf16": torch DDP runs torch's bf16_compress_hook (at world size 1 the average is
    the gradient rounded to bfloat16 once, in both)."""
    cls, kwargs = OPTIMIZERS[optimizer]
    torch.manual_seed(0)
    base = mlp().cuda()
    fast = fastddp.DistributedDataParallel(copy.deepcopy(base), device_ids=[0],
                                           bucket_cap_mb=CAP_MB)
    ref = TorchDDP(copy.deepcopy(base), device_ids=[0], bucket_cap_mb=CAP_MB)
    if wire == "bf16":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        ref.register_comm_hook(None, default_hooks.bf16_compress_hook)
    fast_opt = ShardedOptimizer(fast, cls, overlap_all_gather=overlap_all_gather,
                                zero_stage=zero_stage, gradient_wire=wire, **kwargs)
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


def backward_does_not_wait_for_the_reduce_scatter(steps: int = 3) -> list[float]:
    """Every reduce-scatter of a backward queued behind a delayed collective: before each
    backward a one-element all-reduce on the model's group is issued from a side stream after
    torch.cuda._sleep, so NCCL's stream (one per device and group, the reduce-scatters' too)
    runs it, and every reduce-scatter issued after it, only once the sleep has ended. Had the
    compute stream waited for a reduce-scatter before the end of backward, the input's
    backward (the last op, marked by _MarkBackward) would run after that all-reduce's end.
    Returns, per step, the ms from the mark to the all-reduce's end: positive means backward
    finished first. The step after it must still update (the shards were reduced)."""
    torch.manual_seed(0)
    fast = fastddp.DistributedDataParallel(mlp().cuda(), device_ids=[0], bucket_cap_mb=CAP_MB)
    opt = ShardedOptimizer(fast, torch.optim.AdamW, lr=0.01)
    side = torch.cuda.Stream()
    gaps = []
    for step in range(steps):
        inputs, target = _batch(step)
        before = [p.detach().clone() for p in fast.module.parameters()]
        opt.zero_grad()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            torch.cuda._sleep(SLEEP_CYCLES)
            work = dist.all_reduce(torch.zeros(1, device="cuda"), group=fast.process_group,
                                   async_op=True)
            work.wait()  # the side stream waits for NCCL's: the event below follows it
            delayed_end = torch.cuda.Event(enable_timing=True)
            delayed_end.record()
        marks: list[torch.cuda.Event] = []
        x = _MarkBackward.apply(inputs.clone().requires_grad_(True), marks)
        F.mse_loss(fast(x), target).backward()
        opt.step()
        torch.cuda.synchronize()
        assert marks, "the input's backward did not run"
        assert all(not torch.equal(a, b) for a, b in zip(before, fast.module.parameters())), \
            f"step {step} left a parameter as it was"
        gaps.append(marks[-1].elapsed_time(delayed_end))
    return gaps
