"""`python -m fastddp` on an unmodified script (tests/python/scripts/train_tiny.py) under 2
real gloo ranks started by torchrun, compared with stock torch DDP (FASTDDP_DISABLE=1);
plus fastddp.patch(), the command-line split and the comm report formatting in-process.
"""

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fastddp
from fastddp.launch.launcher import split_command_line
from fastddp.launch.patch import HookSpec, HookUnavailableError, parse_hook_spec
from fastddp.launch.report import format_comm_stats
from tests.python.launch.launch_script import PACKAGE_DIR, run_launcher

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "train_tiny.py"
TIMEOUT_S = 120
FASTDDP_CLASS = "fastddp.ddp.DistributedDataParallel"


def _has_hooks() -> bool:
    return importlib.util.find_spec("fastddp.hooks") is not None


needs_hooks = pytest.mark.skipif(not _has_hooks(), reason="fastddp.hooks is not in this build "
                                 "yet (comm hooks are landing separately)")


def launch(tmp_path: Path, name: str, launcher_args: list[str], script_args: list[str] = (),
           disable: bool = False, nproc: int | None = 2) -> tuple[dict, str]:
    """Runs the script under the launcher; returns rank 0's JSON and the combined output."""
    result, code, output, cmd = run_launcher(SCRIPT, tmp_path / f"{name}.json", launcher_args,
                                             script_args, disable, nproc, TIMEOUT_S)
    assert code == 0, f"{' '.join(cmd)} failed ({code}):\n{output}"
    return result, output


def max_param_diff(a: dict, b: dict) -> float:
    return max((torch.tensor(x) - torch.tensor(y)).abs().max().item()
               for x, y in zip(a["params"], b["params"], strict=True))


def assert_params_close(a: dict, b: dict, atol: float = 0.0) -> None:
    """Final parameters within `atol`. 0 (bit for bit) where both runs do the same float
    ops in the same order: 2 ranks add in the one order there is, and fastddp's bf16 and
    fp16 hooks cast then halve in 16 bits as torch's do (Note [torch's half rounding]).
    The JSON holds the floats exactly."""
    for x, y in zip(a["params"], b["params"], strict=True):
        torch.testing.assert_close(torch.tensor(x), torch.tensor(y), rtol=0, atol=atol)


@pytest.fixture(scope="module")
def stock_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, str]:
    return launch(tmp_path_factory.mktemp("stock"), "stock", [], disable=True)


@pytest.fixture(scope="module")
def fast_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, str]:
    # The other import path and launcher overrides; the world-of-one test covers the
    # package path (`from torch.nn.parallel import DistributedDataParallel`).
    return launch(tmp_path_factory.mktemp("fast"), "fast", ["--bucket-cap-mb", "1", "--report"],
                  ["--import-path", "module"])


def test_replaces_ddp_and_trains_like_torch(fast_run, stock_run) -> None:
    fast, fast_out = fast_run
    stock, _ = stock_run
    assert FASTDDP_CLASS in fast["classes"] and fast["is_torch_ddp"]
    assert fast["world"] == 2 and fast["losses"][-1] < fast["losses"][0]
    assert_params_close(fast, stock)
    # Exactly one summary line (rank 0 only) naming both replaced names and the override.
    lines = [ln for ln in fast_out.splitlines() if ln.startswith("[fastddp] torch.nn")]
    assert len(lines) == 1, fast_out
    assert "torch.nn.parallel.distributed.DistributedDataParallel" in lines[0]
    assert "bucket_cap_mb=1 (launcher)" in lines[0]
    assert fast["bucket_bytes_cap"] == 2**20, "the launcher's --bucket-cap-mb must win"
    assert stock["bucket_bytes_cap"] == 25 * 2**20, "the script's own value"
    if callable(getattr(fastddp.DistributedDataParallel, "comm_stats", None)):
        assert "[fastddp] communication report:" in fast_out, fast_out
    else:
        assert "comm report unavailable: this fastddp build has no" in fast_out, fast_out
    assert fast_out.count("[fastddp] comm") == 1, "the report is printed on rank 0 only"


def test_fastddp_disable_runs_stock_torch(stock_run) -> None:
    stock, out = stock_run
    assert stock["classes"][0] == "torch.nn.parallel.distributed.DistributedDataParallel"
    assert FASTDDP_CLASS not in stock["classes"]
    assert "FASTDDP_DISABLE=1: stock torch DDP, nothing replaced" in out


def test_plain_python_runs_a_world_of_one(tmp_path: Path) -> None:
    run, out = launch(tmp_path, "single", [], nproc=None)
    assert FASTDDP_CLASS in run["classes"] and run["world"] == 1
    assert "[single process: world size 1]" in out


