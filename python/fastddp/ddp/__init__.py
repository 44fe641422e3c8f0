"""fastddp.DistributedDataParallel (distributed.py) and the helpers it is built from: its
construction checks, forward, join, introspection, hook state, torch.compile support and the
stand-in for torch's ``ddp.reducer``."""

from fastddp.ddp.distributed import DistributedDataParallel

__all__ = ["DistributedDataParallel"]
