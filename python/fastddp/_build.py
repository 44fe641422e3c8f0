"""What this copy of fastddp was built with."""

from typing import Any

import torch

from fastddp import _C


def build_info() -> dict[str, Any]:
    """Torch version (running and built against), CUDA on/off and version, NVTX on/off."""
    info = dict(_C.build_info())
    info["torch"] = torch.__version__
    return info
