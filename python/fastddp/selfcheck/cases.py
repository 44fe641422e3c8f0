"""The self-check's cases: each hook fastddp runs natively, with the reference it must meet.

Two kinds of reference, neither of them fastddp's own code:
- "torch": torch DDP running torch's own hook (or no hook) runs a copy of the same model on
  the same batches, from the same parameters at every step; the averaged gradients must
  agree.
- "mean": where torch has no such hook (fp32 sums, error feedback, 8-bit wires), every step's
  averaged gradient must lie within the wire format's error of the exact float32 mean,
  computed by torch (``dist.all_reduce`` of each rank's local gradients).
"""

# No `from __future__ import annotations`: torch DDP checks a hook's annotations as objects.
from dataclasses import dataclass
from typing import Any, Callable
from unittest import mock

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as dh
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

from fastddp import hooks
from fastddp.hooks import catalog

# torch's minimum with error feedback and warm start; the third step is compressed.
PSGD_START = 2
STEPS = 3


@dataclass(frozen=True)
class Tolerance:
    """What |fastddp - reference| may be, element by element: floor + rel * |reference| +
    of_max * max|reference| over the scope ("tensor": the parameter's gradient, "model":
    all of them, for wire formats whose blocks span parameters). All zero: bit for bit."""
    rel: float = 0.0
    of_max: float = 0.0
    floor: float = 0.0
    scope: str = "tensor"


# torch's hook and fastddp's run the same roundings in the same order (the fp16/bf16 hooks
# too: cast, then divide in 16 bits as ATen does on the device, Note [torch's half
# rounding] in csrc/hooks/half/half_compress.h).
EXACT = Tolerance()
# The same algorithm, but fastddp fuses the orthogonalization and the low-rank products,
# which round differently in float32; orthogonalizing amplifies that by the matrix's
# condition number and error feedback carries it on: the test suite measured up to 4.2e-5
# of the gradient's largest magnitude (tests/python/hooks/powersgd_scenarios.py derives it); 1e-4
# leaves a GPU's other BLAS rounding room, and the 3 steps here measure 4e-7 (0.0043).
POWERSGD = Tolerance(of_max=1e-4)

# Unit roundoff u of each wire format (half the spacing of values just below a power of
# two): bf16 keeps 8 significant bits, fp16 11, e4m3 4, e5m2 3; int8 codes round to half
# of absmax/127 of their block of 256 values, which spans parameters.
_ROUNDOFF = {"bf16": 2.0 ** -8, "fp16": 2.0 ** -11, "e4m3": 2.0 ** -4, "e5m2": 2.0 ** -3,
             "int8": 0.5 / 127}


def of_exact_mean(wire: str) -> Tolerance:
    """Against the exact float32 mean: each rank's value rounded once to the wire (u), the
    sum rounded again (u), and with error feedback last step's residual (at most u) added
    in: 4u of the largest magnitude, per tensor (16-bit) or per bucket (8-bit blocks)."""
    return Tolerance(of_max=4 * _ROUNDOFF[wire],
                     scope="model" if wire in ("int8", "e4m3", "e5m2") else "tensor")


@dataclass(frozen=True)
class Case:
    name: str              # the row's label: how a user registers it
    reference: str         # "torch" (torch DDP with torch's hook) or "mean" (exact mean)
    tolerance: Tolerance
    # (model's process group) -> (state, hook) for fastddp's register_comm_hook, or None
    fastddp_hook: Callable[[dist.ProcessGroup], tuple[Any, Any] | None]
    # the same for torch DDP ("torch" references only)
    torch_hook: Callable[[dist.ProcessGroup], tuple[Any, Any] | None] | None = None
    ranks: int | None = None  # None: any world; hierarchical reduction needs 2 x 2


def _none(group: dist.ProcessGroup) -> None:
    return None


def _state_hook(hook: Any) -> Callable[[dist.ProcessGroup], tuple[Any, Any]]:
    return lambda group: (None, hook)


def _fixed_batched_powerSGD_hook(state: psgd.PowerSGDState, bucket: dist.GradBucket
                                 ) -> torch.futures.Future[torch.Tensor]:
    """torch's batched_powerSGD_hook as it is meant to run: it hands _orthogonalize its 2-D
    Q and P, which asserts a 3-D batch (since pytorch/pytorch#75157), so as shipped it raises
    AssertionError at its first compressed step. Here the 2-D matrix is a batch of one, and
    the result is waited for inside (the hook orthogonalizes P in a callback)."""
    def orthogonalize_2d(matrices: torch.Tensor, epsilon: float = 0) -> None:
        original(matrices.unsqueeze(0) if matrices.dim() == 2 else matrices, epsilon)

    original = psgd._orthogonalize
    with mock.patch.object(psgd, "_orthogonalize", orthogonalize_2d):
        value = psgd.batched_powerSGD_hook(state, bucket).wait()
    done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    done.set_result(value)
    return done


