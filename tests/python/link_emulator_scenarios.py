"""EmulatedLinkGroup scenarios, run on every rank of a harness world (see harness.py).

Timing: each collective is timed on its own (ranks aligned by a barrier on the real group)
and compared by the test with Note [collective cost], computed there by hand. Training:
fastddp trained over the plain group and over the wrapper must agree bit for bit, and the
wrapper must have seen the collectives each hook issues.
"""

import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

import fastddp
from fastddp._emulate_link import LinkEmulation
from fastddp.link_emulator import EmulatedLinkGroup

MB = 1_000_000


def _collective(group: dist.ProcessGroup, kind: str, nbytes: int) -> tuple[list, object]:
    """Buffers for `kind` with S = nbytes (Note [collective cost]) and a launcher."""
    n = group.size()
    numel = nbytes // 4
    if kind == "allreduce":
        t = torch.ones(numel)
        return [t], lambda: group.allreduce([t])
    if kind == "broadcast":
        t = torch.ones(numel)
        return [t], lambda: group.broadcast([t])
    if kind == "alltoall":  # S = the input
        src, dst = torch.ones(numel), torch.empty(numel)
        return [src, dst], lambda: group.alltoall_base(dst, src, [], [])
    if kind == "allgather":  # S = the output
        src, dst = torch.ones(numel // n), torch.empty(numel // n * n)
        return [src, dst], lambda: group._allgather_base(dst, src)
    if kind == "barrier":
        return [], lambda: group.barrier()
    raise ValueError(kind)


def time_collectives(cases: list[tuple[str, int, str]], repeats: int = 1) -> list[dict]:
    """Per case (kind, bytes, link spec): the wall time from launch to a finished wait() on
    an EmulatedLinkGroup over WORLD, the best of `repeats`; also the real group's time."""
    world = dist.group.WORLD
    out = []
    for kind, nbytes, spec in cases:
        emulated = EmulatedLinkGroup(world, spec)
        _, launch = _collective(emulated, kind, nbytes)
        _, launch_real = _collective(world, kind, nbytes)
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
        out.append({"kind": kind, "bytes": nbytes, "link": spec, "ms": min(times),
                    "real_ms": min(real), "launch_ms": max(launch_ms)})
    return out


def queued_collectives(nbytes: int, spec: str) -> dict:
    """An allreduce, an alltoall and an allgather launched back to back without waiting:
    the time each finishes after the first launch, and how long the launches took."""
    emulated = EmulatedLinkGroup(dist.group.WORLD, spec)
    launches = [_collective(emulated, kind, nbytes)[1]
                for kind in ("allreduce", "alltoall", "allgather")]
    dist.group.WORLD.barrier().wait()
    t0 = time.perf_counter()
    works = [launch() for launch in launches]
    launched_ms = (time.perf_counter() - t0) * 1e3
    done_ms = []
    for work in works:
        work.wait()
        done_ms.append((time.perf_counter() - t0) * 1e3)
    return {"launched_ms": launched_ms, "done_ms": done_ms}


def _hook(name: str) -> object:
    hooks = fastddp.hooks
    return {"allreduce": None, "bf16": hooks.bf16(), "bf16_fp32": hooks.bf16(accumulate="fp32"),
            "powersgd": hooks.powersgd(matrix_approximation_rank=2, start_powerSGD_iter=2),
            "batched_powersgd": hooks.batched_powersgd(start_powerSGD_iter=2)}[name]


def _train(group: dist.ProcessGroup | None, hook_name: str,
           steps: int) -> tuple[list[torch.Tensor], dict]:
    """The trained parameters, and the wrapper's stats after construction (if wrapped)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 48), nn.ReLU(),
                          nn.Linear(48, 8))
    ddp = fastddp.DistributedDataParallel(model, process_group=group, bucket_cap_mb=0.005)
    hook = _hook(hook_name)
    if hook is not None:
        ddp.register_comm_hook(None, hook)
    built = group.stats() if isinstance(group, EmulatedLinkGroup) else {}
    gen = torch.Generator().manual_seed(10 + dist.get_rank())
    for _ in range(steps):
        x = torch.randn(16, 32, generator=gen)
        loss = (ddp(x) - x[:, :8]).square().mean()
        loss.backward()
        # Plain SGD by hand: torch.optim's first step imports torch._dynamo (seconds per rank).
        with torch.no_grad():
            for p in model.parameters():
                p.add_(p.grad, alpha=-0.05)
                p.grad = None
    return [p.detach().clone() for p in model.parameters()], built


def train_through_wrapper(hook_name: str, steps: int = 5) -> dict:
    """fastddp with `hook_name` over WORLD and over an EmulatedLinkGroup of WORLD (a fast
    link): whether the parameters agree bit for bit, what the wrapper saw during
    construction, and what it saw during the training steps (counts and bytes per kind)."""
    plain, _ = _train(None, hook_name, steps)
    emulated = EmulatedLinkGroup(dist.group.WORLD, "20GB/s,10us")
    wrapped, built = _train(emulated, hook_name, steps)
    after = emulated.stats()
    return {"identical": all(torch.equal(a, b) for a, b in zip(plain, wrapped, strict=True)),
            "construction": built["counts"],
            "counts": {k: n - built["counts"].get(k, 0) for k, n in after["counts"].items()
                       if n - built["counts"].get(k, 0)},
            "bytes": {k: b - built["bytes"].get(k, 0) for k, b in after["bytes"].items()
                      if b - built["bytes"].get(k, 0)},
            "grad_bytes": sum(p.numel() * 4 for p in plain)}


def torch_hook_states() -> dict:
    """LinkEmulation.hook_state on torch's hooks: the group each would reduce over."""
    emulation = LinkEmulation("1GB/s")
    world = emulation.group_for(None)
    state = powerSGD_hook.PowerSGDState(process_group=None, start_powerSGD_iter=2)
    got = {
        "allreduce_hook": emulation.hook_state(None, default_hooks.allreduce_hook, print),
        "explicit_group": emulation.hook_state(dist.group.WORLD, default_hooks.bf16_compress_hook,
                                               print),
        "powersgd": emulation.hook_state(state, powerSGD_hook.powerSGD_hook, print).process_group,
        "fastddp_none": emulation.hook_state(None, fastddp.hooks.bf16(), print),
    }
    return {name: (value is world) if name != "fastddp_none" else value is None
            for name, value in got.items()} | {"groups": len(emulation.groups)}


def dist_api_on_wrapper() -> dict:
    """torch.distributed's own functions given the wrapper as group=."""
    emulated = EmulatedLinkGroup(dist.group.WORLD, "10GB/s")
    t = torch.full((4,), float(dist.get_rank() + 1))
    dist.all_reduce(t, group=emulated)
    b = torch.full((2,), float(dist.get_rank()))
    dist.broadcast(b, src=1, group=emulated)
    gathered = [torch.empty(1) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, torch.tensor([float(dist.get_rank())]), group=emulated)
    dist.barrier(group=emulated)
    return {"sum": t[0].item(), "broadcast": b[0].item(),
            "gathered": [g.item() for g in gathered], "rank": dist.get_rank(emulated),
            "backend": dist.get_backend(emulated), "counts": emulated.stats()["counts"]}
