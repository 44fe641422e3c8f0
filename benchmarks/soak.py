"""Does a long fastddp run leak? Prints memory, thread and file-descriptor growth per hook.

    python benchmarks/soak.py [--steps 2000] [--warmup 200] [--nproc 2]
                              [--hooks allreduce,bf16_ef,powersgd,torch] [--out DIR]

For each hook, a fresh set of ``--nproc`` gloo ranks on 127.0.0.1 (one intra-op thread
each) trains a small MLP with fastddp.DistributedDataParallel and that hook for ``--steps``
steps. Every rank records, after a gc.collect(), at the end of step ``--warmup`` and at the
end (and every ``--every`` steps, for the trend):

- resident memory (RSS, /proc/self/statm), and the process's peak (VmHWM);
- threads (/proc/self/task) and open file descriptors (/proc/self/fd);
- the size of what the model reports per call: comm_stats() and _get_ddp_logging_data()
  (scalar values, and JSON bytes; a per-step history would add values with the steps), and
  compression_stats() for PowerSGD.

Hooks: allreduce (the default), bf16_ef (bf16 with error feedback and float32
accumulation: fastddp.hooks.bf16(accumulate="fp32", error_feedback=True)), powersgd
(fastddp.hooks.powersgd, rank 1, compressing from step 100), batched_powersgd, fp16, python
(a Python comm hook: GradBucket and futures through the GIL), and torch (stock torch DDP,
the reference for what gloo and torch alone do). Pass: RSS after warm-up grows by less than
1%, threads and fds unchanged, reports of constant size. Prints a markdown table and, with
--out, writes it (soak.md) with every sample (soak.json). A benchmark, not a test.
"""

import argparse
import gc
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

import fastddp
from common import machine  # benchmarks/common/: scripts run from benchmarks/

PAGE = os.sysconf("SC_PAGE_SIZE")
MIB = 1024 * 1024
HOOKS = ("allreduce", "bf16_ef", "powersgd", "batched_powersgd", "fp16", "python", "torch")


def _python_hook(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    buffer = bucket.buffer().div_(dist.get_world_size())
    return dist.all_reduce(buffer, async_op=True).get_future().then(lambda f: f.value()[0])


def _model(hook: str, bucket_cap_mb: float) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(128, 256), nn.ReLU()]
    for _ in range(3):
        layers += [nn.Linear(256, 256), nn.ReLU()]
    module = nn.Sequential(*layers, nn.Linear(256, 10))
    if hook == "torch":
        return nn.parallel.DistributedDataParallel(module, bucket_cap_mb=bucket_cap_mb)
    model = fastddp.DistributedDataParallel(module, bucket_cap_mb=bucket_cap_mb)
    builtins = {
        "bf16_ef": lambda: fastddp.hooks.bf16(accumulate="fp32", error_feedback=True),
        "fp16": lambda: fastddp.hooks.fp16(),
        "powersgd": lambda: fastddp.hooks.powersgd(start_powerSGD_iter=100),
        "batched_powersgd": lambda: fastddp.hooks.batched_powersgd(start_powerSGD_iter=100),
    }
    if hook in builtins:
        model.register_comm_hook(None, builtins[hook]())
    elif hook == "python":
        model.register_comm_hook(None, _python_hook)
    return model


def _size(report: object) -> tuple[int, int]:
    """(JSON bytes, scalar values at any depth) of a report. A per-step history shows as
    more values; the bytes also move with the digits of the timings."""
    def values(x: object) -> int:
        if isinstance(x, dict):
            return sum(values(v) for v in x.values())
        if isinstance(x, (list, tuple)):
            return sum(values(v) for v in x)
        return 1

    return len(json.dumps(report, default=str)), values(report)


def _sample(model: nn.Module, step: int, hook: str) -> dict:
    gc.collect()
    with open("/proc/self/statm") as f:
        rss = int(f.read().split()[1]) * PAGE
    with open("/proc/self/status") as f:
        hwm = next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith("VmHWM"))
    sample = {"step": step, "rss": rss, "hwm": hwm,
              "threads": len(os.listdir("/proc/self/task")),
              "fds": len(os.listdir("/proc/self/fd"))}
    sample["logging_bytes"], sample["logging_values"] = _size(model._get_ddp_logging_data())
    if hook != "torch":
        sample["stats_bytes"], sample["stats_values"] = _size(model.comm_stats())
    if "powersgd" in hook:
        _, sample["compression_values"] = _size(model.compression_stats())
    return sample


