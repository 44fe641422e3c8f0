"""fastddp's main job: train a small MLP with fastddp, then with torch DDP, and compare.

Run with ``torchrun --nproc_per_node=2 -m fastddp.demo [--steps N] [--batch B] [--hidden H]``.

The task is synthetic but learnable: inputs ``x ~ N(0, 1)`` and targets from a fixed
random "teacher" network, seeded identically on every rank; each rank draws its own
batches. The student MLP is trained first with ``fastddp.DistributedDataParallel``
(rank 0 prints step, loss averaged across ranks, and step time), then again with
``torch.nn.parallel.DistributedDataParallel`` from the same initial weights on the same
batches. The summary compares median step times, final losses and the largest
difference between the two trained models' parameters (which should be ~0).

Uses NCCL and ``cuda:LOCAL_RANK`` where CUDA is available, else gloo on CPU with one
intra-op thread per rank.
"""

import argparse
import gc
import os
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

import fastddp

IN_FEATURES = 32
OUT_FEATURES = 8


def mlp(hidden: int, depth: int = 3) -> nn.Sequential:
    """An MLP ``IN_FEATURES -> hidden (x depth, ReLU) -> OUT_FEATURES``."""
    layers: list[nn.Module] = []
    width = IN_FEATURES
    for _ in range(depth):
        layers += [nn.Linear(width, hidden), nn.ReLU()]
        width = hidden
    layers.append(nn.Linear(width, OUT_FEATURES))
    return nn.Sequential(*layers)


def make_batches(
    steps: int, batch: int, rank: int, device: torch.device
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's batches: its own inputs, labelled by the teacher shared by all ranks."""
    torch.manual_seed(1234)  # identical teacher on every rank
    teacher = nn.Sequential(
        nn.Linear(IN_FEATURES, 64), nn.Tanh(), nn.Linear(64, OUT_FEATURES)
    ).to(device)
    gen = torch.Generator().manual_seed(10_000 + rank)  # different data per rank
    batches = []
    with torch.no_grad():
        for _ in range(steps):
            x = torch.randn(batch, IN_FEATURES, generator=gen).to(device)
            batches.append((x, teacher(x)))
    return batches


def train(
    wrap: Callable[[nn.Module], nn.Module],
    init_state: dict[str, torch.Tensor],
    hidden: int,
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    device: torch.device,
    label: str,
    verbose: bool,
) -> tuple[nn.Module, list[float], list[float]]:
    """Train a fresh student from ``init_state``; returns it, the losses averaged
    across ranks, and the step times in ms."""
    model = mlp(hidden).to(device)
    model.load_state_dict(init_state)
    ddp = wrap(model)
    opt = torch.optim.Adam(ddp.parameters(), lr=3e-3)
    loss_fn = nn.MSELoss()
    losses, times = [], []
    for step, (x, y) in enumerate(batches):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        opt.zero_grad()
        loss = loss_fn(ddp(x), y)
        loss.backward()
        opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append((time.perf_counter() - start) * 1e3)
        # Averaging the loss for the log is outside the timed step.
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)
        losses.append(mean_loss.item() / dist.get_world_size())
        if verbose:
            print(f"[{label}] step {step:4d}  loss {losses[-1]:.5f}  {times[-1]:7.2f} ms",
                  flush=True)
    return model, losses, times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60, help="training steps per run")
    parser.add_argument("--batch", type=int, default=64, help="per-rank batch size")
    parser.add_argument("--hidden", type=int, default=256, help="MLP hidden width")
    args = parser.parse_args()

    use_cuda = torch.cuda.is_available()
    if use_cuda:
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        torch.set_num_threads(1)
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device_ids = [device.index] if use_cuda else None

    torch.manual_seed(0)  # identical student init on every rank
    init_state = {k: v.clone() for k, v in mlp(args.hidden).to(device).state_dict().items()}
    batches = make_batches(args.steps, args.batch, rank, device)
    if rank == 0:
        n_params = sum(v.numel() for v in init_state.values())
        print(f"fastddp demo: world {world}, {dist.get_backend()} on {device.type}, "
              f"MLP {n_params:,} params, batch {args.batch}/rank, {args.steps} steps", flush=True)

    fast_model, fast_loss, fast_ms = train(
        lambda m: fastddp.DistributedDataParallel(m, device_ids=device_ids),
        init_state, args.hidden, batches, device, "fastddp", rank == 0)
    torch_model, torch_loss, torch_ms = train(
        lambda m: nn.parallel.DistributedDataParallel(m, device_ids=device_ids),
        init_state, args.hidden, batches, device, "torch DDP", False)

    with torch.no_grad():
        diff = max((a - b).abs().max().item()
                   for a, b in zip(fast_model.parameters(), torch_model.parameters()))
    if rank == 0:
        # The first steps build buckets and warm caches; leave them out of the medians.
        skip = min(5, args.steps - 1)
        fast_med = statistics.median(fast_ms[skip:])
        torch_med = statistics.median(torch_ms[skip:])
        print()
        print(f"{'':24s}{'fastddp':>12s}{'torch DDP':>12s}")
        print(f"{'median step time (ms)':24s}{fast_med:12.3f}{torch_med:12.3f}")
        print(f"{'first loss':24s}{fast_loss[0]:12.5f}{torch_loss[0]:12.5f}")
        print(f"{'final loss':24s}{fast_loss[-1]:12.5f}{torch_loss[-1]:12.5f}")
        print(f"step time ratio fastddp / torch DDP: {fast_med / torch_med:.3f} "
              "(two runs one after the other; benchmarks/step_time.py interleaves them)")
        print(f"max |param difference| fastddp vs torch DDP: {diff:.3e}")
    # torch DDP's wrapper sits in a reference cycle: collect it so that destroying the
    # group really joins gloo's threads before the interpreter shuts down.
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