def _cpu_safe(hook: Any) -> Any:
    """torch's PowerSGD hooks, as a reference on CPU buckets of a machine with a GPU.
    Their decompress calls torch.cuda.synchronize(bucket's device) whenever CUDA is
    available, which raises ValueError for a CPU device (seen with torch 2.11 on an H100).
    Here CUDA is hidden from them while the bucket is reduced, and the result is waited for
    inside (bucket by bucket: what torch's hook needs on gloo with several buckets)."""
    def run(state: psgd.PowerSGDState, bucket: dist.GradBucket
            ) -> torch.futures.Future[torch.Tensor]:
        if bucket.buffer().device.type != "cpu" or not torch.cuda.is_available():
            return hook(state, bucket)
        with mock.patch.object(torch.cuda, "is_available", lambda: False):
            value = hook(state, bucket).wait()
        done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        done.set_result(value)
        return done
    return run


def _powersgd(hook: Any, rank: int) -> Callable[[dist.ProcessGroup], tuple[Any, Any]]:
    """torch's PowerSGD hook with a fresh PowerSGDState (its default seed: both sides draw
    the same random Q)."""
    def make(group: dist.ProcessGroup) -> tuple[Any, Any]:
        state = psgd.PowerSGDState(process_group=group, matrix_approximation_rank=rank,
                                   start_powerSGD_iter=PSGD_START)
        return state, hook
    return make


def _torch_case(name: str, fastddp_hook, torch_hook=None, tolerance: Tolerance = EXACT) -> Case:
    return Case(name, "torch", tolerance, fastddp_hook, torch_hook or fastddp_hook)


def numpy_missing() -> bool:
    """Whether numpy is not installed: torch's PowerSGDState draws its random Q with numpy's
    generator, so the PowerSGD rows (whose reference, or whose registration, is a
    PowerSGDState) cannot run; torch's wheel does not require numpy, nor does fastddp."""
    try:
        import numpy  # noqa: F401
    except ImportError:
        return True
    return False


def all_cases() -> list[Case]:
    """Every native hook and every torch hook fastddp maps to one, in the table's order;
    without numpy, all but the PowerSGD rows (skipped_cases)."""
    cases = _every_case()
    if numpy_missing():
        return [c for c in cases if c.tolerance is not POWERSGD]
    return cases


def skipped_cases() -> list[str]:
    """The rows all_cases() leaves out here, by name."""
    return [c.name for c in _every_case() if c.tolerance is POWERSGD] if numpy_missing() else []


def _torch_function(spelling: str) -> Any:
    """A catalog's torch hook ("default_hooks.bf16_compress_hook",
    "default_hooks.fp16_compress_wrapper(allreduce_hook)", "powerSGD_hook.powerSGD_hook") as
    the function it names."""
    module, _, name = spelling.partition(".")
    wrapper, _, wrapped = name.partition("(")
    function = getattr({"default_hooks": dh, "powerSGD_hook": psgd}[module], wrapper)
    return function(getattr(dh, wrapped.rstrip(")"))) if wrapped else function


def _torch_row(spelling: str) -> Case:
    """The row of one torch hook fastddp runs natively: fastddp registers torch's own hook
    (it runs it natively), torch DDP runs it as the reference. torch's PowerSGD hooks get a
    fresh PowerSGDState of rank 2 on each side, and the reference runs through _cpu_safe()
    (batched: its first compressed step fixed)."""
    function = _torch_function(spelling)
    label = "torch " + spelling.partition(".")[2]
    if not spelling.startswith("powerSGD_hook."):
        return _torch_case(label, _state_hook(function))
    reference = (_fixed_batched_powerSGD_hook if function is psgd.batched_powerSGD_hook
                 else function)
    return _torch_case(label + " + PowerSGDState(rank 2)", _powersgd(function, 2),
                       _powersgd(_cpu_safe(reference), 2), POWERSGD)


def _every_case() -> list[Case]:
    """The catalog's hooks (fastddp/hooks/catalog.py), in its order: first each one's torch
    hooks and its own rows against torch (its first torch hook), then the rows against the
    exact mean."""
    torch_rows, mean_rows = [_torch_case("(no hook)", _none)], []
    for entry in catalog.HOOKS:
        references = [_torch_row(t) for t in entry.torch_hooks]
        torch_rows += references
        for check in entry.selfcheck:
            make = _built(entry.name, check.options)
            if check.tolerance in ("exact", "powersgd"):
                torch_rows.append(_torch_case(check.label, make, references[0].torch_hook,
                                              POWERSGD if check.tolerance == "powersgd"
                                              else EXACT))
            else:
                mean_rows.append(Case(check.label, "mean", of_exact_mean(check.tolerance),
                                      make, ranks=check.ranks))
    return torch_rows + mean_rows


def _built(name: str, options: dict[str, Any]) -> Callable[[dist.ProcessGroup],
                                                           tuple[Any, Any]]:
    """fastddp.hooks.<name>(**options), built when the row runs (hierarchical reads its node
    layout then)."""
    return lambda group: (None, getattr(hooks, name)(**options))
