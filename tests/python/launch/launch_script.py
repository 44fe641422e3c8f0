"""Runs a training script under fastddp's launcher (`python -m fastddp`, under torchrun for
``nproc`` ranks) in a clean environment: the tests of the launcher share it."""

import json
import os
import subprocess
import sys
from pathlib import Path

import fastddp

PACKAGE_DIR = Path(fastddp.__file__).resolve().parents[1]


def run_launcher(script: Path, out: Path, launcher_args: list[str], script_args: list[str] = (),
                 disable: bool = False, nproc: int | None = 2, timeout_s: float = 180.0
                 ) -> tuple[dict | None, int, str, list[str]]:
    """``script --out out`` under the launcher, FASTDDP_DISABLE=1 if ``disable`` (stock torch
    DDP), one intra-op thread per rank; no torchrun variables inherited. Returns rank 0's
    JSON (None if it wrote none), the exit status, the combined output and the command.
    ``timeout_s`` is a no-hang deadline only."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(PACKAGE_DIR), os.environ.get("PYTHONPATH", "")]), OMP_NUM_THREADS="1")
    for key in ("FASTDDP_DISABLE", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                "MASTER_PORT"):
        env.pop(key, None)
    if disable:
        env["FASTDDP_DISABLE"] = "1"
    runner = [sys.executable]
    if nproc is not None:
        runner += ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    cmd = [*runner, "-m", "fastddp", *launcher_args, str(script), "--out", str(out),
           *script_args]
    proc = subprocess.run(cmd, check=False, env=env, capture_output=True, text=True,
                          timeout=timeout_s)
    result = json.loads(out.read_text()) if out.exists() else None
    return result, proc.returncode, proc.stdout + proc.stderr, cmd
