"""PowerSGD scenarios, run on every rank of a harness world (see harness.py).

torch DDP runs torch's ``powerSGD_hook`` (or ``batched_powerSGD_hook``) with a
``PowerSGDState``; fastddp runs the native hook with the same arguments, given as
``fastddp.hooks.powersgd(...)`` (``batched_powersgd(...)``) or as torch's own hook and state.
Grads are compared after every backward.
"""

import copy
from unittest import mock

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import fastddp
from tests.python.hooks.hooks_scenarios import compare_grads
from tests.python.scenarios import agree, unwrap


# Short names for PowerSGDState arguments in the test case tables.
RANK = "matrix_approximation_rank"
START = "start_powerSGD_iter"
NO_EF_WS = {"use_error_feedback": False, "warm_start": False}
# The PowerSGDState arguments both hooks (per-tensor and batched) are tested with: ranks
# 1-2, error feedback and warm start on and off, an early and a late start.
SHARED_CASES = {
    "rank1_ef_ws": {RANK: 1, START: 2},
    "rank2_ef_ws": {RANK: 2, START: 3},
    "rank1_plain_start1": {RANK: 1, START: 1, **NO_EF_WS},
    "rank2_plain_start3": {RANK: 2, START: 3, **NO_EF_WS},
    "rank2_ef_only": {RANK: 2, START: 3, "warm_start": False},
}

# PowerSGD's output is the rank-r product P Q^T: an element's float32 error follows the
# matrix's norm, not the element's own size (a small element is a difference of large
# products), so the bound is absolute, relative to the parameter's largest gradient element
# (hooks_scenarios.compare_grads). torch's BLAS and fastddp's fused kernels (dot products in
# double or in 16 float lanes) round each product differently: ~1e-6 of that scale at the
# first compressed step (measured). Orthogonalizing M Q amplifies it by that matrix's
# condition number (nearly parallel columns at rank 2, torch's float32 Householder QR
# against fastddp's double at rank 3), and the error feedback and warm-start Q carry each
# step's difference into the next: measured at most 4.2e-5 of the scale (rank 3 on 3 ranks,
# the second compressed step), 3.4e-5 beyond rtol 1e-5.
TOL = {"rtol": 1e-5, "atol": 5e-5}
# Batched: one square matrix per bucket, better conditioned than the per-parameter ones:
# measured at most 1.1e-5 of the scale, 4e-6 beyond rtol 1e-5.
BATCHED_TOL = {"rtol": 1e-5, "atol": 1e-5}
# Compression ran: a rank-r approximation moves gradients far more than 1e-3 relative,
# while the plain mean's rounding (another sum order) stays within a few ulps.
DIFFERS = {"rtol": 1e-3, "atol": 1e-6}


