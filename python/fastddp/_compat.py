"""Loads fastddp._C, or says why it cannot and the one command that fixes it.

A torch extension built against one torch and imported under another fails with
``ImportError: undefined symbol: _ZN3c10...``, which tells nobody what to do. _C carries
a stamp (csrc/bindings/build_stamp.cpp: the torch, CUDA and TORCH_CUDA_ARCH_LIST it was
built for), read here from the file's bytes before the module is loaded: a module built
for another torch, or without CUDA where this torch has CUDA and a GPU is visible, is
refused with an ImportError that names both and the rebuild command.
"""

import importlib
import importlib.util
import mmap
import os
from typing import Any

import torch

STAMP_PREFIX = b"fastddp-build-stamp:"


def read_stamp(path: str) -> dict[str, str] | None:
    """The stamp in the module file at `path` as a dict (torch, cuda, arch), or None if it
    has none (a module older than the stamp)."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        start = data.find(STAMP_PREFIX)
        if start < 0:
            return None
        end = data.find(b"\0", start)
        text = data[start + len(STAMP_PREFIX):end].decode("utf-8", "replace")
    return dict(field.split("=", 1) for field in text.split(";") if "=" in field)


def rebuild_command() -> str:
    """How to rebuild _C against the torch installed now: in the checkout it came from, or,
    for an installed package, from its source distribution."""
    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(os.path.dirname(here))
    if os.path.exists(os.path.join(root, "setup.py")):
        return f"pip install --no-build-isolation -e {root}"
    return ("pip install --no-build-isolation --no-deps --force-reinstall --no-binary fastddp "
            "fastddp")


def refusal(stamp: dict[str, str], torch_version: str, torch_cuda: str | None,
            gpu_visible: bool) -> str | None:
    """Why a module with `stamp` cannot run under this torch, or None if it can."""
    built = stamp.get("torch")
    if built != torch_version:
        return (f"fastddp._C was built against torch {built}, but torch {torch_version} is "
                "installed; a compiled extension only runs with the torch it was built "
                f"against. Rebuild it against this torch:\n    {rebuild_command()}")
    if stamp.get("cuda") == "none" and torch_cuda is not None and gpu_visible:
        return (f"fastddp._C was built without CUDA, but this torch has CUDA {torch_cuda} and "
                "a GPU is visible. Rebuild it with nvcc on PATH (or CUDA_HOME set; "
                f"FASTDDP_CUDA=1 insists):\n    {rebuild_command()}")
    return None


def load() -> Any:
    """fastddp._C, after the stamp check; every other failure to load it as an ImportError
    that also says how to rebuild."""
    spec = importlib.util.find_spec("fastddp._C")
    if spec is None or spec.origin is None:
        raise ImportError("fastddp._C is not built. Build it against the installed torch:\n"
                          f"    {rebuild_command()}")
    stamp = read_stamp(spec.origin)
    if stamp is not None:
        cuda = torch.version.cuda
        why = refusal(stamp, torch.__version__, cuda,
                      cuda is not None and stamp.get("cuda") == "none"
                      and torch.cuda.is_available())
        if why is not None:
            raise ImportError(why)
    try:
        return importlib.import_module("fastddp._C")
    except ImportError as e:
        raise ImportError(f"fastddp._C ({spec.origin}) cannot be loaded under torch "
                          f"{torch.__version__}: {e}. Rebuilding it usually fixes this:\n"
                          f"    {rebuild_command()}") from e
