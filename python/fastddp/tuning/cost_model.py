"""Predicted step time of each gradient-communication candidate, from one measured backward.

Inputs: per bucket, in the order the buckets become ready, the time from backward start to
the bucket being ready (``ready_ms``) and its fp32 gradient bytes (or its tensors' shapes);
the time backward compute ends (``backward_ms``); the link (bus bandwidth B, latency L:
fastddp.link.Link) and the world size n; per candidate, the collectives it issues per
bucket (wire bytes) and its kernel costs.

The model, per candidate:

1. Compression runs on the compute path, when each bucket is copied in (fastddp fuses it
   into the copy-in hook), so it delays the rest of backward: bucket i is ready at
   ``r_i' = r_i + sum_{j<=i} pre_j`` and backward ends at ``E = backward_ms + sum_j pre_j``,
   where ``pre_j = compress_ms_per_mb * S_j / 1e6`` and S_j is bucket j's fp32 bytes.
2. Each bucket issues its collectives in a chain: the first at r_i', each next one when
   the previous ends plus ``between_ms_per_mb * S_i / 1e6`` (kernels between them, off the
   compute path: PowerSGD's matmuls and orthogonalization, the fp32 sum of bf16 shards).
3. The link serves collectives one at a time, in the order they are issued:
   ``start = max(issue, end of the previous collective)``, ``end = start + T(c)`` with
   ``T(c) = L + f(n) * bytes(c) / B`` (Note [collective cost] in fastddp/link/model.py:
   f = 2(n-1)/n for allreduce, (n-1)/n for alltoall and allgather).
4. ``step_ms = fixed_ms + max(E, end of the last collective) + sum_i post_i``, where
   ``post_i = writeback_ms_per_mb * S_i / 1e6`` (decompression and write-back into the
   grads, after the last collective; fastddp does it in one pass at the end of backward) and
   ``fixed_ms`` is the rest of the step (forward, optimizer), taken as measured.
   ``exposed_ms = step_ms - fixed_ms - E``: the time the step waits on communication.

Wire bytes per bucket of S fp32 bytes (numel = S/4):

- ``allreduce_fp32``: one allreduce of S.
- ``bf16``: one allreduce of S/2.
- ``bf16_fp32_accumulate``: an alltoall of the 16-bit buffer padded to a multiple of n
  elements (W = 2 * n * ceil(numel/n)), then an allgather of the summed shards (W again).
- ``int8`` / ``fp8``: the 8-bit hooks (Note [8-bit wire formats]): the bucket padded to a
  multiple of n * 256 elements (P), one byte per element plus a float32 scale per 256
  (W = P + 4 * P / 256), an alltoall of W, then an allgather of W.
- ``powersgd(r)``: the bucket's tensors seen as matrices (shape[0] x the rest), each of
  rank ``k = min(r, rows, cols)``; one is compressed when ``(rows + cols) * k *
  min_compression_rate < rows * cols`` (torch's PowerSGD rule; 1-D tensors never are).
  Uncompressed tensors U (4 bytes per element), P = 4 * sum(rows * k), Q = 4 * sum(cols * k)
  of the compressed ones. fastddp sends U and P in one allreduce, then Q: two allreduces
  (U + P, Q); torch's hook sends three (U, P, Q): ``separate_uncompressed=True``. Steady
  state: the first ``start_powerSGD_iter`` plain steps are not modelled.
- ``acpsgd(r)``: the same matrices; one allreduce per bucket, of U + P on one step and U + Q
  on the next: modelled as one allreduce of U + (P + Q) / 2.

Hierarchical reduction (:func:`hierarchical`, two links): the chain's collectives name
the link they use. The bucket of S bytes, padded to P elements (a multiple of n), is
reduce-scattered inside the node (``alltoall`` of 4P on the intra-node link of L ranks),
the inner candidate's chain runs on the shard of 4P/L bytes over the inter-node link of
n/L ranks, and an allgather of 4P inside the node ends it. Each link serves its own
collectives one at a time; the two serve concurrently (NVLink and the NIC are different
wires). The kernels between (the L-row shard sum, the inner's compression of 1/L of the
bucket) are spread evenly over the chain's gaps.

Other bucket sizes (:func:`rebucket`): gradients are taken to arrive at a steady rate
between two measured ready times (bucket i's bytes between r_{i-1} and r_i); a bucket of cap
C closes when C bytes have arrived since the previous one closed (the last one at the end),
and is ready then. Parameter boundaries are ignored: an estimate for ranking bucket sizes,
which ``--hook auto`` then measures for real.

DiLoCo (:func:`diloco`; fastddp.DiLoCo, docs/diloco.md) is not a hook: the inner steps issue
no collective, and every H / P steps one of P fragments (numel / P values) is averaged:
``fp32`` one allreduce of 4 numel / P bytes; ``bf16`` / ``int8`` / ``int4`` with
``quantized_sum="gather"`` one allgather of every rank's buffer (W b numel / P bytes,
b = 2, 1 + 4/256, 0.5 + 4/64: codes and block scales), with ``"shards"`` an alltoall and an
allgather of b numel / P each. The exchange overlaps ``overlap`` inner steps of
``compute_ms`` each (the measured step without its communication), and only the rest is
exposed: the amortized step is ``compute_ms + max(0, T - overlap * compute_ms) * P / H``.
Padding to whole blocks, the pseudo-gradient's and outer step's element-wise kernels (one
pass over the weights every H / P steps, less than an inner step's optimizer) and the ranks
drifting apart between syncs are not modelled.

Pure arithmetic on plain numbers, tested with hand-computed cases; ``launch/report.py``'s
``projected_step_ms`` is the one-bucket case (see tests/python/tuning/test_cost_model.py).
"""

