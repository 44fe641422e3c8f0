"""Per-rank runs of ``fastddp.hooks.auto()`` against fixed configurations, on a link of the
caller's choosing (an EmulatedLinkGroup over WORLD). benchmarks/auto.py calls these on
every rank of a gloo world (its auto / best column is the speed comparison that the tests
leave to it); tests/python/tuning/auto_scenarios.py uses the models.

Timing is interleaved: every configuration (auto's tuned model among them) is its own model
and optimizer, all alive at once; each round steps each of them once, in a rotating order,
so that load drifting on a shared machine hits every configuration alike. A configuration's
figure is the median of its step times (rank 0's clock, zero_grad to optimizer step) over
the rounds after the warm-up ones.
"""

import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

import fastddp
from fastddp.link import EmulatedLinkGroup
from fastddp.tuning import advise
from fastddp.tuning import auto as auto_module

MIB = 1024 * 1024
CAP_MB = 4.0  # bucket_cap_mb of every model: auto's lossless candidates are 1, 4 and 16 MB


class ViTBlock(nn.Module):
    """One ViT-L/32 encoder block's layers at full width (d=1024, MLP 4096, ~50 MB of fp32
    gradients), attention reduced to its projections: the shape of the gradients, at a
    compute a CPU can run."""

    def __init__(self, d: int = 1024):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.norm1(x)).chunk(3, dim=-1)
        x = x + self.proj(q * torch.sigmoid(k) + v)
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm2(x))))


def model(kind: str) -> nn.Module:
    """``vit`` (gradient-heavy), ``wide`` (gradient-heavy, ~50 MB, for tests) or ``convnet``
    (compute-heavy: ~0.3 MB of gradients for ~90 ms of one core's compute)."""
    torch.manual_seed(0)
    if kind == "vit":
        return nn.Sequential(ViTBlock(), nn.Linear(1024, 10))
    if kind == "wide":
        return nn.Sequential(nn.Linear(2048, 2048), nn.Tanh(), nn.Linear(2048, 2048),
                             nn.Tanh(), nn.Linear(2048, 2048), nn.Tanh(), nn.Linear(2048, 10))
    if kind == "convnet":
        return nn.Sequential(nn.Conv2d(3, 64, 3, padding=1), nn.ReLU(),
                             nn.Conv2d(64, 64, 3, padding=1), nn.ReLU(),
                             nn.Conv2d(64, 64, 3, padding=1), nn.ReLU(),
                             nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10))
    raise ValueError(f"unknown model {kind!r}")


def batch(kind: str, gen: torch.Generator) -> torch.Tensor:
    if kind == "vit":
        return torch.randn(2, 8, 1024, generator=gen)  # 2 images x 8 tokens
    if kind == "wide":
        return torch.randn(4, 2048, generator=gen)
    return torch.randn(8, 3, 48, 48, generator=gen)


class Run:
    """One configuration: a model over the link, its hook, its optimizer and data."""

    def __init__(self, kind: str, group: dist.ProcessGroup, hook: object = None,
                 cap_mb: float = CAP_MB):
        self.kind = kind
        self.ddp = fastddp.DistributedDataParallel(model(kind), process_group=group,
                                                   bucket_cap_mb=cap_mb)
        if hook is not None:
            self.ddp.register_comm_hook(None, hook)
        self.opt = torch.optim.SGD(self.ddp.parameters(), lr=0.01)
        self.gen = torch.Generator().manual_seed(10 + dist.get_rank())
        self.times: list[float] = []

    def step(self) -> float:
        t0 = time.perf_counter()
        self.opt.zero_grad()
        self.ddp(batch(self.kind, self.gen)).square().mean().backward()
        self.opt.step()
        self.times.append((time.perf_counter() - t0) * 1e3)
        return self.times[-1]


def fixed(kind: str, group: dist.ProcessGroup, name: str) -> Run:
    """A run of candidate ``name`` (fastddp/tuning/candidates.py's names) from the first step."""
    cap = advise.variant_cap(name)
    return Run(kind, group, auto_module.hook_for(name), cap if cap is not None else CAP_MB)


def tune(kind: str, group: dist.ProcessGroup, policy: str, max_steps: int = 80) -> Run:
    """A run with auto(policy), stepped until auto has chosen (and 3 steps beyond, so a
    chosen PowerSGD is past its fresh warm-up)."""
    run = Run(kind, group, fastddp.hooks.auto(policy))
    for _ in range(max_steps):
        run.step()
        choice = run.ddp.auto_choice()
        if choice["choice"] is not None and len(run.times) >= choice["chosen_at_step"] + 3:
            return run
    raise RuntimeError(f"auto:{policy} did not choose within {max_steps} steps: {choice}")


def interleaved(runs: dict[str, Run], rounds: int, warmup: int = 3) -> dict[str, float]:
    """Median step time of each run over ``rounds`` rotating rounds (module docstring)."""
    names = list(runs)
    for r in range(warmup + rounds):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            runs[name].step()
    return {n: statistics.median(runs[n].times[-rounds:]) for n in names}


def auto_against_fixed(kind: str, link: str, policy: str, rounds: int = 8,
                       names: list[str] | None = None) -> dict:
    """auto(policy)'s tuned run and every candidate of the policy (or ``names``), timed
    interleaved on ``link``; auto's summary and its tuning steps' count."""
    group = EmulatedLinkGroup(dist.group.WORLD, link)
    tuned = tune(kind, group, policy)
    summary = tuned.ddp.auto_choice()
    candidates = names or auto_module.candidates.for_auto(fastddp.hooks.auto(policy), CAP_MB)
    runs = {"auto": tuned, **{n: fixed(kind, group, n) for n in candidates}}
    medians = interleaved(runs, rounds)
    grads = sum(p.numel() * 4 for p in tuned.ddp.parameters())
    return {"kind": kind, "link": link, "policy": policy, "auto": summary,
            "tuning_steps": summary["chosen_at_step"], "medians": medians, "grad_bytes": grads}