@needs_hooks
def test_script_hook_is_honoured(tmp_path: Path, fast_run) -> None:
    fast, _ = launch(tmp_path, "fast_hook", [], ["--sum-hook"])
    stock, _ = launch(tmp_path, "stock_hook", [], ["--sum-hook"], disable=True)
    assert fast["hook_calls"] > 0 and FASTDDP_CLASS in fast["classes"]
    assert_params_close(fast, stock)
    # Summed rather than averaged gradients: the hook changed the training (by about lr x
    # a gradient, ~1e-2, far above any rounding).
    assert max_param_diff(fast, fast_run[0]) > 1e-4


@needs_hooks
def test_launcher_hook_replaces_script_hook(tmp_path: Path, fast_run) -> None:
    fast, out = launch(tmp_path, "bf16", ["--hook", "bf16"], ["--sum-hook"])
    stock, _ = launch(tmp_path, "bf16_stock", ["--hook", "bf16"], ["--sum-hook"], disable=True)
    assert fast["hook_calls"] == 0 and stock["hook_calls"] == 0
    assert "comm hook sum_hook was not registered: --hook bf16" in out
    assert "hook=bf16 (launcher" in out
    # bf16 on the wire: torch's bf16 hook's numbers, not the fp32 run's.
    assert_params_close(fast, stock)
    assert max_param_diff(fast, fast_run[0]) > 0


def _run_cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(PACKAGE_DIR))
    return subprocess.run([sys.executable, "-m", "fastddp", *args], check=False, env=env,
                          capture_output=True, text=True, timeout=TIMEOUT_S)


def test_help_usage_and_bad_options() -> None:
    helped = _run_cli("--help")
    assert helped.returncode == 0
    for word in ("--hook", "--bucket-cap-mb", "--report", "FASTDDP_DISABLE", "powersgd",
                 "bf16-fp32acc", "torchrun", "--emulate-link"):
        assert word in helped.stdout, word
    bare = _run_cli()
    assert bare.returncode == 2 and "usage:" in bare.stderr and "no training script" in bare.stderr
    bad = _run_cli("--hook", "fp4", str(SCRIPT))
    assert bad.returncode == 2 and "unknown hook 'fp4'" in bad.stderr
    bad_link = _run_cli("--emulate-link", "3GB", str(SCRIPT))
    assert bad_link.returncode == 2 and "--emulate-link: link spec '3GB'" in bad_link.stderr
    if not _has_hooks():
        missing = _run_cli("--hook", "bf16", str(SCRIPT), "--out", "unused.json")
        assert missing.returncode == 2 and "--hook bf16" in missing.stderr


def test_split_command_line() -> None:
    assert split_command_line(["--hook", "bf16", "t.py", "--hook", "x"]) == (
        ["--hook", "bf16"], "t.py", ["--hook", "x"])
    assert split_command_line(["--report", "--", "t.py", "-v"]) == (["--report"], "t.py", ["-v"])
    assert split_command_line(["--bucket-cap-mb=5", "t.py"]) == (["--bucket-cap-mb=5"], "t.py", [])
    assert split_command_line(["--report"]) == (["--report"], None, [])


def test_parse_hook_spec() -> None:
    assert parse_hook_spec("powersgd:4") == HookSpec("powersgd", 4)
    assert parse_hook_spec("bf16-fp32acc") == HookSpec("bf16-fp32acc")
    for bad, message in (("fp4", "unknown hook 'fp4'"), ("fp8:e3m4", "fp8's format"),
                         ("bf16:2", "only powersgd"), ("powersgd:0", "positive integer")):
        with pytest.raises(ValueError, match=message):
            parse_hook_spec(bad)


def test_patch_swaps_both_names_and_undoes() -> None:
    original = torch.nn.parallel.DistributedDataParallel
    with fastddp.patch(bucket_cap_mb=3, disable=False) as handle:
        assert torch.nn.parallel.DistributedDataParallel is handle.cls
        assert torch.nn.parallel.distributed.DistributedDataParallel is handle.cls
        assert issubclass(handle.cls, fastddp.DistributedDataParallel)
        with pytest.raises(RuntimeError, match="already patched"):
            fastddp.patch()
    assert torch.nn.parallel.DistributedDataParallel is original
    assert torch.nn.parallel.distributed.DistributedDataParallel is original
    untouched = fastddp.patch(disable=True)
    assert untouched.cls is None and torch.nn.parallel.DistributedDataParallel is original
    if not _has_hooks():
        with pytest.raises(HookUnavailableError, match="hook= bf16"):
            fastddp.patch(hook="bf16", disable=False)
        assert torch.nn.parallel.DistributedDataParallel is original