import heapq
import math
from collections.abc import Callable, Sequence
from typing import Any
from dataclasses import dataclass, field

from fastddp.link.model import Link, bus_factor

_MB = 1e6


@dataclass(frozen=True)
class Bucket:
    """One bucket as measured: ``ready_ms`` after backward start, its fp32 gradient bytes,
    and (for PowerSGD) the shapes of its tensors, which then also give its bytes."""

    ready_ms: float
    nbytes: float | None = None
    shapes: tuple[tuple[int, ...], ...] | None = None

    @property
    def fp32_bytes(self) -> float:
        if self.nbytes is not None:
            return float(self.nbytes)
        if self.shapes is None:
            raise ValueError("Bucket: give nbytes or shapes")
        return 4.0 * sum(math.prod(s) for s in self.shapes)


@dataclass(frozen=True)
class Candidate:
    """A way to communicate a bucket: ``collectives(bucket, n)`` gives its chain of
    (collective kind, wire bytes) or (kind, wire bytes, link name, group size) for a
    collective on another link than the model's (``predict``'s ``links``); kernel costs are
    in ms per MB (1e6 bytes) of the bucket's fp32 gradient (model steps 1, 2 and 4)."""

    name: str
    collectives: Callable[[Bucket, int], list[tuple[str, float]]]
    compress_ms_per_mb: float = 0.0
    between_ms_per_mb: float = 0.0
    writeback_ms_per_mb: float = 0.0


@dataclass(frozen=True)
class Prediction:
    """``step_ms`` (model step 4), ``backward_end_ms`` (E), ``comm_end_ms`` (the last
    collective's end, from backward start), ``exposed_ms``, and per collective in issue
    order (bucket index, kind, bytes, start_ms, end_ms)."""

    name: str
    step_ms: float
    backward_end_ms: float
    comm_end_ms: float
    exposed_ms: float
    timeline: list[tuple[int, str, float, float, float]] = field(default_factory=list)
    # Bus bytes per step (f(group size) x wire bytes) per link name: what crosses each link.
    link_bytes: dict[str, float] = field(default_factory=dict)


def allreduce_fp32(**costs: float) -> Candidate:
    """fp32 gradients, one allreduce per bucket."""
    return Candidate("allreduce_fp32", lambda b, n: [("allreduce", b.fp32_bytes)], **costs)


def bf16(**costs: float) -> Candidate:
    """bf16 on the wire and in the sum: one allreduce of half the bytes."""
    return Candidate("bf16", lambda b, n: [("allreduce", b.fp32_bytes / 2)], **costs)


def bf16_fp32_accumulate(**costs: float) -> Candidate:
    """bf16 on the wire, summed in fp32: alltoall of 16-bit shards, allgather of the sums."""
    def chain(bucket: Bucket, n: int) -> list[tuple[str, float]]:
        numel = math.ceil(bucket.fp32_bytes / 4)
        wire = 2.0 * n * math.ceil(numel / n)
        return [("alltoall", wire), ("allgather", wire)]
    return Candidate("bf16_fp32_accumulate", chain, **costs)


QUANT8_BLOCK = 256  # elements per float32 scale in the 8-bit wire formats


