"""``model.logger``: what torch DDP's C++ Logger records, for ``_get_ddp_logging_data()``.

- the last error DDP raised (``set_error_and_log``), read back as ``has_error`` / ``error``;
- runtime statistics of sampled iterations, under torch's key names and in nanoseconds:
  forward compute, backward compute (first to last gradient), backward communication
  (first bucket launched to last bucket's grads written) and their overlap, with host-side
  start/end times and running averages (``avg_*``). As torch, iterations 1-10 and then every
  ``sample_rate``-th are sampled, and ``iteration`` names the last sampled one recorded.

The backward times come from the C++ reducer's per-bucket timings (``comm_stats()``). On the
host's clock (CPU) they are the last step's, read at the next forward, as torch's logger
reads its CPU timer. On a GPU they are CUDA events that the reducer records only in the
sampled iterations, as torch's does (the reducer is told the sample rate), and that
``comm_stats()`` reads without waiting for the device (Note [device timeline] in
csrc/reducer/step_stats.h): a sampled iteration's figures arrive at the first
synchronized forward that finds them complete, usually one or two after it, where torch's
logger synchronizes the device to read them at once. Until then the iteration stays pending
(with its forward times and bucket count, taken at the forward after it); one that a later
sampled iteration overtook before it was read is left out.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

# torch's Reducer: every iteration up to this one is sampled, then every sample_rate-th.
_ALWAYS_SAMPLED = 10
# Sampled iterations kept waiting for their backward times: the reducer keeps at most 4 timed
# backwards in flight on the device (DeviceTimeline::kMaxInFlight), so more never all arrive.
_MAX_PENDING = 8
_TIMES = ("forward_compute_time", "backward_compute_time", "backward_comm_time",
          "backward_compute_comm_overlap_time")


class DdpLogger:
    """Errors and sampled runtime statistics of one DistributedDataParallel."""

    def __init__(self) -> None:
        self.error = ""
        self.sample_rate = 100  # torch's default (kDDPRuntimeLoggingSampleRate)
        self.sampled_iteration = 0
        self.runtime_stats: dict[str, int] = {}
        self._samples = 0
        self._forward: tuple[int, int] | None = None  # (start, end) of the last forward
        # Sampled iterations whose backward times are not read yet: (forward times, buckets
        # reduced), by iteration (at most a few: see the module's docstring).
        self._pending: dict[int, tuple[tuple[int, int], int | None]] = {}

    def set_error_and_log(self, message: str) -> None:
        self.error = message

    @contextlib.contextmanager
    def recording_errors(self) -> Iterator[None]:
        """Records a RuntimeError raised inside (as torch's C++ checks log theirs), then
        lets it go on."""
        try:
            yield
        except RuntimeError as e:
            self.set_error_and_log(f"{RuntimeError}: {e}")
            raise

    def _set_ddp_runtime_logging_sample_rate(self, rate: int) -> None:
        if rate < 1:
            raise ValueError("DDP runtime logging sample rate should be equal or greater than 1")
        self.sample_rate = rate

    @staticmethod
    def now() -> int:
        """The clock the C++ reducer's times use (steady_clock is CLOCK_MONOTONIC)."""
        return time.monotonic_ns()

    def forward_done(self, start: int) -> None:
        self._forward = (start, self.now())

    def _sampled(self, completed: int) -> bool:
        return completed > 0 and (completed <= _ALWAYS_SAMPLED
                                  or completed % self.sample_rate == 0)

    def before_forward(self, completed: int, comm_stats: Callable[[], dict[str, Any]],
                       buckets_reduced: Callable[[], int] | None = None) -> None:
        """At a synchronized forward, `completed` synchronized iterations in: if this count
        is sampled, takes the previous iteration's host figures (torch's
        set_runtime_stats_and_log, called from the same place): its forward times and how
        many buckets its backward reduced (torch's num_buckets_reduced:
        skip_all_reduce_unused_params skips some). Then, while a sampled iteration waits
        for its backward times, reads ``comm_stats`` (never a wait) and records the
        iteration once its figures are there. Outside sampled iterations and pending ones,
        nothing is read."""
        if self._sampled(completed) and self._forward is not None:
            reduced = buckets_reduced() if buckets_reduced is not None else None
            self._pending[completed] = (self._forward, reduced)
            while len(self._pending) > _MAX_PENDING:  # figures that never came (no backward)
                del self._pending[next(iter(self._pending))]
        if not self._pending:
            return
        comm = comm_stats()
        timed = comm.get("timed_iteration", 0)
        if timed <= 0 or not comm.get("buckets") or not comm["steps"]:
            return
        for older in [k for k in self._pending if k < timed]:
            del self._pending[older]  # overtaken before its figures were read
        if timed not in self._pending:
            return
        (forward_start, forward_end), reduced = self._pending.pop(timed)
        buckets = comm["buckets"]
        origin = int(comm["backward_start_ns"])
        compute_end = origin + int(max(b["ready_ms"] for b in buckets) * 1e6)
        comm_start = origin + int(min(b["launched_ms"] for b in buckets) * 1e6)
        comm_end = origin + int(max(b["done_ms"] for b in buckets) * 1e6)
        comm_start = min(comm_start, comm_end)
        current = {
            "forward_compute_time_start": forward_start,
            "backward_compute_time_start": origin,
            "backward_compute_time_end": compute_end,
            "backward_comm_time_start": comm_start,
            "backward_comm_time_end": comm_end,
            "forward_compute_time": max(forward_end - forward_start, 1),
            "backward_compute_time": max(compute_end - origin, 1),
            "backward_comm_time": max(comm_end - comm_start, 1),
            "backward_compute_comm_overlap_time": max(compute_end - comm_start, 0),
        }
        if reduced is not None:
            current["num_buckets_reduced"] = reduced
        self._samples += 1
        for key in _TIMES:
            avg = f"avg_{key}"
            previous = self.runtime_stats.get(avg, 0)
            current[avg] = (previous * (self._samples - 1) + current[key]) // self._samples
        self.runtime_stats = current
        self.sampled_iteration = timed
