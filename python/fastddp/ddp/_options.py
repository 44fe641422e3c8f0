"""fastddp's switches read from the environment (documented in docs/design.md)."""

import os

import torch

WORLD1_REDUCER_ENV = "FASTDDP_WORLD1_REDUCER"


def world1_reducer_requested() -> bool:
    """``FASTDDP_WORLD1_REDUCER=1``: build the C++ reducer at world size 1 too, so that a
    single process (one GPU over NCCL, or gloo) runs every bucket, hook and stream path.
    Without it, a world-size-1 model has no reducer unless a comm hook is registered."""
    value = os.environ.get(WORLD1_REDUCER_ENV, "").strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("", "0", "false", "no", "off"):
        return False
    raise ValueError(f"{WORLD1_REDUCER_ENV}={value!r}: use 1 to build the reducer at world "
                     "size 1, 0 or unset for the bare module")


BUCKET_ALIGN_ENV = "FASTDDP_BUCKET_ALIGN"
# CUDA's widest plain load is 16 bytes (float4): Note [aligned flat buffer] in
# csrc/reducer/bucket.h.
_CUDA_ALIGN_BYTES = 16


def bucket_align_bytes(device: torch.device) -> int:
    """Where each parameter's slice of a bucket starts, in bytes: ``FASTDDP_BUCKET_ALIGN``
    (0 packs the slots back to back, torch's layout; else a power of two up to 4096), by
    default 16 on CUDA, so that every slice can be read with 16-byte accesses, and 0
    elsewhere (CPU kernels load unaligned at full speed)."""
    value = os.environ.get(BUCKET_ALIGN_ENV, "").strip()
    if not value:
        return _CUDA_ALIGN_BYTES if device.type == "cuda" else 0
    try:
        align = int(value)
    except ValueError:
        align = -1
    if align < 0 or align > 4096 or (align & (align - 1)) != 0:
        raise ValueError(f"{BUCKET_ALIGN_ENV}={value!r}: use 0 (packed slots) or a power of "
                         "two up to 4096 (bytes)")
    return align
