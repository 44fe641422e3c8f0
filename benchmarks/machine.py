"""The machine line the CPU/gloo benchmarks print above their tables."""

import os
import platform
import subprocess

import torch


def describe() -> str:
    """CPU model and cores, GPU (or none), torch and Python versions, the gloo set-up."""
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        cpu = next(ln.split(":", 1)[1].strip() for ln in lscpu.splitlines()
                   if ln.startswith("Model name"))
    except (OSError, StopIteration):
        cpu = platform.processor() or "unknown CPU"
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return (f"{cpu}, {os.cpu_count()} cores, {gpu}; torch {torch.__version__}, "
            f"Python {platform.python_version()}, gloo on 127.0.0.1, 1 thread per rank")
