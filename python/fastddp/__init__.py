"""fastddp: torch DistributedDataParallel with a C++/CUDA reducer."""

from fastddp._build import build_info
from fastddp import hooks
from fastddp.ddp import DistributedDataParallel
from fastddp.link import Link
from fastddp.link_emulator import EmulatedLinkGroup
from fastddp.patch import patch

__all__ = ["DistributedDataParallel", "EmulatedLinkGroup", "Link", "build_info", "hooks", "patch"]
__version__ = "0.1.0"
