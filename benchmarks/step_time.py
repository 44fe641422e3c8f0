"""Training-step time, fastddp vs torch DDP: prints ms/step and fastddp/torch per model.

    python benchmarks/step_time.py [--nproc 2] [--rounds 30] [--only NAME] [--large] [--pin]
                                   [--configs plain,gbv,static,unused] [--skip-alone]
                                   [--glibc-malloc-defaults] [--out FILE]

Spawns its own gloo ranks on 127.0.0.1 (one intra-op thread each) and measures:

(a) world size ``--nproc``: the step (zero_grad, forward, backward, optimizer.step) of
    fastddp.DistributedDataParallel vs torch.nn.parallel.DistributedDataParallel on the
    same model, interleaved: after a warm-up, ``--rounds`` rounds each time one block of
    steps of each, in alternating order. Each of ``--configs``: plain, gbv
    (gradient_as_bucket_view=True), static (static_graph=True), unused
    (find_unused_parameters=True), the same arguments on both sides; and nancheck:
    fastddp with check_for_nan_in_grad=True against fastddp without it.
(b) world size 1: fastddp-wrapped vs the bare module (the same module object, called
    through the wrapper or directly), and torch DDP (on an identical replica) vs the bare
    module, interleaved the same way (three variants, rotating order, twice the rounds);
    and, since a step is too noisy to resolve microseconds, what each wrapper's forward
    call adds over the bare call on a 4x4 Linear, as a share of each model's bare step.

Reported: median per-step time of each (block means, rank 0's clock), ratio of the
medians and the spread of the per-round ratios, bytes allreduced per step, and the
bandwidth in the nccl-tests sense: algbw = bytes / time, busbw = algbw * 2(n-1)/n. The
"step" bandwidth divides by the whole step (compute included), so it is a lower bound;
a raw gloo allreduce of the same bytes gives the ceiling. Ranks run with fixed glibc
malloc thresholds unless --glibc-malloc-defaults (why: see main()). This is a benchmark,
not a test.
"""

import argparse
import gc
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import fastddp
from common import machine  # benchmarks/common/: scripts run from benchmarks/
from common.step_timing import (LARGE_SHAPES, SHAPES, Shape, TorchDDP, grad_bytes, make_step,
                                replicas, summary, timed_blocks)


