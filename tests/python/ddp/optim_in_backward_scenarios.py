"""Optimizers in backward (torch.distributed.optim._apply_optimizer_in_backward) under fastddp,
against the written-out training they stand for: torch DDP, then the same optimizers stepped
after backward on the averaged gradients. (torch DDP runs this feature itself only with an
accelerator: its hook makes a torch.Stream(), which fails on a CPU-only machine.)

Scenarios for a harness world (2 and 3 gloo ranks)."""

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as dh
from torch.distributed.optim import _apply_optimizer_in_backward
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import fastddp
from tests.python.scenarios import mlp, vector_batch

OPTIMIZERS = {
    "sgd": (torch.optim.SGD, {"lr": 0.05}),
    "sgd_momentum": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}),
    "adamw": (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1}),
}


def _hook(model, name: str | None) -> None:
    if name == "native" and isinstance(model, fastddp.DistributedDataParallel):
        # fastddp's built-in allreduce: torch DDP's own reduction, the reference's
        model.register_comm_hook(None, fastddp.hooks.allreduce())
    elif name == "python":  # a Python hook (torch's allreduce_hook), on both models
        def hook(state, bucket):
            return dh.allreduce_hook(None, bucket)
        model.register_comm_hook(None, hook)


def train(optimizer: str = "sgd", steps: int = 4, gradient_as_bucket_view: bool = False,
          hook: str | None = None, no_sync_every: int = 0, partial: bool = False) -> dict:
    """fastddp with optimizers in backward against torch DDP + the same optimizers after
    backward, from one set of weights on the same batches. no_sync_every=k: every k-th step
    is a no_sync() backward (accumulated, stepped with the next one). partial: only the
    first layer has optimizers in backward, the rest an ordinary AdamW stepped after
    backward. Returns whether the parameters agree bit for bit on every rank, and the
    grads fastddp left on the in-backward parameters."""
    cls, kwargs = OPTIMIZERS[optimizer]
    torch.manual_seed(0)
    base = mlp()
    fast = fastddp.DistributedDataParallel(copy.deepcopy(base),
                                           gradient_as_bucket_view=gradient_as_bucket_view)
    ref = TorchDDP(copy.deepcopy(base), gradient_as_bucket_view=gradient_as_bucket_view)
    _hook(fast, hook)
    _hook(ref, hook)
    in_bwd = list(fast.module.parameters())[:2] if partial else list(fast.module.parameters())
    _apply_optimizer_in_backward(cls, in_bwd, kwargs)
    rest = [p for p in fast.module.parameters() if all(p is not q for q in in_bwd)]
    fast_rest = torch.optim.AdamW(rest, lr=0.01) if rest else None
    ref_params = list(ref.module.parameters())
    n = len(in_bwd)
    ref_opts = [cls(ref_params[:n], **kwargs)]
    if rest:
        ref_opts.append(torch.optim.AdamW(ref_params[n:], lr=0.01))
    left = []
    for step in range(steps):
        inputs, target = vector_batch(step)
        accumulate = no_sync_every and step % no_sync_every == no_sync_every - 1
        for model in (fast, ref):
            with model.no_sync() if accumulate else _null():
                F.mse_loss(model(inputs), target).backward()
        left.append([p.grad is None for p in in_bwd])
        if accumulate:
            continue
        for opt in ref_opts:
            opt.step()
            opt.zero_grad(set_to_none=True)
        if fast_rest is not None:
            fast_rest.step()
            fast_rest.zero_grad(set_to_none=True)
    equal = all(torch.equal(a, b) for a, b in zip(fast.module.parameters(), ref_params))
    gathered = [None] * dist.get_world_size()
    mine = torch.cat([p.detach().reshape(-1) for p in fast.module.parameters()])
    dist.all_gather_object(gathered, mine)
    moved = not torch.equal(mine, torch.cat([p.reshape(-1) for p in base.parameters()]))
    return {"equal": equal, "replicas_agree": all(torch.equal(g, mine) for g in gathered),
            "moved": moved, "grads_none": left}


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
