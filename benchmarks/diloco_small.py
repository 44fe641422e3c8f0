"""DiLoCo's outer settings on small jobs: the held-out score after a short run, per setting.

    python benchmarks/diloco_small.py [--tasks text,digits] [--worlds 2,4] [--steps 1000]
        [--sync-every 20] [--eval-every 100] [--out PATH] [--write-table PATH]

Issue 54 item 3. The paper's outer step (Nesterov SGD, lr 0.7, momentum 0.9) was tuned on 8
replicas over thousands of inner steps; a user with 2-4 workers and a short run takes it too.
For each task of benchmarks/quality.py (common/quality_tasks.py: the character-level
transformer on Python's standard library, held-out bits per character; the CNN on
scikit-learn's digits, held-out accuracy) and each world size, every configuration trains the
same model from the same seed on the same per-rank batches for --steps inner steps (each
rank's batch is the task's, the learning rate decays along a cosine: quality_tasks.train), on
gloo ranks with one intra-op thread each:

  torch DDP           torch's DistributedDataParallel, a gradient allreduce every step: the
                      reference every other row is read against;
  no communication    every rank trains its own copy on its own batches; rank 0's is scored
                      (what DiLoCo tends to as H grows);
  diloco LR/M         fastddp.DiLoCo(sync_every=--sync-every, outer_lr=LR,
                      outer_momentum=M, wire="fp32"), for each SETTINGS row: the paper's
                      0.7/0.9, plain averaging 1/0 (the anchor becomes the ranks' mean), and
                      lower outer learning rates and momenta between them.

Reported: each configuration's final score and its ratio to torch DDP's (bits per character)
or its difference (accuracy). --write-table writes the finals as the Python module --advise
cites (python/fastddp/tuning/diloco_small_table.py), merged by world size into the one there
when the steps and H are the same. A benchmark, not a test: its scores do not depend on
timing (gloo's sums are in rank order), so a loaded machine only makes it slower.
"""

import argparse
import os
import pprint
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# benchmarks/common/: scripts run from benchmarks/
from common import machine, periodic_sync, quality_table_merge
from common.quality_tasks import task as make_task, train

# name -> (outer_lr, outer_momentum). The effective outer step on a steady pseudo-gradient is
# lr / (1 - momentum): 7 for the paper's, 1 for plain averaging, 3.5 and 1.4 between.
PAPER = "diloco 0.7/0.9 (paper)"  # fastddp.DiLoCo's defaults
SETTINGS = {PAPER: (0.7, 0.9), "diloco 0.35/0.9": (0.35, 0.9),
            "diloco 0.7/0.5": (0.7, 0.5), "diloco 1/0 (averaging)": (1.0, 0.0),
            "diloco 0.5/0.5": (0.5, 0.5)}
REFERENCE, ALONE = "torch DDP", "no communication"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def configs(sync_every: int) -> dict:
    return {REFERENCE: periodic_sync.per_step("torch", lambda: None),
            ALONE: periodic_sync.alone,
            **{name: periodic_sync.diloco(sync_every, outer_lr=lr, outer_momentum=m)
               for name, (lr, m) in SETTINGS.items()}}


