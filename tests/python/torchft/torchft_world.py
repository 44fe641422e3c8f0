"""Replica groups of tests/python/torchft/replica.py, each a process, around a torchft
Lighthouse started here; a replica that is killed is started again, once, as an operator
(or torchft's own test Runner) would restart it.

Every wait has a deadline (a hang fails the test with what each replica printed); nothing
here asserts on time.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from tests.python.harness import forked_process
from tests.python.torchft import replica as replica_module

# A hang guard, far above a run's length on a loaded 2-core machine (20-60 s).
DEADLINE_S = 420.0
# Collectives and quorums give up after this: a replica waiting on a dead peer reports
# the failure to its manager well before the deadline.
TORCHFT_TIMEOUT_S = 30.0


def run_replicas(tmp_path: Path, *, replicas: int, steps: int, impl: str = "fastddp",
                 hook: str | None = None, min_replicas: int = 2, victim: int | None = None,
                 kill_at: int | None = None, restart_after_survivors_commit: bool = False,
                 ranks_per_replica: int = 1,
                 extra: dict[str, Any] | None = None,
                 timeout_s: float | None = None) -> dict[Any, dict[str, Any]]:
    """Trains `replicas` replica groups for `steps` committed steps; replica `victim` dies in
    the backward of step `kill_at` and is started again. Returns each replica's result
    (replica.py), the restarted one's from its second life with ``killed_at`` and
    ``restarted_at`` (time.time()). `restart_after_survivors_commit`: the victim is started
    again only once a survivor has committed a step without it (an operator's restart takes
    its time; a restart at once can be back before the survivors' retry, which then runs with
    every replica and never without it: a race the tests must not depend on).
    `ranks_per_replica`: the ranks of each replica group, each a process with its own
    Manager, around a TCPStore made here for each life of the group; the results are then
    keyed by (replica, group rank), and a victim's ranks all die and are restarted together.
    `extra`: more of replica.run's config (model size); `timeout_s`: the managers' and their
    process groups' timeout."""
    from torchft.coordination import LighthouseServer

    # join_timeout: how long a quorum waits for a member of the last one that does not come
    # back (the killed replica) before it forms without it.
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=min_replicas,
                                  join_timeout_ms=1000, heartbeat_timeout_ms=2000)
    tmp_path.mkdir(parents=True, exist_ok=True)
    processes: dict[tuple[int, int], Any] = {}
    stores: list[Any] = []  # alive while the replicas run
    keys = [(r, k) for r in range(replicas) for k in range(ranks_per_replica)]

    def out(key: tuple[int, int]) -> Path:
        return tmp_path / (f"replica{key[0]}.pt" if ranks_per_replica == 1
                           else f"replica{key[0]}-{key[1]}.pt")

    def start(r: int, kill: int | None) -> None:
        first_life = (r, 0) not in processes
        store = torch.distributed.TCPStore("localhost", 0, is_master=True,
                                           wait_for_workers=False)
        stores.append(store)
        for k in range(ranks_per_replica):
            config = {"replica": r, "group_rank": k, "group_world": ranks_per_replica,
                      "store_port": store.port, "lighthouse": lighthouse.address(),
                      "steps": steps, "impl": impl, "hook": hook, "min_replicas": min_replicas,
                      "kill_at": kill, "timeout_s": timeout_s or TORCHFT_TIMEOUT_S,
                      "out": str(out((r, k))),
                      # The first lives start together; a restart joins a running quorum.
                      "start_together": len(keys) if first_life else 0,
                      **(extra or {})}
            # Forked from the harness's server (torch, fastddp and torchft imported once), not
            # spawned: 2.5-3 CPU-s of imports saved per replica life, about 60 a run of this
            # folder.
            processes[(r, k)] = forked_process(replica_module.run, (config,),
                                               name=f"replica{r}-{k}")
            processes[(r, k)].start()

    def victim_killed() -> bool:
        return all(processes[(victim, k)].exitcode == replica_module.KILLED_EXIT_CODE
                   for k in range(ranks_per_replica))

    try:
        for r in range(replicas):
            start(r, kill_at if r == victim else None)
        restarted_at = None
        deadline = time.monotonic() + DEADLINE_S
        while any(p.exitcode is None for p in processes.values()):
            if time.monotonic() > deadline:
                raise AssertionError(f"replicas still running after {DEADLINE_S} s: "
                                     f"{[key for key, p in processes.items() if p.is_alive()]}")
            for key, p in list(processes.items()):
                if processes[key] is not p:
                    continue  # a killed rank restarted with its group in this pass
                p.join(timeout=0.1)
                if p.exitcode == replica_module.KILLED_EXIT_CODE and key[0] == victim \
                        and restarted_at is None:
                    if not victim_killed() or (restart_after_survivors_commit and not any(
                            _committed_without_one(out(other), replicas)
                            for other in keys if other[0] != victim)):
                        continue
                    restarted_at = time.time()
                    start(victim, None)
                elif p.exitcode not in (None, 0):
                    raise AssertionError(f"replica {key} exited with {p.exitcode}")
        if victim is not None:
            assert restarted_at is not None, f"replica {victim} was to die at step {kill_at} and did not"
    finally:
        for p in processes.values():
            if p.is_alive():
                p.kill()
                p.join()
        lighthouse.shutdown()
    results = {key if ranks_per_replica > 1 else key[0]:
               torch.load(out(key), weights_only=False) for key in keys}
    if victim is not None:
        victim_key = (victim, 0) if ranks_per_replica > 1 else victim
        results[victim_key]["restarted_at"] = restarted_at
        results[victim_key]["killed_at"] = float(
            Path(str(out((victim, 0))) + ".killed").read_text())
    return results


def _committed_without_one(out: Path, replicas: int) -> bool:
    """That replica's log (replica.py's progress file) has a step committed with one
    replica group fewer than all."""
    progress = Path(str(out) + ".progress")
    if not progress.exists():
        return False
    for line in progress.read_text().splitlines():
        fields = line.split()
        if len(fields) == 3 and fields[1] == str(replicas - 1) and fields[2] == "1":
            return True
    return False


def assert_same_training_state(results: dict[int, dict[str, Any]]) -> None:
    """Every replica holds the same weights and optimizer state, bit for bit."""
    first = next(iter(results.values()))
    for r, result in results.items():
        for name, tensor in first["model"].items():
            assert torch.equal(result["model"][name], tensor), (r, name)
        for index, state in first["optim"]["state"].items():
            mine = result["optim"]["state"][index]["momentum_buffer"]
            assert torch.equal(mine, state["momentum_buffer"]), (r, index)