class Mixed(nn.Module):
    """Matrices worth compressing (two of one shape, for batching; a conv viewed as 8 x 36),
    a matrix that is not (2 x 24: (2 + 24) * 2 > 48), and 1-D biases."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(4, 8, 3, padding=1)
        self.a = nn.Linear(32, 24)
        self.b = nn.Linear(24, 24)
        self.c = nn.Linear(24, 24)
        self.head = nn.Linear(24, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.conv(x)).mean(dim=(2, 3))  # (batch, 8)
        h = torch.tanh(self.a(h.repeat(1, 4)))
        h = torch.tanh(self.b(h)) + torch.tanh(self.c(h))
        return self.head(h)


class Tall(nn.Module):
    """One 8200 x 16 matrix, compressed up to rank 4 (torch's min_compression_rate 2). On
    CUDA its P (8200 x r) takes fastddp's tall orthogonalization path from rank 3
    (CholeskyQR2, Note [tall orthogonalization]); torch uses linalg.qr."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(8200, 16) / 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ self.weight.t())


MODELS = {"mixed": Mixed, "tall": Tall}


def serialized_powerSGD_hook(state: psgd.PowerSGDState,
                             bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """torch's powerSGD_hook, waited for before the next bucket's hook runs. torch issues the
    P and Q allreduces from completion callbacks, racing the next bucket's first allreduce; on
    gloo, which pairs collectives by issue order, ranks then mismatch ("Received data size
    doesn't match expected size"). Waiting changes no number."""
    value = psgd.powerSGD_hook(state, bucket).wait()
    done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    done.set_result(value)
    return done


_ORTHOGONALIZE = psgd._orthogonalize


def _orthogonalize_2d(matrices: torch.Tensor, epsilon: float = 0) -> None:
    """torch's _orthogonalize, also on a 2-D matrix (as a batch of one). torch 2.14's
    batched_powerSGD_hook hands it its 2-D Q and P, and it asserts a 3-D batch (since torch
    PR #75157): without this the hook raises AssertionError on its first compressed step."""
    _ORTHOGONALIZE(matrices.unsqueeze(0) if matrices.dim() == 2 else matrices, epsilon)


def serialized_batched_powerSGD_hook(
        state: psgd.PowerSGDState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """torch's batched_powerSGD_hook, serialized as serialized_powerSGD_hook (it issues the Q
    allreduce from a callback), with _orthogonalize taking its 2-D matrices."""
    with mock.patch.object(psgd, "_orthogonalize", _orthogonalize_2d):
        value = psgd.batched_powerSGD_hook(state, bucket).wait()
    done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    done.set_result(value)
    return done


def batch(step: int, model: str = "mixed") -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + dist.get_rank())
    if model == "tall":
        return torch.randn(6, 16, generator=g), torch.randn(6, 8200, generator=g)
    return torch.randn(6, 4, 5, 5, generator=g), torch.randn(6, 2, generator=g)


def powersgd_training(steps: int = 6, how: str = "fastddp", fast_seed: int | None = None,
                      bucket_cap_mb: float = 0.004, gradient_as_bucket_view: bool = False,
                      batched: bool = False, model: str = "mixed", device: str = "cpu",
                      **state_args) -> dict:
    """torch DDP + torch's powerSGD_hook against fastddp + the native hook. `how`:
    "fastddp" (fastddp.hooks.powersgd) or "torch" (torch's hook and a PowerSGDState).
    fast_seed: a different random_seed for fastddp (a mismatch the check must catch).
    batched: torch's batched_powerSGD_hook and fastddp.hooks.batched_powersgd instead.
    model: a key of MODELS; device: where the model and its gradients live. The result says
    which fastddp orthogonalization paths ran."""
    torch.manual_seed(0)
    base = MODELS[model]().to(device)
    ddp_args = {"bucket_cap_mb": bucket_cap_mb, "gradient_as_bucket_view": gradient_as_bucket_view}
    ref = TorchDDP(copy.deepcopy(base), **ddp_args)
    fast = fastddp.DistributedDataParallel(copy.deepcopy(base), **ddp_args)
    ref_state = psgd.PowerSGDState(None, **state_args)
    ref.register_comm_hook(ref_state, serialized_batched_powerSGD_hook if batched
                           else serialized_powerSGD_hook)
    fast_args = dict(state_args)
    if fast_seed is not None:
        fast_args["random_seed"] = fast_seed
    if how == "torch":
        fast_state = psgd.PowerSGDState(None, **fast_args)
        # A generator already used: the native hook must go on from where it stands.
        for state in (ref_state, fast_state):
            state.rng.randint(1_000_000_000, size=1000)
        fast.register_comm_hook(fast_state,
                                psgd.batched_powerSGD_hook if batched else psgd.powerSGD_hook)
    else:
        make = fastddp.hooks.batched_powersgd if batched else fastddp.hooks.powersgd
        fast.register_comm_hook(None, make(**fast_args))
    opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (ref, fast)]
    profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
    with profiler:
        differs_from_mean = _train(ref, fast, opts, base, steps, model, device, batched,
                                   state_args)
    stats = fast.comm_stats()
    ranges = {e.name for e in profiler.events() if e.name.startswith("fastddp orthogonalize")}
    return {"hook": fast._reducer.hook_name, "differs_from_mean": differs_from_mean,
            "bytes_sent": stats["bytes_sent"], "bytes_reduced": stats["bytes_reduced"],
            "buckets": len(stats["buckets"]), "torch_stats": list(ref_state.compression_stats()),
            "orthogonalize_ranges": sorted(ranges)}


def _train(ref: nn.Module, fast: nn.Module, opts: list, base: nn.Module, steps: int,
           model: str, device: str, batched: bool, state_args: dict) -> bool:
    """powersgd_training's steps; whether a compressed step differed from the plain mean."""
    differs_from_mean = False
    for step in range(steps):
        inputs, target = (t.to(device) for t in batch(step, model))
        for net, opt in zip((ref, fast), opts):
            opt.zero_grad(set_to_none=step % 2 == 0)
            F.mse_loss(net(inputs), target).backward()
        tol = BATCHED_TOL if batched else TOL
        agree(lambda s=step: compare_grads(unwrap(ref), unwrap(fast), f"step {s}", tol))
        if step >= state_args.get("start_powerSGD_iter", 1000):
            differs_from_mean |= _differs_from_plain_mean(base, fast, inputs, target)
        for opt in opts:
            opt.step()
        with torch.no_grad():  # float rounding must not compound through the optimizer
            for p, q in zip(ref.parameters(), fast.parameters()):
                q.copy_(p)
    return differs_from_mean


def _differs_from_plain_mean(base: nn.Module, fast: nn.Module, inputs: torch.Tensor,
                             target: torch.Tensor) -> bool:
    """Whether the compressed grads differ from the exact average (compression ran)."""
    model = copy.deepcopy(unwrap(fast))
    model.zero_grad()
    F.mse_loss(model(inputs), target).backward()
    grads = [p.grad.clone() for p in model.parameters()]
    for g in grads:
        dist.all_reduce(g)
        g.div_(dist.get_world_size())
    return any(not torch.allclose(g, p.grad, **DIFFERS)
               for g, p in zip(grads, unwrap(fast).parameters()))


def argument_errors(batched: bool = False) -> list[str]:
    make = fastddp.hooks.batched_powersgd if batched else fastddp.hooks.powersgd
    messages = []
    for bad in ({"matrix_approximation_rank": 0}, {"start_powerSGD_iter": 1},
                {"random_seed": -1}, {"warm_start": 1}, {"min_compression_rate": "2"},
                {"orthogonalization_epsilon": -1.0}):
        try:
            make(**bad)
        except ValueError as e:
            messages.append(str(e))
        else:
            raise AssertionError(f"{bad} was accepted")
    return messages
