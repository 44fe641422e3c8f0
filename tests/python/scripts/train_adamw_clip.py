"""An ordinary torch DDP script with AdamW, a learning-rate schedule and gradient clipping
(it knows nothing about fastddp). The launcher's --shard-optimizer tests run it unmodified;
rank 0 writes the optimizer's class, the clipped norms and the final parameters to --out."""

import argparse
import gc
import json

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--steps", type=int, default=6)
args = parser.parse_args()

dist.init_process_group("gloo")
torch.set_num_threads(1)
rank = dist.get_rank()
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 4))
ddp = DDP(model, bucket_cap_mb=25)
opt = torch.optim.AdamW(ddp.parameters(), lr=0.01, weight_decay=0.1)
schedule = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
gen = torch.Generator().manual_seed(100 + rank)
norms = []
for _ in range(args.steps):
    x = torch.randn(16, 8, generator=gen)
    opt.zero_grad()
    (ddp(x) - x[:, :4]).square().mean().backward()
    norms.append(torch.nn.utils.clip_grad_norm_(ddp.parameters(), 0.05).item())
    opt.step()
    schedule.step()

if rank == 0:
    with open(args.out, "w") as f:
        json.dump({"optimizer": f"{type(opt).__module__}.{type(opt).__qualname__}",
                   "norms": norms,
                   "params": [p.detach().flatten().tolist() for p in model.parameters()]}, f)
del ddp, opt, schedule
gc.collect()
dist.barrier()
dist.destroy_process_group()
