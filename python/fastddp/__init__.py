"""fastddp: torch DistributedDataParallel with a C++/CUDA reducer."""

from fastddp._build import build_info
from fastddp.ddp import DistributedDataParallel
from fastddp.patch import patch

__all__ = ["DistributedDataParallel", "build_info", "patch"]
__version__ = "0.1.0"
