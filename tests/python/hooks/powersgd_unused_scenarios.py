"""PowerSGD under find_unused_parameters, run on every rank of a harness world (issue 43
item 1): a trunk used every step, one head used on even steps, one on odd steps and one
never, trained by torch DDP with torch's own powerSGD_hook and by fastddp with the native
hook, from one seed, side by side. Grads are compared after every backward, parameters are
copied back after every step (float rounding must not compound through the optimizer).
"""

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import fastddp
from fastddp import _C
from tests.python.hooks.powersgd_scenarios import TOL, serialized_powerSGD_hook
from tests.python.scenarios import agree, unwrap


class Heads(nn.Module):
    """A trunk and three heads, the heads registered last."""

    def __init__(self):
        super().__init__()
        self.trunk = nn.Linear(16, 32)
        self.even = nn.Linear(32, 4)
        self.odd = nn.Linear(32, 4)
        self.never = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor, step: int) -> torch.Tensor:
        h = torch.tanh(self.trunk(x))
        return (self.even if step % 2 == 0 else self.odd)(h)


# The trunk's bytes ((32 x 16 + 32) float32). torch DDP (find_unused_parameters, so no
# rebuild) fills buckets in registration order, closing one once it reaches the cap, then
# reverses them: the trunk's bucket closes exactly at its own two parameters, and the three
# heads form the other bucket, the first reduced.
HEADS_ONLY_MB = (32 * 16 + 32) * 4 / 2**20
# torch's default: every parameter in one bucket, the unused heads beside the trunk.
SHARED_MB = 25.0


def _grads_agree(ref: nn.Module, fast: nn.Module, where: str) -> None:
    """None where torch left None (a globally unused parameter's grad is not touched); NaN
    exactly where torch has NaN (torch's powerSGD_hook orthogonalizes a zero matrix, an
    unused head's, to NaN at rank <= 2 and keeps that in its error feedback for good);
    elsewhere within powersgd_scenarios.TOL (float32 rounding of the rank-r products,
    carried through error feedback and warm start), atol relative to the largest finite
    |torch| element of the gradient."""
    for (name, p), q in zip(ref.named_parameters(), fast.parameters(), strict=True):
        assert (p.grad is None) == (q.grad is None), (
            f"{where}: grad of {name}: torch {'None' if p.grad is None else 'set'}, "
            f"fastddp {'None' if q.grad is None else 'set'}")
        if p.grad is None:
            continue
        nan = p.grad.isnan()
        assert torch.equal(nan, q.grad.isnan()), (
            f"{where}: grad of {name}: NaN at {int(nan.sum())} elements in torch, "
            f"{int(q.grad.isnan().sum())} in fastddp")
        finite = p.grad[~nan]
        scale = finite.abs().max().item() if finite.numel() else 0.0
        torch.testing.assert_close(q.grad[~nan], finite, rtol=TOL["rtol"],
                                   atol=TOL["atol"] * scale,
                                   msg=lambda m, n=name: f"{where}: grad of {n}: {m}")


def unused_heads_training(bucket_cap_mb: float, steps: int = 8, rank: int = 2,
                          start: int = 2, seed: int = 7, as_on_device: bool = False) -> dict:
    """as_on_device: the hook's double-buffered state settles as on a GPU (Note
    [double-buffered step state]), where the state read is judged by its Qs."""
    _C._settle_as_on_device(as_on_device)
    try:
        return _train(bucket_cap_mb, steps, rank, start, seed)
    finally:
        _C._settle_as_on_device(False)


def _train(bucket_cap_mb: float, steps: int, rank: int, start: int, seed: int) -> dict:
    torch.manual_seed(0)
    base = Heads()
    args = {"bucket_cap_mb": bucket_cap_mb, "find_unused_parameters": True}
    ref = TorchDDP(copy.deepcopy(base), **args)
    fast = fastddp.DistributedDataParallel(copy.deepcopy(base), **args)
    state_args = {"matrix_approximation_rank": rank, "start_powerSGD_iter": start,
                  "min_compression_rate": 1, "random_seed": seed}
    ref.register_comm_hook(psgd.PowerSGDState(None, **state_args), serialized_powerSGD_hook)
    fast.register_comm_hook(psgd.PowerSGDState(None, **state_args), psgd.powerSGD_hook)
    opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (ref, fast)]
    for step in range(steps):
        g = torch.Generator().manual_seed(1000 * step + dist.get_rank())
        x, y = torch.randn(6, 16, generator=g), torch.randn(6, 4, generator=g)
        for net, opt in zip((ref, fast), opts):
            opt.zero_grad(set_to_none=step % 3 == 0)
            F.mse_loss(net(x, step), y).backward()
        agree(lambda s=step: _grads_agree(unwrap(ref), unwrap(fast), f"step {s}"))
        for opt in opts:
            opt.step()
        with torch.no_grad():
            for p, q in zip(ref.parameters(), fast.parameters()):
                q.copy_(p)
    names = [n for n, _ in unwrap(fast).named_parameters()]
    plan = [sorted({names[i].split(".")[0] for i in b}) for b in fast._reducer.bucket_plan()]
    return {"hook": fast._reducer.hook_name, "buckets": plan,
            "torch_bucket_sizes": ref._get_ddp_logging_data()["bucket_sizes"]}
