"""fastddp: torch DistributedDataParallel with a C++/CUDA reducer."""

from fastddp._build import build_info
from fastddp import hooks
from fastddp.ddp import DistributedDataParallel

__all__ = ["DistributedDataParallel", "build_info", "hooks"]
__version__ = "0.1.0"
