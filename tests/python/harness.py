"""A persistent world of N real ranks (processes of their own, gloo on 127.0.0.1 unless told
otherwise) that runs named scenario functions on every rank and hands back what each rank
returned or raised.

Starting a rank costs seconds (it imports torch), so a test module or session starts a
world once and runs many scenarios on it. Every wait has a deadline: a rank that does not
answer in time fails the test and the whole world is killed and reaped; the next run
starts a fresh one.

Ranks are forked from a server that has imported torch and fastddp already
(``start_method="forkserver"``, the default but for NCCL worlds): a rank starts in a fraction
of a second instead of the 2.5-3 CPU-seconds of a spawned one's imports, and the suite starts
a few hundred ranks (every world after a failed scenario starts again). Each rank takes the
test process's environment as it is when the rank starts, as a spawned one does (the
server's is the one of its own start). ``start_method="spawn"`` starts a fresh interpreter
per rank.
``run(..., allow_deaths=True)`` reports a rank that died (by a signal, say) as a result
instead of tearing the world down at once.
"""

import atexit
import datetime
import gc
import importlib
import multiprocessing as mp
import multiprocessing.connection
import os
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

DEFAULT_TIMEOUT_S = 120.0
# Collectives give up before the harness does, so that a rank stuck in a collective whose
# peer died reports an error instead of being killed.
COLLECTIVE_TIMEOUT_S = 60.0
_STOP = None
# The error_type of a rank that died (see World.run's allow_deaths).
DIED = "Died"
# torch._dynamo: the first optimizer a process builds imports it (2 s and more). torchft:
# its replica groups fork from the same server (forked_process); the server skips a module
# that is not installed.
_FORKSERVER_PRELOAD = ["torch", "torch._dynamo", "torch.distributed", "fastddp",
                       "tests.python.harness", "torchft"]
_live_worlds: "set[World]" = set()


@dataclass
class RankResult:
    """What one rank's scenario returned (`value`) or raised (`error_type`, `error`)."""

    rank: int
    value: Any = None
    error_type: str | None = None
    error: str | None = None
    traceback: str | None = None

    @property
    def ok(self) -> bool:
        return self.error_type is None


