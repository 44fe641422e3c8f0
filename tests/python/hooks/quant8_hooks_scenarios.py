"""Scenarios for the "int8" / "fp8" comm hooks, run on every rank of a harness world.

The reference is the algorithm of Note [8-bit wire formats] written again in torch ops
(quant8_reference.py) as a torch DDP comm hook that puts the packed bytes through real
alltoall / allgather collectives: fastddp's native hook must give its gradients bit for bit.
"""

import copy
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import fastddp
from tests.python.hooks import quant8_reference as ref
from tests.python.hooks.hooks_scenarios import EXACT, compare_grads
from tests.python.scenarios import agree, mlp, unwrap, vector_batch

_all_gather_single = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)


def native_hook(fmt: str, error_feedback: bool = True) -> fastddp.hooks.CommHook:
    if fmt == "int8":
        return fastddp.hooks.int8(error_feedback=error_feedback)
    return fastddp.hooks.fp8(format=fmt, error_feedback=error_feedback)


class ReferenceHook:
    """Quant8Hook's algorithm as a torch DDP comm hook, in torch ops and collectives."""

    def __init__(self, fmt: str, error_feedback: bool):
        self.fmt, self.error_feedback = fmt, error_feedback
        # torch's register_comm_hook reads these.
        self.__name__ = self.__qualname__ = f"reference_{fmt}_hook"
        self.residuals: dict[int, torch.Tensor] = {}
        # Per parameter, float64 sums over steps: the scaled gradients that came in and
        # what the first quantization sent of them (for the error-feedback invariant).
        self.came_in: dict[int, torch.Tensor] = {}
        self.sent: dict[int, torch.Tensor] = {}

    def __call__(self, state: object,
                 bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        world = dist.get_world_size()
        buffer = bucket.buffer()
        n = buffer.numel()
        unit = world * ref.BLOCK
        shard = math.ceil(n / unit) * unit // world
        params = bucket.parameters()
        scaled = buffer * (1.0 / world)
        v = scaled
        if self.error_feedback:
            v = scaled + torch.cat([self.residuals.get(id(p), torch.zeros_like(p).flatten())
                                    for p in params])
        staged = torch.zeros(shard * world, device=buffer.device)
        staged[:n] = v
        parts, first = [], []
        for r in range(world):
            codes, scales = ref.quantize(staged[r * shard:(r + 1) * shard], self.fmt)
            parts.append(ref.pack(codes, scales))
            first.append(ref.dequantize(codes, scales, self.fmt))
        first = torch.cat(first)[:n]
        offset = 0
        for p in params:
            k = slice(offset, offset + p.numel())
            if self.error_feedback:
                self.residuals[id(p)] = (v[k] - first[k]).clone()
            self.came_in[id(p)] = self.came_in.get(id(p), 0) + scaled[k].double()
            self.sent[id(p)] = self.sent.get(id(p), 0) + first[k].double()
            offset += p.numel()
        wire = torch.cat(parts)
        recv = torch.empty_like(wire)
        dist.all_to_all_single(recv, wire)
        rows = recv.view(world, -1)
        total = ref.dequantize(*ref.unpack(rows[0], shard), self.fmt)
        for r in range(1, world):
            total = total + ref.dequantize(*ref.unpack(rows[r], shard), self.fmt)
        gathered = torch.empty_like(wire)
        _all_gather_single(gathered, ref.pack(*ref.quantize(total, self.fmt)))
        rows = gathered.view(world, -1)
        result = torch.cat([ref.dequantize(*ref.unpack(rows[r], shard), self.fmt)
                            for r in range(world)])
        buffer.copy_(result[:n])
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result(buffer)
        return fut

    def invariant_gap(self) -> float:
        """max |sum in - (sum sent + residual)| over the elements, relative to sum |in|."""
        worst = 0.0
        for key, came in self.came_in.items():
            residual = self.residuals.get(key, torch.zeros_like(came)).double()
            gap = (came - self.sent[key] - residual).abs().max().item()
            worst = max(worst, gap / max(came.abs().max().item(), 1e-30))
        return worst


def matches_reference(fmt: str, error_feedback: bool = True, steps: int = 4,
                      **ddp_kwargs) -> dict:
    """torch DDP running ReferenceHook against fastddp's native hook: grads bit for bit
    after every backward, parameters following."""
    torch.manual_seed(0)
    base = mlp()
    reference = ReferenceHook(fmt, error_feedback)
    ref_model = TorchDDP(copy.deepcopy(base), **ddp_kwargs)
    fast = fastddp.DistributedDataParallel(copy.deepcopy(base), **ddp_kwargs)
    ref_model.register_comm_hook(None, reference)
    fast.register_comm_hook(None, native_hook(fmt, error_feedback))
    opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (ref_model, fast)]
    for step in range(steps):
        inputs, target = vector_batch(step)
        for model, opt in zip((ref_model, fast), opts):
            opt.zero_grad(set_to_none=step % 2 == 0)
            F.mse_loss(model(inputs), target).backward()
        agree(lambda: compare_grads(unwrap(ref_model), unwrap(fast), f"step {step}", EXACT))
        for opt in opts:
            opt.step()
    return {"hook": fast._reducer.hook_name, "gap": reference.invariant_gap()}


