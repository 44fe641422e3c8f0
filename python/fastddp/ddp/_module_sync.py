"""Construction-time agreement between ranks: same model shapes, same gradient buckets, same
start values.

Runs once per model, not per step, so it stays in Python.
"""

from collections.abc import Sequence

import torch
import torch.distributed as dist

from fastddp import _group_ops

_DTYPES = [
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128,
]


def _describe(params: Sequence[torch.Tensor]) -> list[int]:
    desc = [len(params)]
    for p in params:
        code = _DTYPES.index(p.dtype) if p.dtype in _DTYPES else len(_DTYPES)
        desc += [code, p.dim(), *p.shape]
    return desc


def _decode(desc: list[int]) -> list[tuple[torch.dtype | None, tuple[int, ...]]]:
    out, pos = [], 1
    for _ in range(desc[0]):
        code, ndim = desc[pos], desc[pos + 1]
        dtype = _DTYPES[code] if code < len(_DTYPES) else None
        out.append((dtype, tuple(desc[pos + 2 : pos + 2 + ndim])))
        pos += 2 + ndim
    return out


def written_in_python(group: dist.ProcessGroup) -> bool:
    """Whether ``group`` is a ``dist.ProcessGroup`` subclass written in Python (its
    collectives return Python ``Work`` objects), rather than one of c10d's own groups."""
    return type(group) is not dist.ProcessGroup


def verify_param_shapes(
    group: dist.ProcessGroup, names: Sequence[str], params: Sequence[torch.Tensor],
    device: torch.device,
) -> None:
    """Raises ValueError on every rank, naming the first parameter whose shape or
    dtype differs from rank 0's, and the ranks involved.

    Ours rather than torch's ``dist._verify_params_across_processes`` (c10d's
    verify_params_across_processes): torch's compares against rank 0 too, but reports an
    index and sizes only, and only on the rank that differs, so the other ranks wait in
    the next collective; this check raises the same named error on every rank.
    """
    per_rank = [_decode(v) for v in _gather_vectors(group, _describe(params), device)]
    reference = per_rank[0]
    for rank, layout in enumerate(per_rank[1:], start=1):
        for i in range(min(len(reference), len(layout))):
            if layout[i] != reference[i]:
                (dt0, s0), (dt1, s1) = reference[i], layout[i]
                raise ValueError(
                    f"fastddp: parameter {i} ({names[i]!r} on this rank) differs across ranks: "
                    f"shape {list(s0)} {dt0} on rank 0 but shape {list(s1)} {dt1} on rank {rank}. "
                    "DistributedDataParallel needs the same model on every rank."
                )
        if len(layout) != len(reference):
            raise ValueError(
                f"fastddp: rank 0 has {len(reference)} parameters that require grad but rank "
                f"{rank} has {len(layout)}; the first {min(len(reference), len(layout))} agree. "
                "DistributedDataParallel needs the same model on every rank."
            )


def _gather_vectors(group: dist.ProcessGroup, local: list[int],
                    device: torch.device) -> list[list[int]]:
    """Every rank's list of ints (of any length), in rank order (through the group object,
    which need not be in c10d's group map: see _group_ops)."""
    world = group.size()
    mine = torch.tensor(local, dtype=torch.int64, device=device)
    lengths = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world)]
    _group_ops.all_gather(group, lengths, torch.tensor([mine.numel()], device=device))
    counts = [int(n.item()) for n in lengths]
    padded = torch.zeros(max(counts), dtype=torch.int64, device=device)
    padded[: mine.numel()] = mine
    gathered = [torch.empty_like(padded) for _ in range(world)]
    _group_ops.all_gather(group, gathered, padded)
    return [t[:n].tolist() for t, n in zip(gathered, counts)]


def verify_bucket_layout(
    group: dist.ProcessGroup, names: Sequence[str], plan: Sequence[Sequence[int]],
    arguments: dict[str, list[int]], device: torch.device,
) -> None:
    """Raises ValueError on every rank when the ranks' initial buckets, or the arguments
    that decide the collectives of a step, differ from rank 0's.

    `arguments` maps an argument's name to its value as ints (sizes in millionths of a
    MiB, as the user wrote them: 0.001 is 1000). Ranks with
    different buckets issue allreduces of different sizes: gloo then aborts the process
    ("Received data size doesn't match expected size"), as it does under torch DDP, and
    NCCL may hang. Only what changes the collectives is compared: the rebuilt layout is
    rank 0's on every rank (see the reducer's broadcast_plan), so a bucket_cap_mb that only
    decides the rebuild may differ, as under torch DDP.
    """
    keys = list(arguments)
    local = [len(plan), *(len(b) for b in plan), *(i for b in plan for i in b)]
    for key in keys:
        local += [len(arguments[key]), *arguments[key]]
    per_rank = [_split_layout(v, keys) for v in _gather_vectors(group, local, device)]
    reference_plan, reference_args = per_rank[0]
    for rank, (rank_plan, rank_args) in enumerate(per_rank[1:], start=1):
        differ = [k for k in keys if rank_args[k] != reference_args[k]]
        if rank_plan == reference_plan and "find_unused_parameters" not in differ:
            continue
        shown = ", ".join(f"{k}={_shown(k, reference_args[k])} on rank 0 but "
                          f"{_shown(k, rank_args[k])} on rank {rank}" for k in differ)
        raise ValueError(
            f"fastddp: the gradient buckets differ across ranks: rank 0 has "
            f"{len(reference_plan)} bucket(s) starting with "
            f"{[names[b[0]] for b in reference_plan]}, rank {rank} has {len(rank_plan)} "
            f"starting with {[names[b[0]] for b in rank_plan]}"
            + (f" ({shown})" if shown else "")
            + ". Their allreduces would not match. Pass the same bucket_cap_mb, "
            "bucket_cap_mb_list and find_unused_parameters on every rank."
        )


def _split_layout(values: list[int],
                  keys: list[str]) -> tuple[list[list[int]], dict[str, list[int]]]:
    """verify_bucket_layout's vector back into (plan, arguments)."""
    sizes = values[1 : 1 + values[0]]
    pos = 1 + values[0]
    plan = []
    for size in sizes:
        plan.append(values[pos : pos + size])
        pos += size
    arguments = {}
    for key in keys:
        n = values[pos]
        arguments[key] = values[pos + 1 : pos + 1 + n]
        pos += 1 + n
    return plan, arguments


def _shown(key: str, value: list[int]) -> str:
    """An argument as the user wrote it (sizes in MiB)."""
    if key == "find_unused_parameters":
        return str(bool(value[0]))
    if not value:
        return "None"
    mib = [f"{v / 1e6:g}" for v in value]
    return mib[0] if key == "bucket_cap_mb" else "[" + ", ".join(mib) + "]"

