"""``fastddp.hooks.auto()`` scenarios, run on every rank of a harness world (see harness.py).

The models are benchmarks/common/auto_runs.py's (``wide``, ``convnet``), and ``sleep``:
sleep_model.SleepNet, whose compute is a sleep in backward, for the runs whose decision
depends on time (over an emulated link, whose delays are sleeps too: no CPU load changes
them). Auto's speed against the fixed configurations is the benchmark's
(benchmarks/auto.py), not a test's. Here: the decisions and the training numbers. An auto
run against a run that installs auto's configurations at the same steps by hand
(``_auto_install``, as the tuner does), and for the lossless policy against stock torch
DDP, whose reducer fastddp's code shares nothing with.
"""

import os
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))

import fastddp  # noqa: E402
from common import auto_runs  # noqa: E402  (benchmarks/common/auto_runs.py)
from fastddp.link import EmulatedLinkGroup  # noqa: E402
from fastddp.tuning import advise  # noqa: E402
from fastddp.tuning import auto as auto_module  # noqa: E402
from tests.python import sleep_model  # noqa: E402


def _cap_mb(kind: str) -> float:
    return sleep_model.BUCKET_CAP_MB if kind == "sleep" else auto_runs.CAP_MB


def _train(ddp: nn.Module, kind: str, steps: int,
           schedule: list[tuple[int, str, bool]] = (), groups: tuple | None = None,
           stop: Callable[[int], bool] | None = None) -> list[torch.Tensor]:
    """``steps`` SGD steps (fewer if ``stop(steps done)`` holds after one); before step i,
    the candidate ``schedule`` names for i (if any) is installed as auto installs it: a new
    hook when the entry says so, else the one that candidate had before (hierarchical ones
    over ``groups``). Returns the parameters."""
    switches = {step: (name, new) for step, name, new in schedule}
    natives: dict[str, object] = {}
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(10 + dist.get_rank())
    for i in range(steps):
        if i in switches:
            name, new = switches[i]
            if new:
                natives[name] = fastddp.hooks.resolve(None, auto_module.hook_for(name, groups),
                                                      ddp.process_group, ddp._reducer_params)
            cap = advise.variant_cap(name)
            ddp._auto_install(natives[name],
                              int((cap if cap is not None else _cap_mb(kind)) * 2**20))
        opt.zero_grad()
        x = sleep_model.batch(gen) if kind == "sleep" else auto_runs.batch(kind, gen)
        ddp(x).square().mean().backward()
        opt.step()
        if stop is not None and stop(i + 1):
            break
    return [p.detach().clone() for p in ddp.module.parameters()]


def _model(kind: str, sleep_ms: float) -> nn.Module:
    return sleep_model.SleepNet(sleep_ms) if kind == "sleep" else auto_runs.model(kind)


def _wrap(kind: str, group: dist.ProcessGroup,
          sleep_ms: float = 0.0) -> fastddp.DistributedDataParallel:
    return fastddp.DistributedDataParallel(_model(kind, sleep_ms), process_group=group,
                                           bucket_cap_mb=_cap_mb(kind))


def _tune_and_replay(kind: str, group: dist.ProcessGroup, hook: object, steps: int,
                     sleep_ms: float, after_choice: int | None, replay: bool,
                     groups: tuple | None = None) -> tuple[dict, list[torch.Tensor]]:
    """auto (``hook``) for ``steps`` (or until ``after_choice`` steps have run on its
    choice); unless not ``replay``, the same steps with auto's history replayed by hand
    (hierarchical candidates over ``groups``). auto's summary, the steps run and whether
    the replay agrees bit for bit; and auto's parameters."""
    tuned = _wrap(kind, group, sleep_ms)
    tuned.register_comm_hook(None, hook)
    done = [0]

    def stop(n: int) -> bool:
        done[0] = n
        chosen = tuned.auto_choice()["chosen_at_step"]
        return after_choice is not None and chosen is not None and n >= chosen + after_choice

    params = _train(tuned, kind, steps, stop=stop)
    summary = tuned.auto_choice()
    out = {"auto": summary, "steps": done[0], "names": tuned._auto.names}
    if replay:
        replayed = _train(_wrap(kind, group, sleep_ms), kind, done[0], summary["history"],
                          groups)
        out["replay_identical"] = all(torch.equal(a, b) for a, b in zip(params, replayed))
    return out, params


