"""``fastddp.hooks.auto()`` scenarios, run on every rank of a harness world (see harness.py).

The models, the tuned and fixed runs and their interleaved timing are benchmarks/auto_runs.py
(the benchmark's own code, so that the test checks what the benchmark reports). Here: the
training numbers. An auto run against a run that installs auto's configurations at the same
steps by hand (``_auto_install``, as the tuner does), and for the lossless policy against
stock torch DDP, whose reducer fastddp's code shares nothing with.
"""

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import auto_runs  # noqa: E402  (benchmarks/auto_runs.py)
import fastddp  # noqa: E402
from fastddp import advise  # noqa: E402
from fastddp import auto as auto_module  # noqa: E402
from fastddp.link_emulator import EmulatedLinkGroup  # noqa: E402

auto_against_fixed = auto_runs.auto_against_fixed


def _train(ddp: nn.Module, kind: str, steps: int,
           schedule: list[tuple[int, str, bool]] = (), groups: tuple | None = None
           ) -> list[torch.Tensor]:
    """``steps`` SGD steps; before step i, the candidate ``schedule`` names for i (if any)
    is installed as auto installs it: a new hook when the entry says so, else the one that
    candidate had before (hierarchical ones over ``groups``). Returns the parameters."""
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
                              int((cap if cap is not None else auto_runs.CAP_MB) * 2**20))
        opt.zero_grad()
        ddp(auto_runs.batch(kind, gen)).square().mean().backward()
        opt.step()
    return [p.detach().clone() for p in ddp.module.parameters()]


def _wrap(kind: str, group: dist.ProcessGroup) -> fastddp.DistributedDataParallel:
    return fastddp.DistributedDataParallel(auto_runs.model(kind), process_group=group,
                                           bucket_cap_mb=auto_runs.CAP_MB)


def auto_and_replay(kind: str, link: str, policy: str, steps: int = 45) -> dict:
    """auto(policy) for ``steps``; the same steps with auto's history replayed by hand; for
    the lossless policy, torch DDP. Whether each agrees, and auto's summary."""
    group = EmulatedLinkGroup(dist.group.WORLD, link)
    tuned = _wrap(kind, group)
    tuned.register_comm_hook(None, fastddp.hooks.auto(policy, verbose=False))
    params = _train(tuned, kind, steps)
    summary = tuned.auto_choice()
    replayed = _train(_wrap(kind, group), kind, steps, summary["history"])
    out = {"auto": summary,
           "replay_identical": all(torch.equal(a, b) for a, b in zip(params, replayed))}
    if policy == "lossless":
        reference = nn.parallel.DistributedDataParallel(auto_runs.model(kind),
                                                        bucket_cap_mb=auto_runs.CAP_MB)
        out["max_diff_vs_torch"] = max((a - b).abs().max().item() for a, b in zip(
            params, _train(reference, kind, steps)))
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


def auto_hierarchical(kind: str, inter_link: str, steps: int = 80) -> dict:
    """auto("any") on 2 nodes x 2 ranks (node-major): the flat ring and the inter-node group
    on the ``inter_link``, the intra-node group on 100 GB/s (emulated; the real transport
    is loopback); every family that qualifies gets a trial. Then auto's history replayed by
    hand over the same groups."""
    intra, inter = fastddp.hooks.hierarchical_groups(2)
    groups = (EmulatedLinkGroup(intra, "100GB/s"), EmulatedLinkGroup(inter, inter_link))
    world = EmulatedLinkGroup(dist.group.WORLD, inter_link)
    tuned = _wrap(kind, world)
    tuned.register_comm_hook(None, fastddp.hooks.auto("any", groups=groups, trials=5,
                                                      verbose=False))
    params = _train(tuned, kind, steps)
    summary = tuned.auto_choice()
    replayed = _train(_wrap(kind, world), kind, steps, summary["history"], groups)
    return {"auto": summary, "names": tuned._auto.names,
            "replay_identical": all(torch.equal(a, b) for a, b in zip(params, replayed))}


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