def _allreduce_ms(n_bytes: int, reps: int = 10) -> float:
    buf = torch.zeros(n_bytes // 4)
    for _ in range(3):
        dist.all_reduce(buf)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        dist.all_reduce(buf)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


CONFIGS = {
    "plain": {},
    "gbv": {"gradient_as_bucket_view": True},
    "static": {"static_graph": True},
    "unused": {"find_unused_parameters": True},
    # fastddp with its non-finite check against fastddp without it (not against torch).
    "nancheck": {"check_for_nan_in_grad": True},
}


def _compare_ranks(shape: Shape, x: torch.Tensor, args: argparse.Namespace) -> list[dict]:
    """(a): fastddp vs torch DDP across the ranks, for each DDP configuration."""
    rows = []
    for config in args.configs.split(","):
        kwargs = CONFIGS[config]
        fast_m, torch_m = replicas(shape, 2)
        variants = {"fastddp": make_step(fastddp.DistributedDataParallel(fast_m, **kwargs), x)}
        if config == "nancheck":
            variants["torch"] = make_step(fastddp.DistributedDataParallel(torch_m), x)
            b = "fastddp unchecked"
        else:
            variants["torch"] = make_step(TorchDDP(torch_m, **kwargs), x)
            b = "torch DDP"
        dist.barrier()
        ms = timed_blocks(variants, args.rounds, shape.block_steps, args.warmup)
        n_bytes = grad_bytes(fast_m)
        rows.append({"world": dist.get_world_size(), "model": shape.name, "config": config,
                     "bytes": n_bytes, "a": "fastddp", "b": b,
                     **summary(ms, "fastddp", "torch"), "raw_ms": _allreduce_ms(n_bytes)})
    return rows


def _wrapper_us(rounds: int, warmup: int) -> dict[str, float]:
    """Microseconds each wrapper adds to a forward call (grad on, no backward), measured
    on a 4x4 Linear so that the module's own time and its noise stay small: the median
    over rounds of (wrapper's call - bare call). Steps are too noisy here to resolve it."""
    bare = nn.Linear(4, 4)
    x = torch.randn(2, 4)
    calls = {"bare": bare, "fastddp": fastddp.DistributedDataParallel(bare),
             "torch": TorchDDP(nn.Linear(4, 4))}
    us = timed_blocks({k: (lambda m=m: m(x)) for k, m in calls.items()}, rounds, 200, warmup)
    return {k: statistics.median((a - b) * 1e3 for a, b in zip(us[k], us["bare"]))
            for k in ("fastddp", "torch")}


def _compare_alone(shape: Shape, x: torch.Tensor, args: argparse.Namespace) -> list[dict]:
    """(b): at world size 1, fastddp and torch DDP each vs the bare module."""
    bare_m, torch_m = replicas(shape, 2)
    # fastddp wraps the very module "bare" steps: at world size 1 it has no reducer
    # (bucket_plan() is empty) and installs nothing on the module, so the two differ
    # only by the wrapper, and replica effects cancel out.
    fast = fastddp.DistributedDataParallel(bare_m)
    assert fast.bucket_plan() == []
    variants = {
        "bare": make_step(bare_m, x),
        "fastddp": make_step(fast, x),
        "torch": make_step(TorchDDP(torch_m), x),
    }
    # Cheap enough for twice the rounds, which the ~1% question needs.
    ms = timed_blocks(variants, 2 * args.rounds, shape.block_steps, args.warmup)
    extra_us = _wrapper_us(2 * args.rounds, args.warmup)
    # At world size 1 torch DDP still copies into buckets and allreduces them over its
    # one-rank group; fastddp has no reducer there.
    return [{"world": 1, "model": shape.name, "config": "plain", "bytes": n_bytes, "a": label,
             "b": "bare module", **summary(ms, name, "bare"),
             "wrapper_us": extra_us[name]}
            for name, label, n_bytes in (("fastddp", "fastddp", 0),
                                         ("torch", "torch DDP", grad_bytes(torch_m)))]


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, queue) -> None:
    torch.set_num_threads(1)
    if args.pin and hasattr(os, "sched_setaffinity"):
        cpus = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cpus[rank % len(cpus)]})  # gloo's threads inherit it
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    gen = torch.Generator().manual_seed(100 + rank)  # each rank its own input
    rows = []
    for shape in LARGE_SHAPES if args.large else SHAPES:
        if args.only in shape.name:
            x = shape.input(gen)
            rows += _compare_ranks(shape, x, args) if world > 1 else _compare_alone(shape, x, args)
    if rank == 0:
        queue.put(rows)
    # Free every wrapper (torch DDP sits in reference cycles) so that the group is
    # really destroyed, joining gloo's threads, before the interpreter shuts down:
    # otherwise a gloo thread may still be releasing the last allreduce's Python
    # tensor during finalization, which aborts the rank ("terminate called without
    # an active exception").
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


def _run(world: int, args: argparse.Namespace) -> list[dict]:
    queue = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_worker, args=(world, machine.free_port(), args, queue), nprocs=world, join=True)
    return queue.get()


def _gbps(n_bytes: int, ms: float) -> float:
    return n_bytes / (ms * 1e-3) / 1e9


