"""Construction-time agreement between ranks: same model shapes, same start values.

Runs once per model, not per step, so it stays in Python.
"""

from collections.abc import Sequence

import torch
import torch.distributed as dist

# torch DDP broadcasts module state in chunks of this size.
BROADCAST_BUCKET_BYTES = 250 * 1024 * 1024

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
    world = group.size()
    local = torch.tensor(_describe(params), dtype=torch.int64, device=device)
    lengths = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world)]
    dist.all_gather(lengths, torch.tensor([local.numel()], device=device), group=group)
    longest = int(max(int(n.item()) for n in lengths))
    padded = torch.full((longest,), -1, dtype=torch.int64, device=device)
    padded[: local.numel()] = local
    gathered = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(gathered, padded, group=group)
    per_rank = [_decode(t.tolist()) for t in gathered]
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


def broadcast_tensors(group: dist.ProcessGroup, tensors: Sequence[torch.Tensor], src: int) -> None:
    """Copies `tensors` from rank `src` to every rank, coalesced into few collectives."""
    if tensors:
        dist._broadcast_coalesced(group, list(tensors), BROADCAST_BUCKET_BYTES, src)
