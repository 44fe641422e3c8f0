"""``EmulatedLinkGroup``: a process group that runs every collective on the group it wraps
and completes it no earlier than the given link would have (Note [collective cost]).

    group = EmulatedLinkGroup(dist.group.WORLD, "3GB/s,20us")   # the article's PCIe box
    model = fastddp.DistributedDataParallel(net, process_group=group)

or from the command line, for every model a script wraps:
``torchrun ... -m fastddp --emulate-link 3GB/s train.py``.

Note [emulated link timing]: the wrapper keeps one clock per link. A collective of kind k
and S bytes launched at time t starts on the link at ``start = max(t, previous end)``
(collectives on one link run one after another) and ends at ``end = start + L + f(n)·S/B``.
The real collective is launched at once on the wrapped group; the returned Work completes at
``max(real completion, end)``. Nothing blocks the caller: a completer thread per link sleeps
until each ``end``, waits for the real work, then completes the Work, in ``end`` order. The
clock is local to the rank: a rank that launches early is not held back by a late peer
beyond what the real collective does. Wake-ups are Python threads, so a completion can come
late by up to the interpreter's switch interval (5 ms) while another thread runs Python.

One wrapper is one link. A later multi-node setup wraps its intra-node group and its
inter-node group in two wrappers with different links; each has its own clock.

The Work's future is typed: Note [typed futures] in fastddp/link/_typed_future.py. On CUDA the
Work completes once the collective has finished on the device (the completer synchronizes a
side stream), so its users need no stream waits.
"""

import heapq
import itertools
import sys
import threading
import time
from collections import Counter
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import (AllgatherOptions, AllreduceCoalescedOptions,
                                        AllreduceOptions, AllToAllOptions, BarrierOptions,
                                        BroadcastOptions, GatherOptions, ReduceOptions,
                                        ReduceScatterOptions, ScatterOptions)

from fastddp import _group_ops
from fastddp.link._typed_future import remember_done, typed_future_maker
from fastddp.link.model import Link, parse_link

__all__ = ["EmulatedLinkGroup"]

Tensors = list[torch.Tensor]
# The clock of Note [emulated link timing], read at each launch and by the completers.
# Tests put a fake one here (time that moves only when they say), to check the schedule
# without measuring wall time on a loaded machine.
_clock = time.perf_counter


def _nbytes(tensors: Any) -> int:
    """Bytes of a tensor or of (nested lists of) tensors."""
    if isinstance(tensors, torch.Tensor):
        return tensors.numel() * tensors.element_size()
    return sum(_nbytes(t) for t in tensors)


def _flat(tensors: Any) -> Tensors:
    if isinstance(tensors, torch.Tensor):
        return [tensors]
    return [t for item in tensors for t in _flat(item)]


class _Pending:
    __slots__ = ("end", "seq", "work", "done", "failed", "kind", "device")

    def __init__(self, end: float, seq: int, work: Any, kind: str, device: torch.device):
        self.end, self.seq, self.work, self.kind, self.device = end, seq, work, kind, device
        self.done = torch.futures.Future()
        self.failed = torch.zeros((), dtype=torch.bool)

    def __lt__(self, other: "_Pending") -> bool:
        return (self.end, self.seq) < (other.end, other.seq)


