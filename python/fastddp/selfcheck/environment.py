"""The self-check's first lines: what fastddp runs on, and how its module was built."""

from __future__ import annotations

import platform

import torch
import torch.distributed as dist

from fastddp import _C, _libstdcxx


def _nccl() -> str:
    if not torch.cuda.is_available() or not dist.is_nccl_available():
        return "not available"
    version = torch.cuda.nccl.version()
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)


def _gpus() -> str:
    if not torch.cuda.is_available():
        return "none visible"
    names = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        names.append(f"cuda:{i} {p.name} (sm_{p.major}{p.minor}, {p.total_memory >> 20} MiB)")
    return "; ".join(names)


def _runtime_libstdcxx() -> str:
    path = _libstdcxx.loaded_libstdcxx()
    if path is None:
        return "none found in this process"
    newest = _libstdcxx.newest_glibcxx(_libstdcxx.read_elf(path).defined_versions)
    return f"{path} (up to {newest})"


def describe() -> list[tuple[str, str]]:
    """(what, value) pairs, in print order."""
    info = _C.build_info()
    cuda = (f"on, CUDA {info['cuda_version']}" if info["cuda"] else "off")
    return [
        ("python", f"{platform.python_version()} ({platform.machine()})"),
        ("torch", f"{torch.__version__} (CUDA {torch.version.cuda or 'none'}); fastddp._C "
                  f"built against {info['built_with_torch']}"),
        ("fastddp._C", f"{_C.__file__}: CUDA {cuda}, NVTX {'on' if info['nvtx'] else 'off'}"),
        ("built with", f"{info['compiler']}; libstdc++ headers "
                       f"{info['libstdcxx_headers'] or 'unknown'}"),
        ("libstdc++ loaded", _runtime_libstdcxx()),
        ("gloo", "available" if dist.is_gloo_available() else "not available"),
        ("NCCL", _nccl()),
        ("GPUs", _gpus()),
    ]


def module_problems() -> list[str]:
    """What Note [one libstdc++] finds wrong with the loaded fastddp._C (empty: nothing)."""
    return _libstdcxx.check_module(_C.__file__)
