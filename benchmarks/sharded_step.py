"""The sharded optimizer vs torch DDP + the same optimizer unsharded: step time, where it goes,
and the bytes each rank holds.

    python benchmarks/sharded_step.py [--nproc 2] [--rounds 10] [--block 2] [--warmup 2]
                                      [--width 2048] [--depth 5] [--batch 32]
                                      [--optims adamw,adamw_foreach,adamw_fused]
                                      [--memory 2,3,4] [--wire] [--out FILE]

Spawns gloo ranks on 127.0.0.1 (one intra-op thread each, step_time.py's allocator
thresholds). The model is an MLP of ``--depth`` square ``--width`` layers (5 x 2048: 21M
parameters), where AdamW's step is a visible share of the step. Per optimizer, four
training steps (zero_grad, forward, backward, step) run in interleaved blocks (rotating
order, common/step_timing.timed_blocks): ``torch`` (torch DDP + the optimizer), ``fastddp``
(fastddp + the optimizer), ``sharded`` (fastddp + fastddp.optim.ShardedOptimizer) and
``zero`` (torch DDP + torch's ZeroRedundancyOptimizer). Reported: median ms per step (block
means, rank 0's clock), the ratios of the medians to torch's with the per-round spread, and
for ``sharded`` the median split of its step into forward + backward (with the
reduce-scatter), the shards' optimizer step and the all-gather. ``--wire``: two more,
``torch_bf16`` (torch DDP with torch's bf16_compress_hook + the optimizer) and
``sharded_bf16`` (the sharded optimizer with ``gradient_wire="bf16"``), and the ratio of
the second to the first.

``--memory``: per world size, after two steps, what rank 0 holds: optimizer state bytes
(every tensor of the optimizer's state) and gradient bytes (the reducer's bucket buffers,
the shards of the averaged gradient, and the .grad tensors), for torch DDP + the unsharded
optimizer, torch's ZeroRedundancyOptimizer and the sharded optimizer (zero_stage 1 and 2);
counted from the tensors, not from the process's memory. This is a benchmark, not a test.
"""

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.optim import ZeroRedundancyOptimizer

import fastddp
from common import machine, step_timing  # benchmarks/common/: scripts run from benchmarks/

OPTIMIZERS = {
    "adamw": (torch.optim.AdamW, {"lr": 1e-6}),
    "adamw_foreach": (torch.optim.AdamW, {"lr": 1e-6, "foreach": True}),
    "adamw_fused": (torch.optim.AdamW, {"lr": 1e-6, "fused": True}),
    "sgd": (torch.optim.SGD, {"lr": 1e-6, "momentum": 0.9}),
}
VARIANTS = ("torch", "fastddp", "sharded", "overlap", "zero")


def _mlp(width: int, depth: int) -> nn.Module:
    layers = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def _variant(name: str, body: nn.Module, optim: str, x: torch.Tensor, phases: dict | None):
    cls, kwargs = OPTIMIZERS[optim]
    wrapper = (step_timing.TorchDDP if name in ("torch", "zero", "torch_bf16")
               else fastddp.DistributedDataParallel)
    model = wrapper(body)
    if name == "torch_bf16":
        model.register_comm_hook(None, default_hooks.bf16_compress_hook)
    if name in ("sharded", "overlap", "zero2", "sharded_bf16"):
        opt = fastddp.optim.ShardedOptimizer(model, cls, overlap_all_gather=name == "overlap",
                                             zero_stage=2 if name == "zero2" else 1,
                                             gradient_wire="bf16" if name == "sharded_bf16"
                                             else "fp32", **kwargs)
    elif name == "zero":
        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=cls, **kwargs)
    else:
        opt = cls(model.parameters(), **kwargs)

    def step() -> None:
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()

    if phases is None or name != "sharded":
        return model, opt, step

    def timed_step() -> None:  # the same step, with its parts' times
        t0 = time.perf_counter()
        opt.zero_grad()
        model(x).square().mean().backward()
        t1 = time.perf_counter()
        opt.step()
        t2 = time.perf_counter()
        phases["backward"].append((t1 - t0) * 1e3)
        phases["step"].append((t2 - t1) * 1e3)
    return model, opt, timed_step


def _state_bytes(opt) -> int:
    inner = opt.optim if isinstance(opt, ZeroRedundancyOptimizer) else opt
    if isinstance(opt, fastddp.optim.ShardedOptimizer):
        return opt.shard_state_bytes()
    return sum(t.numel() * t.element_size() for s in inner.state.values()
               for t in s.values() if torch.is_tensor(t) and t.dim() > 0)


