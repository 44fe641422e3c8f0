"""A tiny, ordinary torch DDP training script (it knows nothing about fastddp).

The launcher tests run it unmodified under ``python -m fastddp``; rank 0 writes what it
saw (the wrapper's classes, bucket cap, final parameters, losses, hook calls) to --out.
"""

import argparse
import gc
import json

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--steps", type=int, default=4)
parser.add_argument("--import-path", choices=["package", "module"], default="package")
parser.add_argument("--sum-hook", action="store_true",
                    help="register a comm hook that sums gradients instead of averaging")
args = parser.parse_args()

dist.init_process_group("gloo")
torch.set_num_threads(1)
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
if args.import_path == "module":
    ddp = torch.nn.parallel.distributed.DistributedDataParallel(model, bucket_cap_mb=25)
else:
    ddp = DDP(model, bucket_cap_mb=25)

hook_calls = [0]


def sum_hook(state, bucket):
    hook_calls[0] += 1
    fut = dist.all_reduce(bucket.buffer(), async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


if args.sum_hook:
    ddp.register_comm_hook(None, sum_hook)

opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
gen = torch.Generator().manual_seed(100 + rank)
losses = []
grad_max = 0.0  # the largest |gradient| any step applied (a scale for the tests' bounds)
for _ in range(args.steps):
    x = torch.randn(16, 8, generator=gen)
    loss = (ddp(x) - x[:, :4]).square().mean()
    opt.zero_grad()
    loss.backward()
    grad_max = max([grad_max] + [p.grad.abs().max().item() for p in model.parameters()])
    opt.step()
    losses.append(loss.item())

if rank == 0:
    with open(args.out, "w") as f:
        json.dump({
            "classes": [f"{c.__module__}.{c.__qualname__}" for c in type(ddp).__mro__],
            "is_torch_ddp": isinstance(ddp, torch.nn.parallel.DistributedDataParallel),
            "world": world,
            "bucket_bytes_cap": ddp.bucket_bytes_cap,
            "params": [p.detach().flatten().tolist() for p in model.parameters()],
            "losses": losses,
            "grad_max": grad_max,
            "lr": opt.param_groups[0]["lr"],
            "hook_calls": hook_calls[0],
        }, f)
# Free the wrapper before tearing gloo down: torch DDP sits in reference cycles, and a gloo
# thread still releasing a Python hook's last future while the interpreter finalizes
# aborts the process ("terminate called without an active exception", see RESULTS.md).
del ddp, opt
gc.collect()
dist.barrier()
dist.destroy_process_group()
