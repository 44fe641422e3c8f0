"""The optimizer overlapped with backward vs torch DDP + step: prints step ratio, peak memory.

The optimizer overlapped with backward (``model.overlap_optimizer(opt)``) against torch DDP
followed by ``opt.step()``: step time and peak memory.

    python benchmarks/overlap_optimizer.py [--nproc 2] [--rounds 15] [--warmup 3]
                                           [--only NAME] [--optims adamw_fused,sgd,...]
                                           [--memory-steps 6] [--out FILE]

Spawns gloo ranks on 127.0.0.1 (one intra-op thread each, step_time.py's allocator
thresholds). For each model of step_time.py (common/step_timing.py's SHAPES, all but the
tiny one) and each optimizer, three training steps of the same model run in interleaved
blocks (rotating order): ``torch`` (torch DDP, backward, step), ``fastddp`` (fastddp,
backward, step) and ``overlap`` (fastddp with the optimizer overlapped: backward only; the
fused SGD / AdamW step natively from C++, the others through their own step() per bucket).
Reported: median per-step ms (block means, rank 0's clock) and the ratios of the medians to
torch's.

Peak memory: each variant alone in fresh ranks (``--memory-steps`` steps), the growth of
rank 0's peak resident set (``ru_maxrss``) over its resident set before the first step:
gradients, buckets, optimizer state and the step's temporaries. This is a benchmark, not
a test.
"""

import argparse
import copy
import gc
import os
import resource

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import fastddp
from common import machine, step_timing  # benchmarks/common/: scripts run from benchmarks/

OPTIMIZERS = {
    # foreach=True: torch's default on GPUs (on the CPU it picks the per-tensor loop)
    "adamw_foreach": (torch.optim.AdamW, {"lr": 1e-6, "foreach": True}),
    "adamw": (torch.optim.AdamW, {"lr": 1e-6}),
    "adamw_fused": (torch.optim.AdamW, {"lr": 1e-6, "fused": True}),
    "sgd": (torch.optim.SGD, {"lr": 1e-6, "momentum": 0.9}),
    "sgd_fused": (torch.optim.SGD, {"lr": 1e-6, "momentum": 0.9, "fused": True}),
}
VARIANTS = ("torch", "fastddp", "overlap")


def _variant(name: str, body: torch.nn.Module, optim: str, x: torch.Tensor):
    cls, kwargs = OPTIMIZERS[optim]
    wrapper = step_timing.TorchDDP if name == "torch" else fastddp.DistributedDataParallel
    model = wrapper(copy.deepcopy(body))
    opt = cls(model.parameters(), **kwargs)
    if name == "overlap":
        model.overlap_optimizer(opt)

    def step() -> None:
        model(x).float().square().mean().backward()
        if name != "overlap":
            opt.step()
        opt.zero_grad()

    return step


def _rss_kib() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024


def _times(rank: int, args: argparse.Namespace, x_gen: torch.Generator) -> list[dict]:
    rows = []
    for shape in step_timing.SHAPES:
        if args.only not in shape.name or shape.name.startswith("tiny"):
            continue
        x = torch.randn(shape.input_shape, generator=x_gen)
        for optim in args.optims.split(","):
            torch.manual_seed(0)
            body = shape.build()
            variants = {v: _variant(v, body, optim, x) for v in VARIANTS}
            dist.barrier()
            ms = step_timing.timed_blocks(variants, args.rounds, shape.block_steps, args.warmup)
            rows.append({"model": shape.name, "optim": optim,
                         "fastddp": step_timing.summary(ms, "fastddp", "torch"),
                         "overlap": step_timing.summary(ms, "overlap", "torch")})
    return rows


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, queue,
            memory_of: tuple | None) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    gen = torch.Generator().manual_seed(100 + rank)  # each rank its own input
    if memory_of is None:
        result = _times(rank, args, gen)
    else:  # one variant alone: (shape index, optimizer, variant)
        shape_index, optim, name = memory_of
        shape = step_timing.SHAPES[shape_index]
        torch.manual_seed(0)
        step = _variant(name, shape.build(), optim, torch.randn(shape.input_shape, generator=gen))
        gc.collect()
        before = _rss_kib()
        for _ in range(args.memory_steps):
            step()
        result = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    if rank == 0:
        queue.put(result)
    gc.collect()  # see step_time._worker
    dist.barrier()
    dist.destroy_process_group()


def _spawn(args: argparse.Namespace, memory_of: tuple | None = None):
    queue = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_worker, args=(args.nproc, machine.free_port(), args, queue, memory_of),
             nprocs=args.nproc, join=True)
    return queue.get()


def _table(rows: list[dict], peaks: dict) -> str:
    lines = ["| model | optimizer | torch DDP + step, ms | fastddp + step / torch "
             "| overlapped / torch (per-round median [IQR]) | peak growth MiB: torch / "
             "fastddp / overlapped |", "|---|---|---|---|---|---|"]
    for r in rows:
        f, o = r["fastddp"], r["overlap"]
        peak = " / ".join(f"{peaks[(r['model'], r['optim'], v)] / 1024:.1f}" for v in VARIANTS)
        lines.append(f"| {r['model']} | {r['optim']} | {f['b_ms']:.2f} | {f['ratio']:.3f} | "
                     f"**{o['ratio']:.3f}** ({o['paired']:.3f} [{o['q1']:.3f}, {o['q3']:.3f}]) "
                     f"| {peak} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2, help="ranks")
    parser.add_argument("--rounds", type=int, default=15, help="interleaved rounds")
    parser.add_argument("--warmup", type=int, default=3, help="warm-up steps per variant")
    parser.add_argument("--only", default="", help="only models whose name contains this")
    parser.add_argument("--optims", default="adamw_foreach,adamw,adamw_fused,sgd,sgd_fused",
                        help=f"among {', '.join(OPTIMIZERS)}")
    parser.add_argument("--memory-steps", type=int, default=6, help="steps per memory run")
    parser.add_argument("--out", help="also write the markdown table to this file")
    args = parser.parse_args()
    if set(args.optims.split(",")) - set(OPTIMIZERS):
        parser.error(f"--optims: choose among {', '.join(OPTIMIZERS)}")
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(32 * 1024 * 1024))
    os.environ.setdefault("MALLOC_TRIM_THRESHOLD_", str(2**32))
    bench = machine.Run()
    rows = _spawn(args)
    peaks = {}
    for i, shape in enumerate(step_timing.SHAPES):
        for r in rows:
            if r["model"] == shape.name:
                for v in VARIANTS:
                    peaks[(r["model"], r["optim"], v)] = _spawn(args, (i, r["optim"], v))
    bench.publish(bench.header(")"), _table(rows, peaks), args.out)


if __name__ == "__main__":
    main()