def _worker(rank: int, world: int, port: int, hook: str, args: argparse.Namespace,
            queue) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    model = _model(hook, args.bucket_cap_mb)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(rank)
    batches = [(torch.randn(32, 128, generator=gen), torch.randn(32, 10, generator=gen))
               for _ in range(16)]
    samples = [_sample(model, 0, hook)]
    start = None
    for step in range(1, args.steps + 1):
        inputs, target = batches[step % len(batches)]
        opt.zero_grad()
        F.mse_loss(model(inputs), target).backward()
        opt.step()
        if step == args.warmup:
            start = time.perf_counter()
        if step == args.warmup or step % args.every == 0 or step == args.steps:
            samples.append(_sample(model, step, hook))
    ms = (time.perf_counter() - start) * 1e3 / max(1, args.steps - args.warmup)
    queue.put({"rank": rank, "hook": hook, "ms_per_step": ms, "samples": samples,
               "buckets": len(model.bucket_plan()) if hook != "torch" else None})
    del model, opt
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


def _run(hook: str, args: argparse.Namespace) -> list[dict]:
    queue = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_worker, args=(args.nproc, machine.free_port(), hook, args, queue), nprocs=args.nproc,
             join=True)
    return sorted((queue.get() for _ in range(args.nproc)), key=lambda r: r["rank"])


def _verdict(warm: dict, end: dict) -> list[str]:
    problems = []
    if end["rss"] > warm["rss"] * 1.01:
        problems.append("RSS +1% or more")
    for key in ("threads", "fds", "logging_values", "stats_values"):
        if key in warm and end[key] > warm[key]:
            problems.append(f"{key} grew")
    return problems


def _table(runs: list[dict], warmup: int) -> str:
    lines = [
        f"| hook | rank | RSS at step {warmup} MiB | RSS at end MiB | growth | growth over "
        "the 2nd half | peak RSS MiB "
        "| threads | fds | comm_stats() values (bytes) | logging data values (bytes) "
        "| ms/step | verdict |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for run in runs:
        samples = run["samples"]
        warm = next(s for s in samples if s["step"] == warmup)
        end = samples[-1]
        growth = (end["rss"] - warm["rss"]) / warm["rss"]
        # The allocator settles in the first few hundred steps; a leak keeps growing.
        half = min(samples, key=lambda x: abs(x["step"] - samples[-1]["step"] / 2))
        late = (end["rss"] - half["rss"]) / half["rss"]
        stats = (f"{warm['stats_values']} ({warm['stats_bytes']}) -> {end['stats_values']} "
                 f"({end['stats_bytes']})" if "stats_bytes" in warm else "n/a (torch)")
        problems = _verdict(warm, end)
        lines.append(
            f"| {run['hook']} | {run['rank']} | {warm['rss'] / MIB:.2f} | {end['rss'] / MIB:.2f} "
            f"| {growth:+.3%} | {late:+.3%} (from step {half['step']}) "
            f"| {end['hwm'] / MIB:.1f} | {warm['threads']} -> {end['threads']} "
            f"| {warm['fds']} -> {end['fds']} | {stats} "
            f"| {warm['logging_values']} ({warm['logging_bytes']}) -> {end['logging_values']} "
            f"({end['logging_bytes']}) | {run['ms_per_step']:.2f} "
            f"| {'ok' if not problems else ', '.join(problems)} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000, help="training steps per hook")
    parser.add_argument("--warmup", type=int, default=200,
                        help="the step whose figures are the baseline")
    parser.add_argument("--every", type=int, default=250, help="also sample every N steps")
    parser.add_argument("--nproc", type=int, default=2, help="ranks")
    parser.add_argument("--bucket-cap-mb", type=float, default=0.25,
                        help="bucket size (the default model then has several buckets)")
    parser.add_argument("--hooks", default="allreduce,bf16_ef,powersgd,torch",
                        help=f"comma-separated, among {', '.join(HOOKS)}")
    parser.add_argument("--out", help="directory for soak.md and soak.json")
    args = parser.parse_args()
    hooks = args.hooks.split(",")
    unknown = set(hooks) - set(HOOKS)
    if unknown:
        parser.error(f"--hooks: unknown {', '.join(sorted(unknown))}")
    if not 0 < args.warmup < args.steps:
        parser.error("--warmup must be between 0 and --steps")

    bench = machine.Run()
    runs = [run for hook in hooks for run in _run(hook, args)]
    buckets = next((r["buckets"] for r in runs if r["buckets"]), "?")
    header = bench.header(f"). Model: MLP 128-256x4-10 (0.23M parameters), batch 32, SGD; "
                          f"bucket_cap_mb={args.bucket_cap_mb:g} ({buckets} buckets under "
                          "fastddp).")
    table = _table(runs, args.warmup)
    print(header)
    print(table)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "soak.md"), "w") as f:
            f.write(header + "\n" + table + "\n")
        with open(os.path.join(args.out, "soak.json"), "w") as f:
            json.dump({"command": sys.argv, "machine": machine.describe(), "runs": runs}, f, indent=1)


if __name__ == "__main__":
    main()
