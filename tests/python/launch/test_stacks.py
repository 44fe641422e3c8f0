"""Unmodified Lightning, Accelerate and Hugging Face Trainer scripts (tests/stacks/) under
``torchrun --nproc_per_node=2 -m fastddp`` on 2 CPU gloo ranks, against the same command with
FASTDDP_DISABLE=1 (stock torch DDP): the same losses, parameters and buffers on every rank,
and fastddp's class really in use. Select with ``-m stacks``; the pins are in
tests/stacks/requirements.txt (``make deps-stacks``).
"""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fastddp

pytestmark = pytest.mark.stacks

STACKS = Path(__file__).resolve().parents[2] / "stacks"
PACKAGE_DIR = Path(fastddp.__file__).resolve().parents[1]
TIMEOUT_S = 300
FASTDDP_CLASS = "fastddp.ddp.DistributedDataParallel"
TORCH_CLASS = "torch.nn.parallel.distributed.DistributedDataParallel"
# Bit for bit: 2 ranks add their gradients in the one order there is, and both runs do the
# same float ops otherwise (measured: every loss, parameter and buffer equal).
EXACT = {"rtol": 0.0, "atol": 0.0}

# name: (package the script needs, script, script arguments, find_unused_parameters the
# framework passes to DDP)
SCENARIOS = {
    "lightning_auto": ("lightning", "lightning_train.py", [], False),
    "lightning_manual": ("lightning", "lightning_train.py", ["--manual"], False),
    "lightning_manual_find_unused": ("lightning", "lightning_train.py",
                                     ["--manual", "--find-unused"], True),
    "accelerate": ("accelerate", "accelerate_train.py", [], False),
    # The Trainer passes find_unused_parameters=True for a PreTrainedModel.
    "hf_trainer": ("transformers", "hf_trainer_train.py", [], True),
}
_runs: dict[tuple[str, bool], tuple[list[dict], str]] = {}


def run_script(tmp: Path, script: str, args: list[str], disable: bool,
               launcher: bool = True) -> tuple[list[dict], str]:
    """Runs the script on 2 ranks; returns each rank's result and the combined output."""
    out = tmp / ("stock" if disable else "fast")
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               HF_DATASETS_OFFLINE="1", WANDB_DISABLED="true", WANDB_MODE="disabled",
               TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=os.pathsep.join([str(PACKAGE_DIR), os.environ.get("PYTHONPATH", "")]))
    for key in ("FASTDDP_DISABLE", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                "MASTER_PORT"):
        env.pop(key, None)
    if disable:
        env["FASTDDP_DISABLE"] = "1"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           *(["-m", "fastddp"] if launcher else []), str(STACKS / script), "--out", str(out),
           *args]
    proc = subprocess.run(cmd, check=False, env=env, capture_output=True, text=True,
                          timeout=TIMEOUT_S, cwd=tmp)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{' '.join(cmd)} failed ({proc.returncode}):\n{output[-6000:]}"
    return [json.loads(Path(f"{out}.rank{r}.json").read_text()) for r in range(2)], output


def scenario_run(name: str, disable: bool, tmp_path_factory: pytest.TempPathFactory):
    """Each scenario's run, once per session and mode (the stock run is shared)."""
    package, script, args, _ = SCENARIOS[name]
    if importlib.util.find_spec(package) is None:
        pytest.skip(f"{package} is not installed (make deps-stacks)")
    key = (name, disable)
    if key not in _runs:
        tmp = tmp_path_factory.mktemp(f"{name}-{'stock' if disable else 'fast'}")
        _runs[key] = run_script(tmp, script, args, disable)
    return _runs[key]


def assert_same_training(fast: list[dict], stock: list[dict], tol: dict = EXACT) -> None:
    """Every rank's losses, parameters and buffers (also test_lightning_strategy.py's)."""
    for ours, theirs in zip(fast, stock, strict=True):
        rank = ours["rank"]
        assert list(ours["state"]) == list(theirs["state"])
        for key, value in theirs["state"].items():
            torch.testing.assert_close(torch.tensor(ours["state"][key]), torch.tensor(value),
                                       **tol, msg=lambda m: f"rank {rank}: {key}: {m}")
        torch.testing.assert_close(torch.tensor(ours["losses"]), torch.tensor(theirs["losses"]),
                                   **tol, msg=lambda m: f"rank {rank}: losses: {m}")


def assert_ranks_agree(results: list[dict], buffers: set[str]) -> None:
    """DDP did reduce: the parameters are identical on both ranks (their data differ)."""
    first, second = results
    for key, value in first["state"].items():
        if key not in buffers:
            assert value == second["state"][key], f"{key} differs between the ranks"


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_stack_matches_stock_torch(name: str, tmp_path_factory) -> None:
    stock, _ = scenario_run(name, True, tmp_path_factory)
    fast, output = scenario_run(name, False, tmp_path_factory)
    assert all(FASTDDP_CLASS in r["wrapper"]["classes"] for r in fast), fast[0]["wrapper"]
    assert all(r["wrapper"]["classes"][0] == TORCH_CLASS for r in stock), stock[0]["wrapper"]
    assert "-> fastddp.DistributedDataParallel" in output
    flags = {k: v for k, v in fast[0]["wrapper"].items() if k != "classes"}
    assert flags == {k: v for k, v in stock[0]["wrapper"].items() if k != "classes"}
    assert flags["find_unused_parameters"] is SCENARIOS[name][3], flags
    assert_same_training(fast, stock)
    buffers = {k for k in fast[0]["state"] if "running_" in k}
    assert_ranks_agree(fast, buffers)
    assert_ranks_agree(stock, buffers)


def test_lightning_patch_after_import(tmp_path, tmp_path_factory) -> None:
    """fastddp.patch() called after `import lightning` (which bound torch's class by name)
    still gives Lightning fastddp's class; the run matches lightning_auto's stock run."""
    stock, _ = scenario_run("lightning_auto", True, tmp_path_factory)
    fast, output = run_script(tmp_path, "lightning_patch_after_import.py", [], disable=False,
                              launcher=False)
    assert all(FASTDDP_CLASS in r["wrapper"]["classes"] for r in fast), fast[0]["wrapper"]
    assert "lightning.pytorch.strategies.ddp.DistributedDataParallel" in output, output[-3000:]
    assert_same_training(fast, stock)
