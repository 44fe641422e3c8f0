"""Compression quality on real data: prints each hook's final score against fp32's, bytes, time.

Compression quality on real data: which hook trains as well as plain allreduce, what it
sends, and how soon it gets there on a slow link. Side by side in one run.

    python benchmarks/quality.py [--nproc 4] [--tasks digits,text] [--steps 300]
        [--eval-every 25] [--links 1GB/s,10GB/s] [--configs NAME,...|hooks|sync] [--quick]
        [--charts DIR] [--name quality] [--write-table PATH]

Tasks (benchmarks/common/quality_tasks.py): scikit-learn's handwritten digits (a small CNN,
held-out accuracy) and the source of Python's standard library (a character-level
transformer, held-out bits per character). Every configuration trains the same model from
the same seed on the same per-rank batches for --steps steps on --nproc gloo ranks, one
intra-op thread each, and is scored on the held-out split every --eval-every steps. The
learning rate decays along a cosine to a tenth of its peak (quality_tasks.train); the
low-rank hooks compress from 10% of the steps on (START).

Configurations (--configs): "hooks" (the default) are the per-step ones, a DDP comm hook
each; "sync" is issue 47's comparison of those that synchronize every few steps (torch's
post-local SGD, fastddp.DiLoCo and streaming DiLoCo, torchft's DiLoCo:
common/periodic_sync.py) against fp32 allreduce and PowerSGD r4.

Reported per task and configuration: the final score and its difference from fp32
allreduce's and from torch's bf16 hook's (the 16-bit baseline "Beyond Throughput and
Compression Ratios" recommends), the bytes one rank sends per step (fastddp's comm_stats()
and DiLoCo.stats(); counted from the tensor sizes for post-local SGD and torchft; "-" for
torch DDP's hooks), the first evaluated step at which the score is within TOLERANCE of fp32's
final one, the step time on each emulated --link (fastddp.link.EmulatedLinkGroup; the median
of 8 steps after the warm-up, or for the periodic configurations the mean over whole sync
periods) and their product: the time to fp32's quality on that link.
--quick: 3 configurations (or --configs), the text task, 60 steps (the test suite's run).
--write-table merges the run into the table there (common/quality_table_merge.py).
"""

import argparse
import math
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

import fastddp
from fastddp.hooks import catalog
from fastddp.link import EmulatedLinkGroup
from fastddp.tuning import candidates

from common import periodic_sync, quality_chart, quality_table_merge  # benchmarks/common/: scripts run from benchmarks/
from common.quality_tasks import task as make_task, train

# The low-rank hooks' plain allreduce steps (PowerSGD's start_powerSGD_iter): 10% of the
# run, where torch's PowerSGDState docs say to start tuning it. Set from --steps in worker().
START = 30
# Within this of fp32 allreduce's final score counts as its quality: one digit in a hundred
# held-out images (accuracy), 2% of the bits per character (text).
TOLERANCE = {"accuracy": 0.01, "bits/char": 0.02}
H = fastddp.hooks
RANKS = (1, 2, 4, 8, 16)  # the low-rank hooks' ranks measured


def _hook(config: catalog.Config, rank: int | None):
    """(state, hook) of a catalog configuration (at ``rank``, a low-rank one), as --hook
    would register it but starting compression at START."""
    options = dict(config.options)
    if rank is not None:
        options.update(matrix_approximation_rank=rank, **{config.start: START})
    return None, getattr(H, config.hook)(**options)


def _configs() -> dict:
    """name -> make(task, group, start) -> periodic_sync.Setup: every tuner candidate with a
    quality row (fastddp/tuning/candidates.py; plain allreduce is the baseline, no hook
    registered), torch's hooks beside fastddp's, batched PowerSGD, and hierarchical
    reduction on 2 "nodes" of 2 ranks with each lossy inter-node hook."""
    rows = {}
    for candidate in [c for c in candidates.CANDIDATES if c.quality]:
        for rank in RANKS if "{rank}" in candidate.quality else (None,):
            rows[candidate.quality.format(rank=rank)] = ("fastddp", (
                (lambda: None) if candidate.flag == "allreduce"
                else lambda c=candidate.config, r=rank: _hook(c, r)))
    rows["torch bf16_compress_hook"] = ("torch", lambda: (None, default_hooks.bf16_compress_hook))
    rows["torch powerSGD_hook r2"] = ("torch", lambda: (psgd.PowerSGDState(
        None, matrix_approximation_rank=2, start_powerSGD_iter=START), psgd.powerSGD_hook))
    rows["batched powersgd r2"] = ("fastddp", lambda: (None, H.batched_powersgd(
        2, start_powerSGD_iter=START)))
    for inner in candidates.hier_inners():
        if (row := candidates.quality_of(candidates.HIER_PREFIX + inner)) is not None:
            inner_config = candidates.by_name(inner)[0].config
            rows[row] = ("fastddp", lambda c=inner_config: (None, H.hierarchical(
                _hook(c, None)[1], local_size=2)))
    return {name: periodic_sync.per_step(side, make) for name, (side, make) in rows.items()}