def error_against_exact_mean(fmt: str) -> float:
    """One step of fastddp + the hook against torch DDP's float32 mean; returns the worst
    |difference| / bound, the bound being what two block quantizations can cost (Note
    [8-bit wire formats]): < 1 passes."""
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 64))
    local, exact = copy.deepcopy(base), TorchDDP(copy.deepcopy(base))
    fast = fastddp.DistributedDataParallel(copy.deepcopy(base))
    fast.register_comm_hook(None, native_hook(fmt))
    g = torch.Generator().manual_seed(dist.get_rank())
    inputs, target = torch.randn(32, 64, generator=g), torch.randn(32, 64, generator=g)
    for model in (local, exact, fast):
        F.mse_loss(model(inputs), target).backward()
    mine = torch.cat([p.grad.flatten() for p in local.parameters()])
    want = torch.cat([p.grad.flatten() for p in exact.parameters()])
    got = torch.cat([p.grad.flatten() for p in fast.parameters()])
    return ((got - want).abs() / quantization_bound(fmt, mine, want)).max().item()


def quantization_bound(fmt: str, mine: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """Per element, what the hook's two block quantizations (each rank's share, then the
    sum) can cost against the exact mean `want`, from every rank's local gradients `mine`
    (a collective: call on every rank). No error feedback yet (the first step)."""
    world = dist.get_world_size()
    largest = mine.abs().max().reshape(1)
    dist.all_reduce(largest, op=dist.ReduceOp.MAX)
    abs_sum = mine.abs() / world
    dist.all_reduce(abs_sum)
    big = largest.item()
    if fmt == "int8":
        # Each rank's values err by at most half a step of G/world/127, the sum by half a
        # step of about G/127: G/127 in all (G: the largest |grad| on any rank).
        return torch.full_like(want, big / 127 * 1.01)
    # Half an ulp relative (2^-4 / 2^-3), or half the least subnormal times the scale,
    # per quantization.
    rel, least = (2.0 ** -4, 2.0 ** -9) if fmt == "e4m3" else (2.0 ** -3, 2.0 ** -16)
    floor = least * big / ref.QMAX[fmt]
    return rel * (1 + rel) * abs_sum * 1.01 + rel * want.abs() + 2 * floor


def wire_bytes(fmt: str) -> dict:
    """comm_stats() of one step with the hook and without (plain allreduce)."""
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 256))
    out = {}
    for name in ("allreduce", fmt):
        model = fastddp.DistributedDataParallel(copy.deepcopy(base))
        if name != "allreduce":
            model.register_comm_hook(None, native_hook(fmt))
        F.mse_loss(model(torch.randn(8, 256)), torch.zeros(8, 256)).backward()
        stats = model.comm_stats()
        out[name] = {"sent": stats["bytes_sent"], "reduced": stats["bytes_reduced"],
                     "hook": stats["hook"]}
    return out


def float64_model_is_refused(fmt: str) -> str:
    """The hook compresses float32 only: a float64 model is refused when the hook is
    registered, with NotImplementedError."""
    model = fastddp.DistributedDataParallel(mlp().double())
    try:
        model.register_comm_hook(None, native_hook(fmt))
    except NotImplementedError as e:
        return str(e)
    raise AssertionError("the 8-bit hook was registered on a float64 model")
