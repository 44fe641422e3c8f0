"""Runs the self-check's cases in spawned ranks and survives a rank that crashes.

A case that kills its process (a segfault in native code is what this check exists to
catch) becomes a "crashed" row; the ranks are started again for the cases after it, so
every row is run. A deadline bounds the whole run: what it cuts reads "not run".
"""

from __future__ import annotations

import multiprocessing as mp
import queue as queue_module
import signal
import socket
import time
from dataclasses import dataclass
from typing import Callable

from fastddp.selfcheck import worker


@dataclass
class Row:
    case: int                  # index into cases.all_cases()
    where: str                 # "cpu, gloo x2", "cuda:0, nccl x1", ...
    error: float | None = None
    failure: str | None = None  # an exception, a crash or "not run: ..."
    seconds: float = 0.0


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _exit_reason(code: int) -> str:
    if code < 0:
        try:
            return f"crashed: the process was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"crashed: the process was killed by signal {-code}"
    return f"crashed: the process exited with status {code}"


def _run_once(where: str, backend: str, device: str, world: int, indices: list[int],
              deadline: float, target: Callable) -> tuple[list[Row], list[int]]:
    """Rows of `indices` run by one set of ranks, and the indices still to run when a
    rank died (after the case it died in)."""
    ctx = mp.get_context("spawn")
    events = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=target, daemon=True,
                         args=(rank, world, backend, device, port, indices, events))
             for rank in range(world)]
    for p in procs:
        p.start()
    rows: dict[int, Row] = {}
    started = -1  # the furthest case any rank has started

    def take(event) -> None:
        nonlocal started
        if event[0] == "start":
            started = max(started, event[1])
        else:
            _, index, error, failure, seconds = event
            rows[index] = Row(index, where, error, failure, seconds)

    try:
        while True:
            try:
                take(events.get(timeout=0.1))
                continue
            except queue_module.Empty:
                pass
            dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if dead or time.monotonic() > deadline:
                # What the ranks reported before they stopped decides which case it was.
                while True:
                    try:
                        take(events.get(timeout=0.5))
                    except queue_module.Empty:
                        break
                late = [i for i in indices if i not in rows]
                current = started if started in late else None
                if current is not None:
                    rows[current] = Row(current, where, failure=(
                        _exit_reason(dead[0]) if dead else "not run: out of time"))
                rest = [i for i in late if i != current]
                return list(rows.values()), rest if dead else []
            if all(p.exitcode == 0 for p in procs):
                while not events.empty():
                    take(events.get(timeout=0.5))
                return list(rows.values()), []
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
            p.join(timeout=5)


def run_world(where: str, backend: str, device: str, world: int, indices: list[int],
              deadline: float, target: Callable = worker.main) -> list[Row]:
    """Every case of `indices` on `world` ranks of `backend` over `device`, one row each.
    `target` is the ranks' entry point (worker.main's arguments and events)."""
    rows: list[Row] = []
    todo = list(indices)
    while todo and time.monotonic() < deadline:
        done, todo = _run_once(where, backend, device, world, todo, deadline, target)
        rows += done
    ran = {r.case for r in rows}
    rows += [Row(i, where, failure="not run: out of time") for i in indices if i not in ran]
    return sorted(rows, key=lambda r: r.case)
