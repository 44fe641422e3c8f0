"""A torch DDP training script, unmodified for ``python -m fastddp --sync diloco:...``; with
``--direct H`` it builds fastddp.DiLoCo itself instead (the same run written against the API).
Rank 0 writes the final weights and the wrapper's class to ``--out`` as JSON."""

import argparse
import gc
import json

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--steps", type=int, default=6)
parser.add_argument("--direct", type=int, default=0, help="build fastddp.DiLoCo(H) directly")
parser.add_argument("--wire", default="fp32")
parser.add_argument("--fragments", type=int, default=1)
parser.add_argument("--overlap", type=int, default=0)
parser.add_argument("--merge-alpha", type=float, default=0.0)
parser.add_argument("--two-optimizers", action="store_true",
                    help="one optimizer per layer of the wrapped model (--sync refuses it)")
args = parser.parse_args()

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
if args.direct:
    import fastddp

    net = model
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    diloco = fastddp.DiLoCo(model, optimizer, sync_every=args.direct, wire=args.wire,
                            fragments=args.fragments, overlap=args.overlap,
                            merge_alpha=args.merge_alpha)
else:
    net = DDP(model)
    optimizer = torch.optim.AdamW(net.parameters(), lr=0.01)
optimizers = [optimizer]
if args.two_optimizers:
    optimizers = [torch.optim.AdamW(model[0].parameters(), lr=0.01),
                  torch.optim.AdamW(model[2].parameters(), lr=0.01)]
for step in range(args.steps):
    g = torch.Generator().manual_seed(1000 * step + rank)
    inputs, target = torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)
    for opt in optimizers:
        opt.zero_grad()
    F.mse_loss(net(inputs), target).backward()
    for opt in optimizers:
        opt.step()
flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
dist.all_gather(gathered, flat)
if rank == 0:
    with open(args.out, "w") as f:
        json.dump({"params": flat.tolist(), "class": f"{type(net).__module__}",
                   "ranks_agree": all(torch.equal(t, flat) for t in gathered)}, f)
# As docs/README.md says a script should end: no gloo group left alive at exit.
del net, model, optimizer, optimizers
gc.collect()
dist.barrier()
dist.destroy_process_group()
