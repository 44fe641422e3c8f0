"""Streaming DiLoCo's overlap on an emulated slow link: the wall time of inner steps with each
fragment's exchange waited for at once (overlap 0) against overlapped with the next inner steps.

    torchrun --standalone --nproc_per_node=2 benchmarks/diloco_overlap.py --link 100Mb/s,1ms

Every rank trains an MLP of --width x --width layers with AdamW on random data; DiLoCo's
group is an EmulatedLinkGroup of --link (fastddp/link/emulator.py), so each exchange completes
no earlier than it would on that link. Rank 0 prints, per configuration, the seconds per inner
step (median of --repeats runs of --steps steps) and the bytes each sync put on the link.
"""

import argparse
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import fastddp


def model(width: int, layers: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(width, width), nn.Tanh())])


def run(args: argparse.Namespace, group: fastddp.EmulatedLinkGroup,
        overlap: int | None) -> tuple[float, float, float]:
    """Seconds for args.steps inner steps, and the bytes and emulated link seconds they put on
    the link (not counting the construction's broadcast); overlap None: no DiLoCo at all."""
    net = model(args.width, args.layers)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    diloco = None if overlap is None else fastddp.DiLoCo(
        net, opt, sync_every=args.sync_every, fragments=args.fragments, overlap=overlap,
        wire=args.wire, process_group=group)
    inputs = torch.randn(args.batch, args.width)
    dist.barrier()
    before = group.stats()
    start = time.perf_counter()
    for _ in range(args.steps):
        opt.zero_grad()
        F.mse_loss(net(inputs), inputs).backward()
        opt.step()
    elapsed = time.perf_counter() - start
    after = group.stats()
    if diloco is not None:
        diloco.close()
    sent = sum(after["bytes"].values()) - sum(before["bytes"].values())
    return elapsed, sent, after["emulated_s"] - before["emulated_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--link", default="100Mb/s,1ms")
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--sync-every", type=int, default=32)
    parser.add_argument("--fragments", type=int, default=2)
    parser.add_argument("--overlap", type=int, default=12)
    parser.add_argument("--wire", default="fp32")
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    group = fastddp.EmulatedLinkGroup(dist.group.WORLD, args.link)
    rows = []
    for label, overlap in (("local steps only", None), ("overlap 0", 0),
                           (f"overlap {args.overlap}", args.overlap)):
        runs = [run(args, group, overlap) for _ in range(args.repeats)]
        syncs = max(args.steps // (args.sync_every // args.fragments), 1)
        rows.append((label, statistics.median(r[0] for r in runs) / args.steps,
                     runs[0][1] / syncs, runs[0][2] / syncs))
    if dist.get_rank() == 0:
        params = sum(p.numel() for p in model(args.width, args.layers).parameters())
        print(f"link {args.link}, {dist.get_world_size()} ranks, {params} parameters, "
              f"H={args.sync_every}, fragments={args.fragments}, wire={args.wire}, "
              f"{args.steps} steps x {args.repeats}")
        for label, per_step, per_sync, link_s in rows:
            print(f"  {label:18s} {per_step * 1e3:8.1f} ms/step   collective of "
                  f"{per_sync / 1e6:5.2f} MB, {link_s * 1e3:6.1f} ms of link a sync")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