def quant8_wire_bytes(numel: int, n: int) -> float:
    """Bytes of one 8-bit hook collective for a bucket of ``numel`` elements on n ranks."""
    unit = n * QUANT8_BLOCK
    padded = math.ceil(numel / unit) * unit
    return float(padded + 4 * padded // QUANT8_BLOCK)


def quant8(name: str = "int8", **costs: float) -> Candidate:
    """8-bit codes with block scales on the wire, summed in fp32 (the int8 and fp8 hooks):
    an alltoall of the packed shards, an allgather of the re-quantized sums."""
    if name not in ("int8", "fp8"):
        raise ValueError(f"quant8: name must be 'int8' or 'fp8', got {name!r}")

    def chain(bucket: Bucket, n: int) -> list[tuple[str, float]]:
        wire = quant8_wire_bytes(math.ceil(bucket.fp32_bytes / 4), n)
        return [("alltoall", wire), ("allgather", wire)]
    return Candidate(name, chain, **costs)


def _low_rank_split(bucket: Bucket, rank: int, min_compression_rate: float,
                    name: str) -> tuple[int, int, int]:
    """(uncompressed numel, P numel, Q numel) of a bucket under PowerSGD's rule (shared by
    ACP-SGD): an (n, m) view is compressed at r = min(rank, n, m) when (n + m) r times
    min_compression_rate < n m."""
    if bucket.shapes is None:
        raise ValueError(f"{name}({rank}): a Bucket needs its tensors' shapes")
    plain = p = q = 0
    for shape in bucket.shapes:
        numel = math.prod(shape)
        rows = shape[0] if len(shape) > 1 else 0
        cols = numel // rows if rows else 0
        k = min(rank, rows, cols)
        if rows and (rows + cols) * k * min_compression_rate < rows * cols:
            p, q = p + rows * k, q + cols * k
        else:
            plain += numel
    return plain, p, q


def _check_rank(name: str, rank: Any) -> None:
    if not isinstance(rank, int) or rank < 1:
        raise ValueError(f"{name}: rank must be a positive int, got {rank!r}")


def powersgd(rank: int, min_compression_rate: float = 2.0, separate_uncompressed: bool = False,
             **costs: float) -> Candidate:
    """PowerSGD of ``rank``: per bucket, allreduces of U + P then Q (fastddp), or of U, P
    and Q with ``separate_uncompressed`` (torch's hook)."""
    _check_rank("powersgd", rank)

    def chain(bucket: Bucket, n: int) -> list[tuple[str, float]]:
        plain, p, q = _low_rank_split(bucket, rank, min_compression_rate, "powersgd")
        if not p:
            return [("allreduce", 4.0 * plain)] if plain else []
        if separate_uncompressed:
            head = [("allreduce", 4.0 * plain)] if plain else []
            return head + [("allreduce", 4.0 * p), ("allreduce", 4.0 * q)]
        return [("allreduce", 4.0 * (plain + p)), ("allreduce", 4.0 * q)]
    return Candidate(f"powersgd_r{rank}", chain, **costs)


def acpsgd(rank: int, min_compression_rate: float = 2.0, **costs: float) -> Candidate:
    """ACP-SGD of ``rank`` (Note [acpsgd]): per bucket one allreduce of U + P on even steps,
    U + Q on odd ones, modelled as their mean; its local work is all before the collective
    (``compress``), none between collectives."""
    _check_rank("acpsgd", rank)

    def chain(bucket: Bucket, n: int) -> list[tuple[str, float]]:
        plain, p, q = _low_rank_split(bucket, rank, min_compression_rate, "acpsgd")
        numel = plain + (p + q) / 2
        return [("allreduce", 4.0 * numel)] if numel else []
    return Candidate(f"acpsgd_r{rank}", chain, **costs)


def hierarchical(inner: Candidate, local_size: int, sum_ms_per_mb: float = 0.0) -> Candidate:
    """``inner`` between nodes of ``local_size`` ranks, inside a float reduce-scatter and
    allgather (fastddp.hooks.hierarchical; module docstring). ``sum_ms_per_mb``: the cost of
    adding two fp32 shards (the intra-node sum on the CPU), per MB."""
    if not isinstance(local_size, int) or local_size < 2:
        raise ValueError(f"hierarchical: local_size must be an int >= 2, got {local_size!r}")
    L = local_size
    # The inner's kernels run on 1/L of the bucket, between the intra-node collectives.
    between = ((L - 1) / L * sum_ms_per_mb + (inner.compress_ms_per_mb + inner.between_ms_per_mb
                                                + inner.writeback_ms_per_mb) / L)
    gaps = len(inner.collectives(Bucket(0.0, nbytes=4.0 * _MB), 2)) + 1

    def chain(bucket: Bucket, n: int) -> list[tuple]:
        if n % L or n // L < 2:
            raise ValueError(f"hierarchical: {n} ranks are not 2 or more nodes of {L}")
        numel = math.ceil(bucket.fp32_bytes / 4)
        padded = math.ceil(numel / n) * n
        shard = Bucket(bucket.ready_ms, nbytes=4.0 * padded / L)
        inner_chain = [(c[0], c[1], "inter", n // L) for c in inner.collectives(shard, n // L)]
        return [("alltoall", 4.0 * padded, "intra", L), *inner_chain,
                ("allgather", 4.0 * padded, "intra", L)]
    return Candidate(f"hier_{inner.name}", chain, between_ms_per_mb=between / gaps)


def predict(buckets: Sequence[Bucket], backward_ms: float, link: Link, world: int,
            candidate: Candidate, fixed_ms: float = 0.0,
            links: dict[str, Link] | None = None) -> Prediction:
    """The step time of ``candidate`` (the model in this module's docstring). ``links``:
    the other links a candidate's collectives may name ("intra", "inter"), by name."""
    _check(buckets, backward_ms, world)
    links = {"world": link, **(links or {})}
    pre = [candidate.compress_ms_per_mb * b.fp32_bytes / _MB for b in buckets]
    between = [candidate.between_ms_per_mb * b.fp32_bytes / _MB for b in buckets]
    post = sum(candidate.writeback_ms_per_mb * b.fp32_bytes / _MB for b in buckets)
    chains = [candidate.collectives(b, world) for b in buckets]
    # (issue time, sequence, bucket, position in its chain); popped in issue order.
    issued: list[tuple[float, int, int, int]] = []
    delay, seq = 0.0, 0
    for i, bucket in enumerate(buckets):
        delay += pre[i]
        if chains[i]:
            issued.append((bucket.ready_ms + delay, seq, i, 0))
            seq += 1
    heapq.heapify(issued)
    backward_end = backward_ms + sum(pre)
    free = dict.fromkeys(links, 0.0)  # per link: when it has served what it was given
    timeline, link_bytes = [], {}
    while issued:
        at, _, i, k = heapq.heappop(issued)
        kind, nbytes, name, n = (*chains[i][k], "world", world)[:4]
        if name not in links:
            raise ValueError(f"cost model: {candidate.name} uses link {name!r}; links given: "
                             f"{sorted(links)}")
        start = max(at, free[name])
        end = free[name] = start + links[name].ms(kind, nbytes, n)
        timeline.append((i, kind, nbytes, start, end))
        link_bytes[name] = link_bytes.get(name, 0.0) + bus_factor(kind, n) * nbytes
        if k + 1 < len(chains[i]):
            heapq.heappush(issued, (end + between[i], seq, i, k + 1))
            seq += 1
    comm_end = max((end for *_, end in timeline), default=0.0)
    done = max(backward_end, comm_end) + post
    return Prediction(candidate.name, fixed_ms + done, backward_end, comm_end,
                      done - backward_end, timeline, link_bytes)


def predict_all(buckets: Sequence[Bucket], backward_ms: float, link: Link, world: int,
                candidates: Sequence[Candidate], fixed_ms: float = 0.0,
                links: dict[str, Link] | None = None) -> list[Prediction]:
    """:func:`predict` for each candidate, fastest first."""
    return sorted((predict(buckets, backward_ms, link, world, c, fixed_ms, links)
                   for c in candidates), key=lambda p: p.step_ms)


def rebucket(buckets: Sequence[Bucket], cap_bytes: float) -> list[Bucket]:
    """The measured ``buckets`` re-cut into buckets of ``cap_bytes`` (module docstring);
    shapes are dropped, so only candidates that need bytes alone can use the result."""
    if not cap_bytes > 0:
        raise ValueError(f"rebucket: cap_bytes must be positive, got {cap_bytes!r}")
    # The arrival curve: (time, cumulative bytes) at each measured ready time.
    points, total = [(0.0, 0.0)], 0.0
    for b in buckets:
        total += b.fp32_bytes
        points.append((b.ready_ms, total))
    out, closed, k = [], 0.0, 1
    while closed < total:
        target = min(closed + cap_bytes, total)
        while points[k][1] < target:
            k += 1
        (t0, c0), (t1, c1) = points[k - 1], points[k]
        at = t1 if target >= c1 else min(t1, t0 + (t1 - t0) * (target - c0) / (c1 - c0))
        out.append(Bucket(at, nbytes=target - closed))
        closed = target
    return out


# Bytes a value per DiLoCo wire (docs/diloco.md's table): float32, bf16, int8 codes with a
# float32 scale per 256 (quant8's), int4 codes two a byte with a float32 scale per 64
# (fastddp/diloco/_wire.py's INT4_BLOCK).
DILOCO_WIRE_BYTES = {"fp32": 4.0, "bf16": 2.0, "int8": 1.0 + 4.0 / QUANT8_BLOCK,
                     "int4": 0.5 + 4.0 / 64}


@dataclass(frozen=True)
class DiLoCoPrediction:
    """``step_ms``: the amortized step (module docstring); ``sync_ms``: the link time of one
    fragment's exchange, ``exposed_ms`` the part of it the inner steps do not hide;
    ``bytes_per_step``: bus bytes per rank a step, amortized over the H steps."""

    step_ms: float
    sync_ms: float
    exposed_ms: float
    bytes_per_step: float


def diloco(numel: int, compute_ms: float, link: Link, world: int, sync_every: int,
           wire: str = "fp32", fragments: int = 1, overlap: int = 0,
           quantized_sum: str = "gather") -> DiLoCoPrediction:
    """DiLoCo's amortized step time over ``numel`` parameters (module docstring)."""
    if wire not in DILOCO_WIRE_BYTES:
        raise ValueError(f"cost model: DiLoCo wire must be one of {list(DILOCO_WIRE_BYTES)}, "
                         f"got {wire!r}")
    if not (isinstance(sync_every, int) and isinstance(fragments, int) and fragments >= 1
            and sync_every >= fragments and sync_every % fragments == 0):
        raise ValueError(f"cost model: DiLoCo sync_every={sync_every!r} must be a positive "
                         f"multiple of fragments={fragments!r}")
    if not isinstance(world, int) or world < 1:
        raise ValueError(f"cost model: world must be a positive int, got {world!r}")
    # As fastddp.DiLoCo checks them (diloco/_args.py): what it refuses has no cost here.
    if quantized_sum not in ("gather", "shards"):
        raise ValueError(f"cost model: DiLoCo quantized_sum must be 'gather' or 'shards', got "
                         f"{quantized_sum!r}")
    if quantized_sum == "shards" and wire not in ("int8", "int4"):
        raise ValueError(f"cost model: DiLoCo quantized_sum='shards' needs an int8 or int4 "
                         f"wire, got {wire!r}")
    period = sync_every // fragments
    if isinstance(overlap, bool) or not isinstance(overlap, int) or not 0 <= overlap < period:
        raise ValueError(f"cost model: DiLoCo overlap={overlap!r} must be an int in [0, "
                         f"sync_every / fragments = {period})")
    values = numel / fragments
    b = DILOCO_WIRE_BYTES[wire]
    if wire == "fp32":
        chain = [("allreduce", 4.0 * values)]
    elif quantized_sum == "shards":
        chain = [("alltoall", b * values), ("allgather", b * values)]
    else:
        chain = [("allgather", world * b * values)]
    times = [link.ms(kind, nbytes, world) for kind, nbytes in chain]
    sync_ms = sum(times)
    if len(times) == 2:
        # The shards' two collectives split the window as DiLoCo runs them
        # (diloco.py's _after_inner_step): the alltoall has overlap - overlap // 2 inner
        # steps, then the allgather (launched once the alltoall is waited for) overlap // 2.
        exposed = (max(0.0, times[0] - (overlap - overlap // 2) * compute_ms)
                   + max(0.0, times[1] - (overlap // 2) * compute_ms))
    else:
        exposed = max(0.0, sync_ms - overlap * compute_ms)
    syncs_per_step = fragments / sync_every
    bus = sum(bus_factor(kind, world) * nbytes for kind, nbytes in chain)
    return DiLoCoPrediction(compute_ms + exposed * syncs_per_step, sync_ms, exposed,
                            bus * syncs_per_step)


def _check(buckets: Sequence[Bucket], backward_ms: float, world: int) -> None:
    if not isinstance(world, int) or world < 1:
        raise ValueError(f"cost model: world must be a positive int, got {world!r}")
    if not buckets:
        raise ValueError("cost model: no buckets")
    previous = 0.0
    for i, b in enumerate(buckets):
        if not previous <= b.ready_ms <= backward_ms:
            raise ValueError(f"cost model: bucket {i} ready at {b.ready_ms} ms; ready times "
                             f"must be in order, from 0 to backward_ms={backward_ms}")
        if b.fp32_bytes < 0:
            raise ValueError(f"cost model: bucket {i} has negative bytes {b.fp32_bytes}")
        previous = b.ready_ms
