"""``torchrun -m fastddp --sync diloco:H=...`` on an unmodified torch DDP script
(sync_script.py, 2 gloo ranks): the run equals the same script written against
fastddp.DiLoCo, bit for bit; bad specs and per-step options are refused."""

from pathlib import Path

import pytest

from tests.python.launch.launch_script import run_launcher

SCRIPT = Path(__file__).resolve().parent / "sync_script.py"
TIMEOUT_S = 240  # a no-hang deadline only: a run takes about 15 s on 2 loaded cores


def launched(tmp_path: Path, name: str, launcher_args: list[str],
             script_args: list[str]) -> tuple[dict, str]:
    result, code, output, _ = run_launcher(SCRIPT, tmp_path / f"{name}.json", launcher_args,
                                           script_args, timeout_s=TIMEOUT_S)
    assert code == 0 and result is not None, f"{name} failed ({code}):\n{output}"
    return result, output


@pytest.mark.parametrize("wire", ["fp32", "int8"])
def test_sync_equals_the_api(tmp_path, wire):
    # 6 steps of H = 3: two syncs, the last one at the end, so the ranks agree there.
    synced, output = launched(tmp_path, "synced", ["--sync", f"diloco:H=3,wire={wire}"],
                              ["--steps", "6"])
    direct, _ = launched(tmp_path, "direct", [], ["--steps", "6", "--direct", "3",
                                                  "--wire", wire])
    assert "fastddp.DiLoCo(sync_every=3" in output, output
    assert synced["class"] == "fastddp.launch.sync_patch", synced["class"]
    assert synced["ranks_agree"] and direct["ranks_agree"]
    assert synced["params"] == direct["params"]


def test_sync_streaming_equals_the_api(tmp_path):
    # 2 fragments of H = 4, overlap 1: a fragment syncs every 2 steps. merge_alpha keeps half
    # of each rank's local weights, so the ranks differ: compare rank 0's.
    spec = "diloco:H=4,fragments=2,overlap=1,merge_alpha=0.5"
    synced, output = launched(tmp_path, "synced", ["--sync", spec], ["--steps", "8"])
    direct, _ = launched(tmp_path, "direct", [], ["--steps", "8", "--direct", "4",
                                                  "--fragments", "2", "--overlap", "1",
                                                  "--merge-alpha", "0.5"])
    assert "fragments=2, overlap=1, merge_alpha=0.5" in output, output
    assert synced["params"] == direct["params"]


@pytest.mark.parametrize("args, message", [
    (["--sync", "diloco"], "H=STEPS (inner steps between syncs) is required"),
    (["--sync", "localsgd:H=2"], "the only method is 'diloco'"),
    (["--sync", "diloco:H=2,lr=1"], "'lr=1' is not KEY=VALUE"),
    (["--sync", "diloco:H=two"], "H='two' is not a valid int"),
    (["--sync", "diloco:H=2", "--hook", "bf16"], "--sync excludes --hook"),
    # Every DiLoCo setting is checked before the script runs, not at its first step.
    (["--sync", "diloco:H=4,fragments=2,overlap=2"],
     "overlap=2 must be < sync_every / fragments = 2"),
    (["--sync", "diloco:H=4,outer_lr=inf"], "outer_lr must be a finite number"),
])
def test_bad_sync(tmp_path, args, message):
    _, code, output, _ = run_launcher(SCRIPT, tmp_path / "bad.json", args, [], nproc=None,
                                      timeout_s=TIMEOUT_S)
    assert code == 2 and message in output, output


def test_two_optimizers_over_one_model_are_refused(tmp_path):
    # Each would get a DiLoCo over the whole model: the second would undo the first's local
    # steps and apply the outer step twice.
    _, code, output, _ = run_launcher(SCRIPT, tmp_path / "two.json", ["--sync", "diloco:H=2"],
                                      ["--two-optimizers"], timeout_s=TIMEOUT_S)
    assert code != 0 and "--sync diloco takes one optimizer per model" in output, output
