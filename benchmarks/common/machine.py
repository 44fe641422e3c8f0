"""What the CPU/gloo benchmarks share: the machine line and the run header they print above
their tables, and a free port for the ranks they spawn."""

import os
import platform
import socket
import subprocess
import sys
import time

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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Run:
    """Started when the benchmark starts; ``header(details)`` is the two lines above its
    table: the machine, the command, how long it took and the load around it."""

    def __init__(self):
        self.start, self.load_before = time.perf_counter(), os.getloadavg()[0]

    def header(self, details: str = "") -> str:
        return (f"Machine: {describe()}\n\nCommand: `python {' '.join(sys.argv)}` "
                f"({time.perf_counter() - self.start:.0f} s; 1-min load average "
                f"{self.load_before:.2f} before, {os.getloadavg()[0]:.2f} after{details}\n")

    @staticmethod
    def publish(header: str, table: str, out: str | None) -> None:
        """Prints the header and the table, and writes both to ``out`` if given."""
        print(header)
        print(table)
        if out:
            with open(out, "w") as f:
                f.write(header + "\n" + table + "\n")
