"""``model.logger``: what torch DDP's C++ Logger records, for ``_get_ddp_logging_data()``.

- the last error DDP raised (``set_error_and_log``), read back as ``has_error`` / ``error``;
- runtime statistics of sampled iterations, under torch's key names and in nanoseconds:
  forward compute, backward compute (first to last gradient), backward communication
  (first bucket launched to last bucket's grads written) and their overlap, with host-side
  start/end times and running averages (``avg_*``). As torch, iterations 1-10 and then every
  ``sample_rate``-th are sampled, and ``iteration`` names the last sampled one.

The backward times come from the C++ reducer's per-bucket timings (``comm_stats()``), which
it keeps anyway; this module only reads them once per sampled iteration, at the next forward.
On CUDA they are host times, as torch's logger's are on CPU.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

# torch's Reducer: every iteration up to this one is sampled, then every sample_rate-th.
_ALWAYS_SAMPLED = 10
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

    def before_forward(self, completed: int, comm_stats: Callable[[], dict[str, Any]],
                       buckets_reduced: Callable[[], int] | None = None) -> None:
        """At a synchronized forward, `completed` synchronized iterations in: records the
        previous one's statistics if this count is sampled (torch's
        set_runtime_stats_and_log, called from the same place), with how many buckets its
        backward reduced (torch's num_buckets_reduced: skip_all_reduce_unused_params
        skips some). `comm_stats` and `buckets_reduced` are read only then."""
        if completed <= 0 or not (completed <= _ALWAYS_SAMPLED
                                  or completed % self.sample_rate == 0):
            return
        comm = comm_stats() if self._forward is not None else None
        if comm is None or not comm.get("buckets") or not comm["steps"]:
            return
        buckets = comm["buckets"]
        origin = int(comm["backward_start_ns"])
        compute_end = origin + int(max(b["ready_ms"] for b in buckets) * 1e6)
        comm_start = origin + int(min(b["launched_ms"] for b in buckets) * 1e6)
        comm_end = origin + int(max(b["done_ms"] for b in buckets) * 1e6)
        comm_start = min(comm_start, comm_end)
        forward_start, forward_end = self._forward
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
        if buckets_reduced is not None:
            current["num_buckets_reduced"] = buckets_reduced()
        self._samples += 1
        for key in _TIMES:
            avg = f"avg_{key}"
            previous = self.runtime_stats.get(avg, 0)
            current[avg] = (previous * (self._samples - 1) + current[key]) // self._samples
        self.runtime_stats = current
        self.sampled_iteration = completed