def _grad_bytes(name: str, model, opt) -> int:
    seen, total = set(), 0

    def add(t):
        nonlocal total
        if t is None or t.is_meta:
            return
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()

    for p in model.parameters():
        add(p.grad)
    if name in ("sharded", "zero2"):
        for b in model._sharded:  # benchmark's reading: the shards and the bucket buffers
            add(b.grad)
        total += model._reducer.held_bucket_bytes()
    elif name in ("fastddp",):
        total += model._reducer.held_bucket_bytes()
    else:  # torch's reducer: its buckets hold every gradient once more (no bucket view)
        total += sum(p.numel() * p.element_size() for p in model.parameters())
    return total


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, queue, memory: bool):
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    gen = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(args.batch, args.width, generator=gen)
    out = []
    for optim in args.optims.split(","):
        if memory:
            row = {"optim": optim, "world": world}
            for name in ("torch", "zero", "sharded", "zero2"):
                torch.manual_seed(0)
                model, opt, step = _variant(name, _mlp(args.width, args.depth), optim, x, None)
                for _ in range(2):
                    step()
                opt.zero_grad(set_to_none=False) if name == "torch" else None
                row[name] = (_state_bytes(opt), _grad_bytes(name, model, opt))
                del model, opt, step
            out.append(row)
            continue
        phases = {"backward": [], "step": []}
        variants = {}
        names = VARIANTS + (("torch_bf16", "sharded_bf16") if args.wire else ())
        for name in names:
            torch.manual_seed(0)
            variants[name] = _variant(name, _mlp(args.width, args.depth), optim, x, phases)[2]
        dist.barrier()
        ms = step_timing.timed_blocks(variants, args.rounds, args.block, args.warmup)
        out.append({"optim": optim, **{v: step_timing.summary(ms, v, "torch")
                                        for v in VARIANTS if v != "torch"},
                    **({"sharded_bf16": step_timing.summary(ms, "sharded_bf16", "torch_bf16")}
                       if args.wire else {}),
                    "phases": {k: statistics.median(v) for k, v in phases.items()}})
    if rank == 0:
        queue.put(out)
    dist.barrier()
    dist.destroy_process_group()


def _spawn(args, world: int, memory: bool):
    queue = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_worker, args=(world, machine.free_port(), args, queue, memory), nprocs=world,
             join=True)
    return queue.get()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--block", type=int, default=2, help="steps per timed block")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--depth", type=int, default=5)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--optims", default="adamw,adamw_foreach,adamw_fused")
    parser.add_argument("--memory", default="", help="world sizes for the memory table")
    parser.add_argument("--wire", action="store_true",
                        help="also gradient_wire='bf16' against torch DDP + bf16_compress_hook")
    parser.add_argument("--out")
    args = parser.parse_args()
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(32 * 1024 * 1024))
    os.environ.setdefault("MALLOC_TRIM_THRESHOLD_", str(2**32))
    bench = machine.Run()
    params = sum(p.numel() for p in _mlp(args.width, args.depth).parameters())
    lines = [f"MLP {args.depth} x {args.width} ({params / 1e6:.1f}M parameters), batch "
             f"{args.batch}, {args.nproc} gloo ranks, {args.rounds} rounds of {args.block} "
             "steps", "",
             "| optimizer | torch DDP + opt, ms | fastddp + opt / torch | **sharded / torch** "
             "(per-round median [IQR]) | overlapped all-gather / torch | ZeroRedundancyOptimizer "
             "/ torch | sharded: fwd+bwd ms, step + all-gather ms |"
             + (" sharded bf16 wire / torch DDP + bf16_compress_hook |" if args.wire else ""),
             "|---|---|---|---|---|---|---|" + ("---|" if args.wire else "")]
    for r in _spawn(args, args.nproc, False):
        f, s, o, z = r["fastddp"], r["sharded"], r["overlap"], r["zero"]
        lines.append(f"| {r['optim']} | {s['b_ms']:.1f} | {f['ratio']:.3f} | **{s['ratio']:.3f}** "
                     f"({s['paired']:.3f} [{s['q1']:.3f}, {s['q3']:.3f}]) | {o['ratio']:.3f} | "
                     f"{z['ratio']:.3f} | "
                     f"{r['phases']['backward']:.1f}, {r['phases']['step']:.1f} |"
                     + (f" {r['sharded_bf16']['ratio']:.3f} |" if args.wire else ""))
    if args.memory:
        lines += ["", "| optimizer | ranks | state MiB per rank: torch / ZeRO / sharded | "
                  "sharded state / (torch / ranks) | gradient MiB per rank between steps: "
                  "torch / ZeRO / sharded / sharded zero_stage=2 |", "|---|---|---|---|---|"]
        for world in map(int, args.memory.split(",")):
            for r in _spawn(args, world, True):
                mib = {k: tuple(v / 2**20 for v in r[k])
                       for k in ("torch", "zero", "sharded", "zero2")}
                share = r["sharded"][0] / (r["torch"][0] / world)
                lines.append(f"| {r['optim']} | {world} | {mib['torch'][0]:.1f} / "
                             f"{mib['zero'][0]:.1f} / {mib['sharded'][0]:.1f} | {share:.4f} | "
                             f"{mib['torch'][1]:.1f} / {mib['zero'][1]:.1f} / "
                             f"{mib['sharded'][1]:.1f} / {mib['zero2'][1]:.1f} |")
    bench.publish(bench.header(")"), "\n".join(lines), args.out)


if __name__ == "__main__":
    main()