def test_format_comm_stats() -> None:
    stats = {
        "steps": 12, "world_size": 8, "hook": "bf16", "bytes_reduced": 1_220_000_000,
        "bytes_sent": 610_000_000, "compression_ratio": 2.0, "exposed_comm_ms": 3.25,
        "mean_exposed_comm_ms": 2.5,
        "buckets": [
            {"index": 0, "num_params": 2, "numel": 250_000, "dtype": "float32",
             "bytes": 1_000_000, "wire_bytes": 500_000, "ready_ms": 1.0, "launched_ms": 1.5,
             "done_ms": 4.0},
            {"index": 1, "num_params": 390, "numel": 304_750_000, "dtype": "float32",
             "bytes": 1_219_000_000, "wire_bytes": 609_500_000, "ready_ms": 80.0,
             "launched_ms": 80.25, "done_ms": 200.5},
        ],
    }
    text = format_comm_stats(stats)
    assert "12 steps, world size 8, hook bf16" in text
    assert "gradients 1220.00 MB, sent 610.00 MB (compression 2.00x)" in text
    assert "last step 3.250 ms, mean 2.500 ms" in text
    rows = text.splitlines()[-2:]
    assert rows[0].split() == ["0", "2", "250,000", "float32", "1.00", "0.50", "1.000", "1.500",
                               "4.000", "2.500"]
    assert rows[1].split()[-1] == "120.250"
    partial = format_comm_stats({"steps": 0, "buckets": []})
    assert "world size -" in partial and "no buckets" in partial


# The stock run's --hook (torch's hook) for each fastddp --hook. bf16-fp32acc: torch has no
# fp32-accumulating hook, but on 2 ranks it sums the same two bf16 values and rounds once,
# as torch's bf16 allreduce does: torch's bf16_compress_hook's numbers.
TORCH_COUNTERPART = {"fp16": "fp16", "bf16-fp32acc": "bf16", "powersgd:2": "powersgd:2"}


@needs_hooks
@pytest.mark.parametrize("hook", ["fp16", "bf16-fp32acc", "powersgd:2"])
def test_each_launcher_hook_trains(tmp_path: Path, hook: str, fast_run) -> None:
    """Every --hook the launcher offers runs the unmodified script to a lower loss, with
    the report on rank 0, to the parameters of stock torch DDP with torch's hook; the
    compressed ones differ from the plain fp32 run."""
    fast, out = launch(tmp_path, hook.replace(":", "_"), ["--hook", hook, "--report"])
    stock, _ = launch(tmp_path, "stock_" + hook.replace(":", "_"),
                      ["--hook", TORCH_COUNTERPART[hook]], disable=True)
    assert FASTDDP_CLASS in fast["classes"]
    assert fast["losses"][-1] < fast["losses"][0], fast["losses"]
    assert f"hook={hook} (launcher" in out, out
    assert out.count("[fastddp] communication report:") == 1, out
    if hook.startswith("powersgd"):
        # fastddp's kernels round differently from torch's: at most 5e-5 of the largest
        # gradient per compressed step (powersgd_scenarios.TOL); steps 2 and 3 of 4 are
        # compressed, each moving a parameter by lr x that (measured 1.5e-8 absolute).
        assert_params_close(fast, stock, atol=2 * fast["lr"] * 5e-5 * fast["grad_max"])
    else:
        assert_params_close(fast, stock)
    assert max_param_diff(fast, fast_run[0]) > 0


def _emulated_link_line(out: str) -> str:
    lines = [ln for ln in out.splitlines() if ln.startswith("[fastddp] emulated link ")]
    assert len(lines) == 1, out
    return lines[0]


def test_emulate_link_puts_every_model_on_the_link(tmp_path: Path, stock_run) -> None:
    """--emulate-link: the script's model reduces through an EmulatedLinkGroup (its
    collectives counted in the report) and trains as without it."""
    fast, out = launch(tmp_path, "emulated", ["--emulate-link", "20MB/s,2ms", "--report"])
    assert FASTDDP_CLASS in fast["classes"]
    assert_params_close(fast, stock_run[0])
    assert "emulated link 20MB/s,2ms (launcher)" in out, out
    line = _emulated_link_line(out)
    assert "over a group of 2" in line and "allreduce 4 x" in line, line  # 4 steps, 1 bucket


@needs_hooks
def test_emulate_link_with_stock_torch_and_its_hook(tmp_path: Path) -> None:
    """FASTDDP_DISABLE=1: torch's DDP and torch's PowerSGD hook (whose state names no
    group, i.e. WORLD) reduce through the emulated link too."""
    stock, out = launch(tmp_path, "emulated_stock", ["--emulate-link", "1GB/s", "--hook",
                                                     "powersgd:1", "--report"], disable=True)
    assert FASTDDP_CLASS not in stock["classes"]
    line = _emulated_link_line(out)
    # 2 plain steps, then 2 compressed ones, each with a P and a Q allreduce (and one for
    # the tensors left uncompressed): more allreduces than steps.
    found = re.search(r"allreduce (\d+) x", line)
    assert found and int(found.group(1)) > 4, line