def _table(rows: list[dict]) -> str:
    lines = [
        "| world | model | config | A | B | A ms/step | B ms/step "
        "| A/B (of medians) | per-round A/B median [IQR] | bytes allreduced/step "
        "| step algbw / busbw GB/s | raw gloo allreduce: ms, algbw / busbw GB/s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        bw, raw, config = "-", "-", "-"
        n_bytes = f"{r['bytes'] / 1e6:.2f} MB" if r["bytes"] else "0"
        if r["world"] > 1:
            n, alg, ralg = r["world"], _gbps(r["bytes"], r["a_ms"]), _gbps(r["bytes"], r["raw_ms"])
            bw = f"{alg:.2f} / {alg * 2 * (n - 1) / n:.2f}"
            raw = f"{r['raw_ms']:.2f} ms, {ralg:.2f} / {ralg * 2 * (n - 1) / n:.2f}"
            config = r["config"]
        lines.append(
            f"| {r['world']} | {r['model']} | {config} | {r['a']} | {r['b']} "
            f"| {r['a_ms']:.3f} | {r['b_ms']:.3f} | **{r['ratio']:.3f}** "
            f"| {r['paired']:.3f} [{r['q1']:.3f}, {r['q3']:.3f}] | {n_bytes} | {bw} | {raw} |"
        )
    alone = [r for r in rows if "wrapper_us" in r]
    if alone:
        lines += [
            "",
            "World size 1, what the wrapper's forward call adds (on a 4x4 Linear, interleaved),",
            "as a share of each model's bare step:",
            "",
            "| model | wrapper | adds us/call | share of the bare step |",
            "|---|---|---|---|",
        ]
        lines += [f"| {r['model']} | {r['a']} | {r['wrapper_us']:+.1f} "
                  f"| {r['wrapper_us'] / (r['b_ms'] * 1e3):+.3%} |" for r in alone]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2, help="ranks for the multi-rank part")
    parser.add_argument("--rounds", type=int, default=30, help="interleaved rounds")
    parser.add_argument("--warmup", type=int, default=5, help="warm-up steps per variant")
    parser.add_argument("--pin", action="store_true",
                        help="pin rank r (and its gloo threads) to CPU r")
    parser.add_argument("--glibc-malloc-defaults", action="store_true",
                        help="keep glibc's adaptive mmap/trim thresholds (see main())")
    parser.add_argument("--only", default="", help="only models whose name contains this")
    parser.add_argument("--large", action="store_true",
                        help="the 23M-parameter MLP in float32 and bfloat16 instead")
    parser.add_argument("--configs", default="plain,gbv",
                        help=f"comma-separated DDP configurations among {', '.join(CONFIGS)}")
    parser.add_argument("--skip-alone", action="store_true", help="skip the world-size-1 part")
    parser.add_argument("--out", help="also write the markdown table to this file")
    args = parser.parse_args()
    unknown = set(args.configs.split(",")) - set(CONFIGS)
    if unknown:
        parser.error(f"--configs: unknown {', '.join(sorted(unknown))}; choose among "
                     f"{', '.join(CONFIGS)}")

    malloc = "glibc defaults"
    if not args.glibc_malloc_defaults:
        # Both models of a comparison share one process's allocator. With glibc's
        # adaptive thresholds, whether a model's fresh per-step gradients (zero_grad sets
        # them to None) land in reused heap or in newly mmap'd pages (page faults, kernel
        # zeroing) depends on the other model's history: that skewed the 10M MLP by up
        # to 20% in one variant's favour, while one-model-per-process runs were at par.
        # Fixed thresholds make the allocator history-free; the ranks inherit them.
        os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(32 * 1024 * 1024))
        os.environ.setdefault("MALLOC_TRIM_THRESHOLD_", str(2**32))
        malloc = (f"MALLOC_MMAP_THRESHOLD_={os.environ['MALLOC_MMAP_THRESHOLD_']} "
                  f"MALLOC_TRIM_THRESHOLD_={os.environ['MALLOC_TRIM_THRESHOLD_']}")
    bench = machine.Run()
    rows = ((_run(args.nproc, args) if args.nproc > 1 else [])
            + ([] if args.skip_alone else _run(1, args)))
    bench.publish(bench.header(f"; malloc: {malloc})"), _table(rows), args.out)


if __name__ == "__main__":
    main()
