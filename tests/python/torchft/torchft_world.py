"""Replica groups of tests/python/torchft/replica.py, each a process, around a torchft
Lighthouse started here; a replica that is killed is started again, once, as an operator
(or torchft's own test Runner) would restart it.

Every wait has a deadline (a hang fails the test with what each replica printed); nothing
here asserts on time.
"""

from __future__ import annotations

import multiprocessing as mp
import time
from pathlib import Path
from typing import Any

import torch

from tests.python.torchft import replica as replica_module

# A hang guard, far above a run's length on a loaded 2-core machine (20-60 s).
DEADLINE_S = 420.0
# Collectives and quorums give up after this: a replica waiting on a dead peer reports
# the failure to its manager well before the deadline.
TORCHFT_TIMEOUT_S = 30.0


def run_replicas(tmp_path: Path, *, replicas: int, steps: int, impl: str = "fastddp",
                 hook: str | None = None, min_replicas: int = 2, victim: int | None = None,
                 kill_at: int | None = None, restart_after_survivors_commit: bool = False,
                 extra: dict[str, Any] | None = None,
                 timeout_s: float | None = None) -> dict[int, dict[str, Any]]:
    """Trains `replicas` replica groups for `steps` committed steps; replica `victim` dies in
    the backward of step `kill_at` and is started again. Returns each replica's result
    (replica.py), the restarted one's from its second life with ``killed_at`` and
    ``restarted_at`` (time.time()). `restart_after_survivors_commit`: the victim is started
    again only once a survivor has committed a step without it (an operator's restart takes
    its time; a restart at once can be back before the survivors' retry, which then runs with
    every replica and never without it: a race the tests must not depend on). `extra`: more of replica.run's config (model size);
    `timeout_s`: the managers' and their process groups' timeout."""
    from torchft.coordination import LighthouseServer

    # join_timeout: how long a quorum waits for a member of the last one that does not come
    # back (the killed replica) before it forms without it.
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=min_replicas,
                                  join_timeout_ms=1000, heartbeat_timeout_ms=2000)
    tmp_path.mkdir(parents=True, exist_ok=True)
    context = mp.get_context("spawn")
    processes: dict[int, Any] = {}

    def start(r: int, kill: int | None) -> None:
        config = {"replica": r, "lighthouse": lighthouse.address(), "steps": steps,
                  "impl": impl, "hook": hook, "min_replicas": min_replicas, "kill_at": kill,
                  "timeout_s": timeout_s or TORCHFT_TIMEOUT_S, "out": str(tmp_path / f"replica{r}.pt"),
                  # The first lives start together; a restart joins a running quorum.
                  "start_together": replicas if r not in processes else 0,
                  **(extra or {})}
        processes[r] = context.Process(target=replica_module.run, args=(config,),
                                       name=f"replica{r}")
        processes[r].start()

    try:
        for r in range(replicas):
            start(r, kill_at if r == victim else None)
        restarted_at = None
        deadline = time.monotonic() + DEADLINE_S
        while any(p.exitcode is None for p in processes.values()):
            if time.monotonic() > deadline:
                raise AssertionError(f"replicas still running after {DEADLINE_S} s: "
                                     f"{[r for r, p in processes.items() if p.is_alive()]}")
            for r, p in list(processes.items()):
                p.join(timeout=0.1)
                if p.exitcode == replica_module.KILLED_EXIT_CODE and r == victim \
                        and restarted_at is None:
                    if restart_after_survivors_commit and not _survivor_committed(
                            tmp_path, replicas, victim):
                        continue
                    restarted_at = time.time()
                    start(r, None)
                elif p.exitcode not in (None, 0):
                    raise AssertionError(f"replica {r} exited with {p.exitcode}")
        if victim is not None:
            assert restarted_at is not None, f"replica {victim} was to die at step {kill_at} and did not"
    finally:
        for p in processes.values():
            if p.is_alive():
                p.kill()
                p.join()
        lighthouse.shutdown()
    results = {r: torch.load(tmp_path / f"replica{r}.pt", weights_only=False)
               for r in range(replicas)}
    if victim is not None:
        results[victim]["restarted_at"] = restarted_at
        results[victim]["killed_at"] = float((tmp_path / f"replica{victim}.pt.killed").read_text())
    return results


def _survivor_committed(tmp_path: Path, replicas: int, victim: int) -> bool:
    """A replica other than the victim has committed a step with one replica fewer."""
    for r in range(replicas):
        progress = tmp_path / f"replica{r}.pt.progress"
        if r == victim or not progress.exists():
            continue
        for line in progress.read_text().splitlines():
            fields = line.split()
            if len(fields) == 3 and fields[1] == str(replicas - 1) and fields[2] == "1":
                return True
    return False


def assert_same_training_state(results: dict[int, dict[str, Any]]) -> None:
    """Every replica holds the same weights and optimizer state, bit for bit."""
    first = results[0]
    for r, result in results.items():
        for name, tensor in first["model"].items():
            assert torch.equal(result["model"][name], tensor), (r, name)
        for index, state in first["optim"]["state"].items():
            mine = result["optim"]["state"][index]["momentum_buffer"]
            assert torch.equal(mine, state["momentum_buffer"]), (r, index)