class World:
    """`size` ranks in processes of their own, one process group over `backend`."""

    def __init__(self, size: int, backend: str = "gloo", timeout_s: float = DEFAULT_TIMEOUT_S,
                 start_method: str | None = None):
        if start_method is None:
            # NCCL ranks use CUDA, and CUDA is not fork-safe once a process has touched it:
            # they get a fresh interpreter each, as they always did.
            start_method = "spawn" if backend == "nccl" else "forkserver"
        if start_method not in ("spawn", "forkserver"):
            raise ValueError(f"start_method must be 'spawn' or 'forkserver', got {start_method!r}")
        self.size = size
        self.backend = backend
        self.timeout_s = timeout_s
        self.start_method = start_method
        self.starts = 0
        self._procs: list[mp.process.BaseProcess] = []
        self._conns: list[multiprocessing.connection.Connection] = []

    @property
    def running(self) -> bool:
        return bool(self._procs)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    def start(self) -> None:
        """Spawns the ranks and waits until each has joined the process group."""
        if self.running:
            return
        try:
            self._spawn()
        except RuntimeError:
            # Most likely another process took the port between picking and binding it.
            self._spawn()

    def _spawn(self) -> None:
        ctx = _forkserver() if self.start_method == "forkserver" else mp.get_context("spawn")
        port = _free_port()
        for rank in range(self.size):
            parent_end, child_end = ctx.Pipe()
            proc = ctx.Process(
                target=_worker_main,
                args=(rank, self.size, port, self.backend, child_end, dict(os.environ)),
                name=f"fastddp-test-rank{rank}",
                daemon=True,
            )
            proc.start()
            # Only the child holds its end now, so its death shows up here as EOF.
            child_end.close()
            self._procs.append(proc)
            self._conns.append(parent_end)
        _live_worlds.add(self)
        self.starts += 1
        replies = self._collect("start-up", self.timeout_s, stop_at_failure=True)
        failed = [r for r in replies if not r.ok]
        if failed:
            self.close(polite=False)
            raise RuntimeError("world failed to start:\n" + _describe(failed))

    def run(self, scenario: Callable[..., Any] | str, timeout_s: float | None = None,
            allow_deaths: bool = False, **kwargs: Any) -> list[RankResult]:
        """Runs `scenario(**kwargs)` on every rank; one result per rank, in rank order.

        `scenario` is a module-level function or its "module.function" name; the ranks
        import it by name. Raises TimeoutError (after tearing the world down) when a rank
        does not answer within `timeout_s`. A rank that dies raises RuntimeError, or with
        `allow_deaths` gives a result with error_type "Died" and its exit code in `error`
        (-9: SIGKILL); the other ranks' results are still collected, then the world is
        torn down.
        """
        name = scenario if isinstance(scenario, str) else (
            f"{scenario.__module__}.{scenario.__qualname__}")
        self.start()
        for rank, conn in enumerate(self._conns):
            try:
                conn.send((name, kwargs))
            except OSError:
                self.close(polite=False)
                raise RuntimeError(f"{name}: rank {rank} is gone; the world was torn down")
        results = self._collect(name, timeout_s or self.timeout_s, allow_deaths=allow_deaths)
        if any(r.error_type == DIED for r in results):
            # Survivors may still hold collectives with the dead rank.
            self.close(polite=False)
        elif len({r.ok for r in results}) > 1:
            # Some ranks failed and others did not: their collectives may be out of step,
            # so a later scenario could hang or pair up with stale messages.
            self.close()
        return results

    def check(self, scenario: Callable[..., Any] | str, **kwargs: Any) -> list[Any]:
        """Runs a scenario that must succeed on every rank; returns the per-rank values."""
        results = self.run(scenario, **kwargs)
        failed = [r for r in results if not r.ok]
        if failed:
            raise AssertionError(f"{_name(scenario)} failed:\n" + _describe(failed))
        return [r.value for r in results]

    def expect_error(self, scenario: Callable[..., Any] | str, error_type: type[BaseException],
                     match: str | None = None, **kwargs: Any) -> list[str]:
        """Runs a scenario that must raise exactly `error_type` on every rank, with a
        message containing `match` (a plain substring); returns the messages."""
        results = self.run(scenario, **kwargs)
        problems = []
        for r in results:
            if r.ok:
                problems.append(f"rank {r.rank}: returned {r.value!r} instead of raising")
            elif r.error_type != error_type.__name__:
                problems.append(f"rank {r.rank}: raised {r.error_type}, expected "
                                f"{error_type.__name__}: {r.error}\n{r.traceback}")
            elif match is not None and match not in r.error:
                problems.append(f"rank {r.rank}: message lacks {match!r}: {r.error}")
        if problems:
            raise AssertionError(f"{_name(scenario)}:\n" + "\n".join(problems))
        return [r.error for r in results]

    def close(self, polite: bool = True) -> None:
        """Stops the ranks: asks them to leave (unless they are known to be stuck), then
        SIGTERM, then SIGKILL; always reaps them."""
        for conn in self._conns if polite else ():
            try:
                conn.send(_STOP)
            except (OSError, ValueError):
                pass
        deadline = time.monotonic() + (10.0 if polite else 0.0)
        for proc in self._procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in self._procs:
            if proc.is_alive():
                proc.terminate()
                proc.join(3.0)
            if proc.is_alive():
                proc.kill()
                proc.join(3.0)
        for conn in self._conns:
            conn.close()
        self._procs, self._conns = [], []
        _live_worlds.discard(self)

    def _collect(self, what: str, timeout_s: float, stop_at_failure: bool = False,
                 allow_deaths: bool = False) -> list[RankResult]:
        """One reply per rank, or TimeoutError. With `stop_at_failure`, returns at the first
        failure (ranks still waiting for a failed peer are then left unanswered). With
        `allow_deaths`, a rank that died is a "Died" result instead of an error."""
        deadline = time.monotonic() + timeout_s
        results: dict[int, RankResult] = {}
        pending = dict(enumerate(self._conns))
        while pending:
            left = deadline - time.monotonic()
            ready = multiprocessing.connection.wait(list(pending.values()), max(0.0, left))
            if not ready and left <= 0:
                missing = sorted(pending)
                self.close(polite=False)
                raise TimeoutError(
                    f"{what}: ranks {missing} did not answer within {timeout_s:.0f} s; "
                    "the world was torn down")
            for rank, conn in list(pending.items()):
                if conn not in ready:
                    continue
                try:
                    results[rank] = conn.recv()
                except (EOFError, OSError):
                    if not allow_deaths:
                        self.close(polite=False)
                        raise RuntimeError(f"{what}: rank {rank} died; the world was torn down")
                    proc = self._procs[rank]
                    proc.join(5.0)  # its pipe closed as it died: the exit code is moments away
                    results[rank] = RankResult(rank, error_type=DIED,
                                               error=f"exit code {proc.exitcode}")
                del pending[rank]
                if stop_at_failure and not results[rank].ok:
                    return [results[rank]]
        return [results[r] for r in range(self.size)]


def _name(scenario: Callable[..., Any] | str) -> str:
    return scenario if isinstance(scenario, str) else scenario.__qualname__


def _describe(results: list[RankResult]) -> str:
    return "\n".join(
        f"--- rank {r.rank}: {r.error_type}: {r.error}\n{r.traceback}" for r in results)


def _forkserver() -> Any:
    """The forkserver context, its server preloading _FORKSERVER_PRELOAD. The preload takes
    effect when the server starts (once per test process); forking from a process that only
    imported torch is safe (no threads run yet)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_FORKSERVER_PRELOAD)
    return ctx


def forked_process(target: Callable[..., None], args: tuple, name: str) -> mp.process.BaseProcess:
    """A process (not started) that runs target(*args), forked from the server that has
    imported torch and fastddp, with the test process's environment as it is now, as a spawned
    one would have: for tests that start processes of their own (torchft's replica groups,
    gloo on the CPU; NCCL worlds keep spawning, see World)."""
    return _forkserver().Process(target=_run_in_environ, args=(dict(os.environ), target, args),
                                 name=name)


def _run_in_environ(environ: dict[str, str], target: Callable[..., None], args: tuple) -> None:
    _take_environ(environ)
    target(*args)


def _take_environ(environ: dict[str, str]) -> None:
    """A forked process has its server's environment (the one of the server's start): the
    test process's, as it was when the process was made, replaces it."""
    os.environ.clear()
    os.environ.update(environ)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@atexit.register
