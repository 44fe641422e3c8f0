"""A small, gradient-heavy DDP training script (it knows nothing about fastddp): two 512x512
layers, so about 2 MB of gradients per step against little compute. The --advise tests run
it under ``python -m fastddp``; rank 0 writes its losses and final parameters to --out.
``--backward-sleep-ms``: the model is tests/python/sleep_model.py's instead, the same layers
behind a backward that sleeps that long (compute that no CPU load stretches)."""

import argparse
import gc
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--steps", type=int, default=12)
parser.add_argument("--backward-sleep-ms", type=float, default=None)
args = parser.parse_args()

dist.init_process_group("gloo")
torch.set_num_threads(1)
rank = dist.get_rank()
torch.manual_seed(0)
if args.backward_sleep_ms is None:
    model = nn.Sequential(nn.Linear(512, 512), nn.Tanh(), nn.Linear(512, 512))
else:
    sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository's root
    from tests.python.sleep_model import BUCKET_CAP_MB, SleepNet

    assert BUCKET_CAP_MB == 1  # the cap below, which puts its gate in a bucket of its own
    model = SleepNet(args.backward_sleep_ms)
ddp = DDP(model, bucket_cap_mb=1)
opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
gen = torch.Generator().manual_seed(100 + rank)
losses = []
for _ in range(args.steps):
    x = torch.randn(8, 512, generator=gen)
    loss = (ddp(x) - x).square().mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    losses.append(loss.item())

if rank == 0:
    with open(args.out, "w") as f:
        json.dump({"losses": losses,
                   "params": [p.detach().flatten().tolist() for p in model.parameters()]}, f)
# Free the wrapper before tearing gloo down (see train_tiny.py).
del ddp, opt
gc.collect()
dist.barrier()
dist.destroy_process_group()
