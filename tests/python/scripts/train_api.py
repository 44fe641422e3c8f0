"""A tiny, ordinary torch DDP training script (it knows nothing about fastddp), for
test_api_launcher.py: plain SGD, so that one step moves each parameter by exactly
lr * its averaged gradient.

Rank 0 writes to --out: the wrapper's classes, the parameters after every step, the
script's own hook calls, and `grad_max`: the largest |local gradient| of the first step
over all ranks, computed by plain autograd on an unwrapped copy (the scale of the
8-bit wires' error bound). --nan-at N puts a NaN into rank 1's gradient of '2.weight' in
backward N (1-based); --sum-hook registers a hook that sums instead of averaging.
"""

import argparse
import copy
import gc
import json

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

LR = 0.1

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--steps", type=int, default=2)
parser.add_argument("--nan-at", type=int, default=0)
parser.add_argument("--sum-hook", action="store_true")
args = parser.parse_args()

dist.init_process_group("gloo")
torch.set_num_threads(1)
rank = dist.get_rank()
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 8))
gen = torch.Generator().manual_seed(100 + rank)
batches = [torch.randn(16, 8, generator=gen) for _ in range(args.steps)]


def loss_of(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return (module(x) - x.flip(1)).square().mean()


bare = copy.deepcopy(model)
loss_of(bare, batches[0]).backward()
grad_max = torch.stack([p.grad.abs().max() for p in bare.parameters()]).max()
dist.all_reduce(grad_max, op=dist.ReduceOp.MAX)

ddp = DDP(model)
hook_calls = [0]


def sum_hook(state, bucket):
    hook_calls[0] += 1
    return dist.all_reduce(bucket.buffer(), async_op=True).get_future().then(
        lambda f: f.value()[0])


if args.sum_hook:
    ddp.register_comm_hook(None, sum_hook)


def poison(grad: torch.Tensor) -> torch.Tensor:
    grad = grad.clone()
    grad.view(-1)[1] = float("nan")
    return grad


opt = torch.optim.SGD(ddp.parameters(), lr=LR)
params = []
for step, x in enumerate(batches, start=1):
    handle = model[2].weight.register_hook(poison) if (
        step == args.nan_at and rank == 1) else None
    opt.zero_grad()
    loss_of(ddp, x).backward()
    if handle is not None:
        handle.remove()
    opt.step()
    params.append([p.detach().flatten().tolist() for p in model.parameters()])

if rank == 0:
    with open(args.out, "w") as f:
        json.dump({"classes": [f"{c.__module__}.{c.__qualname__}" for c in type(ddp).__mro__],
                   "params": params, "grad_max": grad_max.item(), "lr": LR,
                   "hook_calls": hook_calls[0]}, f)
# As train_tiny.py: free torch DDP's reference cycles before gloo is torn down.
del ddp, opt
gc.collect()
dist.barrier()
dist.destroy_process_group()