def _close_all() -> None:
    for world in list(_live_worlds):
        world.close()


def _exit_with_parent(parent_pid: int) -> None:
    # A rank stuck in a collective never reads its pipe again; this makes it die with
    # an interrupted test run instead of lingering as an orphan. The parent is the test
    # process, or the fork server, which exits when the test process does.
    while os.getppid() == parent_pid:
        time.sleep(1.0)
    os._exit(1)


def _worker_main(rank: int, size: int, port: int, backend: str,
                 conn: multiprocessing.connection.Connection, environ: dict[str, str]) -> None:
    threading.Thread(target=_exit_with_parent, args=(os.getppid(),), daemon=True).start()
    _take_environ(environ)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(size), LOCAL_RANK=str(rank))
    try:
        import torch
        import torch.distributed as dist

        # Ranks share a few cores: more intra-op threads would only fight each other.
        torch.set_num_threads(1)
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, rank=rank, world_size=size,
                                timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
        conn.send(RankResult(rank, value="ready"))
    except BaseException as e:
        conn.send(_failure(rank, e))
        return
    world_groups = set(_process_groups())
    # Note [frozen imports]: a full gc.collect() walks every object the process holds, and
    # torch, torch._dynamo and fastddp's imports are ~0.5 M of them: 0.2-0.5 s a collection
    # on this machine, paid by every rank after every scenario (about half the wall time of a
    # short scenario). gc.freeze() puts what exists now out of the collector's reach (still
    # freed by reference counting; only a cycle among frozen objects would stay), so a
    # collection walks only what later scenarios made.
    gc.freeze()
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            break
        # Every rank answered the previous scenario before this message was sent (run()
        # collects all replies first), so no collective is left on its groups.
        _destroy_groups_but(world_groups)
        if message is _STOP:
            break
        name, kwargs = message
        try:
            module_name, func_name = name.rsplit(".", 1)
            result = RankResult(rank, value=getattr(importlib.import_module(module_name),
                                                    func_name)(**kwargs))
        except BaseException as e:
            result = _failure(rank, e)
        # Models of a finished scenario go now, with their reducers and autograd hooks; what
        # outlives it (modules the scenario imported, caches) is frozen with the imports.
        gc.collect()
        gc.freeze()
        try:
            conn.send(result)
        except Exception as e:  # a value that does not pickle: report it, stay alive
            conn.send(_failure(rank, e))
    dist.destroy_process_group()
    # Skips the interpreter's slow teardown of torch; nothing is left to flush but stdio.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _process_groups() -> list:
    """torch's named c10d groups (not the link emulator's wrappers: they sit in torch's group
    map without a name, and torch's destroy_process_group raises KeyError on them)."""
    from torch.distributed import distributed_c10d

    return list(distributed_c10d._world.pg_names)


def _destroy_groups_but(kept: set) -> None:
    """Destroys the c10d groups a finished scenario made (hierarchical hooks, subgroups).
    Each gloo group keeps a thread that wakes every 10 ms for good: a persistent world that
    kept them all had hundreds per rank by the suite's end, and their wake-ups starved other
    processes beside two busy loops (a two-node launcher run took 104-155 s instead of 13 s
    beside 4 idle ranks holding 10 scenarios' groups; results/suite.md).

    A device mesh's groups stay: meshes compare equal by their layout alone, so torch's
    DTensor caches hand a later scenario's equal mesh the earlier one's group names."""
    import torch.distributed as dist

    for group in _process_groups():
        if group not in kept and not group.group_desc.startswith("mesh"):
            try:
                dist.destroy_process_group(group)
            except Exception:  # hygiene only: a group kept costs time, never a result
                pass


def _failure(rank: int, e: BaseException) -> RankResult:
    return RankResult(rank, error_type=type(e).__name__, error=str(e),
                      traceback="".join(traceback.format_exception(e)))


# Scenarios that exercise the harness itself (see test_harness.py).
def environment(name: str) -> str | None:
    return os.environ.get(name)


def ping() -> int:
    import torch.distributed as dist

    return dist.get_rank()


def raise_on_ranks(ranks: list[int]) -> str:
    import torch.distributed as dist

    if dist.get_rank() in ranks:
        raise ValueError(f"rank {dist.get_rank()} raises on purpose")
    return "fine"


def hang_on_rank(rank: int) -> None:
    import torch
    import torch.distributed as dist

    if dist.get_rank() == rank:
        time.sleep(3600)
    dist.all_reduce(torch.ones(1))


def kill_rank(rank: int) -> str:
    import signal

    import torch.distributed as dist

    if dist.get_rank() == rank:
        os.kill(os.getpid(), signal.SIGKILL)
    return "alive"
