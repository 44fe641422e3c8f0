"""Step time with fastddp's bf16 hook vs torch's bf16_compress_hook: prints ms/step and ratio.

Training-step time with gradient compression: fastddp's native bf16 hook vs torch DDP
running torch's bf16_compress_hook, side by side in one run.

    python benchmarks/hook_step_time.py [--nproc 2] [--rounds 12] [--block 3] [--width 1024] [--batch 64]
        [--stateful]

Spawns gloo ranks on 127.0.0.1 (one intra-op thread each). Every variant trains a copy
of the same MLP (``--depth`` Linear(width, width) layers, ``--batch`` rows): after a warm-up,
``--rounds`` rounds each time a block of ``--block`` steps (zero_grad, forward, backward,
SGD step) of every variant, in rotating order. Reported: the median per-step time (rank
0's clock) and its ratio to torch DDP with torch's bf16 hook. Where torch refuses its
bf16 hook (no NCCL in the build), the reference is torch's fp32 DDP. Not a test.
"""

import argparse
import os
import platform
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as dh

import fastddp

TorchDDP = nn.parallel.DistributedDataParallel


def build(width: int, depth: int) -> nn.Module:
    layers = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(width, 16))


def variants(base: nn.Module, stateful: bool = False) -> dict[str, nn.Module]:
    def fast(hook):
        model = fastddp.DistributedDataParallel(_copy(base))
        if hook is not None:
            model.register_comm_hook(None, hook)
        return model

    models = {"fastddp bf16": fast(fastddp.hooks.bf16()),
              "fastddp bf16 fp32-acc": fast(fastddp.hooks.bf16(accumulate="fp32")),
              "fastddp fp32": fast(None),
              "torch fp32": TorchDDP(_copy(base))}
    if stateful:  # the hooks with error feedback, whose state is double-buffered (issue 43)
        models.update({"fastddp bf16 ef": fast(fastddp.hooks.bf16(error_feedback=True)),
                       "fastddp fp16 ef": fast(fastddp.hooks.fp16(error_feedback=True)),
                       "fastddp int8": fast(fastddp.hooks.int8())})
    torch_bf16 = TorchDDP(_copy(base))
    try:
        torch_bf16.register_comm_hook(None, dh.bf16_compress_hook)
        models["torch bf16 hook"] = torch_bf16
    except TypeError:  # torch refuses its bf16 hook without NCCL
        pass
    return models


def _copy(module: nn.Module) -> nn.Module:
    import copy

    return copy.deepcopy(module)


def worker(rank: int, world: int, port: int, args: argparse.Namespace, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    models = variants(build(args.width, args.depth), args.stateful)
    opts = {k: torch.optim.SGD(m.parameters(), lr=1e-3) for k, m in models.items()}
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(args.batch, args.width, generator=g), torch.randn(args.batch, 16, generator=g)

    def step(name: str) -> None:
        opts[name].zero_grad(set_to_none=True)
        F.mse_loss(models[name](x), y).backward()
        opts[name].step()

    names = list(models)
    for name in names:
        for _ in range(3):
            step(name)
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(args.rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            dist.barrier()
            t = time.perf_counter()
            for _ in range(args.block):
                step(name)
            times[name].append((time.perf_counter() - t) / args.block * 1e3)
    if rank == 0:
        n_bytes = sum(p.numel() * p.element_size() for p in models[names[0]].parameters())
        queue.put((times, n_bytes))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--block", type=int, default=3)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--stateful", action="store_true",
                        help="also bf16 and fp16 with error feedback, and int8")
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    mp.spawn(worker, args=(args.nproc, port, args, queue), nprocs=args.nproc)
    times, n_bytes = queue.get()
    ref = "torch bf16 hook" if "torch bf16 hook" in times else "torch fp32"
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"{platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, gloo, "
          f"{args.nproc} ranks x 1 thread; MLP {args.depth}x{args.width} "
          f"({n_bytes / 2**20:.1f} MiB fp32 grads), batch {args.batch}; {args.rounds} rounds x "
          f"{args.block} steps\n")
    print(f"| variant | median ms/step | vs {ref} |")
    print("|---|---:|---:|")
    for k in times:
        print(f"| {k} | {med[k]:.2f} | {med[k] / med[ref]:.3f}x |")


if __name__ == "__main__":
    main()
