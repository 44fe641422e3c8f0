"""The runs of test_lightning_strategy.py: tests/stacks/lightning_train.py, Lightning's DDP
example shape, started with plain ``python`` (Lightning's own process launcher starts the
second rank: no torchrun, no ``-m fastddp``) on 2 CPU gloo ranks, once with a fastddp
strategy by name and once with Lightning's ``"ddp"`` (torch's class), torch's closest hook
registered on it where the fastddp strategy has one.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import fastddp

STACKS = Path(__file__).resolve().parents[2] / "stacks"
SCRIPT = STACKS / "lightning_train.py"
PACKAGE_DIR = Path(fastddp.__file__).resolve().parents[1]
TIMEOUT_S = 300
FASTDDP_CLASS = "fastddp.ddp.DistributedDataParallel"
TORCH_CLASS = "torch.nn.parallel.distributed.DistributedDataParallel"

# strategy name: (the --hook spelling of the torch hook its reference run registers, the
# fastddp hook's name, or None for neither)
SCENARIOS = {
    "fastddp": None,
    "fastddp_bf16": "bf16",
    "fastddp_powersgd": "powersgd",
}


def start(tmp: Path, label: str, args: list[str]) -> tuple[subprocess.Popen, Path]:
    """Starts one 2-rank run in the background; returns it and its output prefix."""
    out = tmp / label
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(PACKAGE_DIR), str(STACKS),
                                           os.environ.get("PYTHONPATH", "")]))
    # Lightning's launcher reads these; a value left by an outer launcher would join a world
    # that is not this run's.
    for key in ("FASTDDP_DISABLE", "RANK", "WORLD_SIZE", "LOCAL_RANK", "NODE_RANK",
                "MASTER_ADDR", "MASTER_PORT", "PL_GLOBAL_SEED"):
        env.pop(key, None)
    cmd = [sys.executable, str(SCRIPT), "--out", str(out), *args]
    proc = subprocess.Popen(cmd, env=env, cwd=tmp, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    return proc, out


def finish(proc: subprocess.Popen, out: Path) -> list[dict]:
    """Waits for a run of start(); returns each rank's result."""
    try:
        output, _ = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        output, _ = proc.communicate()
        raise AssertionError(f"{' '.join(proc.args)} ran past {TIMEOUT_S} s:\n{output[-6000:]}")
    assert proc.returncode == 0, \
        f"{' '.join(proc.args)} failed ({proc.returncode}):\n{output[-6000:]}"
    return [json.loads(Path(f"{out}.rank{r}.json").read_text()) for r in range(2)]


def run_pair(tmp: Path, strategy: str) -> tuple[list[dict], list[dict]]:
    """The fastddp strategy's run and its reference, side by side (2 cores: each run's ranks
    mostly wait on each other)."""
    hook = SCENARIOS[strategy]
    fast = start(tmp, strategy, ["--strategy", strategy])
    stock = start(tmp, f"ddp-{hook}", ["--strategy", "ddp",
                                       *(["--torch-hook", hook] if hook else [])])
    return finish(*fast), finish(*stock)
