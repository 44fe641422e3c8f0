"""Communication figures as text: the ``--report`` table of ``model.comm_stats()``, and the
ring-allreduce projection that ``benchmarks/article.py`` prints.

Pure formatting and arithmetic on plain numbers: nothing here touches torch, a process
group or a device, so the functions are unit-tested with hand-made inputs.
"""

import math
from collections.abc import Mapping, Sequence
from typing import Any

from fastddp.link.model import bus_factor

_MB = 1e6


def format_comm_stats(stats: Mapping[str, Any]) -> str:
    """The table ``--report`` prints for a ``comm_stats()`` dict.

    Keys follow ``DistributedDataParallel.comm_stats()``: steps, world_size, hook,
    bytes_reduced, bytes_sent, compression_ratio, exposed_comm_ms, mean_exposed_comm_ms and
    ``buckets`` (per bucket: index, num_params, numel, dtype, bytes, wire_bytes, ready_ms,
    launched_ms, done_ms, relative to the first gradient of the last step; on a GPU, of the
    sampled step ``timed_iteration``, the latest the device had finished). A missing key
    shows as ``-`` rather than failing, since a report runs at exit.
    """
    g = stats.get
    timed = "last step" if g("clock") != "device" else f"step {_num(g('timed_iteration'))}"
    lines = [
        (f"[fastddp] communication report: {_num(g('steps'))} steps, world size "
         f"{_num(g('world_size'))}, hook {g('hook', '-')}"),
        (f"  per step: gradients {_mb(g('bytes_reduced'))} MB, sent {_mb(g('bytes_sent'))} MB "
         f"(compression {_fixed(g('compression_ratio'), 2)}x)"),
        ("  exposed communication (backward end -> gradients final): "
         f"{timed} {_fixed(g('exposed_comm_ms'), 3)} ms, "
         f"mean {_fixed(g('mean_exposed_comm_ms'), 3)} ms"),
    ]
    buckets = g("buckets") or []
    if not buckets:
        lines.append("  no buckets (world size 1 or nothing reduced yet)")
        return "\n".join(lines)
    header = ("bucket", "params", "numel", "dtype", "MB", "wire MB", "ready ms", "launched ms",
              "done ms", "comm ms")
    rows = [header]
    for b in buckets:
        b_get = b.get
        launched, done = b_get("launched_ms"), b_get("done_ms")
        comm = done - launched if _is_num(launched) and _is_num(done) else None
        rows.append((
            _num(b_get("index")), _num(b_get("num_params")), _num(b_get("numel")),
            str(b_get("dtype", "-")), _mb(b_get("bytes")), _mb(b_get("wire_bytes")),
            _fixed(b_get("ready_ms"), 3), _fixed(launched, 3), _fixed(done, 3), _fixed(comm, 3),
        ))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    for row in rows:
        lines.append("  " + "  ".join(cell.rjust(w) for cell, w in zip(row, widths)))
    return "\n".join(lines)


def _is_num(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _num(x: Any) -> str:
    return f"{x:,}" if isinstance(x, int) and not isinstance(x, bool) else (
        "-" if x is None else str(x))


def _fixed(x: Any, digits: int) -> str:
    return f"{x:.{digits}f}" if _is_num(x) else "-"


def _mb(x: Any) -> str:
    return f"{x / _MB:.2f}" if _is_num(x) else "-"


# The projection: Note [ring allreduce cost] (one case of Note [collective cost] in link/model.py,
# whose bus factors this uses). A ring allreduce of S bytes over n ranks
# moves 2(n-1)/n * S bytes through every rank's link, so with a bus bandwidth B (the
# nccl-tests "busbw") it takes 2(n-1)/n * S / B. Latency terms are left out: at the
# article's sizes (hundreds of MB) they are far below a millisecond per bucket.
def ring_allreduce_ms(nbytes: float, n: int, bus_gbs: float) -> float:
    """Time of a ring allreduce of ``nbytes`` over ``n`` ranks at ``bus_gbs`` GB/s."""
    if n < 1 or bus_gbs <= 0:
        raise ValueError(f"ring_allreduce_ms: need n >= 1 and bus_gbs > 0, got {n}, {bus_gbs}")
    return bus_factor("allreduce", n) * nbytes / (bus_gbs * 1e9) * 1e3


def projected_step_ms(compute_ms: float, kernel_ms: float, wire_bytes: float, n: int,
                      bus_gbs: float, overlap_ms: float = 0.0, buckets: int = 1) -> float:
    """Step time on ``n`` devices: compute, plus the hook's kernels, plus exposed comm.

    ``compute_ms`` is one device's step without DDP, ``kernel_ms`` what the DDP variant
    adds on one device (bucket copies, compression). With one bucket the whole allreduce
    follows backward. With ``buckets`` > 1, all but the last bucket can run while up to
    ``overlap_ms`` of backward is still computing, so the exposed part is at least the
    last bucket's share: an idealized bound (no contention between comm and compute).
    """
    comm = ring_allreduce_ms(wire_bytes, n, bus_gbs)
    exposed = comm if buckets <= 1 else max(comm / buckets, comm - overlap_ms)
    return compute_ms + kernel_ms + exposed


def format_projection(rows: Sequence[Mapping[str, Any]], ns: Sequence[int],
                      bandwidths: Sequence[tuple[str, float]], title: str) -> str:
    """A markdown table of projected steps/s: one row per configuration, one column per
    (n, bandwidth). Each row needs name, compute_ms, kernel_ms, wire_bytes and optionally
    overlap_ms, buckets and ``reported`` ({column label: steps/s} from the article)."""
    columns = [(n, label, gbs) for n in ns for label, gbs in bandwidths]
    head = ["configuration", "wire MB/step", "1 device ms"] + [
        f"{n}x @ {label} ({gbs:g} GB/s)" for n, label, gbs in columns]
    out = [f"**{title}**", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        cells = [row["name"], f"{row['wire_bytes'] / _MB:.1f}",
                 f"{row['compute_ms'] + row['kernel_ms']:.1f}"]
        reported = row.get("reported", {})
        for n, label, gbs in columns:
            ms = projected_step_ms(row["compute_ms"], row["kernel_ms"], row["wire_bytes"], n,
                                   gbs, row.get("overlap_ms", 0.0), row.get("buckets", 1))
            cell = f"{1e3 / ms:.2f}"
            if (n, label) in reported:
                cell += f" (article: {reported[(n, label)]})"
            cells.append(cell)
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)