HOOKS = _configs()  # the per-step configurations: the default --configs
CONFIGS = {**HOOKS, **periodic_sync.CONFIGS}
# --configs presets: "hooks" (every per-step one), "sync": issue 47's comparison of the
# configurations that synchronize every few steps against fp32 and the best per-step hook's.
PRESETS = {"hooks": list(HOOKS),
           "sync": ["fp32 allreduce", "powersgd r4", *periodic_sync.CONFIGS]}
QUICK = ["fp32 allreduce", "fastddp bf16", "acpsgd r2"]
TIMED_STEPS = 8  # per-step configurations: the median of this many steps
TIMED_MIN = 96   # periodic ones: the mean over whole sync periods of at least this many steps


def step_ms(t, config: str, link: str, quick: bool = False) -> float | None:
    """A per-step configuration: the median of TIMED_STEPS steps past the low-rank hooks'
    start. A periodic one: the mean over whole sync periods (at least TIMED_MIN steps; one
    with --quick) after its warm-up (one period, or post-local SGD's gradient allreduce
    steps). None where the configuration's group cannot be emulated."""
    run = CONFIGS[config](t, EmulatedLinkGroup(dist.group.WORLD, link), START)
    if not run.emulated:
        run.close()
        return None
    periodic = run.period > 1
    warmup = run.warmup if periodic else START + 2  # past the low-rank hooks' start
    timed = (run.period * (1 if quick else math.ceil(TIMED_MIN / run.period)) if periodic
             else TIMED_STEPS)
    times = []
    for step in range(warmup + timed):
        x, y = t.batch(dist.get_rank(), step)
        if not periodic:
            dist.barrier()
        start = time.perf_counter()
        run.opt.zero_grad(set_to_none=True)
        t.loss(run.model, x, y).backward()
        run.opt.step()
        run.after_step()
        times.append(time.perf_counter() - start)
    run.close()
    # Periodic: no barrier between steps (the ranks run free between syncs, as in training),
    # the sum over the window divided by its steps.
    return 1e3 * (sum(times[warmup:]) / timed if periodic else statistics.median(times[warmup:]))


