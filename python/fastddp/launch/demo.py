"""fastddp's main job: train a small MLP with fastddp, then with torch DDP, and compare.

Run with ``torchrun --nproc_per_node=2 -m fastddp.launch.demo [--steps N] [--batch B]
[--hidden H] [--rounds R]``.

The task is synthetic but learnable: inputs ``x ~ N(0, 1)`` and targets from a fixed
random "teacher" network, seeded identically on every rank; each rank draws its own
batches. Two students from the same initial weights train on the same batches, one under
``fastddp.DistributedDataParallel`` (rank 0 prints step, loss averaged across ranks, and
step time), one under ``torch.nn.parallel.DistributedDataParallel``, taking turns in
interleaved rounds (``--rounds``, the order swapped each round) so that both meet the same
machine. The summary compares median step times (the ratio of medians per round, its
median and spread), final losses and the largest difference between the two trained
models' parameters (which should be ~0).

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


class Run:
    """One student from ``init_state`` under one DDP wrapper, trained a slice of steps at a
    time so that two runs can take turns (``main``): whatever the machine does meanwhile
    (another process, a frequency change) then falls on both alike."""

    def __init__(self, wrap: Callable[[nn.Module], nn.Module], init_state: dict,
                 hidden: int, device: torch.device, label: str, verbose: bool) -> None:
        self.model = mlp(hidden).to(device)
        self.model.load_state_dict(init_state)
        self.ddp = wrap(self.model)
        self.opt = torch.optim.Adam(self.ddp.parameters(), lr=3e-3)
        self.device, self.label, self.verbose = device, label, verbose
        self.losses: list[float] = []
        self.times: list[float] = []

    def steps(self, batches: list[tuple[torch.Tensor, torch.Tensor]], first: int) -> list[float]:
        """Train on ``batches`` (steps ``first``, ``first + 1``, ...); their times in ms."""
        times = []
        for step, (x, y) in enumerate(batches, start=first):
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            start = time.perf_counter()
            self.opt.zero_grad()
            loss = nn.functional.mse_loss(self.ddp(x), y)
            loss.backward()
            self.opt.step()
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            times.append((time.perf_counter() - start) * 1e3)
            # Averaging the loss for the log is outside the timed step.
            mean_loss = loss.detach().clone()
            dist.all_reduce(mean_loss)
            self.losses.append(mean_loss.item() / dist.get_world_size())
            if self.verbose:
                print(f"[{self.label}] step {step:4d}  loss {self.losses[-1]:.5f}  "
                      f"{times[-1]:7.2f} ms", flush=True)
        self.times += times
        return times


def interleaved(runs: tuple[Run, Run], batches: list, rounds: int, warmup: int) -> list[float]:
    """Both runs train on the same ``batches``, taking turns in ``rounds`` slices (the order
    swapped every round). Returns, per round, the ratio of the first run's median step time
    to the second's; the first ``warmup`` steps (bucket building, first-touch caches) are
    trained but not timed."""
    for run in runs:
        run.steps(batches[:warmup], 0)
    rest = batches[warmup:]
    size = max(1, len(rest) // rounds)
    ratios = []
    for r, first in enumerate(range(0, len(rest) - size + 1, size)):
        chunk = rest[first:first + size]
        order = runs if r % 2 == 0 else runs[::-1]
        medians = {id(run): statistics.median(run.steps(chunk, warmup + first))
                   for run in order}
        ratios.append(medians[id(runs[0])] / medians[id(runs[1])])
    return ratios


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60, help="training steps per run")
    parser.add_argument("--batch", type=int, default=64, help="per-rank batch size")
    parser.add_argument("--hidden", type=int, default=256, help="MLP hidden width")
    parser.add_argument("--rounds", type=int, default=5,
                        help="interleaved rounds the timed steps are split into")
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

    fast = Run(lambda m: fastddp.DistributedDataParallel(m, device_ids=device_ids),
               init_state, args.hidden, device, "fastddp", rank == 0)
    stock = Run(lambda m: nn.parallel.DistributedDataParallel(m, device_ids=device_ids),
                init_state, args.hidden, device, "torch DDP", False)
    warmup = min(5, args.steps - 1)
    ratios = interleaved((fast, stock), batches, args.rounds, warmup)

    with torch.no_grad():
        diff = max((a - b).abs().max().item()
                   for a, b in zip(fast.model.parameters(), stock.model.parameters()))
    if rank == 0:
        print()
        print(f"{'':24s}{'fastddp':>12s}{'torch DDP':>12s}")
        print(f"{'median step time (ms)':24s}{statistics.median(fast.times[warmup:]):12.3f}"
              f"{statistics.median(stock.times[warmup:]):12.3f}")
        print(f"{'first loss':24s}{fast.losses[0]:12.5f}{stock.losses[0]:12.5f}")
        print(f"{'final loss':24s}{fast.losses[-1]:12.5f}{stock.losses[-1]:12.5f}")
        print(f"step time ratio fastddp / torch DDP: {statistics.median(ratios):.3f} "
              f"(median of {len(ratios)} interleaved rounds; "
              f"spread {min(ratios):.3f} to {max(ratios):.3f})")
        if device.type == "cpu":
            print("on CPU both sides run the same gloo allreduce: the ratio shows only the "
                  "reducers' overhead, and rounds that differ by their spread are noise "
                  "(benchmarks/ measures more)")
        print(f"max |param difference| fastddp vs torch DDP: {diff:.3e}")
    # torch DDP's wrapper sits in a reference cycle: collect it so that destroying the
    # group really joins gloo's threads before the interpreter shuts down.
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
