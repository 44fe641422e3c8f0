"""A model whose compute is a sleep: tests of decisions that depend on time (``--hook
auto``, ``--advise``) use it over an emulated link, whose delays are sleeps too. A sleep
takes no CPU, so it lasts as long on a machine whose cores are all busy as on an idle one,
and the decision cannot change with the load. The real compute (two 512x512 layers on a
batch of 8) is well under a millisecond, against sleeps of tens of milliseconds.

Gradient layout, with ``bucket_cap_mb=BUCKET_CAP_MB`` (the first bucket takes that cap
too): backward computes ``body``'s gradients first (two buckets of 1 MiB + a bias each, whose
collectives start at once), then sleeps ``sleep_ms`` (the backward of the layers below,
which have no parameters of their own), then the gradient of ``gate``, a single
scalar, alone in the last bucket. So the sleep is backward compute that the first two
buckets' communication overlaps: on a fast link it hides them (compute-bound), on a slow
one they outlast it (gradient-bound).
"""

import time

import torch
from torch import nn

WIDTH = 512
BUCKET_CAP_MB = 1.0
GRAD_BYTES = 4 * (2 * (WIDTH * WIDTH + WIDTH) + 1)  # fp32 gradients: body and gate


class SleepInBackward(torch.autograd.Function):
    """Identity forward; its backward sleeps ``seconds`` and passes the gradient on."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, seconds: float) -> torch.Tensor:
        ctx.seconds = seconds
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        time.sleep(ctx.seconds)
        return grad, None


class SleepNet(nn.Module):
    """``gate`` -> sleep in backward -> Linear, Tanh, Linear (module docstring)."""

    def __init__(self, sleep_ms: float):
        super().__init__()
        torch.manual_seed(0)
        self.sleep_s = sleep_ms / 1e3
        # Registered first, so its gradient comes last: the one after the sleep.
        self.gate = nn.Parameter(torch.ones(()))
        self.body = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(SleepInBackward.apply(x * self.gate, self.sleep_s))


def batch(gen: torch.Generator) -> torch.Tensor:
    return torch.randn(8, WIDTH, generator=gen)
