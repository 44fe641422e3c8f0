"""``python -m fastddp --advise``: an unmodified script (tests/python/scripts/train_wide.py,
~2 MB of gradients per step) under 2 gloo ranks on an emulated link. The advice must change
no number, name every candidate, and follow what the link implies: compression on a slow
link, plain allreduce on a very fast one. The advice is decided from measured times, so the
script's compute is a sleep in backward (sleep_model.py) and its link an emulated one, whose
delays are sleeps too: CPU load changes neither, and the margins are wide. Plus the advice's
arithmetic on hand-made measurements, checked against hand-computed cost model cases.
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

import fastddp
from fastddp.ddp._tuner_handle import TunerHandle
from fastddp.launch.launcher import _advised_command, split_command_line
from fastddp.launch.launcher import main as launcher_main
from fastddp.link import Link
from fastddp.tuning import advise
from tests.python.sleep_model import GRAD_BYTES

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "train_wide.py"
PACKAGE_DIR = Path(fastddp.__file__).resolve().parents[1]
CANDIDATES = ("allreduce_fp32", "bf16", "bf16_fp32_accumulate", "int8", "fp8", "powersgd_r1",
              "powersgd_r2", "powersgd_r4", "powersgd_r8", "acpsgd_r1", "acpsgd_r2", "acpsgd_r4",
              "acpsgd_r8")
# train_wide.py --backward-sleep-ms: a 10 ms backward, which the first two buckets'
# collectives overlap (sleep_model.py).
SLEEP = ["--backward-sleep-ms", "10"]


def launch(tmp_path: Path, name: str, launcher_args: list[str], nproc: int | None = 2,
           script_args: list[str] = ()) -> tuple[dict, str]:
    """Runs train_wide.py under the launcher; returns rank 0's JSON and the output."""
    out = tmp_path / f"{name}.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(PACKAGE_DIR), os.environ.get("PYTHONPATH", "")]), OMP_NUM_THREADS="1")
    for key in ("FASTDDP_DISABLE", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                "MASTER_PORT", "LOCAL_WORLD_SIZE"):
        env.pop(key, None)
    runner = [sys.executable]
    if nproc is not None:
        runner += ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    cmd = [*runner, "-m", "fastddp", *launcher_args, str(SCRIPT), "--out", str(out),
           *script_args]
    # "No hang" deadline: a launch took up to 38 s with both cores busy and more beside.
    proc = subprocess.run(cmd, check=False, env=env, capture_output=True, text=True,
                          timeout=300, cwd=tmp_path)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{' '.join(cmd)} failed ({proc.returncode}):\n{output}"
    return json.loads(out.read_text()), output


@pytest.fixture(scope="module")
def slow_runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, dict, str, Path]:
    """The same run at 50MB/s without and with --advise (advice into a folder of its own)."""
    tmp = tmp_path_factory.mktemp("advise_slow")
    plain, _ = launch(tmp, "plain", ["--emulate-link", "50MB/s"], script_args=SLEEP)
    advised, out = launch(tmp, "advised", ["--emulate-link", "50MB/s", "--advise",
                                           "--advise-out", str(tmp / "advice")],
                          script_args=SLEEP)
    return plain, advised, out, tmp / "advice"


def test_advise_changes_no_number(slow_runs) -> None:
    plain, advised, _, _ = slow_runs
    assert advised["losses"] == plain["losses"]
    assert advised["params"] == plain["params"]