class _Completer:
    """The thread that completes a link's collectives (Note [emulated link timing])."""

    def __init__(self, rank: int):
        self._rank = rank
        self._heap: list[_Pending] = []
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None

    def submit(self, pending: _Pending) -> None:
        with self._cond:
            heapq.heappush(self._heap, pending)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, daemon=True,
                                                name=f"fastddp-link-rank{self._rank}")
                self._thread.start()
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._heap:
                    self._cond.wait()
                delay = self._heap[0].end - _clock()
                if delay > 0:
                    # Wakes early when a collective with an earlier end arrives.
                    self._cond.wait(delay)
                    continue
                pending = heapq.heappop(self._heap)
            self._complete(pending)

    def _complete(self, pending: _Pending) -> None:
        try:
            _wait_real(pending.work, pending.device)
        except Exception as e:  # noqa: BLE001 -- reported through the Work, and printed here
            pending.failed.fill_(True)
            print(f"[fastddp] EmulatedLinkGroup rank {self._rank}: {pending.kind} failed on the "
                  f"wrapped process group: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        pending.done.set_result(0)


def _wait_real(work: Any, device: torch.device) -> None:
    """Returns when the real collective's outputs are written (on CUDA: on the device, so
    that the completed Work needs no stream synchronization from its users)."""
    if work is None:
        return
    # _group_ops.wait: the wrapped group may be written in Python, its Work's wait(timeout)
    # waited on as C++ waits on it.
    if device.type != "cuda":
        _group_ops.wait(work)
        return
    with torch.cuda.device(device):
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            _group_ops.wait(work)  # makes `stream` wait for the collective
        stream.synchronize()


class _EmulatedWork(dist._Work):
    """The Work of one emulated collective: its future is the typed one (Note [typed
    futures]), and wait() raises when the collective failed, as a real group's Work does
    (torch's _create_work_from_future makes a Work whose wait() does not)."""

    def __init__(self, future: torch.futures.Future):
        super().__init__()
        self._future = future

    def wait(self, timeout: object = None) -> bool:
        self._future.wait()  # releases the GIL while it waits; raises if the collective failed
        return True

    def get_future(self) -> torch.futures.Future:
        return self._future

    def is_completed(self) -> bool:
        return self._future.done()


class EmulatedLinkGroup(dist.ProcessGroup):
    """A ProcessGroup over ``group`` whose collectives take at least the time the bytes would
    take on ``link`` (Note [emulated link timing]); results are ``group``'s, bit for bit.

    ``link`` is a :class:`fastddp.link.Link`, a spec such as ``"3GB/s,20us"``, or given as
    ``bus_gbs=`` (GB/s of bus bandwidth, 1 GB = 1e9 bytes) and ``latency_us=``. fastddp's
    C++ reducer and hooks, torch DDP and ``torch.distributed`` calls all use it as an
    ordinary process group. ``stats()`` counts what went through it.
    """

    def __init__(self, group: dist.ProcessGroup, link: Link | str | None = None, *,
                 bus_gbs: float | None = None, latency_us: float = 0.0):
        if not isinstance(group, dist.ProcessGroup):
            raise TypeError(f"EmulatedLinkGroup: group must be a torch.distributed.ProcessGroup, "
                            f"got {type(group).__name__}")
        if (link is None) == (bus_gbs is None):
            raise ValueError("EmulatedLinkGroup: give either link ('3GB/s,20us' or a Link) or "
                             "bus_gbs= (and optionally latency_us=)")
        if link is None:
            link = Link(bus_gbs, latency_us)
        elif isinstance(link, str):
            link = parse_link(link)
        elif not isinstance(link, Link):
            raise TypeError(f"EmulatedLinkGroup: link must be a Link or a spec string, got "
                            f"{type(link).__name__}")
        super().__init__(group.rank(), group.size())
        self.inner = group
        self.link = link
        self._lock = threading.Lock()
        self._free_at = 0.0
        self._seq = itertools.count()
        self._completer = _Completer(group.rank())
        self.counts: Counter[str] = Counter()
        self.bytes: Counter[str] = Counter()
        self.emulated_s = 0.0
        # Compiled now rather than in the first collective, which it would slow down.
        self._typed_future = typed_future_maker()
        self._register_like(group)

    def __repr__(self) -> str:
        return f"EmulatedLinkGroup({self.inner!r}, link={str(self.link)!r})"

    def stats(self) -> dict[str, Any]:
        """Per collective kind: how many went through, their bytes (S of Note [collective
        cost]), and the total emulated link time in seconds."""
        with self._lock:
            return {"link": str(self.link), "counts": dict(self.counts),
                    "bytes": dict(self.bytes), "emulated_s": self.emulated_s}

    def _register_like(self, group: dist.ProcessGroup) -> None:
        """Makes the wrapper look like ``group`` to torch.distributed and torch DDP."""
        # dist.broadcast(group=...), dist.get_rank(group) and dist.get_backend(group) look
        # groups up in these maps.
        world = dist.distributed_c10d._world
        if group in world.pg_group_ranks:
            world.pg_group_ranks[self] = dict(world.pg_group_ranks[group])
        if group in world.pg_map:
            world.pg_map[self] = world.pg_map[group]
        # torch DDP's C++ logger asks the group for its backend object by type, and the
        # group name comes from it. Collectives never reach it: every one is overridden here.
        for device in getattr(group, "_device_types", []):
            backend = group._get_backend(torch.device(device))
            kind = getattr(dist.ProcessGroup.BackendType, backend.name().upper(),
                           dist.ProcessGroup.BackendType.CUSTOM)
            self._register_backend(torch.device(device), kind, backend)

    def getBackendName(self) -> str:  # noqa: N802 -- the C++ name the trampoline calls
        return self.inner.name()

    def _issue(self, kind: str, nbytes: int, outputs: Tensors, launch: Any) -> Any:
        """Launches the real collective and returns a Work that completes at
        max(real completion, emulated end)."""
        cost = self.link.seconds(kind, nbytes, self.size())
        now = _clock()
        work = launch()  # first: a collective the wrapped group refuses leaves the clock alone
        with self._lock:
            start = max(now, self._free_at)
            self._free_at = end = start + cost
            self.counts[kind] += 1
            self.bytes[kind] += nbytes
            self.emulated_s += cost
            seq = next(self._seq)
        device = outputs[0].device if outputs else torch.device("cpu")
        pending = _Pending(end, seq, work, kind, device)
        typed = self._typed_future(pending.done, pending.failed, outputs)
        remember_done(pending.done)  # Note [exit with forked tasks]
        self._completer.submit(pending)
        return _EmulatedWork(typed)

    # Collectives: the names the C++ trampoline (torch/csrc/distributed/c10d/py/
    # PyProcessGroup.hpp) and torch.distributed call, old and new. Bytes follow Note
    # [collective cost]; outputs are what the wrapped group's Work reports.
    def allreduce(self, tensors: Tensors, opts: Any = None) -> Any:
        opts = AllreduceOptions() if opts is None else opts
        return self._issue("allreduce", _nbytes(tensors), list(tensors),
                           lambda: self.inner.allreduce(tensors, opts))

    def allreduce_coalesced(self, tensors: Tensors, opts: Any = None) -> Any:
        opts = AllreduceCoalescedOptions() if opts is None else opts
        return self._issue("allreduce", _nbytes(tensors), list(tensors),
                           lambda: self.inner.allreduce_coalesced(tensors, opts))

    def broadcast(self, tensors: Tensors, opts: Any = None) -> Any:
        opts = BroadcastOptions() if opts is None else opts
        return self._issue("broadcast", _nbytes(tensors), list(tensors),
                           lambda: self.inner.broadcast(tensors, opts))

    def reduce(self, tensors: Tensors, opts: Any = None) -> Any:
        opts = ReduceOptions() if opts is None else opts
        return self._issue("reduce", _nbytes(tensors), list(tensors),
                           lambda: self.inner.reduce(tensors, opts))

    def allgather(self, outputs: list[Tensors], inputs: Tensors, opts: Any = None) -> Any:
        opts = AllgatherOptions() if opts is None else opts
        return self._issue("allgather", _nbytes(outputs), _flat(outputs),
                           lambda: self.inner.allgather(outputs, inputs, opts))

    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:
        opts = AllgatherOptions() if opts is None else opts
        return self._issue("allgather", _nbytes(output), [output],
                           lambda: self.inner._allgather_base(output, input, opts))

    all_gather_single = _allgather_base

    def allgather_into_tensor_coalesced(self, outputs: Tensors, inputs: Tensors,
                                        opts: Any = None) -> Any:
        opts = AllgatherOptions() if opts is None else opts
        return self._issue("allgather", _nbytes(outputs), list(outputs),
                           lambda: self.inner.allgather_into_tensor_coalesced(
                               outputs, inputs, opts))

    all_gather_single_coalesced = allgather_into_tensor_coalesced

    def alltoall(self, outputs: Tensors, inputs: Tensors, opts: Any = None) -> Any:
        opts = AllToAllOptions() if opts is None else opts
        return self._issue("alltoall", _nbytes(inputs), list(outputs),
                           lambda: self.inner.alltoall(outputs, inputs, opts))

    def alltoall_base(self, output: torch.Tensor, input: torch.Tensor, output_splits: list[int],
                      input_splits: list[int], opts: Any = None) -> Any:
        opts = AllToAllOptions() if opts is None else opts
        return self._issue("alltoall", _nbytes(input), [output],
                           lambda: self.inner.alltoall_base(output, input, output_splits,
                                                            input_splits, opts))

    all_to_all_single = alltoall_base

    def reduce_scatter(self, outputs: Tensors, inputs: list[Tensors], opts: Any = None) -> Any:
        opts = ReduceScatterOptions() if opts is None else opts
        return self._issue("reduce_scatter", _nbytes(inputs), list(outputs),
                           lambda: self.inner.reduce_scatter(outputs, inputs, opts))

    def _reduce_scatter_base(self, output: torch.Tensor, input: torch.Tensor,
                             opts: Any = None) -> Any:
        opts = ReduceScatterOptions() if opts is None else opts
        return self._issue("reduce_scatter", _nbytes(input), [output],
                           lambda: self.inner._reduce_scatter_base(output, input, opts))

    reduce_scatter_single = _reduce_scatter_base

    def reduce_scatter_tensor_coalesced(self, outputs: Tensors, inputs: Tensors,
                                        opts: Any = None) -> Any:
        opts = ReduceScatterOptions() if opts is None else opts
        return self._issue("reduce_scatter", _nbytes(inputs), list(outputs),
                           lambda: self.inner.reduce_scatter_tensor_coalesced(
                               outputs, inputs, opts))

    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced

    def gather(self, outputs: list[Tensors], inputs: Tensors, opts: Any = None) -> Any:
        opts = GatherOptions() if opts is None else opts
        # S is the gathered whole, n inputs (only the root holds the outputs).
        return self._issue("gather", self.size() * _nbytes(inputs), _flat(outputs),
                           lambda: self.inner.gather(outputs, inputs, opts))

    def scatter(self, outputs: Tensors, inputs: list[Tensors], opts: Any = None) -> Any:
        opts = ScatterOptions() if opts is None else opts
        return self._issue("scatter", self.size() * _nbytes(outputs), list(outputs),
                           lambda: self.inner.scatter(outputs, inputs, opts))

    def barrier(self, opts: Any = None) -> Any:
        opts = BarrierOptions() if opts is None else opts
        return self._issue("barrier", 0, [], lambda: self.inner.barrier(opts))

    def send(self, tensors: Tensors, dst: int, tag: int = 0) -> Any:
        return self._issue("send", _nbytes(tensors), list(tensors),
                           lambda: self.inner.send(tensors, dst, tag))

    def recv(self, tensors: Tensors, src: int, tag: int = 0) -> Any:
        return self._issue("recv", _nbytes(tensors), list(tensors),
                           lambda: self.inner.recv(tensors, src, tag))

    def recv_anysource(self, tensors: Tensors, tag: int = 0) -> Any:
        raise NotImplementedError("EmulatedLinkGroup: recv from any source is not emulated")

    recvAnysource = recv_anysource  # noqa: N815 -- the C++ name the trampoline calls
