"""Elastic training with fastddp: checkpoint every K steps, resume after torchrun restarts.

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --standalone --nproc-per-node 2 \\
        --max-restarts 3 elastic_train.py --ckpt DIR --out PREFIX [--hook powersgd] [--kill-at N]

(The variable gives each restart a fresh store: with torch 2.14's shared agent store,
restarted gloo workers can meet the dead attempt's addresses; pytorch/pytorch#135712.)

The model and optimizer go through torch.distributed.checkpoint (DCP) with get_state_dict /
set_state_dict. DCP keeps one copy of a tensor that every rank holds, but a comm hook's
state differs per rank (PowerSGD's error feedback), so each rank torch.saves its own
``comm_hook_state_dict()``. A checkpoint counts once every rank has written it: rank 0 then
points LATEST at it. A restarted run resumes from LATEST and takes the very steps the
uninterrupted run takes (data is a function of the step).

Test scaffolding: with --kill-at N, rank 1 kills itself (SIGKILL) in step N of the first
attempt; each rank writes its final parameters and what it ran to PREFIX.rank<r>.pt.
"""

import argparse
import gc
import os
import signal

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import fastddp

parser = argparse.ArgumentParser()
parser.add_argument("--ckpt", required=True, help="checkpoint directory")
parser.add_argument("--out", required=True)
parser.add_argument("--hook", choices=["allreduce", "powersgd"], default="allreduce")
parser.add_argument("--steps", type=int, default=12)
parser.add_argument("--every", type=int, default=4, help="checkpoint every this many steps")
parser.add_argument("--kill-at", type=int, default=-1)
args = parser.parse_args()

dist.init_process_group("gloo")
torch.set_num_threads(1)
rank = dist.get_rank()
attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))

torch.manual_seed(0)
model = fastddp.DistributedDataParallel(nn.Sequential(
    nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4)))
if args.hook == "powersgd":
    model.register_comm_hook(None, fastddp.hooks.powersgd(matrix_approximation_rank=2,
                                                          start_powerSGD_iter=2))
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def save(model: fastddp.DistributedDataParallel, opt: torch.optim.Optimizer, step: int) -> None:
    path = os.path.join(args.ckpt, f"step{step}")
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    torch.save(model.comm_hook_state_dict(), os.path.join(path, f"hook_rank{rank}.pt"))
    dist.barrier()  # every rank's part is written
    if rank == 0:
        with open(os.path.join(args.ckpt, "LATEST.tmp"), "w") as f:
            f.write(str(step))
        os.replace(os.path.join(args.ckpt, "LATEST.tmp"), os.path.join(args.ckpt, "LATEST"))


def resume(model: fastddp.DistributedDataParallel, opt: torch.optim.Optimizer) -> int:
    """Loads the latest checkpoint, if any; returns the first step to run."""
    latest = os.path.join(args.ckpt, "LATEST")
    step = [int(open(latest).read()) if os.path.exists(latest) else -1]
    dist.broadcast_object_list(step, src=0)  # every rank resumes from rank 0's choice
    if step[0] < 0:
        return 0
    path = os.path.join(args.ckpt, f"step{step[0]}")
    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    model.load_comm_hook_state_dict(torch.load(os.path.join(path, f"hook_rank{rank}.pt")))
    return step[0] + 1


start = resume(model, opt)
losses = {}
for step in range(start, args.steps):
    gen = torch.Generator().manual_seed(1000 * step + rank)
    x, y = torch.randn(32, 16, generator=gen), torch.randn(32, 4, generator=gen)
    loss = (model(x) - y).square().mean()
    if step == args.kill_at and rank == 1 and attempt == 0:
        os.kill(os.getpid(), signal.SIGKILL)  # mid-step: rank 0's backward fails
    opt.zero_grad()
    loss.backward()
    opt.step()
    losses[step] = loss.item()
    if (step + 1) % args.every == 0:
        save(model, opt, step)

torch.save({"params": {n: p.detach().clone() for n, p in model.module.named_parameters()},
            "attempt": attempt, "start": start, "losses": losses,
            "hook_iter": model.comm_hook_state_dict().get("iter")}, f"{args.out}.rank{rank}.pt")
# Free the model before tearing gloo down (see train_tiny.py).
del model, opt
gc.collect()
dist.barrier()
dist.destroy_process_group()
