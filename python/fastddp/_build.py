"""What this copy of fastddp was built with."""

import importlib.metadata
from typing import Any

import torch

from fastddp import _C, _compat


def build_info() -> dict[str, Any]:
    """The package's version (with the torch/CUDA label of a wheel), torch (running and built
    against), CUDA on/off, version and TORCH_CUDA_ARCH_LIST, NVTX on/off, and the compiler
    and libstdc++ headers _C was compiled with."""
    info = dict(_C.build_info())
    info["torch"] = torch.__version__
    try:
        info["version"] = importlib.metadata.version("fastddp")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree, not installed
        info["version"] = None
    stamp = _compat.read_stamp(_C.__file__) or {}
    info["torch_cuda_arch_list"] = stamp.get("arch")
    return info
