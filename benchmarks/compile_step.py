"""Step time under torch.compile: prints compiled fastddp / compiled torch DDP, graph counts.

    python benchmarks/compile_step.py [--nproc 2] [--rounds 20] [--warmup 5] [--only NAME]
                                      [--modes outer,inner] [--backend inductor] [--out FILE]

Spawns gloo ranks on 127.0.0.1 (one intra-op thread each). For each model of step_time.py
(common/step_timing.py's SHAPES, except the 64-layer one, whose compile alone takes minutes
here) and each mode, "outer" (torch.compile(DDP(model))) and "inner"
(DDP(torch.compile(model))), both wrappers are compiled the same way with ``--backend``;
after the warm-up (which compiles), ``--rounds`` interleaved rounds each time one block of
steps (zero_grad, forward, backward, SGD step) of each, in alternating order. Reported:
median per-step time (block means, rank 0's clock), the ratio of the medians and the spread
of the per-round ratios, and the number of graphs the backend compiled for each (dynamo's
DDPOptimizer splits the forward at the buckets: the counts must be equal). Ranks run with
step_time.py's fixed glibc malloc thresholds. This is a benchmark, not a test.
"""

import argparse
import copy
import gc
import os
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import fastddp
from common import machine, step_timing  # benchmarks/common/: scripts run from benchmarks/

MODES = ("outer", "inner")


class Wrapped(nn.Module):
    """The model in a class of its own: dynamo compiles the frames of user code it is
    handed, and skips those of torch's own modules (a bare nn.Sequential under DDP)."""

    def __init__(self, body: nn.Module):
        super().__init__()
        self.body = body

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def counting_backend(backend: str) -> tuple[dict, Callable]:
    """A dynamo backend that compiles with `backend` and counts the graphs it is handed
    (tests/python/ddp/compile_scenarios.py counts with it too)."""
    inner = torch._dynamo.lookup_backend(backend)
    box = {"graphs": 0}

    def compile_fn(gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        box["graphs"] += 1
        return inner(gm, example_inputs)

    return box, compile_fn


def _compiled(cls: type, body: nn.Module, mode: str, backend: str) -> tuple[nn.Module, dict]:
    box, compile_fn = counting_backend(backend)
    module = Wrapped(copy.deepcopy(body))
    if mode == "inner":
        return cls(torch.compile(module, backend=compile_fn)), box
    return torch.compile(cls(module), backend=compile_fn), box


def _compare(shape: step_timing.Shape, x: torch.Tensor, args: argparse.Namespace) -> list[dict]:
    rows = []
    for mode in args.modes.split(","):
        torch._dynamo.reset()
        torch.manual_seed(0)
        body = shape.build()
        fast, fast_box = _compiled(fastddp.DistributedDataParallel, body, mode, args.backend)
        ref, ref_box = _compiled(step_timing.TorchDDP, body, mode, args.backend)
        variants = {"fastddp": step_timing.make_step(fast, x),
                    "torch": step_timing.make_step(ref, x)}
        dist.barrier()
        ms = step_timing.timed_blocks(variants, args.rounds, shape.block_steps, args.warmup)
        rows.append({"model": shape.name, "mode": mode, "graphs": (fast_box["graphs"],
                                                                   ref_box["graphs"]),
                     **step_timing.summary(ms, "fastddp", "torch")})
    return rows


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, queue) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    gen = torch.Generator().manual_seed(100 + rank)  # each rank its own input
    rows = []
    for shape in step_timing.SHAPES:
        if args.only in shape.name and not shape.name.startswith("tiny"):
            rows += _compare(shape, torch.randn(shape.input_shape, generator=gen), args)
    if rank == 0:
        queue.put(rows)
    gc.collect()  # see step_time._worker
    dist.barrier()
    dist.destroy_process_group()


def _table(rows: list[dict]) -> str:
    lines = ["| model | mode | graphs fastddp / torch | fastddp ms/step | torch DDP ms/step "
             "| fastddp/torch (of medians) | per-round ratio median [IQR] |",
             "|---|---|---|---|---|---|---|"]
    mode_text = {"outer": "torch.compile(DDP(m))", "inner": "DDP(torch.compile(m))"}
    for r in rows:
        lines.append(f"| {r['model']} | {mode_text[r['mode']]} | {r['graphs'][0]} / "
                     f"{r['graphs'][1]} | {r['a_ms']:.3f} | {r['b_ms']:.3f} "
                     f"| **{r['ratio']:.3f}** | {r['paired']:.3f} [{r['q1']:.3f}, "
                     f"{r['q3']:.3f}] |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2, help="ranks")
    parser.add_argument("--rounds", type=int, default=20, help="interleaved rounds")
    parser.add_argument("--warmup", type=int, default=5, help="warm-up steps (compiles)")
    parser.add_argument("--only", default="", help="only models whose name contains this")
    parser.add_argument("--modes", default=",".join(MODES), help="outer, inner or both")
    parser.add_argument("--backend", default="inductor", help="torch.compile backend")
    parser.add_argument("--out", help="also write the markdown table to this file")
    args = parser.parse_args()
    if set(args.modes.split(",")) - set(MODES):
        parser.error(f"--modes: choose among {', '.join(MODES)}")
    # As step_time.py: history-free allocator thresholds, inherited by the ranks.
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(32 * 1024 * 1024))
    os.environ.setdefault("MALLOC_TRIM_THRESHOLD_", str(2**32))
    bench = machine.Run()
    queue = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_worker, args=(args.nproc, machine.free_port(), args, queue),
             nprocs=args.nproc, join=True)
    bench.publish(bench.header(")"), _table(queue.get()), args.out)


if __name__ == "__main__":
    main()
