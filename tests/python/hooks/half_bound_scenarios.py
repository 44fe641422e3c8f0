"""The half hooks' modes that torch has no hook for (accumulate="fp32", error feedback)
against an invariant computed by torch: the exact mean of the ranks' gradients, gathered
from every rank, which each averaged gradient must equal within the wire format's error
bound (error_bound below). Run on every rank of a harness world (see harness.py).
"""

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F

import fastddp
from tests.python.hooks.hooks_scenarios import make_hook
from tests.python.scenarios import agree, mlp, vector_batch

U32 = 2.0 ** -24  # float32's unit roundoff
# Unit roundoff of the 16-bit format (half an ulp, relative: 2^-p for p significand bits)
# and half its smallest subnormal (the absolute error of rounding near zero).
WIRE = {"bf16": (2.0 ** -8, 2.0 ** -134), "fp16": (2.0 ** -11, 2.0 ** -25)}


def error_bound(grads: torch.Tensor, residual: torch.Tensor, got: torch.Tensor, wire: str,
                fp32_accumulate: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(bound on |got - mean|, bound on each rank's next residual), element by element, in
    float64. grads: (w, n), every rank's gradient; residual: (w, n), a bound on each rank's
    error-feedback residual (zeros without error feedback); got: the averaged gradient.

    Per rank the hook sends h_r = half(v_r), v_r = fl(fl(g_r * fl(1/w)) + e_r):
      |v_r| <= A_r = (|g_r| / w + E_r)(1 + 4u)
      |v_r - g_r / w| <= 4u A_r + E_r        (the rounded 1/w, the product, the sum)
      |h_r - v_r| <= u_h A_r + eta           (the cast; also the next residual's bound)
    then the ranks' h_r are summed:
      accumulate="fp32": w - 1 float32 additions, <= 1.01 (w - 1) u H with
        H = sum of (1 + u_h) A_r + eta, then one cast back, <= u_h |got| + eta;
      16-bit allreduce: w - 1 additions each rounded to 16 bits, each
        <= u_h (1 + u_h)^(w-1) H + eta.
    u: float32's unit roundoff; u_h, eta: the wire format's (WIRE)."""
    w = grads.shape[0]
    u_h, eta = WIRE[wire]
    a = (grads.abs() / w + residual) * (1 + 4 * U32)
    cast = u_h * a + eta
    h = ((1 + u_h) * a + eta).sum(0)
    if fp32_accumulate:
        accumulate = 1.01 * (w - 1) * U32 * h + u_h * got.double().abs() + eta
    else:
        accumulate = (w - 1) * (u_h * (1 + u_h) ** (w - 1) * h + eta)
    bound = (4 * U32 * a + residual + cast).sum(0) + accumulate
    return bound, cast


def within_bound_of_mean(spec: str, steps: int = 4) -> dict:
    """fastddp with `spec` (a hooks_scenarios.make_hook spec of the half hooks) trains; at
    every step each gradient is checked against the exact mean of the ranks' local
    gradients (torch's, float64) within error_bound. Returns the largest share of the
    bound used and whether the wire format left a trace (some element off the float32
    mean: the hook did compress)."""
    parts = spec.removeprefix("fastddp.").split("_")
    wire, fp32_accumulate, feedback = parts[0], "fp32" in parts, "ef" in parts
    torch.manual_seed(0)
    base = mlp()
    fast = fastddp.DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=0.001)
    fast.register_comm_hook(*make_hook(spec))
    opt = torch.optim.SGD(fast.parameters(), lr=0.05, momentum=0.9)
    w = dist.get_world_size()
    n = sum(p.numel() for p in base.parameters())
    residual = torch.zeros(w, n, dtype=torch.float64)
    used, traced = 0.0, False
    for step in range(steps):
        inputs, target = vector_batch(step)
        local = copy.deepcopy(fast.module)  # this rank's gradient before any reduction
        F.mse_loss(local(inputs), target).backward()
        mine = torch.cat([p.grad.flatten() for p in local.parameters()])
        grads = [torch.empty_like(mine) for _ in range(w)]
        dist.all_gather(grads, mine)
        grads = torch.stack(grads).double()
        opt.zero_grad()
        F.mse_loss(fast(inputs), target).backward()
        got = torch.cat([p.grad.flatten() for p in fast.parameters()])
        bound, cast = error_bound(grads, residual, got, wire, fp32_accumulate)
        error = (got.double() - grads.sum(0) / w).abs()
        used = max(used, (error / bound).max().item())
        traced |= not torch.equal(got, (grads.sum(0) / w).float())
        agree(lambda s=step: _expect(bool((error <= bound).all()),
                                     f"{spec}, step {s}: {int((error > bound).sum())} elements "
                                     f"beyond the bound, by up to "
                                     f"{(error - bound).max().item():.3g}"))
        if feedback:
            residual = cast
        opt.step()
    return {"used": used, "traced": traced}


def _expect(condition: bool, message: str) -> None:
    if not condition:
        raise AssertionError(message)
