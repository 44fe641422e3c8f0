"""EmulatedLinkGroup scenarios, run on every rank of a harness world (see harness.py), and
the fake clock that the emulator's timing tests run on.

Timing: fastddp.link.emulator reads its clock through ``link_emulator._clock``; FakeClock
takes its place, so that emulated time moves only when the test moves it. A collective must
not be complete just before the end that the test computed by hand from Note [collective
cost], and must complete once the clock passes that end: the schedule is checked without
measuring wall time, so a loaded machine cannot fail it (the emulator's accuracy in wall
time is benchmarks/link_emulator.py's). Training: fastddp trained over the plain group and
over the wrapper must agree bit for bit, and the wrapper must have seen the collectives each
hook issues.
"""

import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

import fastddp
from fastddp.launch._emulate_link import LinkEmulation
from fastddp.link import EmulatedLinkGroup
from fastddp.link import emulator as link_emulator

# The benchmark's collective launchers (benchmarks/link_emulator.py), so that the schedule
# checked here is the one whose wall time the benchmark measures.
sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))
from link_emulator import collective as _collective  # noqa: E402

MB = 1_000_000
# Fake seconds either side of an end: far below any collective's time (>= 1 ms), far above
# the float rounding between the hand-computed end and the emulator's sum of costs.
EPS_S = 1e-6
# Real seconds a completer gets to (wrongly) complete a collective whose end the fake clock
# has not reached. Only a broken emulator could fail the check, whatever the load; a loaded
# machine could only let one pass unseen.
GRACE_S = 0.05
# "No hang" deadline, in real seconds, for a collective to complete once the fake clock has
# passed its end (it takes well under 0.1 s: a thread wake-up and the real collective).
NO_HANG_S = 30.0


class FakeClock:
    """``with FakeClock() as clock``: link_emulator's clock for the block. Its time moves only
    by ``advance_to``, which then wakes the completers of the groups made by ``group``."""

    def __init__(self):
        self.now = 0.0
        self._groups: list[EmulatedLinkGroup] = []

    def __call__(self) -> float:
        return self.now

    def __enter__(self) -> "FakeClock":
        self._saved = link_emulator._clock
        link_emulator._clock = self
        return self

    def __exit__(self, *exc: object) -> None:
        link_emulator._clock = self._saved

    def group(self, inner: dist.ProcessGroup, link: str) -> EmulatedLinkGroup:
        group = EmulatedLinkGroup(inner, link)
        self._groups.append(group)
        return group

    def advance_to(self, t: float) -> None:
        self.now = t
        for group in self._groups:
            completer = group._completer
            with completer._cond:  # its thread waits on it until the next end
                completer._cond.notify()


def _wait_done(work: object, what: str) -> None:
    deadline = time.monotonic() + NO_HANG_S
    while not work.is_completed():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not complete {NO_HANG_S:.0f} s after the fake clock "
                                 "passed its end")
        time.sleep(0.001)


def launch_all(launches: list) -> list:
    """The Works of ``launches``, called in order on a thread of their own. The fake clock
    does not move meanwhile, so a launch that waited for the link would never return: the
    thread is given NO_HANG_S, and none of the Works may be complete."""
    works: list = []
    thread = threading.Thread(target=lambda: works.extend(launch() for launch in launches),
                              daemon=True)
    thread.start()
    thread.join(NO_HANG_S)
    assert not thread.is_alive(), "launching waits for the emulated link"
    assert len(works) == len(launches), "a launch raised (see the thread's traceback above)"
    done = [i for i, w in enumerate(works) if w.is_completed()]
    assert not done, f"collectives {done} complete before the fake clock moved"
    return works


def step_through(clock: FakeClock, works: list, ends: list[float], names: list[str]) -> None:
    """Moves the clock to just before, then just after each end in turn: the collective (and
    every later one) must not be complete before, and must complete after."""
    for i, (end, name) in enumerate(zip(ends, names, strict=True)):
        clock.advance_to(end - EPS_S)
        time.sleep(GRACE_S)
        early = [n for n, w in zip(names[i:], works[i:]) if w.is_completed()]
        assert not early, f"complete before {end * 1e3:.3f} ms (fake clock): {early}"
        clock.advance_to(end + EPS_S)
        _wait_done(works[i], f"{name}, due at {end * 1e3:.3f} ms")


def collectives_end_on_schedule(cases: list[tuple[str, int, str, float]]) -> int:
    """Per case (kind, bytes, link spec, its time in s by Note [collective cost]), on a
    wrapper of its own over WORLD: launched on an idle link, the collective is not complete
    after the launch returns nor just before launch + time, and completes after it. Returns
    the cases done."""
    with FakeClock() as clock:
        for kind, nbytes, spec, seconds in cases:
            launch = _collective(clock.group(dist.group.WORLD, spec), kind, nbytes)
            start = clock.now
            works = launch_all([launch])
            step_through(clock, works, [start + seconds], [f"{kind} on {spec}"])
    return len(cases)


def queued_collectives(nbytes: int, spec: str, seconds: list[float]) -> list[float]:
    """An allreduce, an alltoall and an allgather launched back to back without waiting on
    one wrapper: none is complete when the launches return (launch_all); each completes at
    the end of the one before plus its own ``seconds``, not earlier. Returns the first two
    elements of the allreduce's result."""
    names = ["allreduce", "alltoall", "allgather"]
    with FakeClock() as clock:
        group = clock.group(dist.group.WORLD, spec)
        total = torch.ones(nbytes // 4)
        launches = [lambda: group.allreduce([total])] + [
            _collective(group, kind, nbytes) for kind in names[1:]]
        works = launch_all(launches)
        ends = [sum(seconds[: i + 1]) for i in range(3)]
        step_through(clock, works, ends, names)
    return total[:2].tolist()


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
