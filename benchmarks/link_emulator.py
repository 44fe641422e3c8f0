"""EmulatedLinkGroup's collectives against Note [collective cost]: prints % off the formula.

    python benchmarks/link_emulator.py [--nproc 2,4] [--repeats 2] [--out FILE]

Spawns gloo ranks on 127.0.0.1 (one intra-op thread each) and times each case (a collective
of S bytes on an emulated link) from launch to a finished wait(), the ranks aligned by a
barrier on the real group; the slowest rank's best of ``--repeats`` against L + f(n)·S/B
computed here by hand, the real group's own time beside it, and how long the launch took (a
launch that waited for the link would take the whole time). The links are slow enough that
the emulated time (0.1-1.5 s) is several times gloo's real time on loopback, so the
emulator's own accuracy is what shows; the target is within 10% (Note [emulated link
timing]: wake-ups can come late by the interpreter's switch interval). A benchmark, not a
test: tests/python/link/test_link_emulator.py checks the schedule itself on a fake clock.
"""

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fastddp.link import EmulatedLinkGroup, parse_link

from common import machine  # benchmarks/common/: scripts run from benchmarks/

MB = 1_000_000
# (kind, S bytes, link)
CASES = [
    ("allreduce", 1 * MB, "5MB/s"), ("allreduce", 10 * MB, "50MB/s,2ms"),
    ("allreduce", 100 * MB, "100MB/s"), ("alltoall", 10 * MB, "25MB/s,2ms"),
    ("allgather", 10 * MB, "25MB/s,2ms"), ("broadcast", 10 * MB, "50MB/s"),
    ("barrier", 0, "1GB/s,100ms"),
]
TARGET = 0.10  # the emulated time within 10% of the formula's


def expected_ms(kind: str, nbytes: int, n: int, spec: str) -> float:
    """Note [collective cost] by hand (not through fastddp.link)."""
    link = parse_link(spec)
    factor = {"allreduce": 2 * (n - 1) / n, "alltoall": (n - 1) / n, "allgather": (n - 1) / n,
              "broadcast": 1.0, "barrier": 0.0}[kind]
    return link.latency_us * 1e-3 + factor * nbytes / link.bytes_per_s * 1e3


def collective(group: dist.ProcessGroup, kind: str, nbytes: int):
    """A launcher of ``kind`` with S = nbytes (Note [collective cost])."""
    n, numel = group.size(), nbytes // 4
    if kind in ("allreduce", "broadcast"):
        t = torch.ones(numel)
        return lambda: getattr(group, kind)([t])
    if kind == "alltoall":  # S = the input
        src, dst = torch.ones(numel), torch.empty(numel)
        return lambda: group.alltoall_base(dst, src, [], [])
    if kind == "allgather":  # S = the output
        src, dst = torch.ones(numel // n), torch.empty(numel // n * n)
        return lambda: group._allgather_base(dst, src)
    if kind == "barrier":
        return lambda: group.barrier()
    raise ValueError(kind)


def time_collectives(repeats: int) -> list[dict]:
    """Per case: this rank's best time from launch to a finished wait() on an
    EmulatedLinkGroup over WORLD, the real group's best, and the slowest launch."""
    world = dist.group.WORLD
    out = []
    for kind, nbytes, spec in CASES:
        launch = collective(EmulatedLinkGroup(world, spec), kind, nbytes)
        launch_real = collective(world, kind, nbytes)
        times, real, launch_ms = [], [], []
        for _ in range(repeats):
            world.barrier().wait()
            t0 = time.perf_counter()
            work = launch()
            launch_ms.append((time.perf_counter() - t0) * 1e3)
            work.wait()
            times.append((time.perf_counter() - t0) * 1e3)
            world.barrier().wait()
            t0 = time.perf_counter()
            launch_real().wait()
            real.append((time.perf_counter() - t0) * 1e3)
        out.append({"ms": min(times), "real_ms": min(real), "launch_ms": max(launch_ms)})
    return out


def _worker(rank: int, world: int, port: int, repeats: int, queue) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    queue.put((rank, time_collectives(repeats)))
    dist.barrier()
    dist.destroy_process_group()


def rows(n: int, per_rank: list[list[dict]]) -> list[str]:
    lines = []
    for i, (kind, nbytes, spec) in enumerate(CASES):
        want = expected_ms(kind, nbytes, n, spec)
        got = max(rank[i]["ms"] for rank in per_rank)
        real = max(rank[i]["real_ms"] for rank in per_rank)
        launch = max(rank[i]["launch_ms"] for rank in per_rank)
        error = got / want - 1
        verdict = "ok" if -0.01 <= error <= TARGET else "OUT"
        lines.append(f"| {kind} | {nbytes / MB:.0f} | {n} | {spec} | {want:.1f} | {got:.1f} "
                     f"| {error * 100:+.1f}% {verdict} | {real:.1f} | {launch:.2f} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", default="2,4", help="world sizes, comma-separated")
    parser.add_argument("--repeats", type=int, default=2, help="best of this many per case")
    parser.add_argument("--out", default=None, help="also write the table to this file")
    args = parser.parse_args()
    run = machine.Run()
    table = ["| collective | MB | ranks | link | formula ms | emulated ms (slowest rank) "
             "| vs formula | real ms | launch ms |", "|---|---|---|---|---|---|---|---|---|"]
    for n in map(int, args.nproc.split(",")):
        queue = mp.get_context("spawn").SimpleQueue()
        mp.spawn(_worker, args=(n, machine.free_port(), args.repeats, queue), nprocs=n,
                 join=True)
        per_rank = [result for _, result in sorted(queue.get() for _ in range(n))]
        table += rows(n, per_rank)
    machine.Run.publish(run.header(f"); best of {args.repeats}, target within "
                                   f"{TARGET:.0%}."), "\n".join(table), args.out)


if __name__ == "__main__":
    sys.exit(main())