def worker(rank: int, world: int, port: int, args: argparse.Namespace, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    out = {}
    for name in args.tasks:
        t = make_task(name)
        out[name] = {"metric": t.metric, "higher": t.higher_is_better,
                     "runs": {c: train(t, make(t, None, 0), args.steps, args.eval_every)["scores"]
                              for c, make in configs(args.sync_every).items()}}
    if rank == 0:
        queue.put(out)
    dist.barrier()
    dist.destroy_process_group()


def run_world(world: int, args: argparse.Namespace) -> dict:
    queue = mp.get_context("spawn").Queue()
    mp.spawn(worker, args=(world, machine.free_port(), args, queue), nprocs=world)
    return queue.get()


def versus(final: float, reference: float, higher: bool) -> str:
    """Bits per character: the ratio to torch DDP's (below 1: better). Accuracy: the
    difference (above 0: better)."""
    return f"{final - reference:+.4f}" if higher else f"{final / reference:.3f}x"


def report(results: dict, args: argparse.Namespace) -> list[str]:
    lines = []
    for name in args.tasks:
        first = results[args.worlds[0]][name]
        higher = first["higher"]
        lines += ["", f"### {name}: held-out {first['metric']} after {args.steps} steps "
                  f"({'higher' if higher else 'lower'} is better), H = {args.sync_every}", "",
                  "| configuration | " + " | ".join(f"{w} workers | vs torch DDP"
                                                     for w in args.worlds) + " |",
                  "|---|" + "---:|---:|" * len(args.worlds)]
        for config in first["runs"]:
            cells = []
            for w in args.worlds:
                runs = results[w][name]["runs"]
                final, ref = runs[config][args.steps], runs[REFERENCE][args.steps]
                cells += [f"{final:.4f}", versus(final, ref, higher)]
            lines.append(f"| {config} | " + " | ".join(cells) + " |")
    return lines


def write_table(path: str, results: dict, args: argparse.Namespace) -> None:
    """SMALL_JOBS: task -> world -> configuration -> final score, with the run's settings;
    merged by world into the module at ``path`` when its steps and H are these."""
    old = quality_table_merge.read(path, "SMALL_JOBS")
    same = old.get("steps") == args.steps and old.get("sync_every") == args.sync_every
    table = old if same else {"steps": args.steps, "sync_every": args.sync_every,
                              "settings": {}, "tasks": {}}
    table["settings"] = {name: list(v) for name, v in SETTINGS.items()}
    table.update(reference=REFERENCE, alone=ALONE, paper=PAPER)
    for w, per_task in results.items():
        for name, r in per_task.items():
            entry = table["tasks"].setdefault(name, {"metric": r["metric"],
                                                     "higher_is_better": r["higher"],
                                                     "worlds": {}})
            entry["worlds"][w] = {c: round(s[args.steps], 4) for c, s in r["runs"].items()}
    with open(path, "w") as f:
        shown = os.path.relpath(os.path.abspath(path), ROOT)
        f.write(f'"""Generated (do not edit) by\n\n    python benchmarks/diloco_small.py '
                f'--write-table {shown}\n\nDiLoCo\'s outer settings on short runs (issue 54 '
                "item 3): each configuration's\nfinal held-out score per task and world size, "
                "which --advise cites\n(fastddp/tuning/diloco_advice.py). The table and its "
                'reading: docs/diloco.md,\nbenchmarks/results/diloco_small.md."""\n\n'
                f"SMALL_JOBS = {pprint.pformat(table, sort_dicts=False)}\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", default="text,digits")
    parser.add_argument("--worlds", default="2,4")
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--sync-every", type=int, default=20)
    parser.add_argument("--eval-every", type=int, default=100)
    parser.add_argument("--out", help="also write the tables here (.md)")
    parser.add_argument("--write-table", metavar="PATH",
                        help="also write the finals as the module --advise cites")
    args = parser.parse_args()
    args.tasks = args.tasks.split(",")
    args.worlds = [int(w) for w in args.worlds.split(",")]
    if args.steps % args.sync_every:
        parser.error("--steps must be a multiple of --sync-every: the final score is then "
                     "taken right after a sync")
    start = time.time()
    results = {w: run_world(w, args) for w in args.worlds}
    lines = [f"# DiLoCo on small jobs: {', '.join(map(str, args.worlds))} gloo workers, "
             f"{args.steps} inner steps, H = {args.sync_every}, torch {torch.__version__} "
             f"({time.time() - start:.0f} s)", *report(results, args)]
    print("\n".join(lines))
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")
    if args.write_table:
        write_table(args.write_table, results, args)


if __name__ == "__main__":
    main()