def worker(rank: int, world: int, port: int, args: argparse.Namespace, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_WORLD_SIZE="2")
    torch.set_num_threads(1)
    global START
    START = max(2, args.steps // 10)  # 2: the least PowerSGD's error feedback allows
    dist.init_process_group("gloo", rank=rank, world_size=world)
    out = {}
    for name in args.tasks:
        t = make_task(name)
        runs = {c: train(t, CONFIGS[c](t, None, START), args.steps, args.eval_every)
                for c in args.configs}
        times = {c: {link: step_ms(t, c, link, args.quick) for link in args.links}
                 for c in args.configs}
        out[name] = {"metric": t.metric, "higher": t.higher_is_better, "runs": runs,
                     "times": times}
    if rank == 0:
        queue.put(out)
    dist.barrier()
    dist.destroy_process_group()


def reached(scores: dict[int, float], target: float, higher: bool) -> int | None:
    for step, score in sorted(scores.items()):
        if (score >= target) if higher else (score <= target):
            return step
    return None


def finals_and_target(r: dict) -> tuple[dict[str, float], float]:
    """Each configuration's last score, and fp32's quality: its final score, less the
    tolerance where higher is better, plus it (relative) where lower is."""
    final = {c: run["scores"][max(run["scores"])] for c, run in r["runs"].items()}
    base, tol = final["fp32 allreduce"], TOLERANCE[r["metric"]]
    return final, (base - tol if r["higher"] else base * (1 + tol))


def report(name: str, r: dict, links: list[str]) -> None:
    metric, higher = r["metric"], r["higher"]
    final, target = finals_and_target(r)
    base = final["fp32 allreduce"]
    bf16 = final.get("torch bf16_compress_hook")
    print(f"\n### {name}: held-out {metric} ({'higher' if higher else 'lower'} is better); "
          f"fp32's quality: {metric} {'>=' if higher else '<='} {target:.4f}\n")
    cols = " | ".join(f"ms/step, time to it @{link}" for link in links)
    print(f"| configuration | final | vs fp32 | vs torch bf16 | bytes/step | reaches fp32's "
          f"quality at step | {cols} | fp32's bytes / these |")
    print("|---|---:|---:|---:|---:|---:|" + "---:|" * (len(links) + 1))
    fp32_sent = r["runs"]["fp32 allreduce"]["sent"]
    for c, run in r["runs"].items():
        at = reached(run["scores"], target, higher)
        vs_bf16 = f"{final[c] - bf16:+.4f}" if bf16 is not None else "-"
        sent = f"{run['sent']:,}" if run["sent"] is not None else "-"
        fewer = f"{fp32_sent / run['sent']:.0f}x" if run["sent"] else "-"
        timing = " | ".join(_time_cell(r["times"][c][link], at) for link in links)
        print(f"| {c} | {final[c]:.4f} | {final[c] - base:+.4f} | {vs_bf16} | {sent} | "
              f"{at if at else 'never'} | {timing} | {fewer} |")


def _time_cell(ms: float | None, at: int | None) -> str:
    if ms is None:
        return "not emulated"
    return f"{ms:.1f}, " + (f"{at * ms / 1e3:.2f} s" if at else "never")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--tasks", default="digits,text")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--eval-every", type=int, default=25)
    parser.add_argument("--links", default="1GB/s,10GB/s")
    parser.add_argument("--configs", help="names, or a preset: " + ", ".join(
        f"{k} ({', '.join(v)})" for k, v in PRESETS.items()) + "; default: hooks")
    parser.add_argument("--name", default="quality",
                        help="the charts' file names: DIR/<name>_<task>.svg")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--charts", metavar="DIR",
                        help="also write each task's learning curves as DIR/<name>_<task>.svg")
    parser.add_argument("--write-table", metavar="PATH",
                        help="also write the results as the Python module --advise cites "
                             "(python/fastddp/tuning/quality_table.py)")
    args = parser.parse_args(argv)
    if args.quick:
        args.tasks, args.steps, args.eval_every = "text", 60, 20
        args.configs = args.configs or ",".join(QUICK)
    args.tasks, args.links = args.tasks.split(","), args.links.split(",")
    args.configs = PRESETS.get(args.configs or "hooks") or args.configs.split(",")
    unknown = set(args.configs) - set(CONFIGS)
    if unknown:
        parser.error(f"unknown configurations {sorted(unknown)}")
    if "fp32 allreduce" not in args.configs:
        parser.error("--configs must include 'fp32 allreduce': every score is read against it")
    if args.nproc != 4:
        args.configs = [c for c in args.configs if "2x2" not in c]  # 2 nodes of 2 ranks
    print(f"# compression quality: {args.nproc} gloo ranks, {args.steps} steps, torch "
          f"{torch.__version__}; tasks {', '.join(args.tasks)}")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    queue = mp.get_context("spawn").Queue()
    mp.spawn(worker, args=(args.nproc, port, args, queue), nprocs=args.nproc)
    results = queue.get()
    for name in args.tasks:
        report(name, results[name], args.links)
    if args.write_table:
        write_table(args.write_table, results, args)
    if args.charts:
        write_charts(args.charts, results, args)


def write_charts(folder: str, results: dict, args: argparse.Namespace) -> None:
    """One SVG per task: held-out score against step for every configuration."""
    for name, r in results.items():
        _, target = finals_and_target(r)
        curves = {c: run["scores"] for c, run in r["runs"].items()}
        title = f"{name}: held-out {r['metric']}, {args.nproc} gloo ranks"
        with open(os.path.join(folder, f"{args.name}_{name}.svg"), "w") as f:
            f.write(quality_chart.svg(title, r["metric"], curves, target))


def write_table(path: str, results: dict, args: argparse.Namespace) -> None:
    """The scores as a Python literal (fastddp.tuning.quality_table), for --advise, merged
    into the table already at `path` (common/quality_table_merge.py)."""
    table = {}
    for name, r in results.items():
        final, target = finals_and_target(r)
        higher = r["higher"]
        table[name] = {"metric": r["metric"], "higher_is_better": higher,
                       "tolerance": TOLERANCE[r["metric"]],
                       "steps": args.steps, "ranks": args.nproc,
                       "final": {c: round(v, 4) for c, v in final.items()},
                       "reaches_fp32_at": {c: reached(run["scores"], target, higher)
                                           for c, run in r["runs"].items()},
                       "bytes_per_step": {c: run["sent"] for c, run in r["runs"].items()}}
    quality_table_merge.write(path, quality_table_merge.merge(
        quality_table_merge.read(path), table))


if __name__ == "__main__":
    main()
