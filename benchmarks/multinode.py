"""Hierarchical vs flat hooks on emulated 2x2-node links: prints step time / flat bf16's, MB sent.

    python benchmarks/multinode.py [--inter 1GB/s,10GB/s] [--intra 100GB/s] [--model wide]
                                   [--dilate D] [--rounds 8] [--out benchmarks/results/multinode.md]

Spawns 4 gloo ranks on 127.0.0.1 (one intra-op thread each) as 2 nodes x 2 local ranks.
For each inter-node link, five configurations, each its own model and optimizer, all
timed interleaved (benchmarks/common/auto_runs.py: rotating rounds, median step on rank 0's clock,
zero_grad to SGD step), with the same model stepped without DDP as the compute floor:

  flat allreduce, flat bf16   the model's group is an EmulatedLinkGroup over WORLD with the
                              inter-node link: a flat ring crosses the node boundary, and a
                              ring runs at the pace of its slowest hop;
  hier none / bf16 / int8     fastddp.hooks.hierarchical(inter=...) over this rank's node
                              (intra link) and the ranks with its local index on the other
                              node (inter link), each group in its own EmulatedLinkGroup.
                              int8 is skipped, with a note, where no "int8" hook is
                              registered.

Each emulated link is per rank (one NIC per GPU, the usual multi-node layout); so is the
flat ring's. Reported per configuration: median ms, the ratio to flat bf16 (the issue's
target: hier int8 at most 0.5x at 1 GB/s), and the MB per step and rank that crossed the
emulated inter-node link (bus bytes: the link model's f(n)·S, Note [collective cost]), and
the time per step the emulated links (inter and intra) were busy: what the links alone
would cost, without this machine's real transport and compute.

The emulated link only delays: a collective never completes faster than gloo on loopback
moves it on this machine (4 ranks on the cores there are), so the fast links all look alike
once the real transport is the slower; the intra-node link in particular is real loopback.

``--dilate D`` runs every emulated link D times slower (bandwidth / D, latency x D), labelled
"1GB/s /D": the step's communication then weighs against this CPU's compute as the named
links would against compute D times faster (a GPU's), the link ratios kept. One thread of a
CPU is 50-100x slower than a GPU on these matrix products, so D = 50 is the closer picture of
a GPU cluster; D = 1 is this machine's. A benchmark, not a test.
"""

import argparse
import gc
import os
import statistics
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import fastddp
from fastddp.link import EmulatedLinkGroup, Link, bus_factor, parse_link

from common import auto_runs, machine  # benchmarks/common/: scripts run from benchmarks/

LOCAL = 2
WORLD = 4
CONFIGS = ("no communication", "flat allreduce", "flat bf16", "hier none", "hier bf16",
           "hier int8")


class LocalRun(auto_runs.Run):
    """The same model, data and optimizer without DDP: the step's compute floor."""

    def __init__(self, kind: str):
        self.kind = kind
        self.ddp = auto_runs.model(kind)
        self.opt = torch.optim.SGD(self.ddp.parameters(), lr=0.01)
        self.gen = torch.Generator().manual_seed(10 + dist.get_rank())
        self.times = []


def _inner(name: str) -> fastddp.hooks.CommHook | None:
    if name == "none":
        return fastddp.hooks.allreduce()
    if name == "bf16":
        return fastddp.hooks.bf16()
    if "int8" not in fastddp._C.comm_hook_names():
        return None
    factory = getattr(fastddp.hooks, "int8", None)
    return factory() if factory is not None else fastddp.hooks.from_registry("int8")


def dilated(text: str, factor: float) -> Link:
    """The link ``text`` names, ``factor`` times slower (module docstring)."""
    link = parse_link(text)
    return Link(link.bus_gbs / factor, link.latency_us * factor)


def _runs(kind: str, inter_link: Link, intra_link: Link, groups: tuple, cap_mb: float
          ) -> tuple[dict, dict, list[str]]:
    """The configurations' runs, the link wrappers of each (the inter-node one last), and
    skip notes."""
    runs, links, notes = {"no communication": LocalRun(kind)}, {}, []
    world = EmulatedLinkGroup(dist.group.WORLD, inter_link)
    runs["flat allreduce"] = auto_runs.Run(kind, world, fastddp.hooks.allreduce(), cap_mb)
    links["flat allreduce"] = (world,)
    flat_bf16 = EmulatedLinkGroup(dist.group.WORLD, inter_link)
    runs["flat bf16"] = auto_runs.Run(kind, flat_bf16, fastddp.hooks.bf16(), cap_mb)
    links["flat bf16"] = (flat_bf16,)
    intra, inter = groups
    for inner_name in ("none", "bf16", "int8"):
        inner = _inner(inner_name)
        name = f"hier {inner_name}"
        if inner is None:
            notes.append(f"{name}: skipped, no 'int8' comm hook is registered in this build")
            continue
        wrapped = (EmulatedLinkGroup(intra, intra_link), EmulatedLinkGroup(inter, inter_link))
        hook = fastddp.hooks.hierarchical(inter=inner, groups=wrapped)
        runs[name] = auto_runs.Run(kind, dist.group.WORLD, hook, cap_mb)
        links[name] = wrapped
    return runs, links, notes


