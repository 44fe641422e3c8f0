"""What step_time.py, compile_step.py and overlap_optimizer.py share: the benchmarked
models (SHAPES), one training step of a model, and blocks of steps timed interleaved with
their paired-ratio summary."""

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

TorchDDP = nn.parallel.DistributedDataParallel


@dataclass(frozen=True)
class Shape:
    """One benchmarked model: how to build it, its per-rank input, steps per block."""

    name: str
    build: Callable[[], nn.Module]
    input_shape: tuple[int, ...]
    block_steps: int
    dtype: torch.dtype = torch.float32  # the model's and its input's

    def input(self, gen: torch.Generator) -> torch.Tensor:
        return torch.randn(self.input_shape, generator=gen).to(self.dtype)


def _mlp(width_in: int, width: int, depth: int, width_out: int) -> nn.Module:
    layers: list[nn.Module] = [nn.Linear(width_in, width), nn.ReLU()]
    for _ in range(depth - 1):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, width_out))


def _convnet() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(64, 128, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(128 * 4 * 4, 256), nn.ReLU(), nn.Linear(256, 10),
    )


SHAPES = [
    # Many tiny tensors: per-step and per-parameter overhead dominates.
    Shape("tiny 64 Linear(16,16), 17k", lambda: _mlp(16, 16, 63, 16), (4, 16), 16),
    Shape("MLP 0.8M (7 Linear, w384)", lambda: _mlp(256, 384, 6, 10), (32, 256), 8),
    Shape("MLP 10.5M (4 Linear, w2048)", lambda: _mlp(1024, 2048, 3, 10), (16, 1024), 2),
    Shape("convnet 0.6M (3 conv)", _convnet, (8, 3, 32, 32), 4),
]
# Large enough that a pass over the gradients (92 MB in float32) shows in the step (the one-pass
# issue, 55): step_time.py --large.
LARGE_SHAPES = [
    Shape("MLP 23M (7 Linear, w2048)", lambda: _mlp(1024, 2048, 6, 10), (16, 1024), 1),
    Shape("MLP 23M bf16 (7 Linear, w2048)", lambda: _mlp(1024, 2048, 6, 10).to(torch.bfloat16),
          (16, 1024), 1, torch.bfloat16),
]


def grad_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


def timed_blocks(
    variants: dict[str, Callable[[], None]], rounds: int, steps: int, warmup: int
) -> dict[str, list[float]]:
    """Per-step ms (block means) of each variant, blocks interleaved in rotating order."""
    for step in variants.values():
        for _ in range(warmup):
            step()
    names = list(variants)
    ms: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        order = names[r % len(names):] + names[: r % len(names)]
        if len(names) == 2 and r % 2:
            order = names[::-1]
        for name in order:
            step = variants[name]
            start = time.perf_counter()
            for _ in range(steps):
                step()
            ms[name].append((time.perf_counter() - start) * 1e3 / steps)
    return ms


def make_step(model: nn.Module, x: torch.Tensor) -> Callable[[], None]:
    opt = torch.optim.SGD(model.parameters(), lr=1e-6)

    def step() -> None:
        opt.zero_grad()
        model(x).float().square().mean().backward()
        opt.step()

    return step


def replicas(shape: Shape, n: int) -> list[nn.Module]:
    torch.manual_seed(0)
    models = [shape.build() for _ in range(n)]
    for m in models[1:]:
        m.load_state_dict(models[0].state_dict())
    return models


def summary(ms: dict[str, list[float]], a: str, b: str) -> dict[str, float]:
    # Blocks of the same round ran back to back: their ratio cancels slow drifts
    # in machine load, so the paired ratios show the spread.
    paired = sorted(x / y for x, y in zip(ms[a], ms[b]))
    q = len(paired) // 4
    return {
        "a_ms": statistics.median(ms[a]), "b_ms": statistics.median(ms[b]),
        "ratio": statistics.median(ms[a]) / statistics.median(ms[b]),
        "paired": statistics.median(paired), "q1": paired[q], "q3": paired[-1 - q],
    }