def test_advice_table_and_json_name_every_candidate(slow_runs) -> None:
    _, _, out, folder = slow_runs
    md = (folder / "fastddp_advice.md").read_text()
    data = json.loads((folder / "fastddp_advice.json").read_text())
    (advice,) = data["models"]
    assert sorted(r["candidate"] for r in advice["candidates"]) == sorted(CANDIDATES)
    for name in CANDIDATES:
        assert f"| {name}" in md and f"| {name}" in out, name
    assert advice["world_size"] == 2 and advice["link"] == "50MB/s"
    rows = {r["candidate"]: r for r in advice["candidates"]}
    # Wire bytes from the model's shapes, not from the run.
    assert rows["allreduce_fp32"]["wire_bytes_per_step"] == GRAD_BYTES
    assert rows["bf16"]["wire_bytes_per_step"] == GRAD_BYTES / 2
    # Only the configuration that ran has a measured step time.
    assert advice["current"] == "allreduce_fp32"
    measured = [r["candidate"] for r in advice["candidates"] if r["measured_step_ms"] is not None]
    assert measured == ["allreduce_fp32"]
    steps = [r["predicted_step_ms"] for r in advice["candidates"]]
    assert steps == sorted(steps)


def test_slow_link_advises_compression(slow_runs) -> None:
    _, _, out, folder = slow_runs
    advice = json.loads((folder / "fastddp_advice.json").read_text())["models"][0]
    # 2 MB at 50MB/s is 42 ms a step (bus factor 1 at n=2) against a 10 ms backward; bf16
    # halves it, 8-bit and PowerSGD cut it 4x and more; their kernels on 2 MB take well
    # under a millisecond.
    assert advice["best"] != "allreduce_fp32", advice
    assert f"--hook {advice['best_hook']}" in out


def test_fast_link_advises_allreduce(tmp_path: Path) -> None:
    _, out = launch(tmp_path, "fast", ["--emulate-link", "100GB/s", "--advise"],
                    script_args=SLEEP)
    advice = json.loads((tmp_path / "fastddp_advice.json").read_text())["models"][0]
    # 2 MB at 100GB/s is ~0.04 ms, hidden behind the 10 ms backward: compression can only
    # add its kernels.
    assert advice["best"] == "allreduce_fp32", out
    assert "no --hook: the default allreduce" in out


def test_world_of_one_says_why_there_is_no_advice(tmp_path: Path) -> None:
    _, out = launch(tmp_path, "one", ["--advise"], nproc=None)
    assert "[fastddp] advice unavailable: no wrapped model ran" in out
    assert not (tmp_path / "fastddp_advice.json").exists()


def test_advise_out_needs_advise() -> None:
    with pytest.raises(SystemExit) as e:
        launcher_main(["--advise-out", "x", str(SCRIPT)])
    assert e.value.code == 2


def test_advise_with_stock_torch_raises() -> None:
    with pytest.raises(NotImplementedError, match="advise reads fastddp's comm_stats"):
        fastddp.patch(advise=True, disable=True)


def test_estimate_link_by_hand() -> None:
    # Bucket 0 served 0..10 ms, bucket 1 queued behind it and served 10..20 ms; at n=2 an
    # allreduce moves its bytes once (bus factor 1): 2e6 bytes in 20 ms = 0.1 GB/s.
    stats = {"world_size": 2, "buckets": [
        {"launched_ms": 0.0, "done_ms": 10.0, "wire_bytes": 1e6},
        {"launched_ms": 1.0, "done_ms": 20.0, "wire_bytes": 1e6}]}
    assert math.isclose(advise.estimate_link(stats).bus_gbs, 0.1)
    assert advise.estimate_link({"world_size": 2, "buckets": []}) is None


def _sample(step_ms: float, ready_ms: float, exposed_ms: float) -> dict:
    stats = {"world_size": 2, "steps": 1, "exposed_comm_ms": exposed_ms, "buckets": [
        {"ready_ms": ready_ms, "launched_ms": ready_ms, "done_ms": ready_ms + exposed_ms,
         "wire_bytes": 4e6}]}
    return {"step_ms": step_ms, "stats": stats, "shapes": [[(1000, 1000)]]}


