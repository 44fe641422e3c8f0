"""A communication link as two numbers, and what a collective costs on it.

Note [collective cost]: a collective of S bytes over n ranks on a link of bus bandwidth B
(the nccl-tests "busbw") and per-collective latency L takes

    L + f(n) * S / B

where f is the collective's bus factor, as nccl-tests defines busbw = algbw * f(n):

    allreduce                           2(n-1)/n   S = the buffer (ring: reduce-scatter + allgather)
    alltoall, allgather, reduce_scatter  (n-1)/n   S = the whole buffer (allgather: the output,
                                                   reduce_scatter and alltoall: the input)
    broadcast, reduce, send/recv        1          S = the buffer
    gather, scatter                      (n-1)/n   S = the whole buffer at the root
    barrier                             0          latency only

Everything here is plain arithmetic: no torch, so the emulator (emulator.py), the cost
model (tuning/cost_model.py) and the article projection (launch/report.py) share one formula.
"""

import re
from dataclasses import dataclass

# Bus factor f(n) per collective kind (Note [collective cost]).
_FACTORS = {
    "allreduce": lambda n: 2.0 * (n - 1) / n,
    "alltoall": lambda n: (n - 1) / n,
    "allgather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "gather": lambda n: (n - 1) / n,
    "scatter": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "reduce": lambda n: 1.0,
    "send": lambda n: 1.0,
    "recv": lambda n: 1.0,
    "barrier": lambda n: 0.0,
}
COLLECTIVE_KINDS = tuple(_FACTORS)

# Bytes per second for each bandwidth unit (decimal, as nccl-tests and launch/report.py:
# 1 GB = 1e9 B; lower-case b is bits).
_BANDWIDTH_UNITS = {
    "B/s": 1.0, "KB/s": 1e3, "MB/s": 1e6, "GB/s": 1e9, "TB/s": 1e12,
    "KiB/s": 2.0**10, "MiB/s": 2.0**20, "GiB/s": 2.0**30,
    "b/s": 1 / 8, "Kb/s": 1e3 / 8, "Mb/s": 1e6 / 8, "Gb/s": 1e9 / 8, "Tb/s": 1e12 / 8,
    "bps": 1 / 8, "Kbps": 1e3 / 8, "Mbps": 1e6 / 8, "Gbps": 1e9 / 8,
}
_LATENCY_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}
_NUMBER = r"([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)"


def bus_factor(kind: str, n: int) -> float:
    """f(n) of Note [collective cost]: bytes through each rank's link per byte of payload."""
    if kind not in _FACTORS:
        raise ValueError(f"unknown collective {kind!r}; known: {', '.join(COLLECTIVE_KINDS)}")
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"world size must be a positive int, got {n!r}")
    return _FACTORS[kind](n)


@dataclass(frozen=True)
class Link:
    """A link of ``bus_gbs`` GB/s bus bandwidth (1 GB = 1e9 bytes) and ``latency_us``
    microseconds per collective."""

    bus_gbs: float
    latency_us: float = 0.0

    def __post_init__(self) -> None:
        if not (isinstance(self.bus_gbs, (int, float)) and self.bus_gbs > 0):
            raise ValueError(f"Link: bus_gbs must be a positive number, got {self.bus_gbs!r}")
        if not (isinstance(self.latency_us, (int, float)) and self.latency_us >= 0):
            raise ValueError(f"Link: latency_us must be >= 0, got {self.latency_us!r}")

    @property
    def bytes_per_s(self) -> float:
        return self.bus_gbs * 1e9

    def seconds(self, kind: str, nbytes: float, n: int) -> float:
        """Time of one ``kind`` collective of ``nbytes`` over ``n`` ranks on this link."""
        if nbytes < 0:
            raise ValueError(f"Link.seconds: nbytes must be >= 0, got {nbytes}")
        return self.latency_us * 1e-6 + bus_factor(kind, n) * nbytes / self.bytes_per_s

    def ms(self, kind: str, nbytes: float, n: int) -> float:
        """:meth:`seconds` in milliseconds."""
        return self.seconds(kind, nbytes, n) * 1e3

    def __str__(self) -> str:
        """The spec :func:`parse_link` reads back: ``3GB/s,20us``, ``500MB/s``."""
        scale, unit = next(((scale, unit) for scale, unit in (
            (1e9, "GB/s"), (1e6, "MB/s"), (1e3, "KB/s")) if self.bytes_per_s >= scale),
            (1.0, "B/s"))
        bandwidth = f"{self.bytes_per_s / scale:.12g}{unit}"
        if not self.latency_us:
            return bandwidth
        latency = (f"{self.latency_us / 1e3:.12g}ms" if self.latency_us >= 1e3
                   else f"{self.latency_us:.12g}us")
        return f"{bandwidth},{latency}"


def parse_link(text: str) -> Link:
    """``"3GB/s"``, ``"100Gb/s,5us"``, ``"500MB/s,0.1ms"`` -> :class:`Link`.

    Bandwidth units: B/s, KB/s, MB/s, GB/s, TB/s (decimal), KiB/s, MiB/s, GiB/s, and bits:
    b/s, Kb/s, Mb/s, Gb/s, Tb/s (or bps, Mbps, Gbps). Latency units: s, ms, us, ns.
    """
    if not isinstance(text, str):
        raise TypeError(f"link spec must be a string like '3GB/s,20us', got {type(text).__name__}")
    parts = [p.strip() for p in text.split(",")]
    if len(parts) > 2 or not parts[0]:
        raise ValueError(f"link spec {text!r}: expected BANDWIDTH[,LATENCY], e.g. '3GB/s,20us'")
    bandwidth = _quantity(parts[0], _BANDWIDTH_UNITS, text, "bandwidth")
    if bandwidth <= 0:
        raise ValueError(f"link spec {text!r}: the bandwidth must be positive")
    latency = _quantity(parts[1], _LATENCY_UNITS, text, "latency") if len(parts) == 2 else 0.0
    return Link(bus_gbs=bandwidth / 1e9, latency_us=latency * 1e6)


def _quantity(part: str, units: dict[str, float], text: str, what: str) -> float:
    m = re.fullmatch(_NUMBER + r"\s*(\S+)", part)
    if m is None or m.group(2) not in units:
        raise ValueError(f"link spec {text!r}: cannot read the {what} {part!r}; write a number "
                         f"and one of the units {', '.join(units)}")
    return float(m.group(1)) * units[m.group(2)]
