"""_C.HookRunner scenarios, run on every rank of a harness world (see harness.py): comm
hooks on given gradients, fastddp's native ones against torch's Python ones."""

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as dh
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

import fastddp
from fastddp import _C
from tests.python.hooks.powersgd_scenarios import DIFFERS
from tests.python.scenarios import rounding_ulps

# Matrices worth compressing (two of one shape), one that is not (2 x 40), a 4-D one
# (viewed as 8 x 27) and vectors; 64 bytes of cap per bucket splits them into several.
SHAPES = [(8, 3, 3, 3), (8,), (40, 24), (40,), (24, 24), (24, 24), (24,), (2, 40), (2,)]


def grads_for(step: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + dist.get_rank())
    return [torch.randn(s, generator=g) for s in SHAPES]


def plain_mean(grads: list[torch.Tensor]) -> list[torch.Tensor]:
    out = [g.clone() for g in grads]
    for t in out:
        dist.all_reduce(t)
        t.div_(dist.get_world_size())
    return out


# The bounds below are absolute, relative to the largest |element| of all the expected
# tensors (`of_scale`), with rtol as given.
EPS = torch.finfo(torch.float32).eps


def _sum_order() -> dict[str, float]:
    """The mean by buckets against one allreduce per tensor: 2 ranks add in the one order
    there is (bit for bit); on 3 gloo adds the ranks in an order set by its chunking of
    each buffer, and each of a sum's 2 additions may round differently: scenarios.ULPS
    (measured 1.04 eps of the largest |mean|)."""
    return {"rtol": 0.0, "of_scale": rounding_ulps() * EPS}


# PowerSGD against torch's hook (why absolute: powersgd_scenarios.TOL): measured at most
# 1.4e-6 of the scale on these random gradients, 8.7e-7 beyond rtol 1e-5.
POWERSGD = {"rtol": 1e-5, "of_scale": 4e-6}


def _close(a: list[torch.Tensor], b: list[torch.Tensor], what: str, rtol: float,
           of_scale: float) -> None:
    assert len(a) == len(b), what
    atol = of_scale * max(y.abs().max().item() for y in b)
    for i, (x, y) in enumerate(zip(a, b)):
        assert x.shape == y.shape, (what, i, x.shape, y.shape)
        torch.testing.assert_close(x, y, rtol=rtol, atol=atol,
                                   msg=lambda m, i=i: f"{what}, tensor {i}: {m}")


def allreduce_is_mean(bucket_cap_bytes: int = 2048) -> list[list[int]]:
    """The native allreduce hook and torch's allreduce_hook (a Python hook) give the mean;
    returns the bucket plan."""
    grads = grads_for(0)
    expected = plain_mean(grads)
    group = dist.group.WORLD
    native = _C.HookRunner(fastddp.hooks.allreduce().native(group), grads, bucket_cap_bytes,
                           group)
    python = _C.HookRunner(_C.PythonCommHook(group, dh.allreduce_hook, grads, "allreduce_hook"),
                           grads, bucket_cap_bytes, group)
    for name, runner in (("native", native), ("python", python)):
        for _ in range(2):  # the runner can go again
            _close(runner.run(grads), expected, name, **_sum_order())
    # The one-shot form too; the inputs are left alone.
    before = [g.clone() for g in grads]
    _close(_C.run_comm_hook(fastddp.hooks.allreduce().native(group), grads, bucket_cap_bytes,
                            group), expected, "run_comm_hook", **_sum_order())
    _close(grads, before, "inputs", rtol=0, of_scale=0)
    return native.bucket_plan()


def powersgd_matches_torch(steps: int = 6, bucket_cap_bytes: int = 2048, rank: int = 2,
                           start: int = 2) -> dict:
    """fastddp's native powersgd hook against torch's powerSGD_hook (serialized), the same
    grads every step: results within float32 rounding (POWERSGD)."""
    group = dist.group.WORLD
    grads = grads_for(0)
    native_hook = fastddp.hooks.powersgd(matrix_approximation_rank=rank,
                                         start_powerSGD_iter=start).native(group)
    state = psgd.PowerSGDState(process_group=None, matrix_approximation_rank=rank,
                               start_powerSGD_iter=start)
    torch_hook = _C.PythonCommHook(state, psgd.powerSGD_hook, grads, "powerSGD_hook")
    native = _C.HookRunner(native_hook, grads, bucket_cap_bytes, group)
    reference = _C.HookRunner(torch_hook, grads, bucket_cap_bytes, group)
    compressed_steps = 0
    for step in range(steps):
        grads = grads_for(step)
        got = native.run(grads)
        want = reference.run(grads, serialize=True)
        _close(got, want, f"step {step}", **POWERSGD)
        mean = plain_mean(grads)
        if step < start:
            _close(got, mean, f"vanilla step {step}", **_sum_order())
        elif any(not torch.allclose(g, m, **DIFFERS) for g, m in zip(got, mean)):
            compressed_steps += 1
    return {"buckets": len(native.bucket_plan()), "compressed_steps": compressed_steps,
            "torch_iter": state.iter}


def bad_arguments() -> list[str]:
    """The runner's errors: a bad cap, a gradient of another shape, too few gradients."""
    group = dist.group.WORLD
    hook = fastddp.hooks.allreduce().native(group)
    runner = _C.HookRunner(hook, [torch.zeros(3), torch.zeros(2, 2)], 1024, group)
    calls = [lambda: _C.HookRunner(hook, [torch.zeros(3)], 0, group),
             lambda: runner.run([torch.zeros(3), torch.zeros(4)]),
             lambda: runner.run([torch.zeros(3)])]
    messages = []
    for call in calls:
        try:
            call()
        except RuntimeError as e:
            messages.append(str(e))
        else:
            raise AssertionError("accepted")
    return messages


def cuda_matches_cpu(hook: str = "powersgd", steps: int = 5, rank: int = 2,
                     warm_start: bool = True) -> int:
    """A native PowerSGD hook on CUDA gradients against the same hook on CPU (the CPU
    kernels are tested against torch): the CUDA orthogonalization kernel, the pinned random
    Q, bmm and the decompression on the collective's stream. Returns compressed steps."""
    group = dist.group.WORLD
    make = getattr(fastddp.hooks, hook)
    args = {"matrix_approximation_rank": rank, "start_powerSGD_iter": 2,
            "warm_start": warm_start}
    runners = {}
    for device in ("cpu", "cuda"):
        grads = [g.to(device) for g in grads_for(0)]
        runners[device] = _C.HookRunner(make(**args).native(group), grads, 2048, group)
    for step in range(steps):
        grads = grads_for(step)
        want = runners["cpu"].run(grads)
        got = runners["cuda"].run([g.cuda() for g in grads])
        torch.cuda.synchronize()
        # CUDA's kernels and bmm against the CPU's: sums in other orders, as against torch.
        _close([g.cpu() for g in got], want, f"{hook} step {step}", **POWERSGD)
    return steps - 2
