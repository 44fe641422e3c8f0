"""fastddp under torchft against torchft's own DDP: the step time, and the time a death costs.

    python benchmarks/torchft_step.py [--replicas 2] [--rounds 3] [--steps 30]
    python benchmarks/torchft_step.py --recovery [--replicas 3]

Step time: replica groups (one process each, gloo over loopback, a torchft Lighthouse in
this process) train an MLP (``--hidden``) for ``--steps`` committed steps, with fastddp's
DistributedDataParallel under torchft and with torchft's own (torch DDP + a Python hook
calling manager.allreduce; for bf16, torch's bf16_compress_hook's algorithm over it). The
step time is the median gap between replica 0's consecutive commits after ``--warmup``
steps; rounds interleave the two, and the figure is the ratio of medians, per hook.

Recovery (``--recovery``): replica 2 of 3 is killed at step 10 (between two steps, and, for
fastddp, also mid-backward) and started again at once. Reported: from the death to the
survivors' commit of the first step it cost (the one it interrupted, or the next one: the
quorum forms without the dead replica after the Lighthouse's join timeout, 1 s here, plus,
mid-backward, the failed step's collective error), and from the restart to the restarted
replica's first committed step (process start, imports, quorum, healing from a peer).

The replica program is the tests' (tests/python/torchft/replica.py).
"""

import argparse
import platform
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout: tests.python

from tests.python.torchft.torchft_world import run_replicas  # noqa: E402


def _step_times(log: list, warmup: int) -> list[float]:
    commits = [t for step, _, committed, t in log if committed and step >= warmup]
    return [b - a for a, b in zip(commits, commits[1:])]


def step_time(args: argparse.Namespace) -> None:
    extra = {"hidden": args.hidden, "rows": args.rows, "bucket_cap_mb": 25.0}
    params = 24 * args.hidden + args.hidden * args.hidden + args.hidden * 8 + 2 * args.hidden + 8
    print(f"# fastddp under torchft vs torchft's DDP: {args.replicas} replicas, MLP of "
          f"{params / 1e6:.2f}M parameters, batch {args.rows}, {args.steps} steps "
          f"({args.warmup} warm-up), {args.rounds} rounds, {platform.node()}")
    print("| hook | fastddp step (ms) | torchft DDP step (ms) | ratio |")
    print("|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for hook in args.hooks:
            ours, theirs = [], []
            for round_ in range(args.rounds):
                for impl, into in (("fastddp", ours), ("torchft", theirs)):
                    where = Path(tmp) / f"{hook}-{impl}-{round_}"
                    results = run_replicas(where, replicas=args.replicas, steps=args.steps,
                                           impl=impl, hook=None if hook == "none" else hook,
                                           extra=extra)
                    into.append(statistics.median(_step_times(results[0]["log"],
                                                              args.warmup)))
            a, b = statistics.median(ours), statistics.median(theirs)
            print(f"| {hook} | {a * 1e3:.2f} | {b * 1e3:.2f} | {a / b:.3f} |", flush=True)


def recovery(args: argparse.Namespace) -> None:
    print(f"# a death under torchft: {args.replicas} replicas, replica 2 killed at step 10 "
          f"and restarted at once, {platform.node()}")
    print("| DDP | death -> survivors' next commit (s) | restart -> its first commit (s) |")
    print("|---|---|---|")
    extra = {"hidden": args.hidden, "rows": args.rows, "bucket_cap_mb": 25.0}
    with tempfile.TemporaryDirectory() as tmp:
        for impl, kill_in in (("fastddp", "between"), ("torchft", "between"),
                              ("fastddp", "backward")):
            # Between two steps for both: torchft 0.2.0's own DDP raises out of backward when
            # a collective fails mid-backward (docs/torchft.md); fastddp's row beneath it dies
            # mid-backward.
            results = run_replicas(Path(tmp) / f"{impl}-{kill_in}", replicas=args.replicas,
                                   steps=20, impl=impl, victim=2, kill_at=10,
                                   extra={**extra, "kill_in": kill_in, "full": args.replicas})
            killed, restarted = results[2]["killed_at"], results[2]["restarted_at"]
            # The first step the death cost: the one it interrupted, or the next one.
            first = 10 if kill_in == "backward" else 11
            survivor = min(t for s, _, c, t in results[0]["log"] if c and s >= first)
            rejoined = min(t for _, _, c, t in results[2]["log"] if c)
            where = "mid-backward" if kill_in == "backward" else "between steps"
            print(f"| {impl}, killed {where} | {survivor - killed:.2f} | "
                  f"{rejoined - restarted:.2f} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--replicas", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--hooks", type=lambda s: s.split(","), default=["none", "bf16"])
    parser.add_argument("--recovery", action="store_true")
    args = parser.parse_args()
    if args.recovery:
        args.replicas = args.replicas or 3
        recovery(args)
    else:
        args.replicas = args.replicas or 2
        step_time(args)


if __name__ == "__main__":
    main()