def _bus_bytes(link: EmulatedLinkGroup) -> float:
    """Bytes the link has carried so far, as the link model counts them (f(n)·S)."""
    return sum(bus_factor(k, link.size()) * b for k, b in link.stats()["bytes"].items())


def _busy_s(links: tuple[EmulatedLinkGroup, ...]) -> float:
    """Seconds the links' emulated clocks have been busy so far."""
    return sum(link.stats()["emulated_s"] for link in links)


def _worker(rank: int, port: int, args: argparse.Namespace, queue) -> None:
    torch.set_num_threads(1)
    # The emulator completes collectives from Python threads, late by up to the switch
    # interval while another thread holds the GIL (Note [emulated link timing]); the
    # hierarchical hook waits on 3 dependent collectives per bucket, a flat hook on none.
    sys.setswitchinterval(args.switch_interval_ms * 1e-3)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    groups = fastddp.hooks.hierarchical_groups(LOCAL)
    for inter_text in args.inter.split(","):
        inter_link = dilated(inter_text, args.dilate)
        runs, links, notes = _runs(args.model, inter_link, dilated(args.intra, args.dilate),
                                   groups, args.cap_mb)
        # What the initial broadcast put on the links.
        before = {n: (_bus_bytes(ls[-1]), _busy_s(ls)) for n, ls in links.items()}
        links["no communication"] = ()
        before["no communication"] = (0.0, 0.0)
        medians = auto_runs.interleaved(runs, args.rounds, args.warmup)
        steps = args.warmup + args.rounds
        if rank == 0:
            label = inter_text if args.dilate == 1 else f"{inter_text} /{args.dilate:g}"
            queue.put({"link": label, "medians": medians, "notes": notes,
                       "spread": {n: statistics.quantiles(r.times[-args.rounds:], n=4)
                                  for n, r in runs.items()},
                       "inter_mb": {n: (_bus_bytes(links[n][-1]) - before[n][0]) / steps / 1e6
                                    if links[n] else 0.0 for n in runs},
                       "busy_ms": {n: (_busy_s(links[n]) - before[n][1]) / steps * 1e3
                                   for n in runs},
                       "grad_mb": sum(p.numel() * 4 for p in runs["flat bf16"].ddp.parameters())
                       / 1e6})
            print(f"inter-node {label}: done", flush=True)
        del runs, links
        gc.collect()
    if rank == 0:
        queue.put(None)
    dist.barrier()
    dist.destroy_process_group()


def table(results: list[dict], intra: str) -> str:
    lines = [f"| inter-node link (intra {intra}) | configuration | median ms | quartiles ms "
             "| / flat bf16 | inter-node MB per step and rank | emulated links busy, ms per step "
             "|", "|---|---|---|---|---|---|---|"]
    for r in results:
        base = r["medians"]["flat bf16"]
        for name in CONFIGS:
            if name not in r["medians"]:
                lines.append(f"| {r['link']} | {name} | skipped | | | | |")
                continue
            q1, _, q3 = r["spread"][name]
            lines.append(f"| {r['link']} | {name} | {r['medians'][name]:.1f} | {q1:.1f}-{q3:.1f} "
                         f"| {r['medians'][name] / base:.2f}x | {r['inter_mb'][name]:.1f} "
                         f"| {r['busy_ms'][name]:.1f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--inter", default="1GB/s,10GB/s", help="inter-node links, comma-separated")
    parser.add_argument("--intra", default="100GB/s", help="intra-node link")
    parser.add_argument("--dilate", type=float, default=1.0,
                        help="every emulated link this many times slower (see the docstring)")
    parser.add_argument("--model", default="wide", choices=("wide", "vit"),
                        help="benchmarks/common/auto_runs.py's models (gradient-heavy, ~50 MB)")
    parser.add_argument("--cap-mb", type=float, default=auto_runs.CAP_MB)
    parser.add_argument("--rounds", type=int, default=8, help="interleaved timing rounds")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--switch-interval-ms", type=float, default=0.5,
                        help="sys.setswitchinterval of the ranks (Python's default: 5 ms)")
    parser.add_argument("--out", default=None, help="write the header and table here (.md)")
    args = parser.parse_args()
    run = machine.Run()
    queue = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_worker, args=(machine.free_port(), args, queue), nprocs=WORLD, join=True)
    results = list(iter(queue.get, None))
    notes = sorted({n for r in results for n in r["notes"]})
    header = run.header(
        f"); {WORLD} gloo ranks as 2 nodes x {LOCAL}, model {args.model} "
        f"({results[0]['grad_mb']:.1f} MB of fp32 gradients), bucket_cap_mb {args.cap_mb:g}, "
        f"{args.rounds} interleaved rounds after {args.warmup} warm-up, Python switch interval "
        f"{args.switch_interval_ms:g} ms."
        + "".join(f"\n\nNote: {n}." for n in notes))
    intra = args.intra if args.dilate == 1 else f"{args.intra} /{args.dilate:g}"
    machine.Run.publish(header, table(results, intra), args.out)


if __name__ == "__main__":
    main()
