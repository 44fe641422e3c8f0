"""``python -m fastddp --check``: the one-minute self-check of an install.

Prints what fastddp runs on (torch, CUDA, NCCL, gloo, the GPUs, the compiler and
libstdc++ that built fastddp._C and the libstdc++ loaded now), checks that the module uses
the shared libstdc++ (Note [one libstdc++]), then trains a small model for three steps
with every native hook and every torch hook fastddp maps to one, against torch DDP running
torch's own hook, or against the exact mean where torch has no such hook (cases.py): on
two gloo ranks over the CPU, and on each visible GPU (NCCL at world size 1; two gloo ranks
with CUDA tensors on the first). Exit status 0 only if every row passes.
"""

from __future__ import annotations

import sys
import time

import torch
import torch.distributed as dist

from fastddp.selfcheck import environment
from fastddp.selfcheck.cases import all_cases, skipped_cases
from fastddp.selfcheck.runner import Row, run_world

# A hang is the only way to get near this: the CPU check takes about a minute.
DEADLINE_S = 600.0

_REPORT = ("Please report it to the fastddp maintainers with this whole output and the "
           "output of `python -m torch.utils.collect_env`.")


def _worlds() -> list[tuple[str, str, str, int]]:
    """(label, backend, device, ranks) of each set of ranks the check starts."""
    worlds = [("cpu, gloo x2", "gloo", "cpu", 2), ("cpu, gloo x4", "gloo", "cpu", 4)]
    if torch.cuda.is_available():
        if dist.is_nccl_available():
            worlds += [(f"cuda:{i}, nccl x1", "nccl", f"cuda:{i}", 1)
                       for i in range(torch.cuda.device_count())]
        worlds += [("cuda:0, gloo x2", "gloo", "cuda:0", 2),
                   ("cuda:0, gloo x4", "gloo", "cuda:0", 4)]
    return worlds


def _verdict(row: Row) -> tuple[bool, str]:
    """row.error is worker.excess(): the worst difference as a fraction of what is allowed."""
    if row.failure is not None:
        return False, row.failure
    if row.error == 0.0:
        return True, "ok: equal"
    ok = row.error <= 1.0
    return ok, f"{'ok' if ok else 'FAIL'}: {row.error:.2g} of the allowed difference"


def main(out=sys.stdout) -> int:
    """Runs the check, prints its report to `out`; returns the exit status."""
    started = time.monotonic()
    say = lambda text="": print(text, file=out, flush=True)  # noqa: E731
    say("fastddp self-check")
    for what, value in environment.describe():
        say(f"  {what:<17} {value}")
    failures = []
    problems = environment.module_problems()
    say(f"  {'module check':<17} {'ok: uses the shared libstdc++' if not problems else 'FAIL'}")
    for p in problems:
        say(f"    - {p}")
        failures.append(f"fastddp._C: {p}")
    say()
    cases = all_cases()
    width = max(len(c.name) for c in cases)
    say(f"{'hook':<{width}}  {'where':<16} {'against':<10} {'s':>6}  result")
    deadline = started + DEADLINE_S
    for label, backend, device, ranks in _worlds():
        # Cases that name their rank count run there only; the others on 1 or 2 ranks.
        indices = [i for i, c in enumerate(cases) if c.ranks == ranks
                   or (c.ranks is None and ranks <= 2)]
        for row in run_world(label, backend, device, ranks, indices, deadline):
            case = cases[row.case]
            ok, text = _verdict(row)
            against = "torch DDP" if case.reference == "torch" else "exact mean"
            say(f"{case.name:<{width}}  {label:<16} {against:<10} {row.seconds:6.2f}  {text}")
            if not ok:
                failures.append(f"{case.name} on {label}: {text}")
    for name in skipped_cases():
        say(f"{name:<{width}}  skipped: torch's PowerSGDState needs numpy, not installed here")
    say()
    took = time.monotonic() - started
    if failures:
        say(f"fastddp self-check FAILED ({len(failures)} of them, {took:.0f} s):")
        for f in failures:
            say(f"  - {f}")
        say(_REPORT)
        return 1
    say(f"fastddp self-check passed: every hook matched its reference ({took:.0f} s)")
    return 0
