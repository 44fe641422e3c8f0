"""`make run`: fastddp.launch.demo under `torchrun --nproc_per_node=2` at a tiny size (7 steps of
a 16-wide MLP): its report, and fastddp's training against torch DDP's, checked here.
No timing is asserted: the demo's step times and ratio are only read as numbers."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import fastddp
from fastddp.launch import demo
from tests.python.ddp import api_surface_scenarios

PACKAGE_DIR = Path(fastddp.__file__).resolve().parents[1]
TIMEOUT_S = 180  # a no-hang deadline only: the run takes about 15 s on 2 loaded cores
ARGS = {"steps": 7, "batch": 8, "hidden": 16, "rounds": 2}


@pytest.fixture(scope="module")
def demo_output() -> str:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(PACKAGE_DIR), os.environ.get("PYTHONPATH", "")]), OMP_NUM_THREADS="1")
    for key in ("FASTDDP_DISABLE", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                "MASTER_PORT"):
        env.pop(key, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc_per_node=2", "-m", "fastddp.launch.demo",
           *[f"--{k}={v}" for k, v in ARGS.items()]]
    proc = subprocess.run(cmd, check=False, env=env, capture_output=True, text=True,
                          timeout=TIMEOUT_S)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{' '.join(cmd)} failed ({proc.returncode}):\n{output}"
    return output


def _row(output: str, label: str) -> list[str]:
    """The two columns (fastddp, torch DDP) of the summary row `label`."""
    rows = [line for line in output.splitlines() if line.startswith(label)]
    assert len(rows) == 1, output
    return rows[0][len(label):].split()


def test_demo_report(demo_output):
    """The header (world, backend, the MLP's parameter count as torch counts it), one log
    line per fastddp step on rank 0 only, the summary table and the ratio line."""
    params = sum(p.numel() for p in demo.mlp(ARGS["hidden"]).parameters())
    assert (f"fastddp demo: world 2, gloo on cpu, MLP {params:,} params, batch 8/rank, "
            "7 steps") in demo_output, demo_output
    steps = re.findall(r"^\[fastddp\] step +(\d+) +loss [0-9.]+ +[0-9.]+ ms$", demo_output,
                       re.MULTILINE)
    assert steps == [str(s) for s in range(7)], demo_output
    assert "[torch DDP] step" not in demo_output  # the torch run does not log its steps
    times = _row(demo_output, "median step time (ms)")
    assert len(times) == 2 and all(float(t) > 0 for t in times), times
    # 5 warm-up steps, then the 2 left in 2 rounds of one step each.
    assert re.search(r"^step time ratio fastddp / torch DDP: [0-9.]+ \(median of 2 "
                     r"interleaved rounds; spread [0-9.]+ to [0-9.]+\)$", demo_output,
                     re.MULTILINE), demo_output


@pytest.mark.parametrize("world", [2], indirect=True, ids=["world2"])  # the demo's size
def test_demo_trains_as_torch_ddp(demo_output, world):
    """The demo's runs, repeated in a harness world with the same arguments, end bit for
    bit equal (2 ranks: halving is exact, so the same float ops), and the losses the demo
    printed are the ones they compute."""
    losses = world.check(api_surface_scenarios.demo_training, **ARGS)[0]
    assert losses["fastddp"] == losses["torch"]
    assert _row(demo_output, "first loss") == [f"{losses['torch'][0]:.5f}"] * 2
    assert _row(demo_output, "final loss") == [f"{losses['torch'][-1]:.5f}"] * 2
    assert "max |param difference| fastddp vs torch DDP: 0.000e+00" in demo_output