def test_advise_by_hand() -> None:
    """One 4 MB bucket ready at 2 ms, 3 ms exposed, 10 ms steps: the rest of the step is
    10 - 2 - 3 = 5 ms. At 1GB/s, n=2: allreduce 4 ms -> 5 + 2 + 4 = 11 ms; bf16 2 ms ->
    9 ms; PowerSGD rank 1: (1000 + 1000) * 4 bytes -> 5 + 2 + 0.008 ms (kernels free);
    ACP-SGD rank 1: one allreduce of (1000 + 1000) / 2 * 4 bytes -> 5 + 2 + 0.004 ms."""
    costs = {name: {} for name in CANDIDATES}
    samples = [_sample(10.0, 2.0, 3.0), _sample(12.0, 2.0, 3.0), _sample(10.0, 2.0, 3.0)]
    result = advise.advise(samples, Link(bus_gbs=1.0), "allreduce_fp32", costs)
    rows = {r["candidate"]: r for r in result["candidates"]}
    assert math.isclose(result["fixed_ms"], 5.0)
    assert math.isclose(rows["allreduce_fp32"]["predicted_step_ms"], 11.0)
    assert math.isclose(rows["allreduce_fp32"]["measured_step_ms"], 10.0)
    assert math.isclose(rows["bf16"]["predicted_step_ms"], 9.0)
    assert math.isclose(rows["powersgd_r1"]["predicted_step_ms"], 7.008)
    assert math.isclose(rows["acpsgd_r1"]["predicted_step_ms"], 7.004)
    assert math.isclose(rows["allreduce_fp32"]["compute_to_comm"], 7.0 / 4.0)
    assert result["best"] == "acpsgd_r1" and result["best_hook"] == "acpsgd:1"
    # A lossy hook: the advice cites its measured quality on the nearest task (a matrix, no
    # convolution: the text model), also in the printed table.
    assert result["quality"].startswith("Quality on the nearest measured task (a character")
    assert result["quality"] in advise.format_markdown(result)
    assert result["link_source"] == "--emulate-link"
    # Without a link, the one estimated from the samples: 4e6 bytes in 3 ms, 3 digits.
    estimated = advise.advise(samples, None, None, costs)
    assert estimated["link"] == "1.33GB/s"
    # Bytes each rank sends: at n=2 an allreduce sends its payload once.
    assert rows["allreduce_fp32"]["wire_bytes_per_step"] == 4e6
    assert rows["bf16_fp32_accumulate"]["wire_bytes_per_step"] == 2e6
    # 1e6 elements padded to 1954 * 512, a byte each plus 4 per 256: half of it each way.
    assert rows["int8"]["wire_bytes_per_step"] == rows["fp8"]["wire_bytes_per_step"] == 1_016_080
    assert all(r["measured_step_ms"] is None for r in estimated["candidates"])


def test_command_line_split_and_advised_command(monkeypatch: pytest.MonkeyPatch) -> None:
    own, script, rest = split_command_line(["--advise", "--advise-out", "d", "--hook", "bf16",
                                            "t.py", "--advise"])
    assert (own, script, rest) == (["--advise", "--advise-out", "d", "--hook", "bf16"], "t.py",
                                   ["--advise"])
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    command = _advised_command([*own, "--emulate-link", "3GB/s"], script, rest)
    # The script's own --advise stays; the launcher's --advise, --advise-out, --hook go.
    assert command.format(hook="--hook powersgd:2 ") == (
        "torchrun --nproc_per_node=4 -m fastddp --emulate-link 3GB/s --hook powersgd:2 t.py "
        "--advise")


def test_a_failing_comm_stats_never_fails_the_run(tmp_path: Path) -> None:
    """The observer swallows its own errors (the run goes on) and the advice names them."""
    import torch

    class Broken(torch.nn.Linear):
        def comm_stats(self) -> dict:
            raise RuntimeError("boom")

    handle = fastddp.patch(advise=True)
    handle.unpatch()
    model = Broken(2, 2)
    for _ in range(handle.advisor.warmup + 3):
        handle.advisor.before_forward(model, TunerHandle(model))
    text = handle.advice_text(str(tmp_path))
    assert text == "[fastddp] advice unavailable: reading comm_stats() failed: RuntimeError: boom"
    assert not (tmp_path / "fastddp_advice.json").exists()
