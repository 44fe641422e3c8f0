"""The sharded optimizer's float32 main weights for bf16 / fp16 parameters (Megatron's mixed
precision, ``ShardedOptimizer(..., main_weights="fp32")``) against the computation written
out with torch's own ops: every rank's 16-bit gradient divided by the world size in its own
format (torch DDP's copy-in), the ranks' quotients summed in float32 in rank order, torch's
optimizer stepping float32 copies of the parameters, each rounded once into the 16-bit
parameters. Scenarios for a harness world (2 and 3 gloo ranks)."""

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F

import fastddp
from fastddp.optim import ShardedOptimizer
from tests.python.optim.sharded_scenarios import CAP_MB, OPTIMIZERS
from tests.python.scenarios import mlp, vector_batch

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def train(optimizer: str = "adamw", dtype: str = "bf16", steps: int = 8,
          clip: bool = False, device: str = "cpu") -> dict:
    """``steps`` steps of fastddp + ShardedOptimizer(main_weights="fp32") and of the
    written-out reference from the same 16-bit weights on the same batches. ``device``:
    "cuda" on a GPU world (NCCL)."""
    half = DTYPES[dtype]
    world = dist.get_world_size()
    torch.manual_seed(0)
    module = mlp().to(device=device, dtype=half)
    initial = [p.detach().clone() for p in module.parameters()]
    reference = copy.deepcopy(module)
    model = fastddp.DistributedDataParallel(
        module, bucket_cap_mb=CAP_MB, device_ids=[0] if device == "cuda" else None)
    cls, options = OPTIMIZERS[optimizer]
    opt = ShardedOptimizer(model, cls, main_weights="fp32", **options)
    mains = [p.detach().float() for p in reference.parameters()]
    reference_opt = cls(mains, **options)
    for step in range(steps):
        inputs, target = vector_batch(step, device=device)
        opt.zero_grad()
        F.mse_loss(model(inputs.to(half)), target.to(half)).backward()
        if clip:
            opt.clip_grad_norm_(0.5)
        opt.step()

        reference.zero_grad()
        F.mse_loss(reference(inputs.to(half)), target.to(half)).backward()
        for main, p in zip(mains, reference.parameters()):
            quotient = p.grad / world  # in the parameter's 16-bit format, as DDP's copy-in
            gathered = [torch.empty_like(quotient) for _ in range(world)]
            dist.all_gather(gathered, quotient)
            total = gathered[0].float()
            for other in gathered[1:]:
                total += other  # float32, in rank order
            main.grad = total
        if clip:
            torch.nn.utils.clip_grad_norm_(mains, 0.5)
        reference_opt.step()
        with torch.no_grad():
            for main, p in zip(mains, reference.parameters()):
                p.copy_(main)  # rounded once
    got = [p.detach() for p in model.module.parameters()]
    want = [p.detach() for p in reference.parameters()]
    return {
        "dtypes": sorted({str(p.dtype) for p in got}),
        "diff": max((a.float() - b.float()).abs().max().item() for a, b in zip(got, want)),
        "ulps": max(((a.float() - b.float()).abs() / b.float().abs().clamp_min(1e-30)).max().item()
                    for a, b in zip(got, want)),
        "moved": all(not torch.equal(a, b) for a, b in zip(got, initial)),
        "state_dtypes": sorted({str(t.dtype) for inner in opt._inners
                                for state in inner.state.values()
                                for t in state.values() if torch.is_tensor(t) and t.dim()}),
        "main_bytes": sum(m.numel() * m.element_size() for m in opt._mains),
        "grad_shard_bytes": sum(b.grad.numel() * b.grad.element_size() for b in model._sharded),
        "flat_bytes": sum(b.flat.numel() * b.flat.element_size() for b in model._sharded),
        "grads_none": all(p.grad is None for p in model.module.parameters()),
    }


def refusals() -> dict:
    """What main_weights refuses, each naming the cause."""
    found = {}
    for name, build in {
        "float32_parameters": lambda: ShardedOptimizer(
            fastddp.DistributedDataParallel(mlp()), torch.optim.AdamW, main_weights="fp32"),
        "with_a_wire": lambda: ShardedOptimizer(
            fastddp.DistributedDataParallel(mlp().bfloat16()), torch.optim.AdamW,
            main_weights="fp32", gradient_wire="bf16"),
        "other_dtype": lambda: ShardedOptimizer(
            fastddp.DistributedDataParallel(mlp().bfloat16()), torch.optim.AdamW,
            main_weights="fp64"),
        "checkpoint": lambda: ShardedOptimizer(
            fastddp.DistributedDataParallel(mlp().bfloat16()), torch.optim.AdamW,
            main_weights="fp32").consolidate_state_dict(),
    }.items():
        try:
            build()
            found[name] = None
        except (ValueError, NotImplementedError) as e:
            found[name] = f"{type(e).__name__}: {e}"
    return found