def auto_and_replay(kind: str, link: str, policy: str, steps: int = 45, sleep_ms: float = 0.0,
                    after_choice: int | None = None, replay: bool = True) -> dict:
    """auto(policy) over ``link`` (_tune_and_replay); for the lossless policy, also torch
    DDP's largest parameter difference. ``sleep_ms``: the sleep model's backward (kind
    ``sleep``)."""
    group = EmulatedLinkGroup(dist.group.WORLD, link)
    out, params = _tune_and_replay(kind, group, fastddp.hooks.auto(policy, verbose=False),
                                   steps, sleep_ms, after_choice, replay)
    if policy == "lossless":
        reference = nn.parallel.DistributedDataParallel(_model(kind, sleep_ms),
                                                        bucket_cap_mb=_cap_mb(kind))
        out["max_diff_vs_torch"] = max((a - b).abs().max().item() for a, b in zip(
            params, _train(reference, kind, out["steps"])))
    return out


def bucket_switches_vs_torch(kind: str, steps: int = 12) -> float:
    """Bucket caps switched the way auto switches them (a new reducer each time, the old
    one unhooked), against torch DDP at one cap: the largest parameter difference."""
    group = dist.group.WORLD
    schedule = [(2, "allreduce_fp32@1MB", True), (5, "allreduce_fp32@16MB", True),
                (7, "allreduce_fp32", True), (9, "allreduce_fp32@1MB", False)]
    params = _train(_wrap(kind, group), kind, steps, schedule)
    reference = nn.parallel.DistributedDataParallel(auto_runs.model(kind),
                                                    bucket_cap_mb=auto_runs.CAP_MB)
    return max((a - b).abs().max().item()
               for a, b in zip(params, _train(reference, kind, steps)))


def auto_hierarchical(kind: str, inter_link: str, intra_link: str = "100GB/s",
                      steps: int = 80, sleep_ms: float = 0.0,
                      after_choice: int | None = None) -> dict:
    """auto("any") on 2 nodes x 2 ranks (node-major): the flat ring and the inter-node group
    on ``inter_link``, the intra-node group on ``intra_link`` (emulated over loopback);
    every family that qualifies gets a trial. Then auto's history replayed by hand over the
    same groups (_tune_and_replay)."""
    intra, inter = fastddp.hooks.hierarchical_groups(2)
    groups = (EmulatedLinkGroup(intra, intra_link), EmulatedLinkGroup(inter, inter_link))
    world = EmulatedLinkGroup(dist.group.WORLD, inter_link)
    hook = fastddp.hooks.auto("any", groups=groups, trials=5, verbose=False)
    out, _ = _tune_and_replay(kind, world, hook, steps, sleep_ms, after_choice, True, groups)
    return out


def auto_candidates_from_env(local_world_size: str, policy: str) -> tuple[list[str], list]:
    """auto(policy)'s candidates under torchrun's LOCAL_WORLD_SIZE, and its groups' sizes."""
    saved = os.environ.get("LOCAL_WORLD_SIZE")
    os.environ["LOCAL_WORLD_SIZE"] = local_world_size
    try:
        ddp = _wrap("convnet", dist.group.WORLD)
        ddp.register_comm_hook(None, fastddp.hooks.auto(policy, verbose=False))
    finally:
        if saved is None:
            del os.environ["LOCAL_WORLD_SIZE"]
        else:
            os.environ["LOCAL_WORLD_SIZE"] = saved
    groups = ddp._auto.hier_groups
    return ddp._auto.names, None if groups is None else [g.size() for g in groups]
